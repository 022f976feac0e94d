"""vegas-tune grid: every point once with vanilla interleaved, a pass stopped and resumed,
and the regret of a pick re-measured beside the grid's best."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.test_tune_cli import fake_measurement, run
from vegas_core.errors import VegasError
from vegas_tune.grid import (GridResult, PassCutShort, compare, grid_markdown, grid_points,
                             parse_gammas, partial_path, run_grid)
from vegas_tune.measure import Measurer

POINTS = grid_points("vllm", (128, 256), (4, 5, 6))  # 2 selections x 2 budgets x 3 gammas
PREFIX = 1000
# The grid command on the tiny dummy model: 2 x 2 x 3 = 12 points in a few seconds.
GRID = ["grid", "--model", "dummy:tiny", "--ctx", "512", "--batch-size", "2",
        "--max-new-tokens", "12", "--budgets", "32,64", "--gammas", "2-4", "--device", "cpu",
        "--vanilla-every", "4"]


def rate(spec) -> float:
    """A throughput that differs by point: the larger the gamma and budget, the faster."""
    return 100.0 if spec is None else 100.0 + spec.gamma + spec.min_tokens / 64


class FakeMeasurer:
    """Measures instantly; ``vanilla`` gives the vanilla runs' throughputs in turn, and
    the call numbered ``stop_at`` raises KeyboardInterrupt."""

    def __init__(self, vanilla=None, stop_at=None, out_of_memory_at=None):
        self.calls, self.vanilla, self.stop_at = [], list(vanilla or []), stop_at
        # The call numbered ``out_of_memory_at`` runs out of memory while graphs are kept.
        self.out_of_memory_at, self.graphs_kept = out_of_memory_at, True

    measure_freeing_graphs = Measurer.measure_freeing_graphs

    def forget_kept_graphs(self):
        kept, self.graphs_kept = self.graphs_kept, False
        return kept

    def measure(self, spec):
        if self.stop_at is not None and len(self.calls) == self.stop_at:
            raise KeyboardInterrupt
        if len(self.calls) == self.out_of_memory_at and self.graphs_kept:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 576.00 MiB")
        self.calls.append(spec)
        tokens = (self.vanilla.pop(0) if self.vanilla else 100.0) if spec is None else rate(spec)
        return fake_measurement(tokens, gamma=spec.gamma if spec else 0)


@pytest.mark.parametrize("text, gammas", [("4-6", (4, 5, 6)), ("8,6,6", (6, 8)), ("3", (3,))])
def test_gammas_parse_as_ranges_or_lists(text, gammas):
    assert parse_gammas(text) == gammas


@pytest.mark.parametrize("text", ["0-3", "a-b", "", "4,x"])
def test_bad_gammas_name_the_option(text):
    with pytest.raises(VegasError, match="--gammas"):
        parse_gammas(text)


def test_each_point_once_over_the_vanilla_runs_on_either_side():
    vanilla = [100.0, 121.0, 144.0, 169.0]
    measurer = FakeMeasurer(vanilla)
    result = run_grid(measurer, POINTS, PREFIX, vanilla_every=5)
    # Vanilla before points 0, 5 and 10 and after the last: 12 points + 4 vanilla runs.
    assert [v["before_point"] for v in result.vanilla] == [0, 5, 10, 12]
    assert [s is None for s in measurer.calls].count(True) == 4 and len(measurer.calls) == 16
    assert [(r["budget"], r["gamma"]) for r in result.rows] == [(p.budget, p.gamma)
                                                               for p in POINTS]
    for index, row in enumerate(result.rows):
        stretch = index // 5
        reference = math.sqrt(vanilla[stretch] * vanilla[stretch + 1])
        assert row["vanilla_tokens_per_second"] == pytest.approx(reference)
        assert row["speedup"] == pytest.approx(row["tokens_per_second"] / reference)
    # The best is the fastest over its own vanilla runs (vanilla sped up over the pass),
    # not the one of the highest raw throughput (256 slots, gamma 6, in later stretches).
    best = result.best()
    assert (best["drafter"], best["budget"], best["gamma"]) == ("vegas", 256, 5)


def test_a_point_out_of_memory_frees_the_kept_graphs_and_is_measured_again():
    measurer = FakeMeasurer(out_of_memory_at=3)
    result = run_grid(measurer, POINTS, PREFIX, vanilla_every=5)
    assert len(result.rows) == len(POINTS) and not measurer.graphs_kept


def test_a_point_that_does_not_fit_is_recorded_and_the_pass_goes_on():
    """Out of memory again with nothing left to free: the point is a finding (listed as
    out of memory, never the best), and the points after it are measured."""
    measurer = FakeMeasurer(out_of_memory_at=3)

    def nothing_to_free():  # ... and the next point fits
        measurer.graphs_kept = False
        return False

    measurer.forget_kept_graphs = nothing_to_free
    result = run_grid(measurer, POINTS, PREFIX, vanilla_every=5)
    assert len(result.rows) == len(POINTS) and len(result.measured) == len(POINTS) - 1
    (failed,) = result.out_of_memory_rows
    assert (failed["budget"], failed["gamma"]) == (POINTS[2].budget, POINTS[2].gamma)
    assert "Tried to allocate" in failed["out_of_memory"] and "speedup" not in failed
    assert failed not in result.top(len(POINTS)) and result.best() is not failed
    table = grid_markdown(result, "t", [])
    assert table.rstrip().splitlines()[-1].endswith("| out of memory | - | - |")
    # A vanilla run out of memory still ends the pass: no speedup without it.
    measurer = FakeMeasurer(out_of_memory_at=0)
    measurer.forget_kept_graphs = lambda: False
    with pytest.raises(torch.OutOfMemoryError):
        run_grid(measurer, POINTS, PREFIX, vanilla_every=5)


def test_a_grid_where_nothing_fitted_says_what_to_lower():
    result = GridResult([{"drafter": "vegas", "out_of_memory": "CUDA out of memory"}], [], 0.0)
    with pytest.raises(VegasError, match="--batch-size"):
        result.best()


def test_a_stopped_pass_resumes_keeping_every_point_a_vanilla_run_closed():
    kept: list[GridResult] = []
    # Calls: vanilla, 4 points, vanilla (checkpoint of points 0-3), 2 points, then stop.
    with pytest.raises(KeyboardInterrupt):
        run_grid(FakeMeasurer(stop_at=8), POINTS, PREFIX, vanilla_every=4,
                 checkpoint=kept.append)
    partial = kept[-1]
    assert len(partial.rows) == 4 and [v["before_point"] for v in partial.vanilla] == [0, 4]
    # Resumed (another process: its vanilla runs measure 200 tokens/s): the two points
    # measured after the last checkpoint are measured again, after a fresh vanilla run.
    partial = GridResult.from_json(json.loads(json.dumps(partial.to_json())))
    measurer = FakeMeasurer([200.0] * 5)
    result = run_grid(measurer, POINTS, PREFIX, vanilla_every=4, start=partial)
    assert len(result.rows) == len(POINTS)
    assert [(r["budget"], r["gamma"]) for r in result.rows] == [(p.budget, p.gamma)
                                                               for p in POINTS]
    assert measurer.calls[0] is None and len([s for s in measurer.calls if s]) == 8
    # Points 0-3 lie between the first process's vanilla runs; point 4 between the
    # resumed process's first two.
    assert result.rows[3]["vanilla_tokens_per_second"] == pytest.approx(100.0)
    assert result.rows[4]["vanilla_tokens_per_second"] == pytest.approx(200.0)


def test_regret_is_measured_against_the_best_of_the_references():
    best, pick = POINTS[-1], POINTS[0]
    configs = {"grid #1": best.spec(PREFIX), "pick": pick.spec(PREFIX)}
    out = compare(FakeMeasurer(), configs, rounds=3, references=["grid #1"])
    assert out["reference"] == "grid #1"
    assert out["ratios"]["grid #1"]["ratio"] == pytest.approx(1.0)
    expected = rate(pick.spec(PREFIX)) / rate(best.spec(PREFIX))
    assert out["ratios"]["pick"]["ratio"] == pytest.approx(expected)
    assert out["series"]["pick"]["rounds"] == 3


def test_compare_needs_two_rounds_for_an_interval():
    with pytest.raises(VegasError, match="--rounds must be at least 2"):
        compare(FakeMeasurer(), {"a": POINTS[0].spec(PREFIX)}, rounds=1, references=["a"])


def test_an_interrupted_grid_command_resumes_only_with_resume(tmp_path, monkeypatch, capsys):
    out = tmp_path / "grid.json"
    calls, stop_at = [], [9]  # vanilla, 4 points, vanilla, 3 points: stop in the 2nd stretch

    def measure(self, spec, report=None):
        if len(calls) in stop_at:
            raise KeyboardInterrupt
        calls.append(spec)
        return fake_measurement(rate(spec), gamma=spec.gamma if spec else 0)

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    code, _, _ = run([*GRID, "--out", str(out)], capsys)
    partial = partial_path(out)
    assert code == 130 and not out.exists()
    assert len(json.loads(partial.read_text())["grid"]["rows"]) == 4

    code, _, err = run([*GRID, "--out", str(out)], capsys)
    assert code == 2 and "pass --resume to finish it" in err and "Traceback" not in err
    code, _, err = run([*GRID, "--out", str(out), "--resume", "--gammas", "2-5"], capsys)
    assert code == 2 and "holds a grid of another points" in err

    calls.clear()
    stop_at.clear()
    code, stdout, err = run([*GRID, "--out", str(out), "--resume"], capsys)
    assert code == 0, err
    assert "resuming" in err and "4 of 12 points measured" in err
    assert len([s for s in calls if s is not None]) == 8  # only the points not kept
    data = json.loads(out.read_text())
    assert data["points"] == 12 and not partial.exists()
    assert out.with_suffix(".md").read_text().count("| vegas |") == 6


def test_resume_without_a_partial_pass_is_refused(tmp_path, capsys):
    code, _, err = run([*GRID, "--out", str(tmp_path / "g.json"), "--resume"], capsys)
    assert code == 2 and "no unfinished pass" in err


def test_a_grid_out_of_memory_says_so_in_one_line_and_keeps_its_points(tmp_path, monkeypatch,
                                                                        capsys):
    out, calls = tmp_path / "grid.json", []

    def measure(self, spec, report=None):
        # The third vanilla run (before point 8): the first four points are kept.
        if spec is None and len(calls) == 10:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB. "
                                         "GPU 0 has a total capacity of 79.18 GiB")
        calls.append(spec)
        return fake_measurement(rate(spec), gamma=spec.gamma if spec else 0)

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    code, _, err = run([*GRID, "--out", str(out)], capsys)
    progress, last = err.splitlines()[:-1], err.splitlines()[-1]
    assert code == 2 and "Traceback" not in err, err
    assert all(line.startswith("vegas-tune: step grid: ") for line in progress), err
    assert "out of memory (CUDA out of memory)" in last and "--resume" in last
    assert partial_path(out).exists() and not out.exists()


def test_the_grid_command_lists_points_that_did_not_fit_and_finishes(tmp_path, monkeypatch,
                                                                      capsys):
    out = tmp_path / "grid.json"

    def measure(self, spec, report=None):
        if spec is not None and spec.gamma == 4 and spec.min_tokens == 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return fake_measurement(rate(spec), gamma=spec.gamma if spec else 0)

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    code, stdout, err = run([*GRID, "--out", str(out)], capsys)
    assert code == 0, err
    assert "12 points, 2 of them out of memory (listed last)" in stdout  # one per selection
    table = out.with_suffix(".md").read_text().rstrip().splitlines()
    assert all(line.endswith("| 64 | 4 | out of memory | - | - |") for line in table[-2:])
    rows = json.loads(out.read_text())["grid"]["rows"]
    assert sum("Tried to allocate 2.00 GiB" in (r.get("out_of_memory") or "") for r in rows) == 2


def test_a_pass_out_of_time_closes_its_stretch_keeps_it_and_resumes():
    kept: list[GridResult] = []
    measurer = FakeMeasurer([100.0, 121.0])
    with pytest.raises(PassCutShort) as cut:
        run_grid(measurer, POINTS, PREFIX, vanilla_every=5, checkpoint=kept.append,
                 out_of_time=lambda: len(measurer.calls) >= 4)  # vanilla + 3 points
    assert cut.value.kept is kept[-1] and len(cut.value.kept.rows) == 3
    # A vanilla run closed the three points before the pass stopped.
    assert [v["before_point"] for v in cut.value.kept.vanilla] == [0, 3]
    partial = cut.value.kept
    result = run_grid(FakeMeasurer([144.0] * 5), POINTS, PREFIX, vanilla_every=5, start=partial)
    assert len(result.rows) == len(POINTS)
    assert result.rows[2]["vanilla_tokens_per_second"] == pytest.approx(math.sqrt(100 * 121))
    # Out of time from the start, a call still measures one point: resuming goes on.
    with pytest.raises(PassCutShort) as again:
        run_grid(FakeMeasurer(), POINTS, PREFIX, start=partial, out_of_time=lambda: True)
    assert len(again.value.kept.rows) == 4


def test_the_grid_command_stops_at_its_time_budget_with_exit_3(tmp_path, monkeypatch, capsys):
    out = tmp_path / "grid.json"
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure",
                        lambda self, spec, report=None: fake_measurement(
                            rate(spec), gamma=spec.gamma if spec else 0))
    code, _, err = run([*GRID, "--out", str(out), "--time-budget", "1e-6"], capsys)
    assert code == 3, err
    assert "--time-budget 1e-06 s spent after 1 of 12 points" in err and "--resume" in err
    assert partial_path(out).exists() and not out.exists()
    code, stdout, err = run([*GRID, "--out", str(out), "--resume"], capsys)
    assert code == 0 and "resuming" in err and "12 points" in stdout
    assert not partial_path(out).exists()
    code, _, err = run([*GRID, "--out", str(out), "--time-budget", "0"], capsys)
    assert code == 2 and "--time-budget must be a number of seconds above 0" in err
