"""The cost model: a line in gamma through two probes, a draft cost linear in the K/V
share, and step 1's acceptance rescaled by a batch size's probes."""

from __future__ import annotations

import math

import pytest

from vegas_tune.costmodel import (ProbeRun, StepCosts, batch_acceptance, budget_share,
                                  draft_read_share,
                                  expected_tokens, iteration_seconds,
                                  predict_tokens_per_second)

ACCEPTANCE = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
SHARE, LOW_SHARE = 0.1, 0.03


def probe(gamma: int, seconds: float, share: float = SHARE, sparsity: float = 0.1,
          draft: float = 0.004, accepted: tuple = ()) -> ProbeRun:
    return ProbeRun(gamma, sparsity, share, seconds, draft, accepted)


def line_costs(fixed: float, per_gamma: float, per_share: float | None = None) -> StepCosts:
    """Costs of a machine whose iterations take fixed + gamma * (per_gamma + per_share *
    (share - SHARE)) exactly."""
    sparse = None
    if per_share is not None:
        sparse = probe(8, fixed + 8 * (per_gamma + per_share * (LOW_SHARE - SHARE)),
                       share=LOW_SHARE, sparsity=0.01)
    return StepCosts(0.010, probe(8, fixed + 8 * per_gamma),
                     short=probe(1, fixed + per_gamma), sparse=sparse)


def test_the_line_through_two_probes_predicts_every_gamma_between_them():
    costs = line_costs(fixed=0.012, per_gamma=0.005)
    for gamma in range(1, 9):
        assert iteration_seconds(costs, gamma) == pytest.approx(0.012 + 0.005 * gamma)


def test_the_sparse_probe_sets_the_cost_per_share_of_every_draft_step():
    costs = line_costs(fixed=0.012, per_gamma=0.005, per_share=0.02)
    for gamma in (1, 4, 8):
        for share in (0.01, 0.05, 0.2):
            expected = 0.012 + gamma * (0.005 + 0.02 * (share - SHARE))
            assert iteration_seconds(costs, gamma, share) == pytest.approx(expected)


def test_without_a_sparse_probe_the_draft_cost_runs_up_to_a_decode_step():
    costs = StepCosts(0.010, probe(8, 0.060, draft=0.004), short=probe(1, 0.020))
    # Per share: (decode - draft) / (1 - share) = 0.006 / 0.9.
    extra = iteration_seconds(costs, 6, 0.2) - iteration_seconds(costs, 6, SHARE)
    assert extra == pytest.approx(6 * 0.006 / 0.9 * (0.2 - SHARE))


def test_at_a_probe_the_prediction_is_the_probes_throughput():
    costs = StepCosts(0.010, probe(8, 0.060), short=probe(1, 0.020),
                      sparse=probe(8, 0.050, share=LOW_SHARE, sparsity=0.01))
    predicted = predict_tokens_per_second(ACCEPTANCE, costs, 8, batch_size=64)
    assert predicted == pytest.approx(64 * expected_tokens(ACCEPTANCE, 8) / 0.060)
    assert iteration_seconds(costs, 8, LOW_SHARE) == pytest.approx(0.050)
    assert iteration_seconds(costs, 1) == pytest.approx(0.020)


def test_one_probe_predicts_its_own_gamma():
    costs = StepCosts(0.010, probe(1, 0.025))
    assert iteration_seconds(costs, 1) == pytest.approx(0.025)


def test_noisy_probes_never_predict_an_iteration_cheaper_than_a_decode_step():
    # Probe 1 slower than probe 8: the fitted line falls, and would go below zero.
    costs = StepCosts(0.010, probe(8, 0.020), short=probe(1, 0.080))
    assert iteration_seconds(costs, 8) == pytest.approx(0.020)
    assert min(iteration_seconds(costs, g) for g in range(1, 20)) >= 0.010


@pytest.mark.parametrize("short, sparse", [
    (probe(8, 0.02), None),  # same gamma as the main probe
    (probe(1, 0.02, share=LOW_SHARE), None),  # another share
    (None, probe(4, 0.02, share=LOW_SHARE)),  # another gamma
    (None, probe(8, 0.02)),  # the same share
])
def test_probes_must_differ_from_the_main_one_in_one_thing(short, sparse):
    with pytest.raises(ValueError):
        StepCosts(0.010, probe(8, 0.06), short=short, sparse=sparse)


def test_batch_acceptance_rescales_step_1_by_what_the_probes_accepted():
    step1 = {0.01: [0.9, 0.8, 0.6], 0.05: [0.9, 0.8, 0.7], 0.1: [1.0, 0.9, 0.8]}
    probes = (probe(3, 0.06, sparsity=0.1, accepted=(0.9, 0.81, 0.8)),
              probe(1, 0.02, sparsity=0.1, accepted=(0.5,)),  # fewer positions: not used
              probe(3, 0.05, share=LOW_SHARE, sparsity=0.01, accepted=(0.9, 0.4, 0.6)))
    out = batch_acceptance(step1, probes)
    assert out[0.1] == pytest.approx([0.9, 0.81, 0.8])  # the probe itself
    assert out[0.01] == pytest.approx([0.9, 0.4, 0.6])
    # Halfway between the probes' ratios in sparsity... 0.05 is 4/9 of the way.
    w = (0.05 - 0.01) / (0.1 - 0.01)
    factor = (1 - w) * 0.5 + w * 0.9
    assert out[0.05] == pytest.approx([0.9 * ((1 - w) * 1 + w * 0.9), 0.8 * factor, 0.7])
    assert step1[0.05] == [0.9, 0.8, 0.7]  # the input is left alone


def test_batch_acceptance_caps_rates_at_one_and_keeps_unprobed_positions():
    step1 = {0.1: [0.5, 0.4, 0.3], 0.2: [0.9, 0.8, 0.7]}
    out = batch_acceptance(step1, (probe(2, 0.06, sparsity=0.1, accepted=(1.0, 0.8)),))
    assert out[0.2] == pytest.approx([1.0, 1.0, 0.7])
    assert batch_acceptance(step1, ()) == step1


def test_expected_tokens_counts_the_bonus_token_and_refuses_unknown_positions():
    assert expected_tokens(ACCEPTANCE, 2) == pytest.approx(1 + 0.9 + 0.8)
    with pytest.raises(ValueError):
        expected_tokens(ACCEPTANCE, 9)


def test_budget_share_is_the_engines_budget_rule():
    assert budget_share(0.05, 256, 8000) == pytest.approx(400 / 8000)
    assert budget_share(0.01, 256, 8000) == pytest.approx(256 / 8000)  # min_tokens
    assert budget_share(0.05, 256, 100) == 1.0  # capped at the prefix
    assert budget_share(0.013, 1, 1000) == pytest.approx(math.ceil(13.0) / 1000)


def test_draft_read_share_budgets_full_attention_layers_only():
    # Dense: the budget's share of the prefix.
    assert draft_read_share(0.05, 256, 8000, [None] * 4) == pytest.approx(400 / 8000)
    # Gemma3-like: 5 sliding layers (512) per global one. A draft reads 400 slots in the
    # global layer and the whole window in the others, as vanilla does there.
    windows = [512] * 5 + [None]
    want = (400 + 5 * 512) / (8000 + 5 * 512)
    assert draft_read_share(0.05, 256, 8000, windows) == pytest.approx(want)
    # Every layer sliding (Mistral): drafts select as in a dense model.
    assert draft_read_share(0.05, 16, 1000, [4096] * 2) == pytest.approx(50 / 1000)
