"""Sliding layers kept as rings (``vegas_core.cache``): what a ring holds, the kernels and
the prefill reading it, prompts reused through their saved tails, and greedy output
equal to a cache that keeps every layer at full length."""

from __future__ import annotations

import pytest
import torch

import vegas_core.cache as cache_module
from vegas_core import SpecConfig, generate, load_model
from vegas_core.cache import PROMPT_TAIL_SLACK, KVCache, layer_slots, ring_slots
from vegas_core.config import SlidingWindow
from vegas_kernels.prefill_attention import prefill_attention, reference_prefill_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WINDOW = SlidingWindow(8, frozenset({0, 2}))  # the tiny Gemma3's: layers 0 and 2 slide


def small_rings(monkeypatch, headroom: int) -> None:
    """Rings of the window plus ``headroom`` slots: short prompts wrap them many times."""
    monkeypatch.setattr(cache_module, "RING_HEADROOM", headroom)


def ring_of(full: torch.Tensor, ring: int, end: int) -> torch.Tensor:
    """A ring [B, H, ring, D] holding positions [end - ring, end) of ``full``
    [B, H, S, D] where a cache that wrote positions 0 .. end - 1 in order leaves them."""
    out = torch.zeros(*full.shape[:2], ring, full.shape[3], dtype=full.dtype,
                      device=full.device)
    for p in range(max(0, end - ring), end):
        out[:, :, p % ring] = full[:, :, p]
    return out


def test_only_a_hybrid_models_sliding_layers_keep_rings_and_only_in_a_longer_cache(monkeypatch):
    small_rings(monkeypatch, 8)
    assert ring_slots(WINDOW, 16) is None  # no longer than the ring: full length
    assert ring_slots(WINDOW, 64) == 16
    assert ring_slots(SlidingWindow(8), 64) is None  # every layer slides (Mistral)
    assert ring_slots(None, 64) is None
    cache = KVCache(3, 2, 64, 1, 4, dtype=torch.float32, device="cpu", window=WINDOW)
    assert [cache.ring_of(i) for i in range(3)] == [16, None, 16]
    assert cache.k.shape == (1, 2, 1, 64, 4) and cache.ring_k.shape == (2, 2, 1, 16, 4)
    assert cache.store(1)[2] == 0 and cache.store(2)[2] == 1
    per_slot = 2 * 1 * 4 * 4  # K and V, one head of 4 float32 dims
    assert cache.nbytes() == layer_slots(3, WINDOW, 64) * per_slot * 2
    assert layer_slots(3, WINDOW, 64) == 64 + 2 * (16 + 8 + PROMPT_TAIL_SLACK)
    assert layer_slots(3, WINDOW, 16) == 3 * 16


def test_a_ring_keeps_the_last_positions_written_and_unrolls_them_in_place(monkeypatch):
    small_rings(monkeypatch, 8)
    cache = KVCache(3, 1, 64, 1, 2, dtype=torch.float32, device="cpu", window=WINDOW)
    for p in range(40):  # one position per write, as decode steps do
        value = torch.full((1, 1, 1, 2), float(p))
        for layer in range(3):
            cache.write(layer, torch.tensor([[p]]), value, -value)
    k, v = cache.unrolled(0, 40)
    assert k.shape == (1, 1, 40, 2)
    assert k[0, 0, 24:, 0].tolist() == list(range(24, 40))  # the ring's 16 positions
    assert torch.equal(v, -k)
    assert k[0, 0, 23, 0] == 39  # an older position reads the slot's newer occupant
    full, _ = cache.unrolled(1, 40)  # the global layer keeps every position
    assert full[0, 0, :, 0].tolist() == list(range(40))


@pytest.mark.parametrize("start, rows, sinks", [(0, 30, False), (37, 9, False), (300, 17, True),
                                                (5, 4, True)])
def test_prefill_over_a_ring_equals_the_reference_over_full_length(start, rows, sinks):
    """A block's keys read from a ring that holds the window before it and the block
    itself (positions wrapped many times) attend as over the full-length cache."""
    window, ring = 16, 16 + 31
    g = torch.Generator().manual_seed(start + rows)
    q = torch.randn(2, rows, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, start + rows, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, start + rows, 16, generator=g, dtype=torch.float64)
    sink = torch.randn(4, generator=g, dtype=torch.float64) if sinks else None
    got = prefill_attention(q, ring_of(k, ring, start + rows), ring_of(v, ring, start + rows),
                            start, window, sink, ring=ring)
    want = reference_prefill_attention(q, k, v, start, window, sink)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_ring_too_small_for_the_block_is_refused():
    q = torch.zeros(1, 40, 2, 16)
    k = torch.zeros(1, 1, 47, 16)
    with pytest.raises(ValueError, match="cannot hold a window"):
        prefill_attention(q, k, k, 100, 16, ring=47)


