"""Hardware fingerprint, trials table, plots and the Markdown tuning report."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from matplotlib.container import ErrorbarContainer

from vegas_core.errors import VegasError
from vegas_tune.hardware import FINGERPRINT_KEYS, fingerprint, gpu_slug
from vegas_tune.report import (acceptance_figure, batch_figure, plot_acceptance_vs_budget,
                               plot_throughput_vs_batch, plot_throughput_vs_gamma,
                               throughput_figure, write_report, write_trials_table)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# The fixtures' workload: ctx 8192, 128 new tokens, probe gamma 6, budgets 128, 256 and
# 512 slots. A budget's sparsity ratio is budget / 8385 (the longest prefix), rounded down.
RATIOS = {128: 0.0152, 256: 0.0305, 512: 0.061}
PROBE_GAMMA = 6
# Selection rules as (drafter, score, window): the vegas target searches all three.
VEGAS_WEIGHT = ("vegas", "weight", 0.0)
VEGAS_LOGIT_WINDOW = ("vegas", "logit", 0.25)
STREAMING = ("streaming", "logit", 0.0)


def configuration(selection: tuple, budget: int, gamma: int) -> dict:
    """A configuration's columns as ``Studies.all_trials`` writes them (budget = min_tokens)."""
    drafter, score, window = selection
    return {"drafter": drafter, "score": score, "window": window, "budget": budget,
            "gamma": gamma, "sparsity": RATIOS[budget], "min_tokens": budget,
            "collect": "two", "granularity": "layer"}


def point(selection: tuple, budget: int, gamma: int) -> dict:
    """A configuration as a profile step writes it (``sparsity_ratio``, no min_tokens)."""
    drafter, score, window = selection
    return {"drafter": drafter, "score": score, "window": window, "budget": budget,
            "gamma": gamma, "sparsity_ratio": RATIOS[budget]}


def run(step: str, number: int, selection: tuple | None, budget: int | None,
        gamma: int | None, accepted: float, tps: float, batch: int = 1, **extra) -> dict:
    """One measurement of the sweep or extend step (``selection`` None: vanilla)."""
    what = ({"drafter": "vanilla"} if selection is None
            else configuration(selection, budget, gamma))
    return {"step": step, "batch_size": batch, "number": number, "state": "COMPLETE",
            "value": tps, **what, "mean_accepted_length": accepted, "tokens_per_second": tps,
            **extra}


def figures(tps: float, tps_bounds: tuple, accepted: float, rounds: int,
            speedup: float | None = None, speedup_bounds: tuple | None = None) -> dict:
    """A race series' figures: means with ``_low`` / ``_high`` bounds."""
    values = {"mean_accepted_length": accepted, "tokens_per_second": tps,
              "tokens_per_second_low": tps_bounds[0], "tokens_per_second_high": tps_bounds[1],
              "rounds": rounds, "round_tokens_per_second": [round(tps, 3)] * rounds}
    if speedup is not None:
        values.update(speedup=speedup, speedup_low=speedup_bounds[0],
                      speedup_high=speedup_bounds[1])
    return values


def race_rows(configs: dict, chosen: str, batch: int = 1, number: int = 0) -> list[dict]:
    """One race trial as ``Studies.all_trials`` flattens it: a row per configuration.
    ``configs`` maps a name (vanilla, c1, ...) to (configuration or None, figures)."""
    value = configs[chosen][1]["speedup"]
    return [{"step": "race", "batch_size": batch, "number": number, "state": "COMPLETE",
             "value": value, "config": name, "chosen": name == chosen,
             **({"drafter": "vanilla"} if spec is None else spec), **values}
            for name, (spec, values) in configs.items()]


SWEEP_ROWS = [
    run("sweep", 0, None, None, None, 1.0, 100.0),
    run("sweep", 1, VEGAS_WEIGHT, 128, 6, 2.4, 118.0),
    run("sweep", 2, VEGAS_WEIGHT, 256, 6, 3.1, 131.0,
        acceptance_by_position="0.910 0.800 0.660 0.520 0.400 0.300"),
    run("sweep", 3, VEGAS_WEIGHT, 512, 6, 3.3, 126.5),
    run("sweep", 4, VEGAS_LOGIT_WINDOW, 128, 6, 2.2, 112.0),
    run("sweep", 5, VEGAS_LOGIT_WINDOW, 256, 6, 2.7, 121.0),
    run("sweep", 6, VEGAS_LOGIT_WINDOW, 512, 6, 2.9, 117.0),
    run("sweep", 7, STREAMING, 128, 6, 2.0, 108.0),
    run("sweep", 8, STREAMING, 256, 6, 2.5, 116.0),
    run("sweep", 9, STREAMING, 512, 6, 2.8, 114.0),
    # The short probe: one configuration again at half the probe gamma.
    run("sweep", 10, VEGAS_WEIGHT, 256, 3, 2.3, 124.0),
    # Out of memory: failed with its reason, nothing measured.
    {"step": "sweep", "batch_size": 1, "number": 11, "state": "FAIL", "value": None,
     "failed_reason": "out of memory: CUDA out of memory"},
]
# The pick's best gamma was the probe gamma: extend tried a longer one.
EXTEND_ROWS = [run("extend", 0, VEGAS_WEIGHT, 256, 9, 3.5, 127.0)]
RACE_ROWS = race_rows({
    "vanilla": (None, figures(100.0, (98.0, 102.0), 1.0, 5)),
    "c1": (configuration(VEGAS_WEIGHT, 256, 6),
           figures(141.25, (138.0, 144.5), 3.05, 5, 1.4125, (1.38, 1.46))),
    "c2": (configuration(VEGAS_WEIGHT, 256, 4),
           figures(135.0, (131.0, 139.0), 2.65, 5, 1.35, (1.31, 1.39))),
    # Both streaming configurations dropped out after three rounds.
    "c3": (configuration(STREAMING, 256, 5),
           figures(120.0, (117.5, 122.5), 2.6, 3, 1.2, (1.17, 1.23))),
    "c4": (configuration(STREAMING, 512, 4),
           figures(95.0, (92.0, 98.0), 2.7, 3, 0.95, (0.92, 0.98))),
}, chosen="c1")
TRIALS = SWEEP_ROWS + EXTEND_ROWS + RACE_ROWS


