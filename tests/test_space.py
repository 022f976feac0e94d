"""The search space: what each target can serve, and budgets written as slots."""

from __future__ import annotations

import pytest

from vegas_core.spec_config import SpecConfig, draft_budget
from vegas_tune.space import (FORK_STREAMING_SELECTION, FORK_VEGAS, SPREAD, STREAMING, WINDOWS,
                              Point, Selection, budget_ratio, fits_target, longest_prefix,
                              selections)


def test_the_vllm_target_searches_what_the_fork_runs_and_the_vegas_target_everything():
    fork = selections("vllm")
    assert fork == [Selection("vegas", "weight", 0.0, "fork"), Selection("streaming", rule="fork")]
    assert fork[1] == FORK_STREAMING_SELECTION
    engine = selections("vegas")
    # Every score with every window, and with the spread and no window; and streaming.
    assert len(engine) == 2 * len(WINDOWS) + 2 + 1 and STREAMING in engine
    assert {s.rule for s in engine} == {"engine"}
    assert {s.score for s in engine if s.drafter == "vegas"} == {"logit", "weight"}
    spread = [s for s in engine if s.spread]
    assert {(s.score, s.window, s.spread) for s in spread} == {("logit", 0.0, SPREAD),
                                                               ("weight", 0.0, SPREAD)}
    assert all(s.spread == 0 for s in fork)
    for selection in fork:
        spec = Point(selection, 256, 8).spec(9000)
        assert fits_target(spec, "vllm") is None and spec.rule == "fork"
        assert spec.options_set() == {} and "spread" not in spec.to_dict()
    for selection in spread:
        spec = Point(selection, 256, 8).spec(9000)
        assert spec.spread == SPREAD and Selection.of(spec) == selection
        assert spec.options_set() == {"spread": SPREAD} and "spread" in spec.to_dict()
        assert Point(selection, 256, 8).words() == (
            f"vegas {selection.score}, spread {SPREAD}, 256 slots, gamma 8")


@pytest.mark.parametrize("spec, why", [
    (SpecConfig(drafter="vegas", score="logit", rule="fork"), "score 'logit'"),
    (SpecConfig(drafter="vegas", score="weight", window=0.5, rule="fork"), "window 0.5"),
    (SpecConfig(drafter="vegas", score="weight", granularity="kv_head", rule="fork"),
     "granularity"),
    (SpecConfig(drafter="vegas", score="weight"), "rule 'engine'"),
    (SpecConfig(drafter="vegas", score="weight", rule="fork", spread=8), "spread 8"),
    (SpecConfig(drafter="streaming"), "rule 'engine'"),
    (SpecConfig(drafter="quest"), "runs only vegas and streaming"),
])
def test_what_the_fork_cannot_run_is_named(spec, why):
    assert why in fits_target(spec, "vllm")
    assert fits_target(spec, "vegas") is None


@pytest.mark.parametrize("budget", [32, 128, 400, 1024, 4096])
@pytest.mark.parametrize("ctx, new", [(1024, 32), (8000, 128), (32768, 512), (131072, 64)])
def test_a_budget_is_that_many_slots_at_every_prefix_of_the_workload(budget, ctx, new):
    if budget >= ctx:
        return
    prefix = longest_prefix(ctx, new)
    spec = Point(STREAMING, budget, 8).spec(prefix)
    assert spec.min_tokens == budget and 0 < spec.sparsity < 1
    for length in (budget + 1, ctx, ctx + new, prefix):
        assert draft_budget(length, spec.sparsity, spec.min_tokens) == budget
    # Beyond the workload the budget grows with the context, as the ratio says.
    assert draft_budget(4 * prefix, spec.sparsity, spec.min_tokens) > budget


def test_the_ratio_keeps_three_significant_digits():
    assert budget_ratio(128, 8385) == 0.0152
    assert budget_ratio(1024, 8385) == 0.122


def test_a_point_round_trips_through_the_engines_config():
    for selection in selections("vegas") + selections("vllm"):
        point = Point(selection, 512, 7)
        spec = point.spec(9000)
        assert Point.of(spec) == point
        assert spec.score == selection.score and spec.window == selection.window
        assert spec.rule == selection.rule
    assert Point(Selection("vegas", "weight", FORK_VEGAS["window"]), 256, 10).words() == (
        "vegas weight, 256 slots, gamma 10")
    assert [s.words() for s in selections("vllm")] == ["vegas weight (fork rule)",
                                                       "streaming (fork rule)"]
