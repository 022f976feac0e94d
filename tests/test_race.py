"""The race: who is raced (``Steps.candidates``), and its rule (``race_verdict``): paired
ratios to the leader decide who drops out and when the race is over."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from vegas_tune.options import TuneOptions
from vegas_tune.space import Point, selections
from vegas_tune.steps import (EDGE_MARGIN, MIN_ROUNDS, Landscape, Search, Steps, cost_family,
                              race_verdict)


def rounds(mean: float, n: int, noise: float, seed: int, drift: list[float]) -> list[float]:
    """``n`` rounds around ``mean`` times each round's machine-wide ``drift``."""
    rng = random.Random(seed)
    return [mean * d * math.exp(rng.gauss(0.0, noise)) for d in drift[:n]]


def drift(n: int, seed: int = 9, spread: float = 0.05) -> list[float]:
    rng = random.Random(seed)
    return [math.exp(rng.gauss(0.0, spread)) for _ in range(n)]


def test_nothing_is_decided_before_the_minimum_rounds():
    early = {"a": [100.0, 101.0], "b": [50.0, 51.0]}
    live, decided = race_verdict(early, 0.01)
    assert live == ["a", "b"] and not decided and MIN_ROUNDS > 2


def test_a_surely_slower_configuration_drops_out_and_one_left_decides():
    d = drift(4)
    race = {"fast": rounds(100, 4, 0.003, 1, d), "slow": rounds(90, 4, 0.003, 2, d)}
    assert race_verdict(race, 0.01) == (["fast"], True)


def test_drift_between_rounds_cancels_in_the_paired_ratio():
    # Rounds that swing by 5% machine-wide: each configuration's own interval is wide,
    # yet 3% slower in every round is surely slower.
    d = drift(4, spread=0.05)
    race = {"a": rounds(103, 4, 0.002, 1, d), "b": rounds(100, 4, 0.002, 2, d)}
    assert race_verdict(race, 0.01) == (["a"], True)


def test_equals_are_decided_once_neither_can_be_more_than_the_precision_better():
    d = drift(8, spread=0.01)
    race = {"a": rounds(100, 8, 0.001, 1, d), "b": rounds(100, 8, 0.001, 2, d)}
    live, decided = race_verdict(race, 0.01)
    assert sorted(live) == ["a", "b"] and decided
    # With a precision finer than the noise allows, measuring more is the answer.
    live, decided = race_verdict(race, 0.0001)
    assert sorted(live) == ["a", "b"] and not decided


def test_the_leader_is_the_highest_mean_whatever_its_name():
    race = {"c1": [99.0, 99.0, 99.0], "c2": [100.0, 100.5, 99.5], "c3": [99.9, 100.2, 99.6]}
    live, _ = race_verdict(race, 0.01)
    assert live[0] == "c2"


def _sweep_trial(point, prefix: int, acceptance: list[float], iteration_seconds: float,
                 batch: int) -> SimpleNamespace:
    """A sweep run as the landscape reads it: 8 steady iterations at ``iteration_seconds``
    that produced what ``acceptance`` says."""
    spec = point.spec(prefix)
    steady = 8
    tokens = steady * batch * (1 + sum(acceptance))
    attrs = {f"spec_{k}": v for k, v in spec.to_dict().items()}
    attrs.update(claim="x", steady_iterations=steady, steady_seconds=steady * iteration_seconds,
                 steady_tokens=tokens, decode_seconds=0.0, decode_tokens=0, iterations=steady,
                 draft_step_seconds=0.001, acceptance_by_position=acceptance)
    return SimpleNamespace(user_attrs=attrs)


def test_the_race_takes_the_best_pairs_each_at_its_best_gamma_and_either_side():
    """Candidates are the best (selection, budget) pairs, not the best points (which crowd
    onto one pair's flat top), then each drafter's two best pairs, each at its best
    predicted gamma and either side."""
    batch, prefix, probe = 4, 1000, 8
    search = Search(batch, selections("vllm"), (128, 256), probe, prefix, 63, 900)
    vegas, streaming = search.selections
    rates = {(vegas, 256): 0.9, (vegas, 128): 0.85, (streaming, 256): 0.8, (streaming, 128): 0.6}
    trials = [_sweep_trial(Point(s, b, probe), prefix, [r ** i for i in range(1, probe + 1)],
                           0.010, batch) for (s, b), r in rates.items()]
    for short in search.short_probes:
        trials.append(_sweep_trial(short, prefix, [rates[short.curve] ** i
                                                   for i in range(1, short.gamma + 1)],
                                   0.007, batch))
    landscape = Landscape(trials, batch, search)
    bests = landscape.curve_bests()
    assert [p.curve for p in bests] == [(vegas, 256), (vegas, 128), (streaming, 256),
                                        (streaming, 128)]
    assert len({p.curve for p in landscape.ranked()[:2]}) == 1  # the best points: one pair
    steps = SimpleNamespace(options=TuneOptions(candidates=2))
    chosen = Steps.candidates(steps, landscape)
    assert all(1 < p.gamma < probe for p in bests[:2])
    around = lambda p: [p.with_gamma(p.gamma + d) for d in (0, -1, 1)]  # noqa: E731
    assert chosen[:6] == around(bests[0]) + around(bests[1])
    # streaming's two pairs (vegas's two are the best two already)
    assert bests[2] == landscape.best("streaming")
    assert chosen[6:] == around(bests[2]) + around(bests[3])
    steps = SimpleNamespace(options=TuneOptions(candidates=1))
    assert Steps.candidates(steps, landscape) == chosen  # vegas's second pair comes in too