def prediction(selection: tuple, budget: int, gamma: int, predicted: float,
               accepted: float, measured: float | None = None,
               measured_accepted: float | None = None, speedup: float | None = None,
               speedup_interval: list | None = None) -> dict:
    """A race step's prediction row, with what the race measured where it raced."""
    return {**point(selection, budget, gamma), "predicted_tokens_per_second": predicted,
            "predicted_mean_accepted_length": accepted, "measured_tokens_per_second": measured,
            "measured_mean_accepted_length": measured_accepted, "measured_speedup": speedup,
            "measured_speedup_interval": speedup_interval}


# Each curve's best gamma, gammas of the pick's and the best streaming curve, the raced ones.
PREDICTIONS = [
    prediction(VEGAS_WEIGHT, 256, 2, 110.0, 2.0),
    prediction(VEGAS_WEIGHT, 256, 4, 133.0, 2.7, 135.0, 2.65, 1.35, [1.31, 1.39]),
    prediction(VEGAS_WEIGHT, 256, 6, 139.0, 3.1, 141.25, 3.05, 1.4125, [1.38, 1.46]),
    prediction(VEGAS_WEIGHT, 256, 8, 136.0, 3.4),
    prediction(VEGAS_WEIGHT, 512, 6, 134.0, 3.3),
    prediction(VEGAS_LOGIT_WINDOW, 256, 6, 125.0, 2.7),
    prediction(STREAMING, 256, 3, 112.0, 2.1),
    prediction(STREAMING, 256, 5, 118.0, 2.6, 120.0, 2.6, 1.2, [1.17, 1.23]),
    prediction(STREAMING, 512, 4, 97.0, 2.7, 95.0, 2.7, 0.95, [0.92, 0.98]),
]


def make_profile(recommended: bool = True) -> dict:
    pick = point(VEGAS_WEIGHT, 256, 6)
    return {
        "target": "vegas",
        "recommended": recommended,
        "tuned": {"drafter": "vegas", "gamma": 6, "sparsity_ratio": 0.0305, "min_tokens": 256,
                  "collect": "two", "score": "weight", "granularity": "layer", "window": 0.0},
        "model": {"id": "smollm2-135m"},
        "workload": {"ctx": 8192, "batch_size": 1, "batch_sizes": [1], "max_new_tokens": 128,
                     "temperature": 0.0, "dataset": "mixed", "num_prompts": 4},
        "hardware": {"gpu_name": "NVIDIA H200", "gpu_count": 1, "gpu_memory_gb": 139.8,
                     "driver": "550.54", "cuda": "12.4", "torch": "2.5.1", "triton": "3.1.0",
                     "cpu": "Intel Xeon", "cpu_count": 16},
        "results": {"tokens_per_second": 141.25, "tokens_per_second_interval": [138.0, 144.5],
                    "vanilla_tokens_per_second": 100.0,
                    "vanilla_tokens_per_second_interval": [98.0, 102.0],
                    "streaming_tokens_per_second": 120.0,
                    "streaming_tokens_per_second_interval": [117.5, 122.5],
                    "speedup": 1.4125, "speedup_interval": [1.38, 1.46],
                    "speedup_over_streaming": 1.177,
                    "speedup_over_streaming_interval": [1.15, 1.2],
                    "mean_accepted_length": 3.05,
                    "acceptance_by_position": [0.91, 0.8, 0.66], "selection_overhead": 0.042,
                    "rounds": 5, "confidence": 0.95},
        "steps": [
            {"name": "sweep", "study": "s:sweep@1", "batch_size": 1, "trials": 11,
             "chosen": dict(pick),
             "notes": "3 selection(s) x budgets 128, 256, 512 at gamma 6 | vanilla",
             "predictions": [], "within_noise": [], "edges": []},
            {"name": "extend", "study": "s:extend@1", "batch_size": 1, "trials": 1,
             "chosen": dict(pick),
             "notes": "the best predictions lay on an axis's edge: tried gamma up to 9",
             "predictions": [], "within_noise": [], "edges": []},
            {"name": "race", "study": "s:race@1", "batch_size": 1, "trials": 1,
             "chosen": {**pick, "tokens_per_second": 141.25, "speedup": 1.4125,
                        "speedup_low": 1.38, "speedup_high": 1.46, "rounds": 5},
             "notes": "raced 4 configurations beside vanilla for 5 rounds",
             "predictions": copy.deepcopy(PREDICTIONS), "within_noise": [], "edges": []},
        ],
        "provenance": {"tool_version": "0.1.0", "git_revision": "abc1234",
                       "command": "vegas-tune smollm2-135m --ctx 8192",
                       "started": "2025-01-02T03:04:05Z",
                       "duration_seconds": 754.0, "engine_path": "triton"},
    }


def race_step(profile: dict) -> dict:
    return next(step for step in profile["steps"] if step["name"] == "race")


def section(text: str, heading: str) -> str:
    """The body of the Markdown section ``## heading``."""
    assert f"## {heading}\n" in text, f"no section {heading!r}"
    return text.split(f"## {heading}\n")[1].split("\n## ")[0]


def table_rows(body: str) -> list[str]:
    """The body rows of the first Markdown table in ``body`` (header and rule left out)."""
    rows = [line for line in body.splitlines() if line.startswith("| ")]
    return rows[1:]


def report(tmp_path, profile: dict | None = None, trials: list[dict] | None = None,
           **kw) -> str:
    profile = make_profile() if profile is None else profile
    trials = TRIALS if trials is None else trials
    return write_report(profile, trials, tmp_path / "report.md", {}, **kw).read_text()


# --- hardware ------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fingerprint")
@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_cpu_fingerprint_has_every_key_and_no_gpu(device):
    fp = fingerprint(device)
    assert tuple(fp) == FINGERPRINT_KEYS
    assert fp["gpu_name"] is None and fp["gpu_count"] == 0 and fp["gpu_memory_gb"] is None
    assert fp["driver"] is None
    assert fp["torch"] == torch.__version__
    assert fp["cuda"] is None or isinstance(fp["cuda"], str)
    assert fp["triton"] is None or isinstance(fp["triton"], str)
    assert isinstance(fp["cpu"], str) and fp["cpu"]
    assert isinstance(fp["cpu_count"], int) and fp["cpu_count"] >= 1
    assert gpu_slug(fp) == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_cuda_without_it_is_a_user_error():
    with pytest.raises(VegasError, match="--device cpu"):
        fingerprint("cuda")


@pytest.mark.parametrize("name, count, slug", [
    ("NVIDIA H200", 1, "h200"),
    ("NVIDIA H100 80GB HBM3", 1, "h100-80gb-hbm3"),
    ("NVIDIA A100-SXM4-80GB", 1, "a100-sxm4-80gb"),
    ("NVIDIA H200", 2, "h200x2"),
    ("NVIDIA GeForce RTX 4090", 1, "geforce-rtx-4090"),
    (None, 0, "cpu"),
])
def test_gpu_slug(name, count, slug):
    assert gpu_slug({"gpu_name": name, "gpu_count": count}) == slug


