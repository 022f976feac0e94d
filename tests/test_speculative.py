"""Speculative decoding is lossless: greedy equals vanilla token for token (the real
SmolLM2, fp32, CPU), and sampling keeps the target distribution (tiny model, exact)."""

from __future__ import annotations

import inspect
import math
import pathlib

import pytest
import torch

from vegas_core import SpecConfig, SpecSchedule, generate
from vegas_core.spec_config import COLLECT, DRAFTERS, GRANULARITIES, SCORES
from vegas_tune.options import TuneOptions
from vegas_tune.space import Point, longest_prefix, selections
from tests.test_engine import tiny_model


def stdlib_tokens(model, module) -> list[int]:
    return model.tokenizer.encode(pathlib.Path(inspect.getsourcefile(module)).read_text())


@pytest.fixture(scope="module")
def long_batch(smollm):
    """4 prompts of different lengths, up to ~2k tokens, and their vanilla greedy output."""
    import argparse
    import json.decoder

    ids = stdlib_tokens(smollm, argparse)
    other = stdlib_tokens(smollm, json.decoder)
    prompts = [ids[:1900], other[:1000], ids[5000:5450], ids[9000:9120]]
    vanilla = generate(smollm, prompts, max_new_tokens=32, ignore_eos=True).tokens
    return prompts, vanilla


@pytest.fixture(scope="module")
def short_batch(smollm):
    import typing

    ids = stdlib_tokens(smollm, typing)
    prompts = [ids[:600], ids[2000:2300], ids[4000:4200], ids[7000:7090]]
    vanilla = generate(smollm, prompts, max_new_tokens=16, ignore_eos=True).tokens
    return prompts, vanilla


@pytest.mark.slow
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("gamma, sparsity, min_tokens", [(4, 0.05, 32), (7, 0.15, 64)])
def test_every_drafter_is_lossless_in_greedy(smollm, long_batch, drafter, gamma, sparsity,
                                             min_tokens):
    prompts, vanilla = long_batch
    spec = SpecConfig(drafter=drafter, gamma=gamma, sparsity=sparsity, min_tokens=min_tokens)
    out = generate(smollm, prompts, max_new_tokens=32, ignore_eos=True, spec=spec)
    assert out.tokens == vanilla
    assert 1.0 <= out.stats.mean_accepted_length <= spec.gamma + 1
    assert len(out.stats.acceptance_by_position) == gamma


@pytest.mark.slow
@pytest.mark.parametrize("gamma, sparsity, min_tokens", [(1, 0.05, 32), (8, 0.02, 16)])
def test_vegas_is_lossless_at_extreme_gamma(smollm, long_batch, gamma, sparsity, min_tokens):
    prompts, vanilla = long_batch
    spec = SpecConfig(gamma=gamma, sparsity=sparsity, min_tokens=min_tokens)
    out = generate(smollm, prompts, max_new_tokens=32, ignore_eos=True, spec=spec)
    assert out.tokens == vanilla


@pytest.mark.slow
@pytest.mark.parametrize("collect", COLLECT)
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_every_vegas_option_is_lossless(smollm, short_batch, collect, score, granularity):
    prompts, vanilla = short_batch
    spec = SpecConfig(gamma=5, sparsity=0.05, min_tokens=16, collect=collect, score=score,
                      granularity=granularity)
    out = generate(smollm, prompts, max_new_tokens=16, ignore_eos=True, spec=spec)
    assert out.tokens == vanilla


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(drafter="vegas", score="weight"), dict(drafter="vegas", score="logit", collect="last"),
    dict(drafter="streaming")], ids=lambda o: "-".join(o.values()))
def test_the_vllm_forks_rules_are_lossless(smollm, long_batch, options):
    """``rule: fork``: a one-row window after the prefill and the verified window's first
    slot among the candidates (vegas), whole blocks moved at every draft step (streaming)."""
    prompts, vanilla = long_batch
    spec = SpecConfig(gamma=5, sparsity=0.05, min_tokens=48, rule="fork", **options)
    out = generate(smollm, prompts, max_new_tokens=32, ignore_eos=True, spec=spec)
    assert out.tokens == vanilla


