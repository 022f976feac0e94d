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
from vegas_tune.report import (acceptance_figure, plot_acceptance_vs_sparsity,
                               plot_throughput_vs_gamma, throughput_figure, write_report,
                               write_trials_table)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

TRIALS = [
    {"step": "sparsity", "number": 0, "state": "COMPLETE", "sparsity": 0.02, "gamma": 6,
     "mean_accepted_length": 2.4},
    {"step": "sparsity", "number": 1, "state": "COMPLETE", "sparsity": 0.05, "gamma": 6,
     "mean_accepted_length": 3.1, "acceptance_by_position": [0.9, 0.7]},
    {"step": "sparsity", "number": 2, "state": "PRUNED", "sparsity": 0.1},
    {"step": "selection", "number": 0, "state": "COMPLETE", "score": "vegas", "window": 64,
     "mean_accepted_length": 3.3},
    {"step": "gamma", "number": 0, "state": "COMPLETE", "gamma": 4, "tokens_per_second": 130.5,
     "tokens_per_second_low": 127.0, "tokens_per_second_high": 134.0,
     "predicted_tokens_per_second": 128.0},
    {"step": "gamma", "number": 1, "state": "COMPLETE", "gamma": 6, "tokens_per_second": 141.25,
     "tokens_per_second_low": 138.0, "tokens_per_second_high": 144.5,
     "predicted_tokens_per_second": 139.0},
    # The final measurement: one trial, one row per configuration, in interleaved rounds.
    {"step": "baselines", "number": 0, "state": "COMPLETE", "config": "chosen", "gamma": 6,
     "tokens_per_second": 141.25, "tokens_per_second_low": 138.0,
     "tokens_per_second_high": 144.5, "speedup": 1.4125, "speedup_low": 1.38,
     "speedup_high": 1.46, "mean_accepted_length": 3.05, "rounds": 5},
    {"step": "baselines", "number": 0, "state": "COMPLETE", "config": "vanilla",
     "tokens_per_second": 100.0, "tokens_per_second_low": 98.0, "tokens_per_second_high": 102.0,
     "mean_accepted_length": 1.0, "rounds": 5},
    {"step": "baselines", "number": 0, "state": "COMPLETE", "config": "streaming", "gamma": 6,
     "tokens_per_second": 120.0, "tokens_per_second_low": 117.5,
     "tokens_per_second_high": 122.5, "speedup": 1.2, "speedup_low": 1.17,
     "speedup_high": 1.23, "mean_accepted_length": 2.6, "rounds": 5},
]

PREDICTIONS = [
    {"gamma": 2, "predicted_tokens_per_second": 110.0, "measured_tokens_per_second": None},
    {"gamma": 4, "predicted_tokens_per_second": 128.0, "measured_tokens_per_second": 130.5},
    {"gamma": 6, "predicted_tokens_per_second": 139.0, "measured_tokens_per_second": 141.25,
     "measured_speedup": 1.41, "measured_speedup_interval": [1.37, 1.45]},
    {"gamma": 8, "predicted_tokens_per_second": 133.0, "measured_tokens_per_second": None},
]


def make_profile(recommended: bool = True) -> dict:
    return {
        "recommended": recommended,
        "tuned": {"drafter": "vegas", "gamma": 6, "sparsity_ratio": 0.05, "min_tokens": 256, "collect": "max",
                  "score": "vegas", "granularity": "token", "window": 64},
        "model": {"id": "smollm2-135m"},
        "workload": {"ctx": 8192, "batch_size": 1, "max_new_tokens": 128, "temperature": 0.0,
                     "dataset": "mixed", "num_prompts": 4},
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
            {"name": "sparsity", "study": "s1", "trials": 3,
             "chosen": {"sparsity": 0.05, "mean_accepted_length": 3.1},
             "notes": "knee | of the curve"},
            {"name": "gamma", "study": "s3", "trials": 2,
             "chosen": {"gamma": 6, "tokens_per_second": 141.25, "speedup": 1.41,
                        "speedup_low": 1.37, "speedup_high": 1.45},
             "notes": "", "predictions": PREDICTIONS},
        ],
        "provenance": {"tool_version": "0.1.0", "git_revision": "abc1234",
                       "command": "vegas-tune smollm2-135m --ctx 8192",
                       "started": "2025-01-02T03:04:05Z",
                       "duration_seconds": 754.0, "engine_path": "triton"},
    }


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
    assert list(table.columns[:3]) == ["step", "number", "state"]
    assert list(table["step"]) == [t["step"] for t in TRIALS]
    assert table.loc[1, "mean_accepted_length"] == pytest.approx(3.1)
    assert math.isnan(table.loc[2, "mean_accepted_length"])  # a key the trial lacks
    assert table.loc[5, "tokens_per_second"] == pytest.approx(141.25)
    assert table.loc[1, "acceptance_by_position"] == "[0.9, 0.7]"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