@pytest.mark.parametrize("rows, window, sinks", [(1, 64, False), (9, 100, True), (5, 37, False)])
def test_verify_attention_over_a_ring_equals_the_reference_over_full_length(rows, window,
                                                                            sinks):
    pytest.importorskip("triton")
    from vegas_kernels.verify_attention import reference_verify_attention, verify_attention

    ring = window + 40
    ends, kv_len = [300, 170], 300
    g = torch.Generator().manual_seed(rows + window)
    q = torch.randn(2, rows, 8, 32, generator=g).to(DEVICE)
    k = torch.randn(2, 2, kv_len, 32, generator=g).to(DEVICE)
    v = torch.randn(2, 2, kv_len, 32, generator=g).to(DEVICE)
    sink = (torch.randn(8, generator=g) + 2.0).to(DEVICE) if sinks else None
    positions = torch.stack([torch.arange(e - rows, e) for e in ends]).to(DEVICE)
    # Each sequence's ring as its own writes left it.
    ring_k = torch.cat([ring_of(k[b:b + 1], ring, e) for b, e in enumerate(ends)])
    ring_v = torch.cat([ring_of(v[b:b + 1], ring, e) for b, e in enumerate(ends)])
    out, lse, _ = verify_attention(q, ring_k, ring_v, positions, kv_len, window=window,
                                   sinks=sink, ring=ring)
    want_out, want_lse, _ = reference_verify_attention(
        q.double(), k.double(), v.double(), positions, kv_len, window=window,
        sinks=None if sink is None else sink.double())
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="a ring of"):  # a window the ring cannot hold
        verify_attention(q, ring_k, ring_v, positions, kv_len, window=ring + 1, ring=ring)


