"""Grouped mixture of experts (vegas_kernels.moe) against its float64 PyTorch reference, on
fresh random inputs.

Without a GPU the kernels run in Triton's interpreter, so shapes are tiny: 6 experts of
hidden size 48 and expert width 40 (neither a multiple of the 32-wide tiles, so every
tile edge is masked), top-2 routing over 1, 5 or 37 tokens. The reference is first
checked against the model's own MixtureOfExperts, so "matches the reference" means
"matches the model". On a GPU the same tests run natively in float32 and bfloat16, and
two more check that a call never synchronises with the host and that a captured CUDA
graph follows a new routing written in place.
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is optional on CPU-only installs")

from vegas_kernels import launch  # noqa: E402
from vegas_kernels.launch import MOE_BLOCK_M  # noqa: E402
from vegas_kernels.moe import moe, reference_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
EXPERTS, HIDDEN, WIDTH, TOP_K = 6, 48, 40, 2  # E, D, F, K
# Clamped SwiGLU parameters other than gpt-oss's defaults (so passing them is tested),
# with a limit the gate and up values (standard deviation about 2) often pass.
ALPHA, LIMIT = 1.3, 2.5
ACTIVATIONS = [("silu", {}), ("clamped_swiglu", {"alpha": ALPHA, "limit": LIMIT})]


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float32).to(dtype)


def experts(dtype, bias: bool, seed: int, e=EXPERTS, d=HIDDEN, f=WIDTH) -> dict:
    """Expert parameters scaled so that gate/up values have a standard deviation of
    about 2 and outputs are of order 1."""
    params = {"gate_up": (randn(e, 2 * f, d, seed=seed) * (2 / math.sqrt(d))).to(dtype),
              "down": (randn(e, d, f, seed=seed + 1) / math.sqrt(f)).to(dtype)}
    if bias:
        params["gate_up_bias"] = (0.5 * randn(e, 2 * f, seed=seed + 2)).to(dtype)
        params["down_bias"] = (0.5 * randn(e, d, seed=seed + 3)).to(dtype)
    return params


def routing(n: int, kind: str, seed: int, dtype=torch.float32, k=TOP_K, e=EXPERTS):
    """(weights [N, K] in dtype, chosen [N, K] int64), K distinct experts per token.

    ``random``: uniformly chosen experts. ``crowded``: every token's first slot goes to
    expert 0 (37 tokens give it more than MOE_BLOCK_M pairs), the others to experts 1 .. 3,
    so experts 4 and 5 get no token at all."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        chosen = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    else:
        rest = torch.stack([1 + torch.randperm(3, generator=g)[:k - 1] for _ in range(n)])
        chosen = torch.cat([torch.zeros(n, 1, dtype=torch.long), rest], dim=1)
    weights = torch.softmax(torch.randn(n, k, generator=g), dim=-1)
    return weights.to(DEVICE, dtype), chosen.to(DEVICE)


def reference(x, weights, chosen, params, activation, extra):
    """The float64 reference of the (rounded) inputs."""
    p64 = {name: t.double() for name, t in params.items()}
    return reference_moe(x.double(), weights.double(), chosen, **p64, activation=activation,
                         **extra)


def assert_close(actual, expected, dtype):
    """Within TOLERANCE[dtype], relative to the largest expected value in bfloat16 (whose
    rounding of hidden is worth |hidden| / 256 in every output)."""
    tol = TOLERANCE[dtype]
    scale = expected.abs().max().item() if dtype != torch.float32 else 1.0
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol,
                               atol=tol * max(scale, 1.0))


# ----------------------------------------------------------------------------------------
# The reference is the model's code
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_reference_matches_the_model(family):
    """reference_moe on the router's own choices equals MixtureOfExperts.forward (both
    in float64), and moe equals it in float32."""
    from vegas_core.config import ModelConfig
    from vegas_core.model import MixtureOfExperts

    flags = {"normalize_routing": True} if family == "qwen3_moe" else {
        "routing": "top_k_softmax", "router_bias": True, "expert_bias": True,
        "expert_activation": "clamped_swiglu", "swiglu_alpha": ALPHA, "swiglu_limit": LIMIT}
    config = ModelConfig(name=f"tiny-{family}", family=family, vocab_size=32,
                         hidden_size=HIDDEN, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8, max_position_embeddings=64,
                         num_experts=EXPERTS, experts_per_token=TOP_K,
                         expert_intermediate_size=WIDTH, **flags)
    layer = MixtureOfExperts(config).to(DEVICE)
    with torch.no_grad():
        for i, p in enumerate(layer.parameters()):
            p.copy_(randn(*p.shape, seed=10 + i) / math.sqrt(p.shape[-1]))
    activation, extra = ACTIVATIONS[1] if family == "gpt_oss" else ACTIVATIONS[0]
    x = randn(9, HIDDEN, seed=1)

    def params(net):
        return {"gate_up": net.experts_gate_up, "down": net.experts_down,
                "gate_up_bias": net.experts_gate_up_bias, "down_bias": net.experts_down_bias}

    with torch.no_grad():
        want = layer(x)
        got = moe(x, *layer.route(x), **params(layer), activation=activation, **extra)
        layer64 = layer.double()
        x64 = x.double()
        want64 = layer64(x64)
        ref64 = reference_moe(x64, *layer64.route(x64), **params(layer64),
                              activation=activation, **extra)
    torch.testing.assert_close(ref64, want64, rtol=1e-12, atol=1e-12)
    assert got.dtype == torch.float32
    assert_close(got, want, torch.float32)


