"""Triton kernels against their float64 PyTorch references, on fresh random inputs.

On a machine without a GPU they run in Triton's interpreter (small sizes); on a GPU the
same tests run natively, in float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is optional on CPU-only installs")

from kernels.sparse_attention import reference_sparse_attention, sparse_attention  # noqa: E402
from kernels.verify_attention import reference_verify_attention, verify_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def randn(*shape, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, rows, heads, kv_heads, dim, kv_len, split", [
    (2, 9, 8, 2, 64, 257, 128),  # gamma = 8 verify, GQA 4, ragged split
    (1, 1, 4, 4, 32, 100, 512),  # a decode step, no GQA, one split
    (3, 3, 6, 3, 64, 700, 64),  # many splits
    (2, 7, 9, 3, 64, 129, 128),  # SmolLM2's heads: 21 packed rows
])
def test_verify_attention_matches_reference(dtype, batch, rows, heads, kv_heads, dim, kv_len,
                                            split):
    seed = batch * 100 + rows
    q = randn(batch, rows, heads, dim, dtype=dtype, seed=seed)
    k = randn(batch, kv_heads, kv_len + 40, dim, dtype=dtype, seed=seed + 1)
    v = randn(batch, kv_heads, kv_len + 40, dim, dtype=dtype, seed=seed + 2)
    # Ragged: each sequence's window ends at a different slot.
    ends = [kv_len - 5 * i for i in range(batch)]
    positions = torch.stack([torch.arange(e - rows, e) for e in ends]).to(DEVICE)
    weights = torch.zeros(batch, rows, device=DEVICE)
    weights[:, 0] = 1.0
    weights[:, -1] = 1.0
    out, lse, scores = verify_attention(q, k, v, positions, kv_len, weights, split_size=split)
    ref_out, ref_lse, ref_scores = reference_verify_attention(
        q.double(), k.double(), v.double(), positions, kv_len, weights.double())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)
    torch.testing.assert_close(scores.double(), ref_scores, atol=tol * 10, rtol=tol)
    plain_out, _, none = verify_attention(q, k, v, positions, kv_len, split_size=split)
    assert none is None and torch.equal(plain_out, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("counts, tails, split", [
    ([70, 33], [5, 9], 32),  # ragged budgets and tails, many splits
    ([0, 1], [0, 3], 64),  # edges: no selected slot (tail only), one selected slot
    ([120, 120], [2, 2], 256),  # the whole prefix selected: dense
])
def test_sparse_attention_matches_reference(dtype, per_head, counts, tails, split):
    batch, heads, kv_heads, dim, slots = 2, 8, 2, 64, 160
    seed = sum(counts) + split
    q = randn(batch, 1, heads, dim, dtype=dtype, seed=seed)
    k = randn(batch, kv_heads, slots, dim, dtype=dtype, seed=seed + 1)
    v = randn(batch, kv_heads, slots, dim, dtype=dtype, seed=seed + 2)
    positions = torch.tensor([[slots - 1], [slots - 11]], device=DEVICE)
    tail_start = positions[:, 0] - torch.tensor(tails, device=DEVICE)
    groups = kv_heads if per_head else 1
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.stack([torch.randperm(int(tail_start[b]), generator=g)[:120]
                                        for _ in range(groups)]) for b in range(batch)])
    indices = indices.to(DEVICE)
    counts_t = torch.tensor(counts, device=DEVICE)
    max_keys = max(c + t + 1 for c, t in zip(counts, tails))
    out = sparse_attention(q, k, v, positions, indices, counts_t, tail_start, max_keys,
                           split_size=split)
    ref = reference_sparse_attention(q.double(), k.double(), v.double(), positions, indices,
                                     counts_t, tail_start)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("drafter", ["vegas", "streaming", "snapkv"])
def test_engine_on_the_kernel_path_matches_the_reference_path(drafter, monkeypatch):
    """Vanilla decode steps and index-list drafts through the kernels give the same
    greedy tokens as the reference path (float32)."""
    from vegas_core import SpecConfig, generate
    from tests.test_engine import tiny_model

    model = tiny_model(head_dim=16)  # the kernels need a head dim of 16 or more
    if DEVICE == "cuda":
        model.net.to(DEVICE)
    prompts = [list(range(1, 70)), list(range(5, 40))]
    spec = SpecConfig(drafter=drafter, gamma=3, sparsity=0.1, min_tokens=4)
    monkeypatch.setenv("VEGAS_ATTENTION", "reference")
    ref_vanilla = generate(model, prompts, max_new_tokens=10, ignore_eos=True).tokens
    ref_spec = generate(model, prompts, max_new_tokens=10, ignore_eos=True, spec=spec).tokens
    monkeypatch.setenv("VEGAS_ATTENTION", "triton")
    assert generate(model, prompts, max_new_tokens=10, ignore_eos=True).tokens == ref_vanilla
    assert generate(model, prompts, max_new_tokens=10, ignore_eos=True, spec=spec).tokens == ref_spec
    assert ref_spec == ref_vanilla


@pytest.mark.parametrize("collect, granularity", [("two", "layer"), ("all", "kv_head")])
def test_fused_verify_scores_select_what_the_reference_selects(collect, granularity,
                                                                monkeypatch):
    """With the kernels on, a vegas verify hands over row-summed logit scores (no per-row
    tensor), and the selection they give equals the reference path's."""
    from vegas_core import SpecConfig
    from vegas_core.sampling import SamplingParams
    from vegas_core.speculative import SpeculativeSession
    from tests.test_engine import tiny_model

    model = tiny_model(head_dim=16)
    if DEVICE == "cuda":
        model.net.to(DEVICE)
    spec = SpecConfig(gamma=3, sparsity=0.1, min_tokens=4, collect=collect,
                      granularity=granularity)
    prompts = [list(range(1, 80)), list(range(3, 50))]
    sessions = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("VEGAS_ATTENTION", backend)
        session = SpeculativeSession(model, prompts, spec, SamplingParams(), 8, prefill_chunk=32)
        session.step(torch.tensor([True, True], device=DEVICE))
        sessions[backend] = session
    layers = model.config.num_layers
    assert len(sessions["triton"].last_collector.reduced) == layers  # the kernel summed them
    assert not sessions["triton"].last_collector.logit  # no per-row tensor was kept
    assert len(sessions["reference"].last_collector.logit) == layers
    ref, got = sessions["reference"].selection, sessions["triton"].selection
    assert torch.equal(ref.counts, got.counts)
    for layer in range(ref.indices.shape[0]):
        for b in range(2):
            for g in range(ref.indices.shape[2]):
                n = int(ref.counts[layer, b])
                assert set(ref.indices[layer, b, g, :n].tolist()) == set(
                    got.indices[layer, b, g, :n].tolist())