def test_trials_table_rejects_other_formats(tmp_path):
    with pytest.raises(VegasError, match=".csv or .parquet"):
        write_trials_table(TRIALS, tmp_path / "trials.xlsx")


# --- plots ---------------------------------------------------------------------------

def assert_png(path):
    data = path.read_bytes()
    assert data[:len(PNG_SIGNATURE)] == PNG_SIGNATURE
    assert len(data) > len(PNG_SIGNATURE)


def test_plots_write_png_files(tmp_path):
    profile = make_profile()
    acceptance = plot_acceptance_vs_sparsity(TRIALS, tmp_path / "acceptance.png",
                                             tuned=profile["tuned"], step1_sparsity=0.02)
    throughput = plot_throughput_vs_gamma(PREDICTIONS, tmp_path / "throughput.png",
                                          tuned=profile["tuned"], results=profile["results"],
                                          trials=TRIALS)
    assert_png(acceptance)
    assert_png(throughput)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acceptance.png", "throughput.png"]


def test_plots_without_data_still_write_png_files(tmp_path):
    assert_png(plot_acceptance_vs_sparsity([], tmp_path / "a.png"))
    assert_png(plot_throughput_vs_gamma([], tmp_path / "t.png"))


def legend(figure) -> dict:
    """label -> artist of the figure's one axes."""
    handles, labels = figure.axes[0].get_legend_handles_labels()
    return dict(zip(labels, handles))


def test_acceptance_plot_marks_the_tuned_sparsity_and_step_1s_apart():
    # Step 1 chose 0.2 by acceptance; refine moved the profile's sparsity to 0.3443.
    labels = legend(acceptance_figure(TRIALS, tuned={"sparsity_ratio": 0.3443},
                                      step1_sparsity=0.2))
    assert list(labels["tuned: 0.3443"].get_xdata()) == [0.3443, 0.3443]
    assert list(labels["step 1: 0.2"].get_xdata()) == [0.2, 0.2]
    assert not any(label.startswith("chosen") for label in labels)
    # Nothing moved: one line, saying both.
    labels = legend(acceptance_figure(TRIALS, tuned={"sparsity_ratio": 0.05},
                                      step1_sparsity=0.05))
    assert [label for label in labels if label != "trial"] == ["tuned (= step 1): 0.05"]


def test_throughput_plot_has_a_vanilla_line_with_its_band_and_error_bars():
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
    assert list(bars.lines[0].get_xdata()) == [4, 6]
    segments = [[tuple(point) for point in segment] for segment in bars.lines[2][0].get_segments()]
    assert segments == [[(4, 127.0), (4, 134.0)], [(6, 138.0), (6, 144.5)]]


def test_throughput_plot_falls_back_to_the_profiles_measured_points():
    bars = next(c for c in throughput_figure(PREDICTIONS).axes[0].containers
                if isinstance(c, ErrorbarContainer))
    assert list(bars.lines[0].get_ydata()) == [130.5, 141.25]


# --- write_artifacts (vegas_tune.pipeline) --------------------------------------------