# --- trials table --------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_trials_table_round_trips(tmp_path, suffix):
    path = write_trials_table(TRIALS, tmp_path / "out" / f"trials{suffix}")
    table = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
    assert len(table) == len(TRIALS)
    # The usual columns lead, in their order; the others follow as first seen.
    assert list(table.columns[:18]) == [
        "step", "batch_size", "number", "state", "config", "chosen", "drafter", "score",
        "window", "budget", "gamma", "sparsity", "min_tokens", "collect", "granularity",
        "mean_accepted_length", "tokens_per_second", "speedup"]
    assert list(table.columns[18:20]) == ["value", "acceptance_by_position"]
    assert list(table["step"]) == [t["step"] for t in TRIALS]
    assert list(table["drafter"][:2]) == ["vanilla", "vegas"]
    assert table.loc[2, "mean_accepted_length"] == pytest.approx(3.1)
    assert table.loc[2, "budget"] == 256 and table.loc[2, "sparsity"] == pytest.approx(0.0305)
    assert table.loc[2, "acceptance_by_position"] == "0.910 0.800 0.660 0.520 0.400 0.300"
    failed = SWEEP_ROWS.index(next(t for t in SWEEP_ROWS if t["state"] == "FAIL"))
    assert table.loc[failed, "state"] == "FAIL"
    assert math.isnan(table.loc[failed, "mean_accepted_length"])  # a key the trial lacks
    assert table.loc[failed, "failed_reason"].startswith("out of memory")
    # The race: one row per configuration; its per-round list is stored as JSON.
    pick = TRIALS.index(next(t for t in TRIALS if t.get("chosen")))
    assert table.loc[pick, "config"] == "c1"
    assert table.loc[pick, "tokens_per_second"] == pytest.approx(141.25)
    assert table.loc[pick, "speedup_high"] == pytest.approx(1.46)
    assert table.loc[pick, "round_tokens_per_second"] == "[141.25, 141.25, 141.25, 141.25, 141.25]"
    assert list(table["chosen"].dropna().astype(str)) == [
        str(t["chosen"]) for t in RACE_ROWS]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


def test_trials_table_rejects_other_formats(tmp_path):
    with pytest.raises(VegasError, match=".csv or .parquet"):
        write_trials_table(TRIALS, tmp_path / "trials.xlsx")


# --- plots ---------------------------------------------------------------------------

def assert_png(path):
    data = path.read_bytes()
    assert data[:len(PNG_SIGNATURE)] == PNG_SIGNATURE
    assert len(data) > 1000  # more than a signature: an image was drawn


def test_plots_write_png_files(tmp_path):
    profile = make_profile()
    acceptance = plot_acceptance_vs_budget(TRIALS, tmp_path / "acceptance.png",
                                           tuned=profile["tuned"], batch=1)
    throughput = plot_throughput_vs_gamma(PREDICTIONS, tmp_path / "throughput.png",
                                          tuned=profile["tuned"], results=profile["results"],
                                          trials=TRIALS)
    by_batch = plot_throughput_vs_batch(schedule_profile(), tmp_path / "batch.png")
    assert acceptance == tmp_path / "acceptance.png"
    assert throughput == tmp_path / "throughput.png"
    for path in (acceptance, throughput, by_batch):
        assert_png(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "acceptance.png", "batch.png", "throughput.png"]  # no temporary left


def test_plots_without_data_still_write_png_files(tmp_path):
    assert_png(plot_acceptance_vs_budget([], tmp_path / "a.png"))
    assert_png(plot_throughput_vs_gamma([], tmp_path / "t.png"))
    assert_png(plot_throughput_vs_batch({}, tmp_path / "b.png"))


def legend(figure) -> dict:
    """label -> artist of the figure's one axes."""
    handles, labels = figure.axes[0].get_legend_handles_labels()
    return dict(zip(labels, handles))


def texts(figure) -> list[str]:
    return [t.get_text() for t in figure.axes[0].texts]


def test_acceptance_plot_draws_a_line_per_selection_at_the_probe_gamma():
    figure = acceptance_figure(TRIALS, tuned=make_profile()["tuned"], batch=1)
    labels = legend(figure)
    lines = {label: artist for label, artist in labels.items() if not label.startswith("tuned")}
    assert sorted(lines) == ["streaming", "vegas logit, window 0.25", "vegas weight"]
    # Budgets on the x axis, accepted length on y; the short probe (gamma 3), the extend
    # step's run (gamma 9) and vanilla are not on any line.
    assert list(lines["vegas weight"].get_xdata()) == [128, 256, 512]
    assert list(lines["vegas weight"].get_ydata()) == [2.4, 3.1, 3.3]
    assert list(lines["vegas logit, window 0.25"].get_ydata()) == [2.2, 2.7, 2.9]
    assert list(lines["streaming"].get_ydata()) == [2.0, 2.5, 2.8]
    # The profile's budget is marked.
    assert list(labels["tuned: 256 slots"].get_xdata()) == [256, 256]
    axes = figure.axes[0]
    assert axes.get_xscale() == "log"
    assert axes.xaxis.get_transform().base == 2
    assert axes.get_ylabel() == f"mean accepted length at gamma {PROBE_GAMMA}"
    assert not texts(figure)


def test_acceptance_plot_shows_one_batch_size():
    at_64 = [{**run("sweep", 1, VEGAS_WEIGHT, 128, 6, 1.9, 300.0, batch=64)},
             {**run("sweep", 2, VEGAS_WEIGHT, 256, 6, 2.6, 320.0, batch=64)}]
    lines = legend(acceptance_figure(TRIALS + at_64, batch=64))
    assert list(lines) == ["vegas weight"]
    assert list(lines["vegas weight"].get_ydata()) == [1.9, 2.6]
    lines = legend(acceptance_figure(TRIALS + at_64, batch=1))
    assert list(lines["vegas weight"].get_ydata()) == [2.4, 3.1, 3.3]


def test_acceptance_plot_without_sweep_runs_says_so():
    # The race's rows are not sweep runs.
    figure = acceptance_figure(RACE_ROWS + EXTEND_ROWS, tuned={"min_tokens": 256}, batch=1)
    assert texts(figure) == ["no completed sweep runs"]
    assert list(legend(figure)) == ["tuned: 256 slots"]
    assert figure.axes[0].get_xscale() == "linear"