def test_rope_and_store_writes_a_ring_at_each_position_modulo_its_slots():
    pytest.importorskip("triton")
    from vegas_kernels.layer_ops import rope_and_store

    d, ring, full_len = 16, 24, 80
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 5, 4, d, generator=g).to(DEVICE)
    k = torch.randn(2, 5, 2, d, generator=g).to(DEVICE)
    v = torch.randn(2, 5, 2, d, generator=g).to(DEVICE)
    positions = torch.tensor([[60, 61, 62, 63, 64], [3, 4, 5, 6, -1]], device=DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
    full = [torch.zeros(1, 2, 2, full_len, d, device=DEVICE) for _ in range(2)]
    rings = [torch.zeros(1, 2, 2, ring, d, device=DEVICE) for _ in range(2)]
    want_q = rope_and_store(q, k, v, positions, inv_freq, *full, 0)
    got_q = rope_and_store(q, k, v, positions, inv_freq, *rings, 0, ring=True)
    assert torch.equal(got_q, want_q)
    for b in range(2):
        for p in positions[b].tolist():
            if p < 0:
                continue  # dropped, as at full length
            for ring_t, full_t in zip(rings, full):
                assert torch.equal(ring_t[0, b, :, p % ring], full_t[0, b, :, p])
    assert rings[1][0, 1].count_nonzero() == 4 * 2 * d  # four positions, two heads


@pytest.fixture(scope="module")
def gemma3(tiny_hf):
    path, _ = tiny_hf("gemma3")
    return load_model(str(path), device=DEVICE, dtype="float32")


def tokens_with_rings(monkeypatch, model, prompts, headroom, spec=None, new_tokens=24):
    small_rings(monkeypatch, headroom)
    return generate(model, prompts, max_new_tokens=new_tokens, ignore_eos=True,
                    spec=spec).tokens


@pytest.mark.parametrize("drafter", ["vegas", "streaming"])
def test_greedy_output_with_rings_equals_full_length_and_vanilla(gemma3, monkeypatch, drafter):
    """Prompts that wrap a 20-slot ring many times (prefill chunks capped at its 13 free
    slots, verify windows, rejected drafts written ahead and rolled back): the same greedy
    tokens as a cache at full length, vanilla and speculative (float32, reference path)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (300, 120, 47)]
    full = tokens_with_rings(monkeypatch, gemma3, prompts, headroom=1 << 20)
    spec = SpecConfig(drafter=drafter, gamma=4, sparsity=0.1, min_tokens=16)
    assert tokens_with_rings(monkeypatch, gemma3, prompts, headroom=12) == full
    assert tokens_with_rings(monkeypatch, gemma3, prompts, headroom=12, spec=spec) == full


def test_the_kernel_path_reuses_prompts_through_their_saved_tails(gemma3, monkeypatch):
    """On static steps (the kernels; kept caches) a second call on the same prompts
    computes nothing of them: the rings get the prompts' ends back from the saved tails,
    after the first call's decoding overwrote them. Tokens equal the reference's."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 21)]
    spec = SpecConfig(drafter="vegas", gamma=2, sparsity=0.1, min_tokens=4)
    monkeypatch.setenv("VEGAS_ATTENTION", "reference")
    want = tokens_with_rings(monkeypatch, gemma3, prompts, 1 << 20, new_tokens=5)
    restored = []
    real = KVCache.restore_prompt_tail

    def spy(self, row, reused):
        ok = real(self, row, reused)
        restored.append((reused, ok))
        return ok

    monkeypatch.setattr(KVCache, "restore_prompt_tail", spy)
    monkeypatch.setenv("VEGAS_ATTENTION", "triton")
    monkeypatch.setenv("VEGAS_CUDA_GRAPHS", "static")
    assert tokens_with_rings(monkeypatch, gemma3, prompts, 8, new_tokens=5) == want
    assert tokens_with_rings(monkeypatch, gemma3, prompts, 8, spec=spec, new_tokens=5) == want
    assert tokens_with_rings(monkeypatch, gemma3, prompts, 8, new_tokens=5) == want
    # The speculative call reused all but its last window, the vanilla one after it all
    # of each prompt (the end the speculative call's prefill saved).
    assert any(ok and reused > 0 for reused, ok in restored)
    assert all(ok for reused, ok in restored)


def test_a_prompt_diverging_before_the_saved_tail_is_computed_again(monkeypatch):
    small_rings(monkeypatch, 8)
    cache = KVCache(3, 1, 64, 1, 2, dtype=torch.float32, device="cpu", window=WINDOW)
    cache.save_prompt_tail(0, 200)
    assert cache.restore_prompt_tail(0, 200)
    assert cache.restore_prompt_tail(0, 200 - PROMPT_TAIL_SLACK)
    assert not cache.restore_prompt_tail(0, 200 - PROMPT_TAIL_SLACK - 1)
    assert cache.restore_prompt_tail(0, 0)  # nothing reused, nothing needed


def test_a_prefix_cache_serves_a_ring_cache_from_the_saved_tails(gemma3, monkeypatch):
    """On the reference path (no kept cache: every call prefills through the store), the
    copies a ring cache stores give the same tokens as computing the prompts, and serve
    them: later calls compute nothing of them."""
    from vegas_core.prefill import PrefixCache

    small_rings(monkeypatch, 12)
    # The reference path on every device: on CUDA the default static steps keep their own
    # cache across calls and would not prefill through the store.
    monkeypatch.setenv("VEGAS_ATTENTION", "reference")
    monkeypatch.setenv("VEGAS_CUDA_GRAPHS", "0")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (90, 61)]
    want = generate(gemma3, prompts, max_new_tokens=12, ignore_eos=True).tokens
    store = PrefixCache(device_bytes=1 << 30)
    spec = SpecConfig(drafter="vegas", gamma=3, sparsity=0.1, min_tokens=8)
    computed, runs = [], []
    for kw in ({}, {}, {"spec": spec}):
        totals = {0}  # prefill tokens computed, as the progress callback reports them

        def progress(phase, done, total, totals=totals):
            if phase == "prefill":
                totals.add(total)

        runs.append(generate(gemma3, prompts, max_new_tokens=12, ignore_eos=True,
                             prefix_cache=store, progress=progress, **kw).tokens)
        computed.append(max(totals))
    assert runs == [want] * 3
    assert len(store._entries) == 2 and store._entries[0][1].tail_k is not None
    # All of it, then nothing: the copies (with their last hidden states) serve the
    # prompts, and the heads before the speculative window.
    assert computed == [90 + 61, 0, 0]


def test_a_copy_serves_only_a_cache_of_its_own_layout(monkeypatch):
    small_rings(monkeypatch, 8)
    rings = KVCache(3, 1, 256, 1, 2, dtype=torch.float32, device="cpu", window=WINDOW)
    full = KVCache(3, 1, 16, 1, 2, dtype=torch.float32, device="cpu", window=WINDOW)
    rings.save_prompt_tail(0, 200)
    copy = rings.prompt_copy(0, 200)
    assert tuple(copy.k.shape) == (1, 1, 200, 2)  # the global layer
    assert tuple(copy.tail_k.shape) == (2, 1, 8 + PROMPT_TAIL_SLACK, 2)  # the sliding ones
    assert not full.take_prompt(0, copy, 0, 10)  # no full-length K/V of the sliding layers
    assert full.prompt_copy(0, 10).tail_k is None
    assert not rings.take_prompt(0, full.prompt_copy(0, 10), 0, 10)
    other = KVCache(3, 1, 256, 1, 2, dtype=torch.float32, device="cpu", window=WINDOW)
    assert other.take_prompt(0, copy, 0, 200) and other.tail_end[0] == 200
    assert not other.take_prompt(0, copy, 0, 200 - PROMPT_TAIL_SLACK - 1)
    with pytest.raises(ValueError, match="saved tail"):
        rings.prompt_copy(0, 199)
