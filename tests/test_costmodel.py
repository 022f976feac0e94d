"""The cost model: a line in gamma through two probes, a draft cost linear in the K/V
share, and acceptance from step 1."""

from __future__ import annotations

import math

import pytest

from vegas_tune.costmodel import (ProbeRun, StepCosts, budget_share, draft_seconds,
                                  expected_tokens, iteration_seconds, predict_tokens_per_second)

ACCEPTANCE = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]


def synthetic_costs(fixed: float, per_gamma: float, draft: float = 0.004,
                    decode: float = 0.010, share: float = 0.05) -> StepCosts:
    """Costs of a machine whose iterations take exactly fixed + per_gamma * gamma."""
    probes = tuple(ProbeRun(g, fixed + per_gamma * g, draft) for g in (1, 8))
    return StepCosts(decode, probes, share)


def test_the_line_through_two_probes_predicts_every_gamma_between_them():
    costs = synthetic_costs(fixed=0.012, per_gamma=0.005)
    for gamma in range(1, 9):
        assert iteration_seconds(costs, gamma) == pytest.approx(0.012 + 0.005 * gamma)


def test_at_a_probe_the_prediction_is_the_probes_throughput():
    probe = ProbeRun(8, 0.060, 0.004)
    costs = StepCosts(0.010, (ProbeRun(1, 0.020, 0.004), probe), 0.05)
    predicted = predict_tokens_per_second(ACCEPTANCE, costs, 8, batch_size=64)
    assert predicted == pytest.approx(64 * expected_tokens(ACCEPTANCE, 8) / 0.060)


def test_a_larger_share_costs_more_per_draft_step_up_to_a_decode_step():
    costs = synthetic_costs(fixed=0.012, per_gamma=0.005, draft=0.004, decode=0.010, share=0.05)
    assert draft_seconds(costs, 0.05) == pytest.approx(0.004)
    assert draft_seconds(costs, 1.0) == pytest.approx(0.010)
    assert draft_seconds(costs, 0.2) > draft_seconds(costs, 0.1) > draft_seconds(costs, 0.05)
    # Each of gamma draft steps pays the difference.
    extra = iteration_seconds(costs, 6, 0.2) - iteration_seconds(costs, 6, 0.05)
    assert extra == pytest.approx(6 * (draft_seconds(costs, 0.2) - 0.004))


def test_one_probe_predicts_its_own_gamma():
    costs = StepCosts(0.010, (ProbeRun(1, 0.025, 0.004),), 0.05)
    assert iteration_seconds(costs, 1) == pytest.approx(0.025)


def test_noisy_probes_never_predict_an_iteration_cheaper_than_a_decode_step():
    # Probe 1 slower than probe 8: the fitted line falls, and would go below zero.
    costs = StepCosts(0.010, (ProbeRun(1, 0.080, 0.004), ProbeRun(8, 0.020, 0.004)), 0.05)
    assert iteration_seconds(costs, 8) == pytest.approx(0.020)
    assert min(iteration_seconds(costs, g) for g in range(1, 20)) >= 0.010


@pytest.mark.parametrize("probes", [(), (ProbeRun(4, 0.02, 0.004), ProbeRun(4, 0.03, 0.004))])
def test_probes_must_be_one_or_two_distinct_gammas(probes):
    with pytest.raises(ValueError):
        StepCosts(0.010, probes, 0.05)


def test_expected_tokens_counts_the_bonus_token_and_refuses_unknown_positions():
    assert expected_tokens(ACCEPTANCE, 2) == pytest.approx(1 + 0.9 + 0.8)
    with pytest.raises(ValueError):
        expected_tokens(ACCEPTANCE, 9)


def test_budget_share_is_the_engines_budget_rule():
    assert budget_share(0.05, 256, 8000) == pytest.approx(400 / 8000)
    assert budget_share(0.01, 256, 8000) == pytest.approx(256 / 8000)  # min_tokens
    assert budget_share(0.05, 256, 100) == 1.0  # capped at the prefix
    assert budget_share(0.013, 1, 1000) == pytest.approx(math.ceil(13.0) / 1000)
