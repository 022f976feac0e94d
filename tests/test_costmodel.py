"""The cost model: acceptance by position from the sweep's run at the probe gamma, and the
iteration time drawn down from that run, a draft forward and a fixed extra per token."""

from __future__ import annotations

import pytest

from vegas_tune.costmodel import Curve, Run, expected_tokens, per_token_extra

ACCEPTANCE = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)
FIXED, DRAFT, EXTRA = 0.012, 0.004, 0.001  # seconds: verify and selection, a draft, a row


def run(gamma: int, acceptance=ACCEPTANCE, draft: float = DRAFT) -> Run:
    """A run on a machine whose iterations take FIXED + gamma * (draft + EXTRA) exactly."""
    return Run(gamma, FIXED + gamma * (draft + EXTRA), draft, tuple(acceptance[:gamma]))


def test_two_runs_of_one_configuration_give_the_cost_of_a_drafted_token():
    assert per_token_extra(run(8), run(4)) == pytest.approx(EXTRA)
    assert per_token_extra(run(4), run(8)) == pytest.approx(EXTRA)
    with pytest.raises(ValueError, match="different gammas"):
        per_token_extra(run(8), run(8))


def test_below_the_probe_gamma_each_token_less_saves_a_draft_and_the_extra():
    curve = Curve([run(8)], EXTRA)
    for gamma in range(1, 9):
        assert curve.iteration_seconds(gamma) == pytest.approx(FIXED + gamma * (DRAFT + EXTRA))


def test_a_run_is_reproduced_at_its_own_gamma_and_two_runs_are_joined_by_a_line():
    long = run(12, acceptance=ACCEPTANCE + (0.1,) * 4)
    short = Run(6, run(6).iteration_seconds * 1.1, DRAFT, ACCEPTANCE[:6])  # off the line
    curve = Curve([long, short], EXTRA)
    assert curve.iteration_seconds(12) == long.iteration_seconds
    assert curve.iteration_seconds(6) == short.iteration_seconds
    assert curve.iteration_seconds(9) == pytest.approx(
        (short.iteration_seconds + long.iteration_seconds) / 2)
    # The run that drafted furthest knows acceptance furthest.
    assert curve.top_gamma == 12 and curve.acceptance == long.acceptance_by_position


def test_acceptance_at_a_gamma_comes_from_the_nearest_run_that_drafted_that_far():
    """Vegas's rates shift with gamma: below a shorter run, its rates are the estimate,
    and each run's throughput is reproduced at its own gamma."""
    long = run(8)
    short = Run(5, run(5).iteration_seconds, DRAFT, (0.95, 0.9, 0.85, 0.8, 0.75))
    curve = Curve([long, short], EXTRA)
    assert curve.acceptance_at(5) == curve.acceptance_at(3) == short.acceptance_by_position
    assert curve.acceptance_at(6) == curve.acceptance_at(8) == long.acceptance_by_position
    for r in (long, short):
        measured = 64 * (1 + sum(r.acceptance_by_position)) / r.iteration_seconds
        assert curve.tokens_per_second(r.gamma, 64) == pytest.approx(measured)


def test_throughput_is_batch_times_tokens_per_iteration_over_its_time():
    curve = Curve([run(8)], EXTRA)
    for gamma in (1, 4, 8):
        want = 64 * (1 + sum(ACCEPTANCE[:gamma])) / (FIXED + gamma * (DRAFT + EXTRA))
        assert curve.tokens_per_second(gamma, 64) == pytest.approx(want)
    assert curve.best_gamma(64) == max(range(1, 9), key=lambda g: curve.tokens_per_second(g, 64))


def test_no_iteration_is_predicted_faster_than_a_decode_step_and_its_drafts():
    # Noise made the extra very negative: the line would reach zero below the probe.
    curve = Curve([run(8)], extra=-0.010, floor_seconds=0.011)
    for gamma in range(1, 9):
        assert curve.iteration_seconds(gamma) >= 0.011 + gamma * DRAFT


def test_expected_tokens_counts_the_bonus_token_and_refuses_unknown_positions():
    assert expected_tokens(ACCEPTANCE, 3) == pytest.approx(1 + 0.9 + 0.8 + 0.7)
    with pytest.raises(ValueError, match="known for 8 positions"):
        expected_tokens(ACCEPTANCE, 9)
    with pytest.raises(ValueError, match="at least one run"):
        Curve([], 0.0)


def test_acceptance_is_scaled_to_what_a_steady_iteration_produced():
    # The rates say 1 + 4.4 tokens per iteration at gamma 8; the steady window produced
    # 4.3. The throughput at the run's own gamma is then the run's, and lower gammas keep
    # the rates' shape.
    long = Run(8, FIXED + 8 * (DRAFT + EXTRA), DRAFT, ACCEPTANCE, tokens_per_iteration=4.3)
    curve = Curve([long], EXTRA)
    assert curve.tokens_per_second(8, 64) == pytest.approx(64 * 4.3 / long.iteration_seconds)
    scale = 3.3 / sum(ACCEPTANCE)
    assert expected_tokens(curve.acceptance, 2) == pytest.approx(1 + scale * (0.9 + 0.8))
    assert Curve([run(8)], EXTRA).acceptance == ACCEPTANCE  # none given: the rates as they are