def points(bars) -> list[tuple]:
    """The (x, y) points of an error-bar container, sorted."""
    return sorted(zip(*bars.lines[0].get_data()))


def test_throughput_plot_draws_a_predicted_curve_per_configuration_with_several_gammas():
    labels = legend(throughput_figure(PREDICTIONS))
    curves = sorted(label for label in labels if label.startswith("predicted"))
    # Single points (other curves' best gammas) are not curves.
    assert curves == ["predicted, streaming, 256 slots", "predicted, vegas weight, 256 slots"]
    pick = labels["predicted, vegas weight, 256 slots"]
    assert list(pick.get_xdata()) == [2, 4, 6, 8]
    assert list(pick.get_ydata()) == [110.0, 133.0, 139.0, 136.0]
    assert list(labels["predicted, streaming, 256 slots"].get_xdata()) == [3, 5]


def test_throughput_plot_has_a_vanilla_line_with_its_band_and_the_races_error_bars():
    profile = make_profile()
    figure = throughput_figure(PREDICTIONS, tuned=profile["tuned"], results=profile["results"],
                               trials=TRIALS)
    labels = legend(figure)
    assert list(labels["vanilla 100.0 tokens/s"].get_ydata()) == [100.0, 100.0]
    band = labels["vanilla 95% interval"]
    ys = band.get_patch_transform().transform(band.get_path().vertices)[:, 1]
    assert (min(ys), max(ys)) == pytest.approx((98.0, 102.0))
    assert list(labels["tuned: 6"].get_xdata()) == [6, 6]
    bars = next(c for c in figure.axes[0].containers if isinstance(c, ErrorbarContainer))
    assert bars.has_yerr
    # The race's speculative rows, by gamma; vanilla's row is the line, not a point.
    assert list(bars.lines[0].get_xdata()) == [4, 4, 5, 6]
    assert points(bars) == [(4, 95.0), (4, 135.0), (5, 120.0), (6, 141.25)]
    segments = sorted([tuple(p) for p in segment] for segment in bars.lines[2][0].get_segments())
    assert segments == [[(4, 92.0), (4, 98.0)], [(4, 131.0), (4, 139.0)],
                        [(5, 117.5), (5, 122.5)], [(6, 138.0), (6, 144.5)]]


def test_throughput_plot_falls_back_to_the_profiles_measured_points():
    figure = throughput_figure(PREDICTIONS, trials=SWEEP_ROWS)  # no race rows
    bars = next(c for c in figure.axes[0].containers if isinstance(c, ErrorbarContainer))
    assert points(bars) == [(4, 95.0), (4, 135.0), (5, 120.0), (6, 141.25)]
    # The profile keeps means only: no error bars to draw.
    segments = bars.lines[2][0].get_segments()
    assert all(segment[0][1] == segment[1][1] for segment in segments)


def test_throughput_plot_without_predictions_says_so():
    assert texts(throughput_figure([])) == ["no gamma predictions"]
    assert not texts(throughput_figure(PREDICTIONS))


# --- write_artifacts (vegas_tune.pipeline) --------------------------------------------

def tune_result(trials: list[dict]) -> SimpleNamespace:
    """What ``Tuner.run`` returns, as far as ``write_artifacts`` reads it."""
    return SimpleNamespace(trials=trials, steps=[])


def test_artifacts_keep_the_whole_stem_of_a_dotted_profile_name(tmp_path):
    from vegas_tune.pipeline import write_artifacts

    # run_tune passes out.with_suffix(""): my.v2.yaml -> my.v2
    paths = write_artifacts(make_profile(), tune_result(TRIALS), tmp_path / "my.v2")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "my.v2.acceptance.png", "my.v2.batch.png", "my.v2.report.md", "my.v2.throughput.png",
        "my.v2.trials.csv"]
    assert paths["trials"] == str(tmp_path / "my.v2.trials.csv")
    assert paths["batch_plot"] == str(tmp_path / "my.v2.batch.png")
    for name in ("acceptance", "throughput", "batch"):
        assert_png(tmp_path / f"my.v2.{name}.png")
    text = (tmp_path / "my.v2.report.md").read_text()
    assert "![acceptance vs budget](my.v2.acceptance.png)" in text
    assert "![throughput vs gamma](my.v2.throughput.png)" in text
    assert "![throughput vs batch size](my.v2.batch.png)" in text


def test_artifacts_plot_the_headline_batch_size_and_the_profiles_tuned_values(
        tmp_path, monkeypatch):
    from vegas_tune import pipeline

    calls = {}
    monkeypatch.setattr(pipeline, "plot_acceptance_vs_budget",
                        lambda trials, path, **kw: calls.setdefault("acceptance", (trials, kw)))
    monkeypatch.setattr(pipeline, "plot_throughput_vs_gamma",
                        lambda predictions, path, **kw: calls.setdefault(
                            "throughput", (predictions, kw)))
    profile = schedule_profile()
    trials = schedule_trials()
    pipeline.write_artifacts(profile, tune_result(trials), tmp_path / "p")
    _, acceptance = calls["acceptance"]
    assert acceptance == {"tuned": profile["tuned"], "batch": 64}
    labels = legend(acceptance_figure(trials, **acceptance))
    assert "tuned: 256 slots" in labels
    predictions, throughput = calls["throughput"]
    assert predictions == PREDICTIONS  # the race's at batch 64, not batch 1's
    assert throughput["tuned"] == profile["tuned"]
    assert throughput["results"] == profile["results"]
    assert throughput["trials"] and all(t["batch_size"] == 64 for t in throughput["trials"])


# --- report --------------------------------------------------------------------------

