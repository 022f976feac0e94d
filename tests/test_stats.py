"""Intervals of repeated measurements, the choice between configurations within noise,
and interleaved measurement rounds."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from vegas_tune.measure import Measurer, interleave, race
from vegas_tune.stats import Estimate, estimate, t_quantile


def test_interval_is_a_t_interval_of_the_logarithms():
    samples = [100.0, 110.0, 90.0, 105.0]
    e = estimate(samples)
    logs = [math.log(x) for x in samples]
    half = 3.182 * statistics.stdev(logs) / 2  # t(0.975, 3) = 3.182, sqrt(4) = 2
    assert e.mean == pytest.approx(math.exp(statistics.fmean(logs)))
    assert (e.low, e.high) == pytest.approx((e.mean * math.exp(-half), e.mean * math.exp(half)))
    assert e.n == 4 and e.low < e.mean < e.high


def test_identical_samples_give_a_point_and_one_sample_no_interval():
    assert estimate([2.0, 2.0, 2.0]) == Estimate(2.0, 2.0, 2.0, 3)
    with pytest.raises(ValueError):
        estimate([1.0])
    with pytest.raises(ValueError):
        estimate([1.0, 0.0])


def test_t_quantiles():
    assert t_quantile(1) == pytest.approx(12.706)
    assert t_quantile(9) == pytest.approx(2.262)
    assert t_quantile(1000) == pytest.approx(1.96)


def test_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    rng = random.Random(0)
    trials, covered = 2000, 0
    for _ in range(trials):
        e = estimate([1.3 * math.exp(rng.gauss(0, 0.05)) for _ in range(5)])
        covered += e.low <= 1.3 <= e.high
    assert 0.93 < covered / trials < 0.97


def test_overlap_and_below():
    a, b, c = Estimate(1.0, 0.9, 1.1, 3), Estimate(1.15, 1.05, 1.25, 3), Estimate(1.5, 1.4, 1.6, 3)
    assert a.overlaps(b) and b.overlaps(a)
    assert not a.overlaps(c) and a.below(c) and not c.below(a)
    assert a.relative_half_width == pytest.approx(0.1)
    assert Estimate.from_attrs(b.attrs("speedup"), "speedup") == Estimate(1.15, 1.05, 1.25, 0)
    assert Estimate.from_attrs({"speedup": 1.0}, "speedup") is None


class _Recorder:
    def __init__(self):
        self.calls = []

    def measure(self, spec):
        self.calls.append(spec)
        return spec

    # What the races call: the Measurer's own retry around ``measure``.
    measure_freeing_graphs = Measurer.measure_freeing_graphs

    def forget_kept_graphs(self):
        return False


def test_interleave_rotates_the_order_and_stops_when_told():
    recorder = _Recorder()
    samples = interleave(recorder, {"a": "A", "b": "B", "c": "C"}, max_rounds=5,
                         after_round=lambda done, s: done == 3)
    assert recorder.calls == ["A", "B", "C", "B", "C", "A", "C", "A", "B"]
    assert samples == {"a": ["A"] * 3, "b": ["B"] * 3, "c": ["C"] * 3}
    recorder = _Recorder()
    interleave(recorder, {"a": "A", "b": "B"}, max_rounds=2, after_round=lambda d, s: False)
    assert recorder.calls == ["A", "B", "B", "A"]


def test_a_race_measures_only_what_is_still_racing_and_keeps_the_dropped_rounds():
    recorder = _Recorder()

    def decide(done, samples):
        # After round 2, "c" drops out; after round 3 the race ends.
        return set() if done == 3 else ({"v", "a", "b"} if done == 2 else {"v", "a", "b", "c"})

    samples = race(recorder, {"v": "V", "a": "A", "b": "B", "c": "C"}, max_rounds=8,
                   decide=decide)
    assert recorder.calls == ["V", "A", "B", "C", "A", "B", "C", "V", "B", "V", "A"]
    assert {name: len(rounds) for name, rounds in samples.items()} == {"v": 3, "a": 3, "b": 3,
                                                                        "c": 2}