def tune_result(profile: dict) -> SimpleNamespace:
    """What ``Tuner.run`` returns, as far as ``write_artifacts`` reads it."""
    steps = [SimpleNamespace(name=step["name"], chosen=step["chosen"],
                             predictions=step.get("predictions") or []) for step in profile["steps"]]
    return SimpleNamespace(trials=TRIALS, steps=steps)


def moved_sparsity_profile() -> dict:
    """Step 1 chose 0.2 by acceptance; refine moved the tuned sparsity to 0.3443."""
    profile = make_profile()
    profile["tuned"]["sparsity_ratio"] = 0.3443
    profile["steps"][0]["chosen"] = {"sparsity": 0.2, "mean_accepted_length": 3.1}
    return profile


def test_artifacts_keep_the_whole_stem_of_a_dotted_profile_name(tmp_path):
    from vegas_tune.pipeline import write_artifacts

    # run_tune passes out.with_suffix(""): my.v2.yaml -> my.v2
    profile = make_profile()
    paths = write_artifacts(profile, tune_result(profile), tmp_path / "my.v2")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "my.v2.acceptance.png", "my.v2.batch.png", "my.v2.report.md", "my.v2.throughput.png",
        "my.v2.trials.csv"]
    assert paths["trials"] == str(tmp_path / "my.v2.trials.csv")
    report = (tmp_path / "my.v2.report.md").read_text()
    assert "(my.v2.acceptance.png)" in report and "(my.v2.throughput.png)" in report
    assert "(my.v2.batch.png)" in report and paths["batch_plot"] == str(tmp_path / "my.v2.batch.png")


def test_artifacts_plots_mark_the_profiles_tuned_values(tmp_path, monkeypatch):
    from vegas_tune import pipeline

    calls = {}
    monkeypatch.setattr(pipeline, "plot_acceptance_vs_sparsity",
                        lambda trials, path, **kw: calls.setdefault("acceptance", kw))
    monkeypatch.setattr(pipeline, "plot_throughput_vs_gamma",
                        lambda predictions, path, **kw: calls.setdefault("throughput", kw))
    profile = moved_sparsity_profile()
    pipeline.write_artifacts(profile, tune_result(profile), tmp_path / "p")
    labels = legend(acceptance_figure(TRIALS, **calls["acceptance"]))
    assert "tuned: 0.3443" in labels and "step 1: 0.2" in labels
    assert calls["throughput"]["tuned"] == profile["tuned"]
    assert calls["throughput"]["results"] == profile["results"]


# --- report --------------------------------------------------------------------------

def section(text: str, heading: str) -> str:
    """The body of the Markdown section ``## heading``."""
    return text.split(f"## {heading}\n")[1].split("\n## ")[0]


def test_report_states_the_tuned_values_speedups_and_images(tmp_path):
    images = {"Acceptance vs sparsity": "acceptance.png",
              "Throughput vs gamma": str(tmp_path / "plots" / "throughput.png")}
    path = write_report(make_profile(), TRIALS, tmp_path / "report.md", images)
    text = path.read_text()
    assert text.startswith("# Vegas tuning: smollm2-135m on NVIDIA H200, ctx 8192")
    assert "**Recommended**" in text and "Not recommended" not in text
    for value in ("gamma=6", "sparsity_ratio=0.05", "min_tokens=256", "score=vegas", "window=64"):
        assert value in text
    assert ("- Speedup: 1.41x [1.38, 1.46] over vanilla (95% interval, 5 rounds); "
            "1.18x [1.15, 1.20] over streaming.") in text
    assert ("- Throughput: 141.2 [138.0, 144.5] tokens/s vs 100.0 [98.0, 102.0] vanilla and "
            "120.0 [117.5, 122.5] streaming.") in text
    assert "3.05" in text and "4.2% of decode time" in text
    assert "![Acceptance vs sparsity](acceptance.png)" in text
    assert "![Throughput vs gamma](plots/throughput.png)" in text
    # Gamma predictions: predicted and measured side by side, n/a where not measured.
    assert "| 4 | n/a | 128.0 | 130.5 | -1.9% | n/a |" in text
    assert "| 8 | n/a | 133.0 | n/a | n/a | n/a |" in text
    assert "| 6 | n/a | 139.0 | 141.2 | -1.6% | 1.41x [1.37, 1.45] |" in text
    # A step's chosen measurement with its interval folded in.
    assert "gamma=6, tokens_per_second=141.2, speedup=1.41 [1.37, 1.45]" in text
    # Best trials: the gamma step ranked by measured tokens/s, best first, with intervals.
    gamma_section = text.split("### gamma")[1]
    assert gamma_section.index("141.2 [138, 144.5]") < gamma_section.index("130.5 [127, 134]")
    assert "knee \\| of the curve" in text  # a "|" in notes does not break the table
    assert "vegas-tune smollm2-135m --ctx 8192" in text and "2025-01-02T03:04:05Z" in text
    assert "12 min 34 s" in text
    assert "driver 550.54" in text


