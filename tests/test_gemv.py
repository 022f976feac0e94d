"""The few-row linear kernel (vegas_kernels.gemv) against its float32 references, and the
model's use of it.

Without a GPU the kernel runs in Triton's interpreter, in float32 and float16 (the
interpreter's dot mishandles bfloat16 operands); on a GPU in all three, and one test
replays it from a captured CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton", reason="Triton is optional on CPU-only installs")

import vegas_kernels.gemv as gemv_module  # noqa: E402
from vegas_kernels.gemv import (MAX_ROWS, GemvConfig, gemv, gemv_serves,  # noqa: E402
                                gemv_silu_mul, reference_gemv, reference_gemv_silu_mul)
from vegas_core.attention import AttentionMeta  # noqa: E402
from vegas_core.loading.weights import build_random  # noqa: E402
from vegas_core.model import MLP  # noqa: E402
from tests.test_engine import tiny_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = ([torch.float32, torch.float16, torch.bfloat16] if DEVICE == "cuda"
          else [torch.float32, torch.float16])
# Relative to the output's largest value: one rounding of the output in half precision.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# A tile that takes several K steps and leaves N and K ragged at these sizes.
SMALL_TILE = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)


def assert_close(actual, expected, dtype):
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0,
                               atol=TOLERANCE[dtype] * max(scale, 1.0))


def test_the_references_match_the_model_in_float64():
    """reference_gemv is F.linear; reference_gemv_silu_mul is the model's SwiGLU MLP
    before its down projection."""
    x = randn(5, 24, dtype=torch.float64, seed=1)
    w, b = randn(40, 24, dtype=torch.float64, seed=2), randn(40, dtype=torch.float64, seed=3)
    torch.testing.assert_close(reference_gemv(x, w, b), F.linear(x, w, b))
    mlp = MLP(tiny_model().config).to(DEVICE, torch.float64)
    with torch.no_grad():
        mlp.down_proj.weight.copy_(torch.eye(*mlp.down_proj.weight.shape))  # [D, F]: the first D
        x = randn(3, mlp.gate_up_proj.in_features, dtype=torch.float64, seed=4)
        want = mlp(x)
    got = reference_gemv_silu_mul(x, mlp.gate_up_proj.weight.detach())
    torch.testing.assert_close(got[:, :want.shape[-1]], want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("n,k", [(64, 128), (70, 100)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_the_reference(dtype, rows, n, k, bias):
    x = randn(rows, k, dtype=dtype, seed=rows)
    w = randn(n, k, dtype=dtype, seed=n + k, scale=k ** -0.5)
    b = randn(n, dtype=dtype, seed=7) if bias else None
    want = reference_gemv(x.float(), w.float(), None if b is None else b.float())
    assert_close(gemv(x, w, b, config=SMALL_TILE), want, dtype)
    assert_close(gemv(x, w, b), want, dtype)  # the shipped tile for this shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS])
@pytest.mark.parametrize("f,k", [(32, 64), (35, 100)])
def test_gemv_silu_mul_matches_the_reference(dtype, rows, f, k):
    x = randn(2, rows, k, dtype=dtype, seed=rows)[1]  # a row-strided view
    gate_up = randn(2 * f, k, dtype=dtype, seed=f + k, scale=k ** -0.5)
    out = gemv_silu_mul(x, gate_up, config=SMALL_TILE)
    assert out.shape == (rows, f) and out.dtype == dtype
    assert_close(out, reference_gemv_silu_mul(x.float(), gate_up.float()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype):
    """Each output is one dot product in a fixed order: bit-identical at any row count."""
    x = randn(MAX_ROWS, 96, dtype=dtype, seed=1)
    w = randn(48, 96, dtype=dtype, seed=2)
    every = gemv(x, w, config=SMALL_TILE)
    for lo, hi in [(0, 1), (5, 6), (3, 11)]:
        assert torch.equal(gemv(x[lo:hi], w, config=SMALL_TILE), every[lo:hi])


def test_leading_dims_are_kept():
    x = randn(2, 3, 40, dtype=torch.float32, seed=1)
    w = randn(24, 40, dtype=torch.float32, seed=2)
    assert gemv(x, w).shape == (2, 3, 24)
    assert gemv_silu_mul(x, w).shape == (2, 3, 12)


@pytest.mark.parametrize("case,message", [
    ("rows", "1 to 16 rows"), ("dtype", "one dtype"), ("shape", "weight must be"),
    ("odd", "even number of rows"), ("bias", "bias must be"),
])
def test_bad_arguments_say_what_to_fix(case, message):
    x, w = randn(2, 32, dtype=torch.float16, seed=1), randn(8, 32, dtype=torch.float16, seed=2)
    call = {
        "rows": lambda: gemv(randn(MAX_ROWS + 1, 32, dtype=torch.float16, seed=3), w),
        "dtype": lambda: gemv(x.float(), w),
        "shape": lambda: gemv(x, w[:, :16]),
        "odd": lambda: gemv_silu_mul(x, w[:7]),
        "bias": lambda: gemv(x, w, randn(9, dtype=torch.float16, seed=4)),
    }[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_the_engine_sends_only_a_few_half_precision_rows():
    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    assert gemv_serves(torch.zeros(MAX_ROWS, 32, dtype=torch.bfloat16), w)
    assert gemv_serves(torch.zeros(2, 4, 32, dtype=torch.bfloat16), w)
    assert not gemv_serves(torch.zeros(MAX_ROWS + 1, 32, dtype=torch.bfloat16), w)
    assert not gemv_serves(torch.zeros(1, 32, dtype=torch.float16), w)  # dtypes differ
    assert not gemv_serves(torch.zeros(1, 32), w.float())  # float32 keeps F.linear


def test_the_model_runs_its_projections_on_the_kernel(monkeypatch):
    """A half-precision decode step with the kernels enabled sends qkv, o, gate/up (with
    its SiLU) and down of every layer and the LM head to gemv, and its logits match the
    PyTorch path's."""
    config = tiny_model("qwen2", head_dim=16).config  # biased q/k/v
    net = build_random(config, device=torch.device(DEVICE), dtype=torch.float16, seed=3)
    tokens = torch.tensor([[3, 9, 27, 81, 5]], device=DEVICE)
    positions = torch.arange(tokens.shape[1], device=DEVICE)[None]
    launched = []
    launch = gemv_module._launch
    monkeypatch.setattr(gemv_module, "_launch",
                        lambda *a, **kw: launched.append(a[4]) or launch(*a, **kw))

    def last_logits(env: str) -> torch.Tensor:
        monkeypatch.setenv("VEGAS_ATTENTION", env)
        cache = net.new_cache(1, 16)
        with torch.no_grad():
            net(tokens, positions, cache, AttentionMeta.full(positions, tokens.shape[1]))
            step = torch.tensor([[tokens.shape[1]]], device=DEVICE)
            return net.logits(net(torch.tensor([[7]], device=DEVICE), step, cache,
                                  AttentionMeta.full(step, tokens.shape[1] + 1)))

    want = last_logits("reference")
    assert launched == []
    got = last_logits("triton")
    # Per layer: qkv, o and down plain, gate/up with its SiLU; the 5-token forward, then
    # the decode step and its LM head.
    per_forward = [False, False, True, False] * config.num_layers
    assert launched == per_forward * 2 + [False]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_gemv_replays_from_a_cuda_graph():
    x = randn(4, 256, dtype=torch.bfloat16, seed=1)
    w = randn(96, 256, dtype=torch.bfloat16, seed=2, scale=1 / 16)
    gemv(x, w), gemv_silu_mul(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, act = gemv(x, w), gemv_silu_mul(x, w)
    x.copy_(randn(4, 256, dtype=torch.bfloat16, seed=3))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference_gemv(x.float(), w.float()), torch.bfloat16)
    assert_close(act, reference_gemv_silu_mul(x.float(), w.float()), torch.bfloat16)

