"""Hardware fingerprint, trials table, plots and the Markdown tuning report."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from vegas_core.errors import VegasError
from vegas_tune.hardware import FINGERPRINT_KEYS, fingerprint, gpu_slug
from vegas_tune.report import (plot_acceptance_vs_sparsity, plot_throughput_vs_gamma,
                               write_report, write_trials_table)

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
     "predicted_tokens_per_second": 128.0},
    {"step": "gamma", "number": 1, "state": "COMPLETE", "gamma": 6, "tokens_per_second": 141.25,
     "predicted_tokens_per_second": 139.0},
]

PREDICTIONS = [
    {"gamma": 2, "predicted_tokens_per_second": 110.0, "measured_tokens_per_second": None},
    {"gamma": 4, "predicted_tokens_per_second": 128.0, "measured_tokens_per_second": 130.5},
    {"gamma": 6, "predicted_tokens_per_second": 139.0, "measured_tokens_per_second": 141.25},
    {"gamma": 8, "predicted_tokens_per_second": 133.0, "measured_tokens_per_second": None},
]


def make_profile(recommended: bool = True) -> dict:
    return {
        "recommended": recommended,
        "tuned": {"gamma": 6, "sparsity_ratio": 0.05, "min_tokens": 256, "collect": "max",
                  "score": "vegas", "granularity": "token", "window": 64},
        "model": {"id": "smollm2-135m"},
        "workload": {"ctx": 8192, "batch_size": 1, "max_new_tokens": 128, "temperature": 0.0,
                     "dataset": "mixed", "num_prompts": 4},
        "hardware": {"gpu_name": "NVIDIA H200", "gpu_count": 1, "gpu_memory_gb": 139.8,
                     "driver": "550.54", "cuda": "12.4", "torch": "2.5.1", "triton": "3.1.0",
                     "cpu": "Intel Xeon", "cpu_count": 16},
        "results": {"tokens_per_second": 141.25, "vanilla_tokens_per_second": 100.0,
                    "streaming_tokens_per_second": 120.0, "speedup": 1.4125,
                    "speedup_over_streaming": 1.177, "mean_accepted_length": 3.05,
                    "acceptance_by_position": [0.91, 0.8, 0.66], "selection_overhead": 0.042},
        "steps": [
            {"name": "sparsity", "study": "s1", "trials": 3, "chosen": {"sparsity_ratio": 0.05},
             "notes": "knee | of the curve"},
            {"name": "gamma", "study": "s3", "trials": 2, "chosen": {"gamma": 6}, "notes": "",
             "predictions": PREDICTIONS},
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
    acceptance = plot_acceptance_vs_sparsity(TRIALS, tmp_path / "acceptance.png", chosen=0.05)
    throughput = plot_throughput_vs_gamma(PREDICTIONS, tmp_path / "throughput.png", chosen=6)
    assert_png(acceptance)
    assert_png(throughput)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acceptance.png", "throughput.png"]


def test_plots_without_data_still_write_png_files(tmp_path):
    assert_png(plot_acceptance_vs_sparsity([], tmp_path / "a.png"))
    assert_png(plot_throughput_vs_gamma([], tmp_path / "t.png"))


# --- report --------------------------------------------------------------------------

def test_report_states_the_tuned_values_speedups_and_images(tmp_path):
    images = {"Acceptance vs sparsity": "acceptance.png",
              "Throughput vs gamma": str(tmp_path / "plots" / "throughput.png")}
    path = write_report(make_profile(), TRIALS, tmp_path / "report.md", images)
    text = path.read_text()
    assert text.startswith("# Vegas tuning: smollm2-135m on NVIDIA H200, ctx 8192")
    assert "**Recommended**" in text and "no configuration beat vanilla" not in text
    for value in ("gamma=6", "sparsity_ratio=0.05", "min_tokens=256", "score=vegas", "window=64"):
        assert value in text
    assert "141.2 tokens/s vs 100.0 vanilla (1.41x)" in text
    assert "120.0 streaming (1.18x)" in text
    assert "3.05" in text and "4.2% of decode time" in text
    assert "![Acceptance vs sparsity](acceptance.png)" in text
    assert "![Throughput vs gamma](plots/throughput.png)" in text
    # Gamma predictions: predicted and measured side by side, n/a where not measured.
    assert "| 4 | 128.0 | 130.5 |" in text and "| 8 | 133.0 | n/a |" in text
    # Best trials: the gamma step ranked by measured tokens/s, best first.
    gamma_section = text.split("### gamma")[1]
    assert gamma_section.index("141.2") < gamma_section.index("130.5")
    assert "knee \\| of the curve" in text  # a "|" in notes does not break the table
    assert "vegas-tune smollm2-135m --ctx 8192" in text and "2025-01-02T03:04:05Z" in text
    assert "12 min 34 s" in text
    assert "driver 550.54" in text


def test_report_says_plainly_when_nothing_beat_vanilla(tmp_path):
    profile = make_profile(recommended=False)
    profile["results"].update(tokens_per_second=90.0, speedup=0.9)
    text = write_report(profile, TRIALS, tmp_path / "report.md", {}).read_text()
    assert "no configuration beat vanilla decoding" in text
    assert "**Recommended**" not in text
    assert "(0.90x)" in text


def test_report_of_a_rerun_says_what_changed_from_the_profile_it_replaced(tmp_path):
    import copy

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