def test_report_states_the_tuned_values_speedups_and_images(tmp_path):
    images = {"acceptance vs budget": "acceptance.png",
              "throughput vs gamma": str(tmp_path / "plots" / "throughput.png")}
    text = write_report(make_profile(), TRIALS, tmp_path / "report.md", images).read_text()
    assert text.startswith("# Vegas tuning: smollm2-135m on NVIDIA H200, ctx 8192\n")
    assert ("**Recommended** (tuned for vegas): drafter=vegas, gamma=6, sparsity_ratio=0.0305, "
            "min_tokens=256, collect=two, score=weight, granularity=layer, window=0.") in text
    assert "Not recommended" not in text
    assert ("- Speedup: 1.41x [1.38, 1.46] over vanilla (95% interval, 5 rounds); "
            "1.18x [1.15, 1.20] over the best streaming configuration found.") in text
    assert ("- Throughput: 141.2 [138.0, 144.5] tokens/s vs 100.0 [98.0, 102.0] vanilla and "
            "120.0 [117.5, 122.5] the best streaming configuration.") in text
    assert "- Mean accepted length: 3.05 tokens per iteration." in text
    assert "4.2% of decode time" in text
    assert "- Acceptance by draft position: 0.91, 0.80, 0.66." in text
    assert "![acceptance vs budget](acceptance.png)" in text
    assert "![throughput vs gamma](plots/throughput.png)" in text
    assert "vegas-tune smollm2-135m --ctx 8192" in text and "2025-01-02T03:04:05Z" in text
    assert "12 min 34 s" in text
    assert "driver 550.54" in text
    # Sections in reading order; the ones without data are left out.
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ["## Workload", "## Race", "## Steps", "## Cost model",
                        "## Predictions (race @ batch 1)", "## Best trials", "## Plots",
                        "## Hardware", "## Provenance"]


def test_report_without_a_target_does_not_name_one(tmp_path):
    profile = make_profile()
    del profile["target"]
    text = report(tmp_path, profile)
    assert "**Recommended**: drafter=vegas" in text and "tuned for" not in text


def test_steps_table_has_each_step_with_its_chosen_figures(tmp_path):
    rows = table_rows(section(report(tmp_path), "Steps"))
    assert [row.split(" | ")[0] for row in rows] == ["| sweep", "| extend", "| race"]
    assert rows[2] == (
        "| race | 1 | 1 | drafter=vegas, score=weight, window=0, budget=256, gamma=6, "
        "sparsity_ratio=0.0305, tokens_per_second=141.2, speedup=1.413 [1.38, 1.46], "
        "rounds=5 | raced 4 configurations beside vanilla for 5 rounds |")
    # A "|" in notes does not break the table.
    assert "at gamma 6 \\| vanilla |" in rows[0]


def test_predictions_table_lists_every_prediction_fastest_first(tmp_path):
    body = section(report(tmp_path), "Predictions (race @ batch 1)")
    rows = table_rows(body)
    assert len(rows) == len(PREDICTIONS)
    assert rows[0] == "| vegas weight, 256 slots | 6 | 139.0 | 141.2 | -1.6% | 1.41x [1.38, 1.46] |"
    assert rows[1] == "| vegas weight, 256 slots | 8 | 136.0 | n/a | n/a | n/a |"
    assert rows[-1] == "| streaming, 512 slots | 4 | 97.0 | 95.0 | +2.1% | 0.95x [0.92, 0.98] |"
    assert "| vegas weight, 256 slots | 4 | 133.0 | 135.0 | -1.5% | 1.35x [1.31, 1.39] |" in rows
    assert "| vegas logit, window 0.25, 256 slots | 6 | 125.0 | n/a | n/a | n/a |" in rows
    predicted = [float(row.split(" | ")[2]) for row in rows]
    assert predicted == sorted(predicted, reverse=True)


def test_best_trials_rank_each_step_and_leave_the_race_out(tmp_path):
    text = report(tmp_path)
    best = section(text, "Best trials")
    sweep = best.split("### sweep @ batch 1 (by tokens per second)\n")[1].split("###")[0]
    assert table_rows(sweep) == ["| 2 | vegas | weight | 0 | 256 | 6 | 3.1 | 131 |",
                                 "| 3 | vegas | weight | 0 | 512 | 6 | 3.3 | 126.5 |",
                                 "| 10 | vegas | weight | 0 | 256 | 3 | 2.3 | 124 |"]
    assert ("| number | drafter | score | window | budget | gamma | mean accepted length | "
            "tokens per second |") in sweep
    assert "### extend @ batch 1 (by tokens per second)" in best
    # The race's rows are the Race table, not a search to rank.
    assert "### race" not in text


def test_race_table_marks_the_pick_and_the_best_streaming_configuration(tmp_path):
    body = section(report(tmp_path), "Race")
    assert "(95% interval) over interleaved rounds" in body
    assert "the pick is the highest mean" in body
    assert "the largest size tuned" not in body  # one size only
    assert ("| configuration | tokens/s | speedup vs vanilla | mean accepted length | rounds |"
            in body)
    # Fastest first; vanilla is placed by its 1.00x.
    assert table_rows(body) == [
        "| vegas weight, 256 slots, gamma 6 (the pick) | 141.2 [138.0, 144.5] | "
        "1.41x [1.38, 1.46] | 3.05 | 5 |",
        "| vegas weight, 256 slots, gamma 4 | 135.0 [131.0, 139.0] | 1.35x [1.31, 1.39] | 2.65 | 5 |",
        "| streaming, 256 slots, gamma 5 (best streaming) | 120.0 [117.5, 122.5] | "
        "1.20x [1.17, 1.23] | 2.60 | 3 |",
        "| vanilla (no speculation) | 100.0 [98.0, 102.0] | 1.00x (reference) | 1.00 | 5 |",
        "| streaming, 512 slots, gamma 4 | 95.0 [92.0, 98.0] | 0.95x [0.92, 0.98] | 2.70 | 3 |",
    ]


def test_race_table_marks_a_streaming_pick_as_both(tmp_path):
    trials = race_rows({
        "vanilla": (None, figures(100.0, (98.0, 102.0), 1.0, 5)),
        "c1": (configuration(STREAMING, 256, 5),
               figures(120.0, (117.5, 122.5), 2.6, 5, 1.2, (1.17, 1.23))),
        "c2": (configuration(VEGAS_WEIGHT, 256, 6),
               figures(110.0, (104.0, 116.0), 3.0, 5, 1.1, (1.04, 1.16)))}, chosen="c1")
    rows = table_rows(section(report(tmp_path, trials=trials), "Race"))
    assert rows[0].startswith("| streaming, 256 slots, gamma 5 (the pick, best streaming) |")
    assert rows[1].startswith("| vegas weight, 256 slots, gamma 6 | 110.0 [104.0, 116.0] |")


def test_a_streaming_pick_is_the_best_streaming_even_beside_a_higher_mean_that_dropped_out(
        tmp_path):
    # c2 dropped out after three rounds with a higher mean than the pick's at the end; the
    # profile's streaming figures are the pick's (tuner.race_size), and so is the mark.
    trials = race_rows({
        "vanilla": (None, figures(100.0, (98.0, 102.0), 1.0, 8)),
        "c1": (configuration(STREAMING, 256, 5),
               figures(120.0, (118.0, 122.0), 2.6, 8, 1.2, (1.18, 1.22))),
        "c2": (configuration(STREAMING, 512, 4),
               figures(125.0, (95.0, 155.0), 2.7, 3, 1.25, (0.95, 1.55)))}, chosen="c1")
    rows = table_rows(section(report(tmp_path, trials=trials), "Race"))
    assert rows[0].startswith("| streaming, 512 slots, gamma 4 | 125.0 [95.0, 155.0] |")
    assert rows[1].startswith("| streaming, 256 slots, gamma 5 (the pick, best streaming) |")


