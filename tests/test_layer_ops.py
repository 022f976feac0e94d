"""Fused layer ops (vegas_kernels.layer_ops) against their PyTorch references.

Without a GPU the kernels run in Triton's interpreter (which handles bfloat16 tensors
on the CPU too), so shapes are small. The references themselves are first checked
against the model's own modules, so "matches the reference" means "matches the model".
On a GPU one more test replays all three ops from a captured CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is optional on CPU-only installs")

from vegas_kernels.layer_ops import (reference_rms_norm, reference_rope_and_store,  # noqa: E402
                                     reference_silu_mul, rms_norm, rope_and_store, silu_mul)
from vegas_core.cache import KVCache  # noqa: E402
from vegas_core.model import RMSNorm, rotate_half  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS = 1e-6
BF16_ULP = 2.0 ** -7  # relative spacing of bfloat16 values (7 stored mantissa bits)
ROPE_THETA = 10000.0
# RoPE shapes: GQA (2 query heads per KV head), a few tokens per sequence, and a cache
# with room past the last written slot.
BATCH, TOKENS, HEADS, KV_HEADS, LAYERS, SLOTS = 3, 4, 4, 2, 2, 24
LAYER = 1
# Sequence b's tokens sit at slots STARTS[b] .. STARTS[b] + TOKENS - 1 (ragged).
STARTS = (0, 7, 17)


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float32).to(dtype)


def assert_close(actual, expected, dtype):
    """Within ``TOLERANCE[dtype]``, relative to the magnitude of the expected values in
    bfloat16: there one rounding of a value of size |x| is worth |x| / 256, and rotated
    values can be small sums of large terms."""
    tol = TOLERANCE[dtype]
    scale = expected.float().abs().max().item() if dtype != torch.float32 else 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol,
                               atol=tol * max(scale, 1.0))


def assert_rounded_sum(h, expected):
    """h = x + residual is one float32 add rounded to x's dtype: bit-exact, except that
    Triton's CPU interpreter truncates float32 -> bfloat16 where GPUs round to nearest,
    which can cost one unit in the last place."""
    if h.dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(h, expected)
    else:
        torch.testing.assert_close(h, expected, rtol=BF16_ULP, atol=0.0)


def inverse_frequencies(d):
    return 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float32, device=DEVICE) / d))


# ----------------------------------------------------------------------------------------
# The references are the model's code
# ----------------------------------------------------------------------------------------


def test_references_match_the_model():
    x, w = randn(2, 3, 40, seed=1), randn(40, seed=2)
    norm = RMSNorm(40, EPS).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(w)
        assert torch.equal(reference_rms_norm(x, w, EPS), norm(x))

    d = 16
    q, k, v = (randn(BATCH, TOKENS, h, d, seed=s) for s, h in
               ((3, HEADS), (4, KV_HEADS), (5, KV_HEADS)))
    positions = torch.stack([torch.arange(s, s + TOKENS) for s in STARTS]).to(DEVICE)
    inv_freq = inverse_frequencies(d)
    cache = KVCache(LAYERS, BATCH, SLOTS, KV_HEADS, d, dtype=torch.float32, device=DEVICE)
    ck, cv = cache.k.clone(), cache.v.clone()
    q_rot = reference_rope_and_store(q, k, v, positions, inv_freq, ck, cv, LAYER)
    # As Transformer.forward / Attention.forward.
    freqs = positions[..., None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    cos, sin = angles.cos(), angles.sin()
    cache.write(LAYER, positions, k * cos + rotate_half(k) * sin, v)
    assert torch.equal(q_rot, q * cos + rotate_half(q) * sin)
    assert torch.equal(ck, cache.k) and torch.equal(cv, cache.v)

    gate_up = randn(2, 2 * 7, seed=6)
    assert torch.equal(reference_silu_mul(gate_up),
                       torch.nn.functional.silu(gate_up[:, :7]) * gate_up[:, 7:])


# ----------------------------------------------------------------------------------------
# rms_norm
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [64, 576, 1000])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(n, dtype, with_residual):
    x = randn(2, 3, n, dtype=dtype, seed=n)
    weight = (1.0 + 0.1 * randn(n, seed=n + 1)).to(dtype)
    residual = randn(2, 3, n, dtype=dtype, seed=n + 2) if with_residual else None
    got = rms_norm(x, weight, EPS, residual=residual)
    want = reference_rms_norm(x, weight, EPS, residual=residual)
    if with_residual:
        (y, h), (want_y, want_h) = got, want
        assert_rounded_sum(h, want_h)
    else:
        y, want_y = got, want
    assert y.shape == x.shape and y.dtype == want_y.dtype
    assert_close(y, want_y, dtype)


def test_rms_norm_strided_rows():
    """Rows of a wider tensor (one row stride, no copy) and leading dims that cannot be
    flattened into rows (transposed)."""
    n = 96
    wide = randn(5, 2 * n, seed=7)
    weight = randn(n, seed=8)
    residual = randn(5, 2 * n, seed=9)[:, n:]
    y, h = rms_norm(wide[:, :n], weight, EPS, residual=residual)
    want_y, want_h = reference_rms_norm(wide[:, :n], weight, EPS, residual=residual)
    assert_rounded_sum(h, want_h)
    assert_close(y, want_y, torch.float32)

    x = randn(3, 4, n, seed=10).transpose(0, 1)  # [4, 3, n], rows not one stride apart
    assert_close(rms_norm(x, weight, EPS), reference_rms_norm(x, weight, EPS), torch.float32)


# ----------------------------------------------------------------------------------------
# rope_and_store
# ----------------------------------------------------------------------------------------


def qkv_views(d, dtype, seed):
    """q [B, T, H, D], k, v [B, T, H_kv, D]: non-contiguous views of one fused
    [B, T, (H + 2 H_kv) D] projection output, as a fused QKV matmul produces."""
    fused = randn(BATCH, TOKENS, (HEADS + 2 * KV_HEADS) * d, dtype=dtype, seed=seed)
    q_end, k_end = HEADS * d, (HEADS + KV_HEADS) * d
    q = fused[..., :q_end].view(BATCH, TOKENS, HEADS, d)
    k = fused[..., q_end:k_end].view(BATCH, TOKENS, KV_HEADS, d)
    v = fused[..., k_end:].view(BATCH, TOKENS, KV_HEADS, d)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    return q, k, v


def ragged_positions():
    """[B, T]: each sequence at its own offset; the third is written out of order."""
    positions = torch.stack([torch.arange(s, s + TOKENS) for s in STARTS])
    positions[-1] = positions[-1].flip(0)
    return positions.to(DEVICE)


def written_slots(positions):
    """[B, S] bool: the slots rope_and_store should write."""
    written = torch.zeros(BATCH, SLOTS, dtype=torch.bool, device=DEVICE)
    written[torch.arange(BATCH, device=DEVICE)[:, None], positions] = True
    return written


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [16, 64, 128, 256])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm"])
def test_rope_and_store(d, dtype, qk_norm):
    q, k, v = qkv_views(d, dtype, seed=d)
    positions = ragged_positions()
    inv_freq = inverse_frequencies(d)
    norms = {}
    if qk_norm:
        norms = dict(q_norm=(1.0 + 0.1 * randn(d, seed=1)).to(dtype),
                     k_norm=(1.0 + 0.1 * randn(d, seed=2)).to(dtype), eps=EPS)
    # Random cache contents, so that a stray write shows.
    shape = (LAYERS, BATCH, KV_HEADS, SLOTS, d)
    cache_k, cache_v = randn(*shape, dtype=dtype, seed=3), randn(*shape, dtype=dtype, seed=4)
    before_k, before_v = cache_k.clone(), cache_v.clone()
    want_k, want_v = cache_k.clone(), cache_v.clone()

    q_rot = rope_and_store(q, k, v, positions, inv_freq, cache_k, cache_v, LAYER, **norms)
    want_q = reference_rope_and_store(q, k, v, positions, inv_freq, want_k, want_v, LAYER,
                                      **norms)

    assert q_rot.shape == q.shape and q_rot.dtype == dtype and q_rot.is_contiguous()
    assert_close(q_rot, want_q, dtype)
    written = written_slots(positions)[:, None, :, None].expand(-1, KV_HEADS, -1, d)
    for cache, want, before in ((cache_k, want_k, before_k), (cache_v, want_v, before_v)):
        others = [layer for layer in range(LAYERS) if layer != LAYER]
        assert torch.equal(cache[others], before[others])  # other layers untouched
        assert torch.equal(cache[LAYER][~written], before[LAYER][~written])  # other slots
        assert_close(cache[LAYER][written], want[LAYER][written], dtype)
    assert torch.equal(cache_v, want_v)  # v is copied, not computed


def test_rope_and_store_drops_out_of_range_positions():
    """A position outside [0, S) writes nothing (rather than someone else's memory)."""
    d = 16
    q, k, v = qkv_views(d, torch.float32, seed=11)
    positions = ragged_positions()
    positions[0, 0], positions[1, 1] = SLOTS, -1
    shape = (LAYERS, BATCH, KV_HEADS, SLOTS, d)
    cache_k, cache_v = torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)
    rope_and_store(q, k, v, positions, inverse_frequencies(d), cache_k, cache_v, LAYER)
    kept = (positions >= 0) & (positions < SLOTS)
    want_v = torch.zeros_like(cache_v)
    batch = torch.arange(BATCH, device=DEVICE)[:, None].expand_as(positions)
    want_v[LAYER][batch[kept], :, positions[kept]] = v[kept]
    assert torch.equal(cache_v, want_v)
    assert torch.count_nonzero(cache_k.abs().sum(-1)) == kept.sum() * KV_HEADS