def test_dense_drafts_are_always_accepted():
    model = tiny_model()
    prompts = [list(range(1, 30)), list(range(5, 17))]
    gamma = 4
    out = generate(model, prompts, max_new_tokens=1 + 3 * (gamma + 1), ignore_eos=True,
                   spec=SpecConfig(drafter="dense", gamma=gamma))
    assert out.stats.mean_accepted_length == gamma + 1
    assert out.stats.acceptance_by_position == [1.0] * gamma
    assert out.stats.iterations == 3


def test_stats_are_consistent():
    model = tiny_model()
    out = generate(model, [list(range(1, 60))] * 2, max_new_tokens=20, ignore_eos=True,
                   spec=SpecConfig(gamma=3, sparsity=0.1, min_tokens=4))
    s = out.stats
    assert s.new_tokens == [20, 20] and s.decode_tokens == 38
    assert all(0.0 <= a <= 1.0 for a in s.acceptance_by_position)
    assert s.acceptance_by_position == sorted(s.acceptance_by_position, reverse=True)
    assert s.mean_accepted_length == pytest.approx(1 + sum(s.acceptance_by_position))
    assert 0.0 <= s.selection_overhead < 1.0
    assert s.draft_seconds > 0 and s.verify_seconds > 0 and s.tokens_per_second > 0


# ---- sampling: the speculative output distribution equals the target distribution ----

VOCAB, PROMPT_LEN, GAMMA, DRAWS = 8, 48, 3, 20000


