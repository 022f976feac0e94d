"""Acceptance (vegas_core.acceptance) on its own: greedy keeps the longest matching prefix
and adds the target's next token; speculative sampling emits tokens distributed as the
target (chi-square tests at a fixed seed, with the power to reject a wrong rule); the
edge cases; finished sequences stay put."""

from __future__ import annotations

import math

import pytest
import torch

from vegas_core.acceptance import accept, accept_greedy, accept_sampled, advance
from vegas_core.sampling import SamplingParams, probabilities

V = 6  # vocabulary of the sampling tests
DRAWS = 100_000  # sequences per sampling test, all in one batch


def one_hot_logits(tokens: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """[B, G + 1, vocab] logits whose argmax at row i is tokens[b][i]."""
    logits = torch.zeros(len(tokens), len(tokens[0]), vocab)
    logits.scatter_(-1, torch.tensor(tokens)[..., None], 5.0)
    return logits


def test_greedy_accepts_the_longest_matching_prefix_and_the_next_target_token():
    target = [[3, 1, 4, 1, 5], [3, 1, 4, 1, 5], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2]]
    drafts = torch.tensor([[3, 1, 0, 1],  # two match, then a miss: the later match is not kept
                           [3, 1, 4, 1],  # all four match: the bonus is the fifth row's
                           [0, 1, 4, 1],  # none: the bonus is the first row's argmax
                           [2, 7, 1, 0]])
    accepted, bonus = accept_greedy(one_hot_logits(target), drafts)
    assert accepted.tolist() == [2, 4, 0, 3]
    assert bonus.tolist() == [4, 5, 3, 8]


def test_accept_is_greedy_at_temperature_zero():
    logits = one_hot_logits([[3, 1, 4], [2, 2, 2]])
    drafts = torch.tensor([[3, 0], [2, 2]])
    got = accept(logits, drafts, None, SamplingParams(), None)
    assert [t.tolist() for t in got] == [[1, 2], [1, 2]]


def test_a_sequences_acceptance_does_not_depend_on_the_others():
    """A finished sequence's rows (whatever they hold) change no other sequence's result."""
    logits = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(0))
    drafts = logits[:, :3].argmax(-1)
    drafts[1, 2] = (drafts[1, 2] + 1) % 8
    alone = accept_greedy(logits, drafts)
    logits[3] = torch.randn(4, 8)
    drafts[3] = torch.tensor([5, 5, 5])
    changed = accept_greedy(logits, drafts)
    keep = [0, 1, 2, 4]
    assert alone[0][keep].tolist() == changed[0][keep].tolist() == [3, 2, 3, 3]
    assert alone[1][keep].tolist() == changed[1][keep].tolist()


def test_advance_moves_active_sequences_and_leaves_finished_ones():
    lengths, pending = torch.tensor([10, 20, 30]), torch.tensor([7, 8, 9])
    accepted, bonus = torch.tensor([2, 0, 4]), torch.tensor([1, 2, 3])
    active = torch.tensor([True, True, False])
    new_lengths, new_pending = advance(lengths, pending, accepted, bonus, active)
    # The pending token and the accepted drafts enter the cache: accepted + 1 slots.
    assert new_lengths.tolist() == [13, 21, 30]
    assert new_pending.tolist() == [1, 2, 9]


# ---- speculative sampling ------------------------------------------------------------


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile by Wilson-Hilferty; z = 3.719 is alpha = 1e-4."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``tokens``' counts against ``probs`` [V], and its degrees
    of freedom; cells of probability 0 must be empty."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    zero = expected == 0
    assert counts[zero].sum() == 0, "a token of probability 0 was emitted"
    stat = ((counts - expected)[~zero] ** 2 / expected[~zero]).sum().item()
    return stat, int((~zero).sum()) - 1


def fits(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    stat, df = chi2(tokens, probs)
    return stat < chi2_critical(df)


def dist(*weights: float) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float32)
    return w / w.sum()


# The target after each prefix and the drafter's distribution: they overlap only in part,
# so every path (accept, reject, residual) carries weight. One row per draft position.
P = torch.stack([dist(5, 1, 1, 1, 1, 1), dist(1, 1, 4, 2, 1, 1), dist(1, 2, 3, 0, 3, 1)])
Q = torch.stack([dist(1, 1, 1, 1, 1, 5), dist(3, 3, 1, 1, 1, 1)])