def test_race_table_shows_the_latest_finished_race(tmp_path):
    # A later race of the same size (a resumed study raced more candidates); then one
    # that ran out of memory, with no rows of measurements.
    later = race_rows({
        "vanilla": (None, figures(100.0, (98.0, 102.0), 1.0, 5)),
        "c1": (configuration(VEGAS_WEIGHT, 512, 6),
               figures(90.0, (88.0, 92.0), 3.3, 5, 0.9, (0.88, 0.92)))},
        chosen="c1", number=1)
    failed = [{"step": "race", "batch_size": 1, "number": 2, "state": "FAIL", "value": None,
               "failed_reason": "out of memory: CUDA out of memory"}]
    rows = table_rows(section(report(tmp_path, trials=TRIALS + later + failed), "Race"))
    assert rows == [
        "| vanilla (no speculation) | 100.0 [98.0, 102.0] | 1.00x (reference) | 1.00 | 5 |",
        "| vegas weight, 512 slots, gamma 6 (the pick) | 90.0 [88.0, 92.0] | 0.90x [0.88, 0.92] "
        "| 3.30 | 5 |"]


def test_report_without_race_rows_has_no_race_table(tmp_path):
    text = report(tmp_path, trials=SWEEP_ROWS + EXTEND_ROWS)
    assert "## Race" not in text
    assert "## Best trials" in text  # the rest stands


def test_search_edges_list_each_sizes_edges(tmp_path):
    profile = make_profile()
    assert "## Search edges" not in report(tmp_path, profile)  # no pick on an edge
    race_step(profile)["edges"] = [
        "budget: 256 slots is the largest measured for vegas weight (139.0 tok/s predicted "
        "there)",
        "gamma: 6 is the largest with measured acceptance, a tune extends each axis once "
        "(139.0 tok/s predicted there)"]
    profile["steps"].append({"name": "race", "batch_size": 64, "trials": 1, "chosen": {},
                             "edges": ["window: 1 is the engine's largest sink-and-recent "
                                       "share (300.0 tok/s predicted there)"]})
    body = section(report(tmp_path, profile), "Search edges")
    assert "The pick lies on the edge of what was searched" in body
    assert [line for line in body.splitlines() if line.startswith("- ")] == [
        "- race @ batch 1: budget: 256 slots is the largest measured for vegas weight "
        "(139.0 tok/s predicted there)",
        "- race @ batch 1: gamma: 6 is the largest with measured acceptance, a tune extends "
        "each axis once (139.0 tok/s predicted there)",
        "- race @ batch 64: window: 1 is the engine's largest sink-and-recent share "
        "(300.0 tok/s predicted there)"]


def not_recommended(speedup: float, interval: list[float], engine: str = "triton") -> dict:
    profile = make_profile(recommended=False)
    vanilla = profile["results"]["vanilla_tokens_per_second"]
    profile["results"].update(speedup=speedup, speedup_interval=interval,
                              tokens_per_second=vanilla * speedup,
                              tokens_per_second_interval=[vanilla * bound for bound in interval])
    profile["provenance"]["engine_path"] = engine
    return profile


CPU_PATH_WORDS = ("masked full attention", "reads every K/V entry",
                  "cannot show a speedup there by construction", "carries over to a GPU")


def test_report_explains_a_slower_result(tmp_path):
    profile = not_recommended(0.82, [0.79, 0.85])
    summary = section("## x\n" + report(tmp_path, profile), "x")
    assert "**Not recommended: keep vanilla decoding**" in summary
    assert "**Recommended**" not in summary
    assert "Speculation is slower here" in summary
    assert "0.82x [0.79, 0.85]" in summary and "95% interval lies below 1" in summary
    assert not any(words in summary for words in CPU_PATH_WORDS)
    assert "Best found (tuned for vegas): drafter=vegas, gamma=6" in summary


def test_report_explains_a_result_within_noise(tmp_path):
    text = report(tmp_path, not_recommended(0.99, [0.95, 1.03]))
    assert "No measurable difference" in text and "within noise" in text
    assert "0.99x [0.95, 1.03]" in text and "95% interval that contains 1" in text
    assert "Speculation is slower" not in text


@pytest.mark.parametrize("engine", ["pytorch-reference",
                                    "pytorch-reference (decode, verify, drafts) + sdpa (prefill)"])
def test_report_explains_why_the_cpu_path_shows_no_speedup(tmp_path, engine):
    text = report(tmp_path, not_recommended(0.97, [0.93, 1.01], engine=engine))
    assert "No measurable difference" in text
    for words in CPU_PATH_WORDS:
        assert words in text
    assert "mean accepted length 3.05" in text  # what the profile still records


def test_within_noise_section_lists_what_the_race_could_not_order(tmp_path):
    profile = make_profile()
    assert "## Within noise" not in report(tmp_path, profile)  # nothing to list
    race_step(profile)["within_noise"] = [
        {**point(VEGAS_WEIGHT, 256, 4), "tokens_per_second": 135.0, "speedup": 1.35,
         "speedup_low": 1.31, "speedup_high": 1.39, "rounds": 5},
        {**point(STREAMING, 256, 5), "speedup": 1.2, "speedup_low": 1.17,
         "speedup_high": 1.23, "rounds": 3}]
    noise = section(report(tmp_path, profile), "Within noise")
    assert "95% interval overlaps the pick's" in noise
    assert "the pick is the higher mean (never the smaller parameter)" in noise
    assert table_rows(noise) == [
        "| race @ batch 1 | drafter=vegas, score=weight, window=0, budget=256, gamma=6, "
        "sparsity_ratio=0.0305 (chosen) | 1.41x [1.38, 1.46] | 141.2 |",
        "| race @ batch 1 | drafter=vegas, score=weight, window=0, budget=256, gamma=4, "
        "sparsity_ratio=0.0305 | 1.35x [1.31, 1.39] | 135.0 |",
        "| race @ batch 1 | drafter=streaming, score=logit, window=0, budget=256, gamma=5, "
        "sparsity_ratio=0.0305 | 1.20x [1.17, 1.23] | n/a |"]