def chi2_critical(df: int, alpha_z: float = 3.719) -> float:
    """Upper chi-square quantile by Wilson-Hilferty; z = 3.719 is alpha = 1e-4."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + alpha_z * math.sqrt(h)) ** 3


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic; cells expected below 5 are pooled into one."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()
    return stat, int(keep.sum()) - 1


def exact_continuations(model, prompt, params, depth):
    """Exact joint distribution of the first `depth` sampled tokens, [V] * depth."""
    from vegas_core.attention import AttentionMeta
    from vegas_core.sampling import probabilities

    net = model.net
    joint = torch.ones(1, dtype=torch.float64)
    seqs = torch.tensor([prompt])
    for _ in range(depth):
        n, t = seqs.shape
        positions = torch.arange(t).expand(n, -1)
        with torch.inference_mode():
            hidden = net(seqs, positions, net.new_cache(n, t), AttentionMeta.full(positions, t))
            p = probabilities(net.logits(hidden[:, -1]), params).double()  # [n, V]
        joint = (joint[:, None] * p).reshape(-1)
        seqs = torch.cat([seqs.repeat_interleave(VOCAB, 0),
                          torch.arange(VOCAB).repeat(n)[:, None]], dim=1)
    return joint.reshape([VOCAB] * depth)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9)])
def test_speculative_sampling_keeps_the_target_distribution(temperature, top_k, top_p):
    from vegas_core.sampling import SamplingParams

    model = tiny_model(vocab_size=VOCAB)
    with torch.no_grad():  # soften the wide test init: spread-out distributions, not one-hot
        model.net.lm_head.weight.mul_(0.3)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature, top_p, top_k)
    depth = 1 + GAMMA  # the prefill's token, then one iteration's drafts
    exact = exact_continuations(model, prompt, params, depth)
    # A 4-token budget out of ~48 prefix slots: drafts differ from the target, so the
    # rejection and residual-sampling paths run.
    spec = SpecConfig(gamma=GAMMA, sparsity=0.05, min_tokens=4)
    out = generate(model, [prompt] * DRAWS, max_new_tokens=depth, ignore_eos=True,
                   spec=spec, temperature=temperature, top_k=top_k, top_p=top_p, seed=11)
    assert out.stats.mean_accepted_length < GAMMA + 0.8  # rejections did happen
    assert_exact_distribution(out.tokens, exact)


def assert_exact_distribution(out_tokens: list[list[int]], exact: torch.Tensor) -> None:
    """The drawn sequences' first tokens follow ``exact`` ([V] * depth): their joint of
    the first three and the marginal of every position pass the chi-square test."""
    depth = exact.dim()
    tokens = torch.tensor(out_tokens)[:, :depth]
    # The joint of the first three tokens, and the marginal of every position.
    joint3 = torch.bincount(tokens[:, 0] * VOCAB**2 + tokens[:, 1] * VOCAB + tokens[:, 2],
                            minlength=VOCAB**3).double()
    checks = [(joint3, exact.sum(dim=3).reshape(-1))]
    for pos in range(depth):
        marginal = exact.sum(dim=tuple(d for d in range(depth) if d != pos))
        checks.append((torch.bincount(tokens[:, pos], minlength=VOCAB).double(), marginal))
    for counts, probs in checks:
        stat, df = chi2_statistic(counts, probs)
        assert stat < chi2_critical(df), (stat, df)


@pytest.mark.parametrize("before", [None, SpecConfig(gamma=2, sparsity=0.2, min_tokens=6,
                                                     collect="last")],
                         ids=["from-vanilla", "from-other-drafts"])
def test_a_schedule_switching_while_sampling_keeps_the_target_distribution(before):
    """The batch's context passes a schedule boundary right after the prefill's token:
    drafts begin on a cache, generator and pending token another decoder left."""
    from vegas_core.sampling import SamplingParams

    model = tiny_model(vocab_size=VOCAB)
    with torch.no_grad():
        model.net.lm_head.weight.mul_(0.3)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    depth = 1 + GAMMA
    exact = exact_continuations(model, prompt, SamplingParams(1.0), depth)
    spec = SpecConfig(gamma=GAMMA, sparsity=0.05, min_tokens=4)
    schedule = SpecSchedule([(1, DRAWS, before, 1, PROMPT_LEN),
                             (1, DRAWS, spec, PROMPT_LEN + 1, 10 * PROMPT_LEN)])
    out = generate(model, [prompt] * DRAWS, max_new_tokens=depth, ignore_eos=True,
                   spec=schedule, temperature=1.0, seed=11)
    assert out.stats.switches == 1 and out.stats.mean_accepted_length < GAMMA + 0.8
    assert_exact_distribution(out.tokens, exact)


def test_the_sampling_check_detects_a_wrong_distribution():
    """Power: the same statistic rejects the draft-free distribution at another
    temperature, so the lossless test above could fail."""
    from vegas_core.sampling import SamplingParams

    model = tiny_model(vocab_size=VOCAB)
    with torch.no_grad():
        model.net.lm_head.weight.mul_(0.3)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    exact = exact_continuations(model, prompt, SamplingParams(1.0), 2)
    out = generate(model, [prompt] * DRAWS, max_new_tokens=2, ignore_eos=True,
                   temperature=1.2, seed=3)
    tokens = torch.tensor(out.tokens)
    counts = torch.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB**2).double()
    stat, df = chi2_statistic(counts, exact.reshape(-1))
    assert stat > chi2_critical(df)


@pytest.mark.slow
@pytest.mark.parametrize("selection", selections("vegas") + selections("vllm"),
                         ids=lambda s: s.words())
def test_every_configuration_the_tuner_can_choose_is_lossless(smollm, short_batch, selection):
    """Each selection rule of either target, with a budget written in slots as the tuner
    writes it, at its probe gamma."""
    prompts, vanilla = short_batch
    spec = Point(selection, 48, TuneOptions().probe_gamma).spec(longest_prefix(600, 16))
    out = generate(smollm, prompts, max_new_tokens=16, ignore_eos=True, spec=spec)
    assert out.tokens == vanilla


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(accumulate=0.5), dict(accumulate=0.8, score="weight", granularity="kv_head"),
    dict(pages=0.5), dict(pages=0.25, accumulate=0.5, score="weight", window=0.25),
    dict(accumulate=0.5, score="weight", rule="fork"), dict(spread=6, score="weight"),
    dict(spread=3, collect="all", granularity="kv_head")],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_the_key_options_are_lossless(smollm, long_batch, options):
    """Issue 41's vegas options: scores accumulated across iterations, Quest pages beside
    the verification top-k."""
    prompts, vanilla = long_batch
    spec = SpecConfig(gamma=5, sparsity=0.05, min_tokens=48, **options)
    out = generate(smollm, prompts, max_new_tokens=32, ignore_eos=True, spec=spec)
    assert out.tokens == vanilla
