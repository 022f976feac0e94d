"""Our engine against transformers on tiny random checkpoints (CPU, float32)."""

from __future__ import annotations

import inspect

import pytest
import torch

from vegas_core import generate, load_model
from vegas_core.attention import AttentionMeta
from vegas_core.spec_config import DRAFTERS
from tests.conftest import FAMILIES

LOGIT_RTOL = 1e-4


def full_logits(model, ids: list[int]) -> torch.Tensor:
    net = model.net
    tokens = torch.tensor([ids])
    positions = torch.arange(len(ids))[None]
    cache = net.new_cache(1, len(ids))
    with torch.inference_mode():
        meta = AttentionMeta.full(positions, len(ids), model.config.window)
        return net.logits(net(tokens, positions, cache, meta))[0]


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Plain greedy with transformers' KV cache: argmax every step, EOS not special."""
    # transformers renamed past_key_values to cache (5.x); use whichever forward takes.
    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out, past, step_input = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(n):
            res = hf(step_input, use_cache=True, **{cache_arg: past})
            past = getattr(res, cache_arg, None) or res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            step_input = torch.tensor([[out[-1]]])
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tiny_hf, family):
    path, hf = tiny_hf(family)
    ours = load_model(str(path), device="cpu", dtype="float32")
    ids = torch.randint(3, 256, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert rel_err(full_logits(ours, ids), ref) <= LOGIT_RTOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_greedy_matches_transformers(tiny_hf, family):
    path, hf = tiny_hf(family)
    ours = load_model(str(path), device="cpu", dtype="float32")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (64, 17, 40, 5)]
    # A small prefill chunk so the ragged batch crosses chunk boundaries.
    result = generate(ours, prompts, max_new_tokens=32, ignore_eos=True, prefill_chunk=16)
    for ids, got in zip(prompts, result.tokens):
        assert got == hf_greedy(hf, ids, 32)


def test_gemma3_layers_are_local_and_global():
    """The tiny Gemma3's sliding layers see 8 positions, its global layer all of them:
    a prompt longer than the window is where a wrong mask would show (above)."""
    from vegas_core.config import ModelConfig
    from tests.conftest import TINY

    import transformers

    _, extra = FAMILIES["gemma3"]
    hf = transformers.Gemma3TextConfig(**TINY, **extra).to_dict()
    config = ModelConfig.from_hf(hf, "tiny-gemma3")
    assert config.window.size == 8 and config.window.layers == frozenset({0, 2})
    assert [config.is_local(i) for i in range(3)] == [True, False, True]
    assert config.mlp_activation == "gelu_tanh" and config.sandwich_norms


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe", "gpt_oss"])
def test_hybrid_and_moe_speculative_greedy_equals_vanilla(tiny_hf, family, drafter):
    from vegas_core import SpecConfig

    path, _ = tiny_hf(family)
    ours = load_model(str(path), device="cpu", dtype="float32")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (300, 120, 47)]
    vanilla = generate(ours, prompts, max_new_tokens=24, ignore_eos=True).tokens
    spec = SpecConfig(drafter=drafter, gamma=4, sparsity=0.1, min_tokens=16)
    assert generate(ours, prompts, max_new_tokens=24, ignore_eos=True, spec=spec).tokens == vanilla


def test_qwen3_moe_routes_its_sparse_layers_only(tiny_hf):
    from vegas_core.model import MLP, MixtureOfExperts

    path, _ = tiny_hf("qwen3_moe")
    net = load_model(str(path), device="cpu", dtype="float32").net
    assert [type(b.mlp) for b in net.layers] == [MixtureOfExperts, MLP, MixtureOfExperts]


def test_gpt_oss_sinks_take_probability_mass():
    """A sink as large as every slot's logit takes its share of the softmax: one slot
    (logit 0) beside a sink of 0 gets half the weight, so the output halves."""
    from vegas_core.attention import reference_attention

    q = torch.zeros(1, 1, 2, 4)
    k = torch.zeros(1, 1, 1, 4)
    v = torch.ones(1, 1, 1, 4)
    mask = torch.ones(1, 1, 1, 1, 1, dtype=torch.bool)
    out = reference_attention(q, k, v, mask, sinks=torch.tensor([0.0, float("-inf")]))
    assert torch.allclose(out[0, 0, 0], torch.full((4,), 0.5))
    assert torch.allclose(out[0, 0, 1], torch.ones(4))  # a sink of -inf changes nothing