def test_report_of_a_rerun_says_what_changed_from_the_profile_it_replaced(tmp_path):
    old = make_profile(recommended=False)
    old["target"] = "vllm"
    old["tuned"]["gamma"] = 2
    old["results"].update(tokens_per_second=30.5, vanilla_tokens_per_second=38.5,
                          speedup=0.79, selection_overhead=0.012)
    old["provenance"].update(engine_path="pytorch-reference", git_revision="0ef4112",
                             started="2026-11-01T00:00:00+00:00")
    new = make_profile()
    changes = section(report(tmp_path, new, previous=old), "Changes from the previous profile")
    assert "made 2026-11-01T00:00:00+00:00 (git 0ef4112)" in changes
    assert "| target | vllm | vegas |" in changes
    assert "| tuned.gamma | 2 | 6 |" in changes
    assert "| results.tokens_per_second | 30.5 | 141.2 |" in changes
    assert "| results.selection_overhead | 1.2% | 4.2% |" in changes
    assert "| provenance.engine_path | pytorch-reference | triton |" in changes
    assert "| recommended | False | True |" in changes
    assert "tuned.sparsity_ratio" not in changes  # unchanged fields are left out
    assert "Not like for like" not in changes

    other_ctx = copy.deepcopy(new)
    other_ctx["workload"]["ctx"] = 4096
    text = report(tmp_path, new, previous=other_ctx)
    assert "Not like for like: workload.ctx (4096 -> 8192)." in text
    assert "Nothing changed in the tuned values or the results." in text

    assert "Changes from the previous profile" not in report(tmp_path, new)


# --- batch sizes ---------------------------------------------------------------------

def schedule_profile() -> dict:
    """make_profile's figures at batch 64, behind a vanilla entry measured at batch 1."""
    profile = make_profile()
    head = copy.deepcopy(profile["results"])
    small = {**copy.deepcopy(head), "tokens_per_second": 80.0,
             "tokens_per_second_interval": [78.0, 82.0], "speedup": 0.8,
             "speedup_interval": [0.78, 0.82]}
    profile["workload"].update(batch_size=64, batch_sizes=[1, 64])
    profile["schedule"] = [
        {"batch_min": 1, "batch_max": 63, "batch_size": 1, "config": "vanilla",
         "measured": dict(profile["tuned"]), "results": small,
         "reason": "vanilla: the best speculative configuration (vegas weight, 256 slots, "
                   "gamma 6) measured 0.80x [0.78, 0.82], below 1"},
        {"batch_min": 64, "batch_max": 64, "batch_size": 64, "config": dict(profile["tuned"]),
         "results": head, "reason": "vegas weight, 256 slots, gamma 6: 1.41x [1.38, 1.46] "
                                    "vanilla; the whole interval lies above 1"}]
    small_race = {**race_step(profile), "study": "s:race@1",
                  "predictions": [prediction(VEGAS_WEIGHT, 256, 6, 82.0, 3.0, 80.0, 3.0, 0.8,
                                             [0.78, 0.82])]}
    profile["steps"] = [small_race] + [{**step, "study": step["study"].replace("@1", "@64"),
                                        "batch_size": 64} for step in profile["steps"]]
    return profile


def schedule_trials() -> list[dict]:
    """Batch 1's race (speculation slower) and make_profile's trials at batch 64."""
    small = race_rows({
        "vanilla": (None, figures(100.0, (98.0, 102.0), 1.0, 5)),
        "c1": (configuration(VEGAS_WEIGHT, 256, 6),
               figures(80.0, (78.0, 82.0), 3.0, 5, 0.8, (0.78, 0.82)))}, chosen="c1")
    return small + [{**row, "batch_size": 64} for row in TRIALS]