# ----------------------------------------------------------------------------------------
# moe
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation, extra", ACTIVATIONS, ids=[a for a, _ in ACTIVATIONS])
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("n, kind", [
    (1, "random"),  # a decode step: K experts of one token
    (5, "random"),  # a small verify window
    (37, "crowded"),  # one expert over MOE_BLOCK_M pairs (3 row blocks), two experts empty
])
def test_moe_matches_reference(dtype, activation, extra, bias, n, kind):
    seed = n * 10 + len(activation) + bias
    params = experts(dtype, bias, seed)
    x = randn(n, HIDDEN, dtype=dtype, seed=seed + 5)
    weights, chosen = routing(n, kind, seed, dtype)
    if kind == "crowded":
        counts = torch.bincount(chosen.flatten(), minlength=EXPERTS)  # the test's own view
        assert counts[0] > MOE_BLOCK_M and (counts == 0).any()
        for t in params.values():  # experts nobody routes to must not count: poison them
            t[counts == 0] = float("nan")
    got = moe(x, weights, chosen, **params, activation=activation, **extra)
    want = reference(x, weights, chosen, params, activation, extra)
    assert got.shape == (n, HIDDEN) and got.dtype == dtype
    assert_close(got, want, dtype)


@pytest.mark.parametrize("activation, extra", ACTIVATIONS, ids=[a for a, _ in ACTIVATIONS])
def test_moe_with_many_tiles(monkeypatch, activation, extra):
    """16-wide tiles: three reduction steps over D = 48 and over F = 40 (the last one
    partial), three hidden-column programs per expert and three output-column ones."""
    for name in ("MOE_BLOCK_F", "MOE_BLOCK_D", "MOE_BLOCK_K"):
        monkeypatch.setattr(launch, name, 16)
    params = experts(torch.float32, True, seed=3)
    x = randn(37, HIDDEN, seed=4)
    weights, chosen = routing(37, "crowded", seed=5)
    got = moe(x, weights, chosen, **params, activation=activation, **extra)
    assert_close(got, reference(x, weights, chosen, params, activation, extra), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_result_does_not_depend_on_which_tokens_share_an_expert(dtype):
    """Permuting the tokens permutes the output: a pair's result depends on its own
    token alone, not on its place in its expert's blocks of rows."""
    n = 37
    params = experts(dtype, True, seed=6)
    x = randn(n, HIDDEN, dtype=dtype, seed=7)
    weights, chosen = routing(n, "crowded", seed=8, dtype=dtype)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    out = moe(x, weights, chosen, **params)
    permuted = moe(x[perm], weights[perm], chosen[perm], **params)
    if DEVICE == "cuda":  # each tile row is its own dot products: bit for bit
        assert torch.equal(permuted, out[perm])
    else:  # the interpreter's numpy matmul may sum an edge row in another order
        assert_close(permuted, out[perm], dtype)


def test_edge_cases():
    """No tokens: an empty result. One token routed to one expert in both slots (not a
    top-k routing, but the contract allows it). Bad arguments are refused."""
    params = experts(torch.float32, True, seed=11)
    empty = torch.empty(0, TOP_K, device=DEVICE)
    out = moe(randn(0, HIDDEN), empty, empty.long(), **params)
    assert out.shape == (0, HIDDEN)

    x = randn(1, HIDDEN, seed=12)
    weights = torch.tensor([[0.25, 0.75]], device=DEVICE)
    chosen = torch.tensor([[4, 4]], device=DEVICE)
    assert_close(moe(x, weights, chosen, **params),
                 reference(x, weights, chosen, params, "silu", {}), torch.float32)

    with pytest.raises(ValueError, match="activation"):
        moe(x, weights, chosen, **params, activation="gelu")
    with pytest.raises(ValueError, match="shapes"):
        moe(randn(1, HIDDEN + 1), weights, chosen, **params)
    with pytest.raises(ValueError, match="dtype"):
        moe(x.double(), weights, chosen, **params)


# ----------------------------------------------------------------------------------------
# On a GPU: no host synchronisation, CUDA graph capture
# ----------------------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE != "cuda", reason="host synchronisation is a GPU matter")
def test_a_call_does_not_synchronise_with_the_host():
    params = experts(torch.bfloat16, True, seed=13)
    x = randn(37, HIDDEN, dtype=torch.bfloat16, seed=14)
    weights, chosen = routing(37, "crowded", seed=15, dtype=torch.bfloat16)
    moe(x, weights, chosen, **params)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x, weights, chosen, **params, activation="clamped_swiglu")
        moe(x, weights, chosen, **params)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_captured_graph_follows_a_new_routing(dtype):
    """One capture; the routing is rewritten in place (a crowded one with empty experts,
    then a uniform one) and each replay gives that routing's result."""
    n = 37
    params = experts(dtype, True, seed=16)
    x = randn(n, HIDDEN, dtype=dtype, seed=17)
    weights, chosen = routing(n, "random", seed=18, dtype=dtype)

    def launch():
        return moe(x, weights, chosen, **params, activation="clamped_swiglu",
                   alpha=ALPHA, limit=LIMIT)

    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = launch()
    extra = ACTIVATIONS[1][1]
    for kind, seed in (("crowded", 19), ("random", 20)):
        new_weights, new_chosen = routing(n, kind, seed, dtype)
        weights.copy_(new_weights)
        chosen.copy_(new_chosen)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(static, reference(x, weights, chosen, params, "clamped_swiglu", extra),
                     dtype)