# ----------------------------------------------------------------------------------------
# silu_mul
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("f", [37, 1001, 2500])
def test_silu_mul(f, dtype):
    gate_up = randn(2, 3, 2 * f, dtype=dtype, seed=f)
    out = silu_mul(gate_up)
    assert out.shape == (2, 3, f) and out.dtype == dtype
    assert_close(out, reference_silu_mul(gate_up), dtype)


def test_silu_mul_strided_rows():
    f = 45
    gate_up = randn(4, 3 * f, seed=12)[:, f:]  # rows 3F apart
    assert_close(silu_mul(gate_up), reference_silu_mul(gate_up), torch.float32)


# ----------------------------------------------------------------------------------------
# CUDA graphs (GPU only)
# ----------------------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_ops_replay_from_a_cuda_graph():
    """Captured once, replayed on new inputs written into the same buffers: the wrappers
    read nothing back from the device and their outputs follow the new inputs."""
    d, n, f, dtype = 64, 576, 1001, torch.bfloat16
    x, residual = (randn(2, n, dtype=dtype, seed=s) for s in (1, 2))
    weight = randn(n, dtype=dtype, seed=3)
    gate_up = randn(2, 2 * f, dtype=dtype, seed=4)
    q, k, v = qkv_views(d, dtype, seed=5)
    positions = ragged_positions()
    inv_freq = inverse_frequencies(d)
    shape = (LAYERS, BATCH, KV_HEADS, SLOTS, d)
    cache_k = torch.zeros(shape, dtype=dtype, device=DEVICE)
    cache_v = torch.zeros_like(cache_k)

    def launch():
        return (rms_norm(x, weight, EPS, residual=residual), silu_mul(gate_up),
                rope_and_store(q, k, v, positions, inv_freq, cache_k, cache_v, LAYER))

    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (y, h), act, q_rot = launch()
    x.copy_(randn(2, n, dtype=dtype, seed=6))
    gate_up.copy_(randn(2, 2 * f, dtype=dtype, seed=7))
    q.copy_(randn(*q.shape, dtype=dtype, seed=8))
    positions += 1
    cache_k.zero_()
    cache_v.zero_()
    graph.replay()
    torch.cuda.synchronize()

    want_y, want_h = reference_rms_norm(x, weight, EPS, residual=residual)
    assert_rounded_sum(h, want_h)
    assert_close(y, want_y, dtype)
    assert_close(act, reference_silu_mul(gate_up), dtype)
    want_k, want_v = torch.zeros_like(cache_k), torch.zeros_like(cache_v)
    want_q = reference_rope_and_store(q, k, v, positions, inv_freq, want_k, want_v, LAYER)
    assert_close(q_rot, want_q, dtype)
    assert_close(cache_k, want_k, dtype)
    assert torch.equal(cache_v, want_v)