def test_batch_plot_draws_vanilla_the_best_streaming_and_the_best_per_size(tmp_path):
    profile = schedule_profile()
    axes = batch_figure(profile).axes[0]
    handles, labels = axes.get_legend_handles_labels()
    assert sorted(labels) == ["best speculative (hollow: vanilla runs)", "best streaming",
                              "chosen: runs speculatively", "vanilla"]
    bars = [c for c in axes.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 3
    # Points at the measured sizes, each series with its own figures and intervals.
    xs, ys = bars[0].lines[0].get_data()
    assert list(xs) == [1, 64] and list(ys) == [100.0, 100.0]
    xs, ys = bars[1].lines[0].get_data()
    assert list(ys) == [120.0, 120.0]
    xs, ys = bars[2].lines[0].get_data()
    assert list(ys) == [80.0, 141.25]
    segments = [[tuple(p) for p in segment] for segment in bars[2].lines[2][0].get_segments()]
    assert segments == [[(1, 78.0), (1, 82.0)], [(64, 138.0), (64, 144.5)]]
    # Filled only where the schedule runs speculation: batch 64, not batch 1.
    chosen = handles[labels.index("chosen: runs speculatively")]
    assert list(chosen.get_xdata()) == [64] and list(chosen.get_ydata()) == [141.25]
    assert axes.get_xscale() == "log"
    assert [t.get_text() for t in axes.get_xticklabels()] == ["1", "64"]
    assert_png(plot_throughput_vs_batch(profile, tmp_path / "b.png"))


def test_batch_plot_without_a_schedule_says_so():
    axes = batch_figure(make_profile()).axes[0]
    assert [t.get_text() for t in axes.texts] == ["no measured batch size"]
    assert not axes.containers


def test_report_has_a_schedule_table_and_a_sentence_per_range(tmp_path):
    text = report(tmp_path, schedule_profile(), schedule_trials())
    schedule = section(text, "Schedule by batch size")
    assert ("| batch | measured at | runs | vanilla tokens/s | best streaming tokens/s | "
            "best speculative tokens/s | vs vanilla | vs best streaming | accepted |") in schedule
    rows = table_rows(schedule)
    assert rows[0].startswith("| 1-63 | 1 | vanilla | 100.0 [98.0, 102.0] | 120.0 [117.5, 122.5] "
                              "| 80.0 [78.0, 82.0] | 0.80x [0.78, 0.82] |")
    assert rows[1] == ("| 64 and above | 64 | vegas weight, 256 slots, gamma 6 | 100.0 [98.0, 102.0] | "
                       "120.0 [117.5, 122.5] | 141.2 [138.0, 144.5] | 1.41x [1.38, 1.46] | "
                       "1.18x [1.15, 1.20] | 3.05 |")
    assert ("- **1-63**: vanilla: the best speculative configuration (vegas weight, 256 slots, "
            "gamma 6) measured 0.80x [0.78, 0.82], below 1.") in schedule
    assert "- **64 and above**: vegas weight, 256 slots, gamma 6: 1.41x" in schedule
    assert "**Recommended at batch 64, the largest size tuned**" in text


def test_race_table_shows_the_headline_batch_size(tmp_path):
    text = report(tmp_path, schedule_profile(), schedule_trials())
    race = section(text, "Race")
    assert race.startswith("\nAt batch 64, the largest size tuned. ")
    rows = table_rows(race)
    assert rows[0].startswith("| vegas weight, 256 slots, gamma 6 (the pick) | 141.2 [138.0, 144.5] |")
    assert len(rows) == 5 and not any("80.0 [78.0, 82.0]" in row for row in rows)
    # Each size's predictions and best trials, labelled with their size.
    assert "## Predictions (race @ batch 1)" in text and "## Predictions (race @ batch 64)" in text
    assert "### sweep @ batch 64 (by tokens per second)" in text


def test_report_names_what_was_cut_short_and_not_tuned(tmp_path):
    profile = schedule_profile()
    profile["cut_short"] = ["race at batch 1: 0 of 1 trials finished when --time-budget "
                            "stopped the run"]
    profile["not_tuned"] = [{"batch_size": 256, "reason": "out of memory: CUDA out of memory"}]
    cut = section(report(tmp_path, profile), "Cut short and not tuned")
    assert "- race at batch 1: 0 of 1 trials finished" in cut
    assert "- batch 256: out of memory" in cut
    assert "## Cut short" not in report(tmp_path)


def test_cost_model_section_names_each_miss_and_splits_it(tmp_path):
    profile = make_profile()
    race_step(profile).update(batch_size=16, predictions=[
        # 2% high: within the tolerance.
        prediction(VEGAS_WEIGHT, 256, 4, 102.0, 3.0, 100.0, 3.0),
        # 25% high, all of it acceptance: assumed 3.75 tokens, measured 3.0, same time.
        prediction(VEGAS_WEIGHT, 256, 6, 125.0, 3.75, 100.0, 3.0),
        # 20% high at the accepted length measured: all of it timing.
        prediction(STREAMING, 512, 5, 120.0, 2.5, 100.0, 2.5),
        prediction(VEGAS_WEIGHT, 256, 8, 90.0, 3.9),
    ])
    text = report(tmp_path, profile)
    cost = section(text, "Cost model")
    assert "Over 3 raced points" in cost and "+2.0% to +25.0%" in cost
    assert "(largest 25.0%; tolerance 10%)" in cost
    misses = [line for line in cost.splitlines() if line.startswith("- ")]
    assert len(misses) == 2  # gamma 4 lies within the tolerance: not listed
    assert misses[0].startswith("- race @ batch 16, vegas weight, 256 slots, gamma 6: "
                                "predicted 125.0, measured 100.0 tokens/s (+25.0%). ")
    assert "accepted length assumed 3.75, measured 3.00 (+25.0%)" in misses[0]
    assert misses[0].endswith("mostly acceptance: the race accepted differently from the "
                              "sweep's run at the probe gamma.")
    assert misses[1].startswith("- race @ batch 16, streaming, 512 slots, gamma 5: ")
    assert "iteration time predicted -16.7% off the measured one" in misses[1]
    assert "mostly timing" in misses[1]
    table = section(text, "Predictions (race @ batch 16)")
    assert "| vegas weight, 256 slots | 6 | 125.0 | 100.0 | +25.0% | n/a |" in table
    assert "| vegas weight, 256 slots | 8 | 90.0 | n/a | n/a | n/a |" in table


def test_cost_model_section_says_when_every_point_is_within_tolerance(tmp_path):
    cost = section(report(tmp_path), "Cost model")
    assert "Over 4 raced points" in cost and "-1.7% to +2.1%" in cost
    assert "Every measured point lies within the tolerance." in cost
    assert "Outside the tolerance" not in cost


def test_trial_cost_section_summarises_wall_time_prefill_and_steady_share(tmp_path):
    assert "## Trial cost" not in report(tmp_path)  # no trial timed

    def timed(number, wall, decode, prefill, steady):
        return run("sweep", number, VEGAS_WEIGHT, 256, 6, 3.0, 120.0, wall_seconds=wall,
                   decode_seconds=decode, prefill_seconds=prefill,
                   steady_iterations=steady, iterations=100)

    trials = [timed(0, 1.1, 1.0, 0.3, 90), timed(1, 2.4, 2.0, 0.1, 80),
              timed(2, 1.5, 1.0, 0.2, 100),
              # Not timed: no decode time to compare with.
              run("sweep", 3, VEGAS_WEIGHT, 512, 6, 3.2, 118.0, wall_seconds=9.0,
                  decode_seconds=0.0)]
    cost = section(report(tmp_path, trials=trials), "Trial cost")
    assert ("- 3 measured trials: wall time / timed decode time, median 1.20x "
            "(range 1.10x to 1.50x).") in cost
    assert "the longest prefill of a trial took 0.30 s; the median trial's took 0.20 s" in cost
    assert "median 90% of a trial's decode iterations" in cost


def test_the_report_of_several_contexts_names_each_entrys_band(tmp_path):
    from tests.test_profile import sample_profile_dict, several_contexts_dict
    from vegas_tune.profile import profile_from_dict, profile_to_dict

    profile = profile_to_dict(profile_from_dict(several_contexts_dict()))
    profile["not_tuned"] = [{"batch_size": 128, "ctx": 4096, "reason": "out of memory"}]
    text = report(tmp_path, profile, [])
    assert "# Vegas tuning: " in text and ", ctx 4096, 8192\n" in text
    schedule = text.split("## Schedule by context and batch size")[1]
    rows = [line.split(" | ")[:2] for line in schedule.splitlines() if line.startswith("| ctx")]
    assert rows == [["| ctx 1-5792, batch 1-63", "1 at ctx 4096"],
                    ["| ctx 1-5792, batch 64 and above", "64 at ctx 4096"],
                    ["| ctx 5793 and above, batch 1-63", "1 at ctx 8192"],
                    ["| ctx 5793 and above, batch 64 and above", "64 at ctx 8192"]]
    assert "at ctx 8192, the longest context" in text
    assert "- batch 128 at ctx 4096: out of memory" in text
    # One context: the table and its heading as they were.
    plain = report(tmp_path, profile_to_dict(profile_from_dict(sample_profile_dict())), [])
    assert "## Schedule by batch size" in plain and "| ctx" not in plain