def test_each_cost_family_has_its_own_short_probe_and_per_token_extra():
    """A drafted token's cost beyond its draft forward differs by drafter and score (the
    weight rules' verify does more per row): each family's curves take its own probe's
    figure; a family whose probe is missing takes the mean of those measured."""
    batch, prefix, probe = 4, 1000, 8
    search = Search(batch, selections("vegas"), (128, 256), probe, prefix, 63, 900)
    shorts = search.short_probes
    assert len(shorts) == len({cost_family(s) for s in search.selections}) == 3
    assert all(p.gamma == probe // 2 and p.budget == 256 for p in shorts)
    # Iterations of 10 ms at gamma 8, draft forwards of 1 ms: a short probe at 6, 4 or 2 ms
    # says a drafted token costs 0, 0.5 or 1 ms beyond its draft forward.
    short_seconds = dict(zip(sorted(shorts, key=lambda p: p.selection.words()),
                             (0.006, 0.004, 0.002)))
    trials = [_sweep_trial(Point(s, b, probe), prefix, [0.5] * probe, 0.010, batch)
              for s in search.selections for b in search.budgets]
    probes = [_sweep_trial(p, prefix, [0.5] * p.gamma, seconds, batch)
              for p, seconds in short_seconds.items()]
    landscape = Landscape(trials + probes, batch, search)
    for p, seconds in short_seconds.items():
        extra = (0.010 - seconds) / (probe - p.gamma) - 0.001
        assert landscape.extra_for(p.selection) == pytest.approx(extra)
        for s in search.selections:  # every window of the family: one figure
            if cost_family(s) == cost_family(p.selection):
                curve = landscape.curves[(s, 128)]
                assert curve.iteration_seconds(6) == pytest.approx(0.010 - 2 * (0.001 + extra))
    missing = max(short_seconds, key=short_seconds.get)
    partial = Landscape(trials + [t for t, p in zip(probes, short_seconds) if p != missing],
                        batch, search)
    others = [p for p in short_seconds if p != missing]
    assert partial.extra_for(missing.selection) == pytest.approx(
        sum(landscape.extra_for(p.selection) for p in others) / 2)


def test_a_budget_edge_near_a_drafters_best_is_extended_and_a_far_one_is_not():
    """The sweep ranks pairs by one run each: an edge pair predicted within ``EDGE_MARGIN``
    of its drafter's best may be the best once measured at its own gamma, so the budget axis
    goes one step past it; an edge far below the best is left alone."""
    batch, prefix, probe = 4, 1000, 8
    search = Search(batch, selections("vllm"), (128, 256, 512), probe, prefix, 63, 4000)
    vegas, streaming = search.selections
    rates = {(vegas, 128): 0.5, (vegas, 256): 0.9, (vegas, 512): 0.895,
             (streaming, 128): 0.61, (streaming, 256): 0.62, (streaming, 512): 0.3}
    trials = [_sweep_trial(Point(s, b, probe), prefix, [r ** i for i in range(1, probe + 1)],
                           0.010, batch) for (s, b), r in rates.items()]
    landscape = Landscape(trials, batch, search)
    for drafter in ("vegas", "streaming"):
        assert landscape.best(drafter).budget == 256  # each drafter's best: a middle budget
    edges = {(vegas, 512), (streaming, 128)}
    best = {s: landscape.predict(landscape.best(s.drafter)) for s in (vegas, streaming)}
    for (s, b) in rates:
        near = landscape.predict(landscape.best(s.drafter, budget=b)) >= (1 - EDGE_MARGIN) * best[s]
        assert near == ((s, b) in edges or b == 256)
    points, words = Steps.extension(landscape, search)
    budgets = {(p.selection, p.budget) for p in points if p.budget not in search.budgets}
    assert budgets == {(vegas, 1024), (streaming, 64)}
    assert all(p.gamma == probe for p in points if p.budget not in search.budgets)
    assert f"budget up to 1024 slots for {vegas.words()}" in words
    assert f"budget down to 64 slots for {streaming.words()}" in words
