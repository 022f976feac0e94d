"""Prefill: the fused attention against its reference, the new prefill against the old
one (greedy output, every drafter), prompt K/V kept in the cache and in a PrefixCache."""

from __future__ import annotations

import pytest
import torch

from vegas_kernels.prefill_attention import prefill_attention, reference_prefill_attention
from vegas_core import SpecConfig, generate
from vegas_core.prefill import PrefixCache, prefill
from vegas_core.spec_config import DRAFTERS
from tests.test_engine import prompt, tiny_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_block(b, t, h, h_kv, d, start, dtype, device, seed=0):
    """q [B, T, H, D] and K/V as views into a larger cache, [B, H_kv, start + T, D]."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g, dtype=torch.float64)
    cache = torch.randn(2, 3, b, h_kv, start + t + 17, d, generator=g, dtype=torch.float64)
    q, cache = q.to(device, dtype), cache.to(device, dtype)
    return q, cache[0, 1, :, :, : start + t], cache[1, 1, :, :, : start + t]


@pytest.mark.parametrize("start", [0, 1, 37, 300])
@pytest.mark.parametrize("shape", [(2, 48, 4, 2, 16), (1, 130, 9, 3, 64), (3, 1, 8, 8, 32)])
def test_prefill_attention_matches_the_reference_in_float64(shape, start):
    b, t, h, h_kv, d = shape
    q, k, v = random_block(b, t, h, h_kv, d, start, torch.float64, "cpu")
    got = prefill_attention(q, k, v, start)
    assert got.shape == q.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, reference_prefill_attention(q, k, v, start),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("start, window", [(0, 16), (37, 5), (300, 64), (0, 1000)])
def test_sliding_window_prefill_matches_the_reference(monkeypatch, start, window):
    """A sliding layer's prefill, in blocks smaller than the prompt (so some blocks start
    past the window and some within it)."""
    import vegas_kernels.prefill_attention as module

    monkeypatch.setattr(module, "WINDOW_BLOCK_ROWS", 48)
    q, k, v = random_block(2, 130, 4, 2, 16, start, torch.float64, "cpu", seed=window)
    got = prefill_attention(q, k, v, start, window)
    torch.testing.assert_close(got, reference_prefill_attention(q, k, v, start, window),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("start, window", [(0, None), (37, None), (0, 16), (300, 64)])
def test_prefill_with_attention_sinks_matches_the_reference(monkeypatch, start, window):
    """gpt-oss's sinks through the fused path (a sink slot reached by extra head dims),
    with and without a sliding window, against the reference's softmax with the sink."""
    import vegas_kernels.prefill_attention as module

    monkeypatch.setattr(module, "WINDOW_BLOCK_ROWS", 48)
    q, k, v = random_block(2, 130, 4, 2, 16, start, torch.float64, "cpu", seed=start + 1)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    got = prefill_attention(q, k, v, start, window, sinks)
    assert got.shape == q.shape
    want = reference_prefill_attention(q, k, v, start, window, sinks)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(want, reference_prefill_attention(q, k, v, start, window))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("start", [0, 200])
def test_prefill_attention_in_half_precision_is_close_to_float32(device, start):
    dtype = torch.bfloat16  # on the GPU: cuDNN (start 0) or FlashAttention
    for shape in [(2, 256, 32, 8, 128), (4, 96, 9, 3, 64)]:
        b, t, h, h_kv, d = shape
        q, k, v = random_block(b, t, h, h_kv, d, start, dtype, device, seed=t)
        want = reference_prefill_attention(q.float(), k.float(), v.float(), start)
        got = prefill_attention(q, k, v, start).float()
        # bf16 inputs, float32 accumulation: errors of a few bf16 ulps of values below 1
        assert (got - want).abs().max().item() < 2e-2
        sinks = torch.linspace(-2, 3, h, device=device)  # the bf16 sink slot: as precise
        want = reference_prefill_attention(q.float(), k.float(), v.float(), start, None, sinks)
        got = prefill_attention(q, k, v, start, None, sinks).float()
        assert (got - want).abs().max().item() < 2e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("start, window", [(0, None), (700, None), (0, 512), (700, 512)])
def test_prefill_at_gemma3_shapes_in_half_precision_is_close_to_float32(device, start, window):
    """Gemma3-270M's heads (4 query heads on one KV head of 256 dims), its 512-slot window
    and a block after a prefix: the backends each case reaches on a GPU (cuDNN, FlashAttention's
    lower-right mask, the windowed blocks) at a head dim the shapes above do not reach."""
    q, k, v = random_block(2, 600, 4, 1, 256, start, torch.bfloat16, device, seed=start + 1)
    want = reference_prefill_attention(q.float(), k.float(), v.float(), start, window)
    got = prefill_attention(q, k, v, start, window).float()
    assert (got - want).abs().max().item() < 2e-2