def test_baselines_table_labels_each_row_with_mean_and_interval(tmp_path):
    text = write_report(make_profile(), TRIALS, tmp_path / "report.md", {}).read_text()
    table = section(text, "Baselines")
    assert "95% interval" in table
    assert "| configuration | tokens/s | speedup vs vanilla | mean accepted length | rounds |" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows == [
        "| chosen (the tuned settings) | 141.2 [138.0, 144.5] | 1.41x [1.38, 1.46] | 3.05 | 5 |",
        "| vanilla (no speculation) | 100.0 [98.0, 102.0] | 1.00x (reference) | 1.00 | 5 |",
        "| streaming drafter (same budget) | 120.0 [117.5, 122.5] | 1.20x [1.17, 1.23] | 2.60 | 5 |",
    ]
    # The unlabelled best-trials table of the baselines step is gone.
    assert "### baselines" not in text


def test_baselines_table_shows_the_trial_behind_the_profiles_results(tmp_path):
    # A later baselines trial measured another choice (an earlier run's): not this profile's.
    other = [{**row, "number": 1, "tokens_per_second": 90.0, "tokens_per_second_low": 88.0,
              "tokens_per_second_high": 92.0} for row in TRIALS if row["step"] == "baselines"]
    profile = make_profile()
    text = write_report(profile, TRIALS + other, tmp_path / "r.md", {}).read_text()
    assert "| chosen (the tuned settings) | 141.2 [138.0, 144.5] |" in section(text, "Baselines")
    # No trial matches the profile: the latest is shown.
    profile["results"]["tokens_per_second"] = 150.0
    text = write_report(profile, TRIALS + other, tmp_path / "r.md", {}).read_text()
    assert "| chosen (the tuned settings) | 90.0 [88.0, 92.0] |" in section(text, "Baselines")


def test_baselines_table_without_trial_rows_comes_from_the_results(tmp_path):
    trials = [t for t in TRIALS if t["step"] != "baselines"]
    text = write_report(make_profile(), trials, tmp_path / "report.md", {}).read_text()
    table = section(text, "Baselines")
    assert "| chosen (the tuned settings) | 141.2 [138.0, 144.5] | 1.41x [1.38, 1.46] |" in table
    assert "| vanilla (no speculation) | 100.0 [98.0, 102.0] | 1.00x (reference) |" in table
    assert "| streaming drafter (same budget) | 120.0 [117.5, 122.5] | n/a |" in table


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
    summary = section("## x\n" + write_report(profile, TRIALS, tmp_path / "r.md", {})
                      .read_text(), "x")
    assert "**Not recommended: keep vanilla decoding**" in summary
    assert "**Recommended**" not in summary
    assert "Speculation is slower here" in summary
    assert "0.82x [0.79, 0.85]" in summary and "95% interval lies below 1" in summary
    assert not any(words in summary for words in CPU_PATH_WORDS)
    assert "Best found: " in summary and "gamma=6" in summary


def test_report_explains_a_result_within_noise(tmp_path):
    profile = not_recommended(0.99, [0.95, 1.03])
    text = write_report(profile, TRIALS, tmp_path / "r.md", {}).read_text()
    assert "No measurable difference" in text and "within noise" in text
    assert "0.99x [0.95, 1.03]" in text and "95% interval that contains 1" in text
    assert "Speculation is slower" not in text