def sample_round(target: torch.Tensor, draft: torch.Tensor, seed: int):
    """DRAWS sequences that draft from ``draft`` [G, V] and verify against ``target``
    [G + 1, V] -> (drafts, accepted, bonus)."""
    gen = torch.Generator().manual_seed(seed)
    gamma = draft.shape[0]
    drafts = torch.stack([torch.multinomial(draft[i], DRAWS, replacement=True, generator=gen)
                          for i in range(gamma)], dim=1)  # [DRAWS, G]
    accepted, bonus = accept_sampled(target.expand(DRAWS, -1, -1), draft.expand(DRAWS, -1, -1),
                                     drafts, gen)
    return drafts, accepted, bonus


def emitted(drafts: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor, i: int):
    """The i-th emitted token of the sequences that emit one: draft i where kept, else the
    bonus where it stands at position i."""
    has = accepted >= i
    token = torch.where(accepted > i, drafts[:, min(i, drafts.shape[1] - 1)], bonus)
    return token[has]


def test_speculative_sampling_emits_the_target_distribution():
    drafts, accepted, bonus = sample_round(P, Q, seed=1)
    first = emitted(drafts, accepted, bonus, 0)
    assert len(first) == DRAWS and fits(first, P[0])
    # Given a kept first draft, the second token is distributed as the target after it.
    second = emitted(drafts, accepted, bonus, 1)
    assert 0.2 * DRAWS < len(second) < 0.8 * DRAWS
    assert fits(second, P[1])
    # After every draft is kept, the bonus comes from the target after the last one.
    after_all = bonus[accepted == 2]
    assert len(after_all) > 1000 and fits(after_all, P[2])
    # The acceptance rate of the first draft is sum(min(p, q)).
    rate = (accepted >= 1).double().mean().item()
    assert rate == pytest.approx(torch.minimum(P[0], Q[0]).sum().item(), abs=0.01)


def test_the_chi_square_check_rejects_a_wrong_rule():
    """Power: the emitted tokens do not fit what a plausible wrong rule would give (the
    bonus drawn from p instead of norm(max(0, p - q))), nor the draft distribution."""
    drafts, accepted, bonus = sample_round(P[:2], Q[:1], seed=2)
    first = emitted(drafts, accepted, bonus, 0)
    p, q = P[0], Q[0]
    kept = torch.minimum(p, q)
    wrong = kept + (1 - kept.sum()) * p  # reject, then sample p again
    assert not fits(first, wrong)
    assert not fits(first, q)


def test_sampling_accepts_every_draft_where_the_distributions_agree():
    drafts, accepted, bonus = sample_round(P, P[:2], seed=3)
    assert accepted.eq(2).all()
    assert fits(bonus, P[2])


def test_sampling_rejects_a_draft_the_target_rules_out():
    """q drafts only token 5, which the target gives probability 0: every first draft is
    rejected, and the bonus comes from the residual, the target itself here."""
    target = torch.stack([dist(1, 2, 3, 4, 0, 0), P[1]])
    draft = torch.zeros(1, V)
    draft[0, 5] = 1.0
    drafts, accepted, bonus = sample_round(target, draft, seed=4)
    assert accepted.eq(0).all() and drafts.eq(5).all()
    assert fits(bonus, target[0])


def test_accept_samples_the_processed_target_distribution():
    """``accept`` applies the sampling parameters to the target logits (here top-k 2)
    before comparing them with the drafts' distribution."""
    params = SamplingParams(temperature=1.0, top_k=2)
    logits = torch.log(dist(4, 3, 2, 1, 1, 1))[None, None].expand(DRAWS, 2, V).contiguous()
    target = probabilities(logits[0], params)  # [2, V]: tokens 0 and 1 only
    draft = dist(1, 1, 1, 1, 1, 1)[None]
    gen = torch.Generator().manual_seed(5)
    drafts = torch.multinomial(draft[0], DRAWS, replacement=True, generator=gen)[:, None]
    accepted, bonus = accept(logits, drafts, draft.expand(DRAWS, -1, -1), params, gen)
    first = torch.where(accepted > 0, drafts[:, 0], bonus)
    assert fits(first, target[0])