def test_prefill_attention_memory_grows_linearly():
    """A fused block holds no [T, S] score matrix: doubling the context roughly doubles
    the extra memory a prefill forward takes (it would quadruple otherwise)."""
    if not torch.cuda.is_available():
        pytest.skip("peak-memory accounting needs the CUDA allocator")
    peaks = []
    for t in (4096, 8192, 16384):
        q, k, v = random_block(1, t, 8, 2, 64, 0, torch.bfloat16, "cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        prefill_attention(q, k, v, 0)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del q, k, v
    assert peaks[2] / peaks[1] < 3 and peaks[1] / peaks[0] < 3, peaks


# ---- the engine: the new prefill gives the old one's tokens ----------------------------

@pytest.fixture(scope="module")
def smollm_prompts(smollm):
    from vegas_tune.datasets import embedded_prompts

    long, short = embedded_prompts(smollm.tokenizer, "mixed", 700, 2)
    return [long.ids, short.ids[:450]]  # ragged: rows prefill separately


@pytest.mark.slow
@pytest.mark.parametrize("drafter", [None, *DRAFTERS])
def test_new_prefill_gives_the_old_prefills_greedy_tokens(smollm, smollm_prompts, drafter,
                                                         monkeypatch):
    """fp32 on the CPU: SDPA prefill (whole prompts) against the masked reference in
    512-row chunks, for vanilla decoding and every drafter."""
    spec = None if drafter is None else SpecConfig(drafter=drafter, gamma=4, sparsity=0.1,
                                                   min_tokens=32)

    import vegas_core.attention as dispatch

    calls = [0]
    real = dispatch.prefill_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "prefill_attention", counted)

    def run():
        return generate(smollm, smollm_prompts, max_new_tokens=12, ignore_eos=True,
                        spec=spec).tokens

    monkeypatch.setenv("VEGAS_ATTENTION", "reference")
    old = run()
    assert calls[0] == 0
    monkeypatch.setenv("VEGAS_ATTENTION", "auto")
    assert run() == old
    assert calls[0] >= smollm.config.num_layers  # the new path ran


# ---- prompt K/V kept in the cache ----------------------------------------------------

def computed_tokens(model, ids, cache, **kwargs) -> tuple[int, torch.Tensor]:
    seen = [0]

    def progress(phase, done, total):
        seen[0] = total

    hidden = prefill(model, ids, cache, progress=progress, **kwargs)
    return seen[0], hidden


def test_a_kept_cache_computes_only_what_its_rows_do_not_hold():
    model = tiny_model()
    net = model.net
    a, b = prompt(60, seed=1), prompt(45, seed=2)
    fresh = net.new_cache(2, 80)
    _, want = computed_tokens(model, [a, b], fresh)

    cache = net.new_cache(2, 80)
    assert computed_tokens(model, [a, b], cache)[0] == 105
    n, hidden = computed_tokens(model, [a, b], cache)
    assert n == 0 and torch.equal(hidden, want)
    cache.forget_from(0, 52)  # e.g. a speculative window rewrote slots 52..59
    n, hidden = computed_tokens(model, [a, b], cache)
    assert n == 8
    torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)
    # A prompt sharing 20 leading tokens with the row's: only the rest is computed.
    c = b[:20] + prompt(30, seed=3)
    n, _ = computed_tokens(model, [a, c], cache)
    assert n == 30
    other = net.new_cache(2, 80)
    computed_tokens(model, [a, c], other)
    torch.testing.assert_close(cache.k[:, 1, :, :50], other.k[:, 1, :, :50], rtol=1e-5, atol=1e-5)
    # A leading part of the held prompt needs no compute, except for its hidden state.
    assert computed_tokens(model, [a[:40], c], cache, need_last_hidden=False)[0] == 0
    assert computed_tokens(model, [a[:30], c], cache)[0] == 1
    assert cache.prompts[0].ids == a[:30]  # decoding writes right after the prompt


def test_prefix_cache_serves_shared_leading_parts_and_spills_to_host():
    model = tiny_model()
    net = model.net
    a, b = prompt(60, seed=1), prompt(45, seed=2)
    store = PrefixCache(device_bytes=0, host_bytes=1 << 30)  # everything in the second tier
    computed_tokens(model, [a], net.new_cache(1, 80), reuse=store)
    assert store._used == {"device": 0, "host": store.nbytes} and store.nbytes > 0
    # The stored prompt serves a longer one that starts with it: only the rest computed.
    n, hidden = computed_tokens(model, [a + b[:10]], net.new_cache(1, 80), reuse=store)
    assert n == 10
    _, want = computed_tokens(model, [a + b[:10]], net.new_cache(1, 80))
    torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)
    full = PrefixCache(device_bytes=1, host_bytes=0)
    computed_tokens(model, [b], net.new_cache(1, 80), reuse=full)
    assert full.nbytes == 0


def test_prefill_runs_equal_length_prompts_together():
    """Rows with the same remaining work share forwards; the output is the same as
    prefilling each alone."""
    model = tiny_model()
    prompts = [prompt(33, seed=s) for s in range(4)]
    batched = generate(model, prompts, max_new_tokens=6, ignore_eos=True, prefill_chunk=10)
    for p, got in zip(prompts, batched.tokens):
        assert generate(model, [p], max_new_tokens=6, ignore_eos=True).tokens[0] == got