@pytest.mark.parametrize("engine", ["pytorch-reference",
                                    "pytorch-reference (decode, verify, drafts) + sdpa (prefill)"])
def test_report_explains_why_the_cpu_path_shows_no_speedup(tmp_path, engine):
    profile = not_recommended(0.97, [0.93, 1.01], engine=engine)
    text = write_report(profile, TRIALS, tmp_path / "r.md", {}).read_text()
    assert "No measurable difference" in text
    for words in CPU_PATH_WORDS:
        assert words in text
    assert "mean accepted length 3.05" in text  # what the profile still records


def test_within_noise_section_lists_what_the_tuner_could_not_tell_apart(tmp_path):
    profile = make_profile()
    text = write_report(profile, TRIALS, tmp_path / "r.md", {}).read_text()
    assert "## Within noise" not in text  # nothing to list
    profile["steps"][1]["within_noise"] = [
        {"gamma": 7, "tokens_per_second": 142.0, "speedup": 1.42, "speedup_low": 1.36,
         "speedup_high": 1.48},
        {"gamma": 8, "speedup": 1.4, "speedup_low": 1.33, "speedup_high": 1.47}]
    text = write_report(profile, TRIALS, tmp_path / "r.md", {}).read_text()
    noise = section(text, "Within noise")
    assert "could not tell them apart" in noise and "chose the cheapest" in noise
    assert "95% interval overlaps the interval of the step's best mean" in noise
    assert "| gamma | gamma=6 (chosen) | 1.41x [1.37, 1.45] | 141.2 |" in noise
    assert "| gamma | gamma=7 | 1.42x [1.36, 1.48] | 142.0 |" in noise
    assert "| gamma | gamma=8 | 1.40x [1.33, 1.47] | n/a |" in noise


def test_report_of_a_rerun_says_what_changed_from_the_profile_it_replaced(tmp_path):
    old = make_profile(recommended=False)
    old["tuned"]["gamma"] = 2
    old["results"].update(tokens_per_second=30.5, vanilla_tokens_per_second=38.5,
                          speedup=0.79, selection_overhead=0.012)
    old["provenance"].update(engine_path="pytorch-reference", git_revision="0ef4112",
                             started="2026-11-01T00:00:00+00:00")
    new = make_profile()
    text = write_report(new, TRIALS, tmp_path / "r.md", {}, previous=old).read_text()
    section = text.split("## Changes from the previous profile")[1].split("\n## ")[0]
    assert "made 2026-11-01T00:00:00+00:00 (git 0ef4112)" in section
    assert "| tuned.gamma | 2 | 6 |" in section
    assert "| results.tokens_per_second | 30.5 | 141.2 |" in section
    assert "| results.selection_overhead | 1.2% | 4.2% |" in section
    assert "| provenance.engine_path | pytorch-reference | triton |" in section
    assert "| recommended | False | True |" in section
    assert "tuned.sparsity_ratio" not in section  # unchanged fields are left out
    assert "Not like for like" not in section

    other_ctx = copy.deepcopy(new)
    other_ctx["workload"]["ctx"] = 4096
    text = write_report(new, TRIALS, tmp_path / "r.md", {}, previous=other_ctx).read_text()
    assert "Not like for like: workload.ctx (4096 -> 8192)." in text
    assert "Nothing changed in the tuned values or the results." in text

    plain = write_report(new, TRIALS, tmp_path / "r.md", {}).read_text()
    assert "Changes from the previous profile" not in plain


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
         "reason": "vanilla: the best speculative configuration measured 0.80x, below 1"},
        {"batch_min": 64, "batch_max": 64, "batch_size": 64, "config": dict(profile["tuned"]),
         "results": head, "reason": "vegas gamma 6: 1.41x [1.38, 1.46] vanilla"}]
    return profile


