"""vegas-tune end to end on the tiny dummy model: tune, resume after a kill, the
subcommands, bad input, and the not-recommended and out-of-memory paths."""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from vegas_tune import cli
from vegas_tune.measure import Measurement
from vegas_tune.tuner import Tuner

# Small enough for seconds per trial on the CPU, big enough to exercise every step.
FAST = ["--model", "dummy:tiny", "--ctx", "512", "--num-prompts", "2", "--max-new-tokens", "12",
        "--probe-gamma", "4", "--gamma-max", "4", "--gamma-candidates", "2",
        "--sparsity-grid", "0.05,0.2", "--refine-trials", "3", "--min-tokens", "8",
        "--device", "cpu"]


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


@pytest.fixture(scope="module")
def tuned_profile(tmp_path_factory):
    """One full tune, shared by the subcommand tests."""
    out = tmp_path_factory.mktemp("tune") / "tiny.yaml"
    proc = subprocess.run([sys.executable, "-m", "vegas_tune.cli", *FAST, "--out", str(out),
                           "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 3), proc.stderr
    return out, json.loads(proc.stdout), proc


def test_tune_writes_a_valid_profile_and_its_files(tuned_profile, capsys):
    out, summary, proc = tuned_profile
    assert summary["profile"] == str(out)
    assert (proc.returncode == 0) == summary["recommended"]
    for key in ("trials", "acceptance_plot", "throughput_plot", "report"):
        assert Path(summary["files"][key]).is_file()
    assert Path(summary["files"]["acceptance_plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, stdout, _ = run(["validate", str(out)], capsys)
    assert code == 0 and "valid" in stdout
    profile = yaml.safe_load(out.read_text())
    assert profile["model"]["dummy"] is True
    assert [s["name"] for s in profile["steps"]] == ["sparsity", "gamma", "refine"]
    assert profile["tuned"]["gamma"] in (1, 2, 3, 4)
    gamma_step = profile["steps"][1]
    # Every gamma up to 4 at both step-1 ratios predicted; the two best measured.
    assert len(gamma_step["predictions"]) == 8
    assert sum(p["measured_tokens_per_second"] is not None for p in gamma_step["predictions"]) == 2
    assert [e["batch_size"] for e in profile["schedule"]] == [1]
    r = profile["results"]
    assert r["speedup"] == pytest.approx(r["tokens_per_second"] / r["vanilla_tokens_per_second"],
                                         rel=1e-3)
    assert profile["exports"]["vllm"]["serve_config"]["speculative-config"]["method"] == "sparse_attn"


def test_show_export_and_diff(tuned_profile, tmp_path, capsys):
    out, _, _ = tuned_profile
    code, stdout, _ = run(["show", str(out)], capsys)
    assert code == 0 and "tuned: vegas gamma" in stdout
    recommended = yaml.safe_load(out.read_text())["recommended"]
    code, stdout, err = run(["export", str(out), "--target", "vllm"], capsys)
    serve = yaml.safe_load(stdout)
    # A profile that is not recommended exports vanilla serving, and says so.
    assert code == 0 and ("speculative-config" in serve) == recommended
    assert recommended or "runs vanilla" in err
    code, stdout, _ = run(["export", str(out), "--target", "vllm", "--force"], capsys)
    assert code == 0 and yaml.safe_load(stdout)["speculative-config"]["sparse_attn_algorithm"] == "vegas"
    code, stdout, _ = run(["export", str(out), "--target", "vegas", "--format", "json", "--force"],
                          capsys)
    assert code == 0 and json.loads(stdout)["drafter"] == "vegas"
    code, stdout, _ = run(["diff", str(out), str(out)], capsys)
    assert code == 0
    worse = yaml.safe_load(out.read_text())
    for results in (worse["results"], worse["schedule"][-1]["results"]):
        results["tokens_per_second"] *= 0.5
        results["tokens_per_second_interval"] = [
            x * 0.5 for x in results["tokens_per_second_interval"]]
    worse_path = tmp_path / "worse.yaml"
    worse_path.write_text(yaml.safe_dump(worse, sort_keys=False))
    code, stdout, _ = run(["diff", str(out), str(worse_path), "--tolerance", "0.1"], capsys)
    assert code == 1 and "tokens_per_second" in stdout


def completed_trials(storage: str, study: str) -> list[tuple[int, dict, float]]:
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    try:
        s = optuna.load_study(study_name=study, storage=JournalStorage(JournalFileBackend(storage)))
    except KeyError:
        return []
    return [(t.number, t.params["sparsity"], t.value) for t in s.get_trials(
        deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))]


def test_killed_run_resumes_without_repeating_finished_trials(tmp_path):
    out = tmp_path / "p.yaml"
    storage = str(tmp_path / "study.journal")
    # Enough grid points that the step is still running when the kill lands, however
    # slowly this process polls the storage on a loaded machine.
    points = "0.02,0.03,0.05,0.07,0.1,0.13,0.16,0.2,0.25,0.3,0.35,0.4".split(",")
    grid = ["--sparsity-grid", ",".join(points)]
    argv = [sys.executable, "-m", "vegas_tune.cli", *FAST, *grid, "--ctx", "2k",
            "--num-prompts", "3", "--out", str(out), "--storage", storage,
            "--study-name", "kill"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    before = []
    while time.time() < deadline and proc.poll() is None:
        before = completed_trials(storage, "kill:sparsity")
        if len(before) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed; make it slower"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = completed_trials(storage, "kill:sparsity")
    assert 2 <= len(before) < len(points)
    fresh = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert fresh.returncode == 2 and "--resume" in fresh.stderr  # refuses to overwrite
    resumed = subprocess.run([*argv, "--resume"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode in (0, 3), resumed.stderr
    after = completed_trials(storage, "kill:sparsity")
    assert set(before) <= set(after)  # finished trials kept as they were
    values = sorted(sparsity for _, sparsity, _ in after)
    assert values == sorted(map(float, points))  # each grid point measured exactly once
    assert out.is_file()


def test_ctrl_c_exits_130_and_keeps_trials(tmp_path):
    storage = str(tmp_path / "study.journal")
    # Many refine trials: the run must still be going when the interrupt lands, however
    # slowly this process polls the storage on a loaded machine.
    argv = [sys.executable, "-m", "vegas_tune.cli", *FAST, "--ctx", "2k", "--num-prompts", "3",
            "--sparsity-grid", "0.02,0.05,0.1,0.2,0.3", "--refine-trials", "200",
            "--out", str(tmp_path / "p.yaml"), "--storage", storage, "--study-name", "int"]
    # As from a terminal: SIGINT at its default, also when this test runs under a parent
    # that ignores it (a background job of a non-interactive shell), which the child would
    # inherit and Python would keep.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while time.time() < deadline and len(completed_trials(storage, "int:sparsity")) < 1:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "--resume" in err and "Traceback" not in err
    assert len(completed_trials(storage, "int:sparsity")) >= 1
    # The finished trials still make a profile, which says it was cut short.
    profile = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert any("Ctrl-C" in line for line in profile["cut_short"])


def test_ctrl_c_while_a_finished_trial_is_being_written_stops_at_the_next_one(
        tmp_path, monkeypatch, capsys):
    """Ctrl-C landing inside optuna's write of a finished trial (the moment a watcher of
    the storage sees it complete) waits for the write, then stops the next trial."""
    from optuna.storages.journal import JournalStorage
    from optuna.trial import TrialState

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", noisy_measure(lambda s: 1.3))
    write = JournalStorage.set_trial_state_values
    interrupted = []

    def interrupt_while_writing(self, trial_id, state, values=None):
        if state == TrialState.COMPLETE and not interrupted:
            interrupted.append(trial_id)
            signal.raise_signal(signal.SIGINT)  # handled before the write below starts
        return write(self, trial_id, state, values)

    monkeypatch.setattr(JournalStorage, "set_trial_state_values", interrupt_while_writing)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, _, err = run([*FAST, "--out", str(tmp_path / "p.yaml"), "--storage",
                            str(tmp_path / "s.journal"), "--study-name", "int"], capsys)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130, err
    assert interrupted and "internal error" not in err
    assert len(completed_trials(str(tmp_path / "s.journal"), "int:sparsity")) == 1
    profile = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert any("sparsity: 1 of 2 trials finished when Ctrl-C" in line
               for line in profile["cut_short"])


def fake_measurement(tokens_per_second: float, accepted: float = 2.0,
                     gamma: int = 4) -> Measurement:
    return Measurement(tokens_per_second=tokens_per_second,
                       completion_tokens_per_second=0.9 * tokens_per_second, decode_seconds=1.0,
                       decode_tokens=int(tokens_per_second), steady_seconds=0.8,
                       steady_tokens=int(0.8 * tokens_per_second), iterations=10,
                       steady_iterations=8, prefill_seconds=0.1, wall_seconds=1.2,
                       mean_accepted_length=accepted,
                       acceptance_by_position=[0.5, 0.3, 0.1, 0.1, 0.0, 0.0, 0.0, 0.0][:gamma],
                       selection_overhead=0.01, draft_step_seconds=0.01,
                       verify_step_seconds=0.02, selection_step_seconds=0.001,
                       decode_step_seconds=0.01)


def noisy_measure(speedup_of, noise: float = 0.03, seed: int = 0):
    """A fake ``Measurer.measure``: vanilla at 100 tokens/s, a configuration at
    ``speedup_of(spec)`` times that, each call scaled by seeded log-normal noise; the
    calls are recorded as ``measure.calls``."""
    rng = random.Random(seed)

    def measure(self, spec, report=None):
        measure.calls.append(spec)
        factor = math.exp(rng.gauss(0.0, noise))
        if spec is None:
            return fake_measurement(100.0 * factor, 1.0, 0)
        return fake_measurement(100.0 * speedup_of(spec) * factor, 2.0, spec.gamma)

    measure.calls = []
    return measure


def test_nothing_beats_vanilla_exits_3_with_recommended_false(tmp_path, monkeypatch, capsys):
    def measure(self, spec, report=None):
        return fake_measurement(50.0 if spec is not None else 100.0, gamma=spec.gamma if spec else 0)

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out)], capsys)
    assert code == 3
    assert yaml.safe_load(out.read_text())["recommended"] is False
    assert "NOT recommended" in err
    report = tmp_path / "p.report.md"
    assert "Changes from the previous profile" not in report.read_text()

    # Re-tuned into the same file (a fresh study): the report compares with the profile
    # it replaced, here a faster speculative configuration and the recommendation.
    def faster(self, spec, report=None):
        return fake_measurement(150.0 if spec is not None else 100.0, gamma=spec.gamma if spec else 0)

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", faster)
    code, _, _ = run([*FAST, "--out", str(out), "--storage", str(tmp_path / "again.journal")],
                     capsys)
    assert code == 0
    changes = report.read_text().split("## Changes from the previous profile")[1]
    assert "| recommended | False | True |" in changes
    assert "| results.speedup | 0.50 | 1.50 |" in changes


def test_out_of_memory_trial_is_recorded_and_tuning_goes_on(tmp_path, monkeypatch, capsys):
    def measure(self, spec, report=None):
        if spec is not None and spec.sparsity == 0.2 and spec.gamma == 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return fake_measurement(120.0 if spec is not None else 100.0, gamma=spec.gamma if spec else 0)

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    out = tmp_path / "p.yaml"
    code, _, _ = run([*FAST, "--out", str(out), "--refine-trials", "2"], capsys)
    assert code == 0
    trials = (tmp_path / "p.trials.csv").read_text()
    assert "out of memory" in trials and "FAIL" in trials


@pytest.mark.parametrize("argv, fragment", [
    (["--ctx", "lots"], "--ctx 'lots'"),
    (["--model", "dummy:nope"], "unknown dummy preset"),
    (["--ctx", "20k"], "maximum of 16384 positions"),
    (["--dataset", "missing.jsonl"], "not found"),
    (["--batch-size", "0"], "--batch-size '0': every size must be >= 1, got 0"),
    (["--batch-size", "1,-3"], "every size must be >= 1, got -3"),
    (["--batch-size", "1,16,16"], "16 is given twice"),
    (["--batch-size", "1,many"], "--batch-size '1,many' is not a whole number"),
    (["--sparsity-grid", "0.1,2"], "--sparsity-grid"),
])
def test_bad_tune_input(argv, fragment, tmp_path, capsys):
    code, _, err = run([*FAST, "--out", str(tmp_path / "p.yaml"), *argv], capsys)
    assert code == 2 and "Traceback" not in err
    assert fragment in err


def test_bad_profile_and_export_target(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: 1\nrecommended: true\nsurprise: 1\n")
    code, _, err = run(["validate", str(bad)], capsys)
    assert code == 2 and "bad.yaml" in err and err.count("\n") == 1
    code, _, err = run(["validate", str(tmp_path / "none.yaml")], capsys)
    assert code == 2


def test_settings_precedence(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("ctx: 8k\nnum-prompts: 3\nseed: 5\n")
    monkeypatch.setenv("VEGAS_TUNE_NUM_PROMPTS", "7")
    monkeypatch.setenv("VEGAS_TUNE_SEED", "6")
    s = cli.resolve_settings({"seed": 9}, config)
    assert s["ctx"] == 8192  # config over default
    assert s["num_prompts"] == 7  # env over config
    assert s["seed"] == 9  # flag over env
    assert s["model"] == "smollm2-135m"  # default
    config.write_text("ctxx: 1\n")
    from vegas_core.errors import VegasError

    with pytest.raises(VegasError, match="unknown option 'ctxx'"):
        cli.resolve_settings({}, config)


def test_measurements_repeat_interleaved_with_vanilla_and_noise_is_not_recommended(
        tmp_path, monkeypatch, capsys):
    # 2% faster than vanilla inside 10% noise: the interval holds 1, so no recommendation.
    measure = noisy_measure(lambda spec: 1.02, noise=0.10)
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--max-rounds", "6"], capsys)
    assert code == 3, err
    r = yaml.safe_load(out.read_text())["results"]
    low, high = r["speedup_interval"]
    assert low < 1 < high and r["rounds"] == 6 and r["confidence"] == 0.95
    for name in ("tokens_per_second", "vanilla_tokens_per_second", "streaming_tokens_per_second",
                 "speedup_over_streaming"):
        assert r[f"{name}_interval"][0] <= r[name] <= r[f"{name}_interval"][1]
    # The last measurements are the baselines: vanilla, tuned and streaming in rotating order.
    kinds = ["vanilla" if s is None else s.drafter for s in measure.calls[-18:]]
    assert kinds[:6] == ["vanilla", "vegas", "streaming", "vegas", "streaming", "vanilla"]


def test_configurations_within_noise_go_to_the_cheapest(tmp_path, monkeypatch, capsys):
    # Every gamma above 1 is equally fast: the smallest of them is chosen, the others are
    # reported as within noise; gamma 1 is measured slower and stops early.
    measure = noisy_measure(lambda spec: 1.0 if spec.gamma == 1 else 1.5)
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--gamma-candidates", "4",
                        "--sparsity-grid", "0.05"], capsys)
    assert code == 0, err
    profile = yaml.safe_load(out.read_text())
    gamma_step = profile["steps"][1]
    assert profile["tuned"]["gamma"] == gamma_step["chosen"]["gamma"] == 2
    assert sorted(row["gamma"] for row in gamma_step["within_noise"]) == [3, 4]
    chosen = gamma_step["chosen"]
    assert chosen["speedup_low"] < chosen["speedup"] < chosen["speedup_high"]
    assert chosen["speedup"] == pytest.approx(1.5, rel=0.05)
    measured = {p["gamma"]: p for p in gamma_step["predictions"]}
    assert measured[1]["measured_speedup_interval"][1] < 1.5


def test_resume_refuses_another_workload_and_new_study_replaces_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", noisy_measure(lambda s: 1.3))
    out, storage = tmp_path / "p.yaml", str(tmp_path / "s.journal")
    base = [*FAST, "--out", str(out), "--storage", storage]
    code, _, err = run(base, capsys)
    assert code == 0, err
    code, _, err = run([*base, "--max-new-tokens", "16", "--dataset", "code", "--resume"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "max_new_tokens: 12 then, 16 now" in err and "dataset: 'mixed' then, 'code' now" in err
    assert yaml.safe_load(out.read_text())["workload"]["max_new_tokens"] == 12  # untouched
    code, _, err = run([*base, "--max-new-tokens", "16", "--new-study"], capsys)
    assert code == 0, err
    assert yaml.safe_load(out.read_text())["workload"]["max_new_tokens"] == 16
    code, _, err = run([*base, "--max-new-tokens", "16", "--resume"], capsys)
    assert code == 0, err  # same workload: resumes (nothing left to measure)


def test_a_run_that_failed_on_its_first_trial_needs_no_resume(tmp_path, monkeypatch, capsys):
    def broken(self, spec, report=None):
        raise RuntimeError("a bug in the first trial")

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", broken)
    base = [*FAST, "--out", str(tmp_path / "p.yaml"), "--storage", str(tmp_path / "s.journal")]
    code, _, err = run(base, capsys)
    assert code == 1 and "a bug in the first trial" in err
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", noisy_measure(lambda s: 1.3))
    code, _, err = run(base, capsys)
    assert code == 0, err


def test_too_short_a_workload_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    def never(self, spec, report=None):
        raise AssertionError("measured a workload that should have been refused")

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", never)
    code, _, err = run([*FAST, "--out", str(tmp_path / "p.yaml"), "--max-new-tokens", "3"],
                       capsys)
    assert code == 2 and "--max-new-tokens 3 is too few" in err and err.count("\n") == 1


def test_bench_measures_rounds_and_reports_an_interval(capsys):
    code, out, err = run(["bench", "--model", "dummy:tiny", "--ctx", "256", "--gamma", "2",
                          "--min-tokens", "8", "--max-new-tokens", "12", "--device", "cpu",
                          "--rounds", "2", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    low, high = result["speedup_interval"]
    assert low <= result["speedup"] <= high
    assert result["measured"]["rounds"] == 2
    assert len(result["measured"]["round_vanilla_tokens_per_second"]) == 2
    code, _, err = run(["bench", "--model", "dummy:tiny", "--rounds", "1"], capsys)
    assert code == 2 and "--rounds must be at least 2" in err


def test_too_short_a_workload_from_the_environment_names_the_variable(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VEGAS_TUNE_MAX_NEW_TOKENS", "5")
    argv = [a for a in FAST if a not in ("--max-new-tokens", "12")]
    code, _, err = run([*argv, "--out", str(tmp_path / "p.yaml")], capsys)
    assert code == 2 and "VEGAS_TUNE_MAX_NEW_TOKENS 5 is too few" in err, err


def batch_aware_measure(speedup_at, noise: float = 0.02, seed: int = 0, fail_at=()):
    """A fake ``Measurer.measure`` that knows its batch size: vanilla at 100 tokens/s per
    sequence, a configuration ``speedup_at(batch, spec)`` times that; sizes in
    ``fail_at`` run out of memory."""
    rng = random.Random(seed)

    def measure(self, spec, report=None):
        batch = self.workload.batch_size
        measure.calls.append((batch, spec))
        measure.prompts[batch] = {tuple(ids) for b in self.workload.batches() for ids in b}
        if batch in fail_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")
        factor = math.exp(rng.gauss(0.0, noise)) * 100.0 * batch
        if spec is None:
            return fake_measurement(factor, 1.0, 0)
        return fake_measurement(factor * speedup_at(batch, spec), 2.0, spec.gamma)

    measure.calls = []
    measure.prompts = {}  # batch size -> the distinct prompts its batches decode
    return measure


def test_batch_list_measures_acceptance_once_and_writes_a_schedule(tmp_path, monkeypatch,
                                                                    capsys):
    # Vegas loses at batch 1 and wins from batch 4 up, as K/V reads grow with the batch.
    measure = batch_aware_measure(lambda batch, spec: 0.8 if batch < 4 else 1.6)
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--batch-size", "8,1,4"], capsys)
    assert code == 0, err
    profile = yaml.safe_load(out.read_text())
    assert profile["workload"]["batch_sizes"] == [1, 4, 8]
    ranges = [(e["batch_min"], e["batch_max"], e["batch_size"]) for e in profile["schedule"]]
    assert ranges == [(1, 3, 1), (4, 7, 4), (8, 8, 8)]
    configs = [e["config"] for e in profile["schedule"]]
    assert configs[0] == "vanilla" and configs[1]["drafter"] == configs[2]["drafter"] == "vegas"
    assert "below 1" in profile["schedule"][0]["reason"]
    assert profile["recommended"] is True and profile["workload"]["batch_size"] == 8
    serve = profile["exports"]["vllm"]["serve_config"]
    assert serve["max-num-seqs"] == 8 and serve["max-model-len"] == 512 + 12
    # Step 1 (acceptance) ran once, at the smallest size, not once per size.
    step1 = [(b, s) for b, s in measure.calls if s is not None and s.gamma == 4
             and s.sparsity in (0.05, 0.2)][:2]
    assert {b for b, _ in step1} == {1}
    sparsity_steps = [s for s in profile["steps"] if s["name"] == "sparsity"]
    assert len(sparsity_steps) == 1 and sparsity_steps[0]["batch_size"] is None
    assert sorted(s["batch_size"] for s in profile["steps"] if s["name"] == "gamma") == [1, 4, 8]
    # --num-prompts 2: batch 1 decodes those two; larger batches one prompt per sequence,
    # not copies of the two (their greedy sequences would be copies too).
    assert {b: len(p) for b, p in measure.prompts.items()} == {1: 2, 4: 4, 8: 8}
    assert measure.prompts[1] < measure.prompts[4] < measure.prompts[8]
    assert profile["workload"]["num_prompts"] == 8
    code, stdout, _ = run(["validate", str(out)], capsys)
    assert code == 0, stdout
    code, stdout, _ = run(["show", str(out)], capsys)
    assert code == 0 and "batch 1-3: vanilla" in stdout and "batch 4-7: vegas gamma" in stdout
    # The served concurrency picks the entry: vanilla at 2, speculative at 5.
    code, stdout, err = run(["export", str(out), "--serve-batch", "2"], capsys)
    serve = yaml.safe_load(stdout)
    assert code == 0 and serve["max-num-seqs"] == 2 and "speculative-config" not in serve
    assert "runs vanilla at batch 2" in err
    code, stdout, err = run(["export", str(out), "--serve-batch", "5"], capsys)
    serve = yaml.safe_load(stdout)
    assert code == 0 and serve["max-num-seqs"] == 5 and err == ""
    assert serve["speculative-config"]["num_speculative_tokens"] == configs[1]["gamma"]
    assert 0 < serve["speculative-config"]["sparse_attn_ratio"] < 1
    for bad in ("0", "9"):
        code, _, err = run(["export", str(out), "--serve-batch", bad], capsys)
        assert code == 2 and "lies outside the tuned sizes (1, 4, 8)" in err
        assert len(err.strip().splitlines()) == 1


def tune_1_and_4(speedup_at, tmp_path, monkeypatch, capsys):
    """A tune at batch sizes 1 and 4 (6 refine trials at 4, 1 at 1) on a fake measure:
    (the measure, with its calls, and the profile)."""
    measure = batch_aware_measure(speedup_at)
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--batch-size", "1,4",
                        "--refine-trials", "6", "--refine-trials-below", "1"], capsys)
    assert code == 0, err
    return measure, yaml.safe_load(out.read_text())


def test_the_largest_size_is_refined_and_smaller_sizes_start_from_its_choice(
        tmp_path, monkeypatch, capsys):
    # A window pays at every size: the largest size's refine finds it, and the sizes
    # below try it first instead of searching again.
    measure, profile = tune_1_and_4(lambda batch, spec: 1.2 + 0.4 * (spec.window > 0),
                                    tmp_path, monkeypatch, capsys)
    refine = {s["batch_size"]: s for s in profile["steps"] if s["name"] == "refine"}
    assert refine[4]["trials"] == 6 and refine[1]["trials"] == 1
    assert refine[4]["chosen"]["window"] > 0
    assert "starting from batch 4's choice" in refine[1]["notes"]
    # The one trial below is the largest size's score and window at batch 1's sparsity.
    gamma_1 = next(s for s in profile["steps"] if s["name"] == "gamma" and s["batch_size"] == 1)
    assert refine[1]["chosen"]["window"] == refine[4]["chosen"]["window"]
    assert refine[1]["chosen"]["sparsity"] == gamma_1["chosen"]["sparsity"]
    # The largest size was tuned first; the profile lists the steps smallest size first.
    first_at = [b for b, s in measure.calls if s is None]
    assert first_at[0] == 4, first_at
    assert [s["batch_size"] for s in profile["steps"]] == [None, 1, 1, 4, 4]
    code, _, err = run([*FAST, "--out", str(tmp_path / "q.yaml"), "--refine-trials-below",
                        "-1"], capsys)
    assert code == 2 and "--refine-trials-below must be >= 0, got -1" in err


def test_a_smaller_size_where_the_largest_sizes_choice_loses_keeps_its_own(
        tmp_path, monkeypatch, capsys):
    # A window pays at batch 4 and halves the speedup at batch 1: batch 1's one refine
    # trial is pruned against its gamma-step winner, which stands.
    _, profile = tune_1_and_4(
        lambda batch, spec: 1.2 + (0.4 if batch == 4 else -0.6) * (spec.window > 0),
        tmp_path, monkeypatch, capsys)
    assert [e["batch_size"] for e in profile["schedule"]] == [1, 4] and not profile["not_tuned"]
    at_1, at_4 = (e["config"] for e in profile["schedule"])
    assert at_4["window"] > 0 and at_1["window"] == 0.0
    assert 1.1 < profile["schedule"][0]["results"]["speedup"] < 1.3


def test_a_size_out_of_memory_is_recorded_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    measure = batch_aware_measure(lambda batch, spec: 1.5, fail_at=(8,))
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--batch-size", "1,8,2"], capsys)
    assert code == 0, err
    profile = yaml.safe_load(out.read_text())
    assert [e["batch_size"] for e in profile["schedule"]] == [1, 2]
    assert profile["not_tuned"][0]["batch_size"] == 8
    assert "out of memory" in profile["not_tuned"][0]["reason"]
    assert "not tuned: batch 8" in err


def test_time_budget_writes_the_best_profile_the_finished_trials_support(
        tmp_path, monkeypatch, capsys):
    inner = batch_aware_measure(lambda batch, spec: 1.5)

    def slow(self, spec, report=None):
        time.sleep(0.05)
        return inner(self, spec, report)

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", slow)
    clock_from_the_tuner(monkeypatch)
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--batch-size", "1,2",
                        "--time-budget", "1.2"], capsys)
    assert code in (0, 3), err
    profile = yaml.safe_load(out.read_text())
    assert profile["cut_short"] and "--time-budget" in profile["cut_short"][0]
    assert "cut short" in err
    code, stdout, _ = run(["validate", str(out)], capsys)
    assert code == 0, stdout
    # Out of time during step 1: its finished trial is all there is to say (measured
    # once, without vanilla), so the profile runs vanilla and says why.
    out = tmp_path / "q.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--time-budget", "0.01"], capsys)
    assert code == 3, err
    profile = yaml.safe_load(out.read_text())
    (entry,) = profile["schedule"]
    assert entry["config"] == "vanilla" and entry["results"]["speedup"] is None
    assert entry["results"]["rounds"] == 1 and profile["cut_short"][0].startswith("sparsity")


def test_time_budget_counts_from_the_start_of_the_run(tmp_path, monkeypatch, capsys):
    # Building the prompts takes longer than the whole budget: no trial may start. A clock
    # started after the set-up would have let the tune run (fast fake measurements).
    from vegas_tune import pipeline

    build = pipeline.load_prompts

    def slow_prompts(*args, **kwargs):
        time.sleep(2.0)
        return build(*args, **kwargs)

    monkeypatch.setattr(pipeline, "load_prompts", slow_prompts)
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure",
                        batch_aware_measure(lambda batch, spec: 1.5))
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--time-budget", "1.5"], capsys)
    assert code == 2 and "ran out before any trial finished" in err, err
    assert not out.exists()


def clock_from_the_tuner(monkeypatch):
    """Start the budget's clock when the tuner starts, so that a slow machine's set-up
    (imports, loading) does not decide where a short budget ends."""
    start = Tuner.__init__

    def now(self, *args, started=None, **kwargs):
        start(self, *args, **kwargs)

    monkeypatch.setattr(Tuner, "__init__", now)


def test_time_budget_with_no_finished_trial_exits_2_and_writes_nothing(tmp_path, monkeypatch,
                                                                        capsys):
    # Every measurement runs out of memory, slowly: the budget ends with nothing finished.
    def failing(self, spec, report=None):
        time.sleep(0.05)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", failing)
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--sparsity-grid",
                        ",".join(str(0.01 * k) for k in range(1, 30)), "--time-budget", "0.3"],
                       capsys)
    assert code == 2 and not out.exists()
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "before any trial finished" in lines[0], err
    assert "Traceback" not in err
