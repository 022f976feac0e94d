"""Intervals of repeated measurements, the choice between configurations within noise,
and interleaved measurement rounds."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from vegas_tune.measure import interleave
from vegas_tune.stats import Estimate, choose_within_noise, estimate, t_quantile


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


def test_choice_goes_to_the_cheapest_within_noise_and_to_the_best_otherwise():
    estimates = {"big": Estimate(1.5, 1.45, 1.55, 5), "small": Estimate(1.47, 1.40, 1.52, 5),
                 "tiny": Estimate(1.2, 1.1, 1.3, 5)}
    cost = {"big": (8,), "small": (2,), "tiny": (1,)}
    chosen, tied = choose_within_noise(list(estimates), estimates.get, cost.get)
    assert chosen == "small" and tied == ["big"]
    estimates["small"] = Estimate(1.3, 1.28, 1.32, 5)
    chosen, tied = choose_within_noise(list(estimates), estimates.get, cost.get)
    assert chosen == "big" and tied == []


class _Recorder:
    def __init__(self):
        self.calls = []

    def measure(self, spec):
        self.calls.append(spec)
        return spec


def test_interleave_rotates_the_order_and_stops_when_told():
    recorder = _Recorder()
    samples = interleave(recorder, {"a": "A", "b": "B", "c": "C"}, max_rounds=5,
                         after_round=lambda done, s: done == 3)
    assert recorder.calls == ["A", "B", "C", "B", "C", "A", "C", "A", "B"]
    assert samples == {"a": ["A"] * 3, "b": ["B"] * 3, "c": ["C"] * 3}
    recorder = _Recorder()
    interleave(recorder, {"a": "A", "b": "B"}, max_rounds=2, after_round=lambda d, s: False)
    assert recorder.calls == ["A", "B", "B", "A"]