def test_batch_plot_draws_vanilla_streaming_and_the_best_per_size(tmp_path):
    from vegas_tune.report import batch_figure, plot_throughput_vs_batch

    profile = schedule_profile()
    axes = batch_figure(profile).axes[0]
    labels = axes.get_legend_handles_labels()[1]
    assert any(label.startswith("vanilla") for label in labels)
    assert any(label.startswith("streaming") for label in labels)
    assert "chosen: runs speculatively" in labels
    bars = [c for c in axes.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 3
    # Points at the measured sizes, each series with its own figures.
    xs, ys = bars[0].lines[0].get_data()
    assert list(xs) == [1, 64] and list(ys) == [100.0, 100.0]
    xs, ys = bars[2].lines[0].get_data()
    assert list(ys) == [80.0, 141.25]
    path = plot_throughput_vs_batch(profile, tmp_path / "b.png")
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_report_has_a_schedule_table_and_a_sentence_per_range(tmp_path):
    path = write_report(schedule_profile(), TRIALS, tmp_path / "r.md", {})
    text = path.read_text()
    section = text.split("## Schedule by batch size")[1].split("\n## ")[0]
    assert "| 1-63 | 1 | vanilla |" in section
    assert "| 64-64 | 64 | vegas gamma 6" in section and "1.41x [1.38, 1.46]" in section
    assert "- **1-63**: vanilla: the best speculative configuration measured 0.80x" in section
    assert "- **64-64**: vegas gamma 6" in section
    assert "at batch 64, the largest size tuned" in text


def test_report_names_what_was_cut_short_and_not_tuned(tmp_path):
    profile = schedule_profile()
    profile["cut_short"] = ["refine at batch 64: 2 of 8 trials finished when --time-budget "
                            "stopped the run"]
    profile["not_tuned"] = [{"batch_size": 256, "reason": "out of memory: CUDA out of memory"}]
    text = write_report(profile, TRIALS, tmp_path / "r.md", {}).read_text()
    section = text.split("## Cut short and not tuned")[1].split("\n## ")[0]
    assert "- refine at batch 64: 2 of 8 trials finished" in section
    assert "- batch 256: out of memory" in section
    assert "## Cut short" not in write_report(make_profile(), TRIALS, tmp_path / "s.md",
                                              {}).read_text()


def test_cost_model_section_names_each_miss_and_splits_it(tmp_path):
    profile = make_profile()
    predictions = [
        # 2% high: within the tolerance.
        {"gamma": 4, "sparsity_ratio": 0.05, "predicted_tokens_per_second": 102.0,
         "predicted_mean_accepted_length": 3.0, "measured_tokens_per_second": 100.0,
         "measured_mean_accepted_length": 3.0},
        # 25% high, all of it acceptance: assumed 3.75 tokens, measured 3.0, same time.
        {"gamma": 6, "sparsity_ratio": 0.05, "predicted_tokens_per_second": 125.0,
         "predicted_mean_accepted_length": 3.75, "measured_tokens_per_second": 100.0,
         "measured_mean_accepted_length": 3.0},
        {"gamma": 8, "sparsity_ratio": 0.05, "predicted_tokens_per_second": 90.0,
         "measured_tokens_per_second": None},
    ]
    profile["steps"][1].update(predictions=predictions, batch_size=16)
    text = write_report(profile, TRIALS, tmp_path / "r.md", {}).read_text()
    section = text.split("## Cost model")[1].split("\n## ")[0]
    assert "Over 2 measured points" in section and "+2.0% to +25.0%" in section
    assert "gamma @ batch 16, gamma 6, sparsity 0.05" in section
    assert "(+25.0%)" in section and "mostly acceptance" in section
    assert "gamma 4," not in section  # within tolerance: not listed
    table = text.split("## Throughput by gamma (gamma @ batch 16 step)")[1]
    assert "| 6 | 0.05 | 125.0 | 100.0 | +25.0% |" in table


def test_cost_model_section_says_when_every_point_is_within_tolerance(tmp_path):
    profile = make_profile()
    text = write_report(profile, TRIALS, tmp_path / "r.md", {}).read_text()
    section = text.split("## Cost model")[1].split("\n## ")[0]
    assert "Every measured point lies within the tolerance." in section
