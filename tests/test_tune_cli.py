"""vegas-tune end to end on the tiny dummy model: tune, resume after a kill, the
subcommands, bad input, and the not-recommended and out-of-memory paths."""

from __future__ import annotations

import json
import math
import random
import re
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
from vegas_tune.space import SPREAD

# Small enough for seconds per trial on the CPU, big enough to exercise every step.
FAST = ["--model", "dummy:tiny", "--ctx", "512", "--num-prompts", "2", "--max-new-tokens", "12",
        "--probe-gamma", "4", "--budgets", "32,64", "--candidates", "2", "--device", "cpu"]
# Many sweep points: a run that is still sweeping when a test interrupts it.
MANY_BUDGETS = ",".join(str(b) for b in range(32, 512, 16))


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
    assert profile["model"]["dummy"] is True and profile["target"] == "vllm"
    names = [s["name"] for s in profile["steps"]]
    assert names[0] == "sweep" and names[-1] == "race"
    assert names[1:-1] in ([], ["extend"], ["focus"], ["extend", "focus"])
    # The sweep: vanilla, both fork selections at both budgets, and a short probe of each
    # (their drafted tokens cost differently).
    assert profile["steps"][0]["trials"] == 1 + 2 * 2 + 2
    race = profile["steps"][-1]
    raced = [p for p in race["predictions"] if p["measured_tokens_per_second"] is not None]
    # The two best (selection, budget) pairs and each drafter's two best, each at its
    # best gamma and either side: at most the four pairs of this space.
    pairs = {(p["drafter"], p["score"], p["window"], p["budget"]) for p in raced}
    assert 2 <= len(pairs) <= 4 and 2 <= len(raced) <= 12
    assert {p["drafter"] for p in raced} == {"vegas", "streaming"}
    assert profile["tuned"]["min_tokens"] in (32, 64, 128)
    assert [e["batch_size"] for e in profile["schedule"]] == [1]
    r = profile["results"]
    assert r["speedup"] == pytest.approx(r["tokens_per_second"] / r["vanilla_tokens_per_second"],
                                         rel=1e-3)
    assert profile["exports"]["vllm"]["serve_config"]["speculative-config"]["method"] == "sparse_attn"


def test_show_export_and_diff(tuned_profile, tmp_path, capsys):
    out, _, _ = tuned_profile
    code, stdout, _ = run(["show", str(out)], capsys)
    assert code == 0 and "tuned for vllm: " in stdout and " slots, gamma " in stdout
    profile = yaml.safe_load(out.read_text())
    recommended, drafter = profile["recommended"], profile["tuned"]["drafter"]
    code, stdout, err = run(["export", str(out)], capsys)  # the profile's own target: vllm
    serve = yaml.safe_load(stdout)
    # A profile that is not recommended exports vanilla serving, and says so.
    assert code == 0 and ("speculative-config" in serve) == recommended
    assert recommended or "runs vanilla" in err
    code, stdout, _ = run(["export", str(out), "--target", "vllm", "--force"], capsys)
    algorithm = {"vegas": "vegas", "streaming": "streamingllm"}[drafter]
    assert code == 0 and yaml.safe_load(stdout)["speculative-config"]["sparse_attn_algorithm"] == algorithm
    # Another target than the profile's serves what was not measured: refused, one line.
    code, _, err = run(["export", str(out), "--target", "vegas"], capsys)
    assert code == 2 and "tuned for --target vllm" in err and err.count("\n") == 1
    code, stdout, err = run(["export", str(out), "--target", "vegas", "--format", "json",
                             "--force"], capsys)
    assert code == 0 and json.loads(stdout)["drafter"] == drafter
    assert "was tuned for vllm" in err
    code, stdout, _ = run(["diff", str(out), str(out)], capsys)
    assert code == 0
    worse = yaml.safe_load(out.read_text())
    # Both throughputs halved (a slower machine or engine): the speedup, their ratio, stays.
    for results in (worse["results"], worse["schedule"][-1]["results"]):
        for name in ("tokens_per_second", "vanilla_tokens_per_second"):
            results[name] *= 0.5
            results[f"{name}_interval"] = [x * 0.5 for x in results[f"{name}_interval"]]
    worse_path = tmp_path / "worse.yaml"
    worse_path.write_text(yaml.safe_dump(worse, sort_keys=False))
    code, stdout, _ = run(["diff", str(out), str(worse_path), "--tolerance", "0.1"], capsys)
    assert code == 1 and "tokens_per_second" in stdout


def completed_trials(storage: str, study: str) -> list[tuple[int, str, float]]:
    """(number, what it measured, value) of a study's complete trials."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    try:
        s = optuna.load_study(study_name=study, storage=JournalStorage(JournalFileBackend(storage)))
    except KeyError:
        return []
    return [(t.number, t.user_attrs["claim"], t.value) for t in s.get_trials(
        deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))]


def test_killed_run_resumes_without_repeating_finished_trials(tmp_path):
    out = tmp_path / "p.yaml"
    storage = str(tmp_path / "study.journal")
    # Enough sweep points that the step is still running when the kill lands, however
    # slowly this process polls the storage on a loaded machine.
    budgets = "32,48,64,96,128,160,192,256,320,384"
    points = 1 + 2 * len(budgets.split(",")) + 2  # vanilla, 2 selections, 2 short probes
    argv = [sys.executable, "-m", "vegas_tune.cli", *FAST, "--budgets", budgets, "--ctx", "2k",
            "--num-prompts", "3", "--out", str(out), "--storage", storage,
            "--study-name", "kill"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    before = []
    while time.time() < deadline and proc.poll() is None:
        before = completed_trials(storage, "kill:sweep@1")
        if len(before) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed; make it slower"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = completed_trials(storage, "kill:sweep@1")
    assert 2 <= len(before) < points
    fresh = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert fresh.returncode == 2 and "--resume" in fresh.stderr  # refuses to overwrite
    resumed = subprocess.run([*argv, "--resume"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode in (0, 3), resumed.stderr
    after = completed_trials(storage, "kill:sweep@1")
    assert set(before) <= set(after)  # finished trials kept as they were
    claims = [claim for _, claim, _ in after]
    assert len(claims) == len(set(claims)) == points  # each point measured exactly once
    assert out.is_file()


def test_ctrl_c_exits_130_and_keeps_trials(tmp_path):
    storage = str(tmp_path / "study.journal")
    # Many sweep points: the run must still be going when the interrupt lands, however
    # slowly this process polls the storage on a loaded machine.
    argv = [sys.executable, "-m", "vegas_tune.cli", *FAST, "--ctx", "2k", "--num-prompts", "3",
            "--budgets", MANY_BUDGETS,
            "--out", str(tmp_path / "p.yaml"), "--storage", storage, "--study-name", "int"]
    # As from a terminal: SIGINT at its default, also when this test runs under a parent
    # that ignores it (a background job of a non-interactive shell), which the child would
    # inherit and Python would keep.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while time.time() < deadline and len(completed_trials(storage, "int:sweep@1")) < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "--resume" in err and "Traceback" not in err
    assert len(completed_trials(storage, "int:sweep@1")) >= 3
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
        if state == TrialState.COMPLETE:
            interrupted.append(trial_id)
            if len(interrupted) == 2:  # vanilla, then the first speculative run
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
    assert len(interrupted) == 2 and "internal error" not in err
    assert len(completed_trials(str(tmp_path / "s.journal"), "int:sweep@1")) == 2
    profile = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert any("sweep at batch 1: 2 of 7 trials finished when Ctrl-C" in line
               for line in profile["cut_short"])
    # One run beside one vanilla run has no interval: the profile runs vanilla.
    assert profile["schedule"][0]["config"] == "vanilla"


def fake_measurement(tokens_per_second: float, accepted: float = 2.0,
                     gamma: int = 4) -> Measurement:
    """A measurement of ``tokens_per_second`` whose iterations take as long as that rate
    says (8 steady iterations of 80 tokens at 100 tokens/s: 0.1 s each), so the tuner's
    cost model ranks configurations as their throughputs do."""
    rates = [0.5, 0.3, 0.1, 0.1]
    return Measurement(tokens_per_second=tokens_per_second,
                       decode_seconds=100.0 / tokens_per_second,
                       decode_tokens=int(tokens_per_second),
                       steady_seconds=80.0 / tokens_per_second,
                       steady_tokens=int(0.8 * tokens_per_second), iterations=10,
                       steady_iterations=8, prefill_seconds=0.1, wall_seconds=1.2,
                       mean_accepted_length=accepted,
                       acceptance_by_position=(rates + [0.0] * gamma)[:gamma],
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
        if spec is not None and spec.min_tokens == 64 and spec.gamma == 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return fake_measurement(120.0 if spec is not None else 100.0, gamma=spec.gamma if spec else 0)

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    out = tmp_path / "p.yaml"
    code, _, _ = run([*FAST, "--out", str(out)], capsys)
    assert code == 0
    trials = (tmp_path / "p.trials.csv").read_text()
    assert "out of memory" in trials and "FAIL" in trials


def test_out_of_memory_frees_kept_graphs_and_measures_again(tmp_path, monkeypatch, capsys):
    """A trial that runs out of memory while graphs of earlier configurations are kept
    frees them and is measured again, instead of failing."""
    failed_once, forgotten = set(), []

    def measure(self, spec, report=None):
        if spec is not None and spec.gamma == 4 and spec.min_tokens not in failed_once:
            failed_once.add(spec.min_tokens)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return fake_measurement(120.0 if spec is not None else 100.0, gamma=spec.gamma if spec else 0)

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    monkeypatch.setattr("vegas_tune.measure.Measurer.forget_kept_graphs",
                        lambda self: forgotten.append(1) or True)
    code, _, _ = run([*FAST, "--out", str(tmp_path / "p.yaml")], capsys)
    assert code == 0
    assert failed_once and len(forgotten) >= len(failed_once)
    trials = (tmp_path / "p.trials.csv").read_text()
    assert "out of memory" not in trials and "FAIL" not in trials


@pytest.mark.parametrize("argv, fragment", [
    (["--ctx", "lots"], "--ctx 'lots'"),
    (["--model", "dummy:nope"], "unknown dummy preset"),
    (["--ctx", "20k"], "maximum of 16384 positions"),
    (["--dataset", "missing.jsonl"], "not found"),
    (["--batch-size", "0"], "--batch-size '0': every size must be >= 1, got 0"),
    (["--batch-size", "1,-3"], "every size must be >= 1, got -3"),
    (["--batch-size", "1,16,16"], "16 is given twice"),
    (["--batch-size", "1,many"], "--batch-size '1,many' is not a whole number"),
    (["--budgets", "0.1,2"], "--budgets '0.1,2': give comma-separated slot counts"),
    (["--budgets", "16,64"], "every budget must be >= 32 slots"),
    (["--budgets", "512,1024"], "every budget covers the whole 512-token prompt"),
    (["--target", "sglang"], "--target 'sglang': choose one of vllm, vegas"),
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
    assert s["ctx"] == (8192,)  # config over default; tune takes a list of contexts
    assert s["num_prompts"] == 7  # env over config
    assert s["seed"] == 9  # flag over env
    assert s["model"] == "smollm2-135m"  # default
    config.write_text("ctx: [16k, 4k]\n")  # a YAML list, sorted
    assert cli.resolve_settings({}, config)["ctx"] == (4096, 16384)
    monkeypatch.setenv("VEGAS_TUNE_CTX", "8k,2k")
    assert cli.resolve_settings({}, config)["ctx"] == (2048, 8192)
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
    # The race: each of the first rounds (before anyone may drop out) measures vanilla
    # beside every candidate, in rotating order.
    profile = yaml.safe_load(out.read_text())
    before = sum(s["trials"] for s in profile["steps"] if s["name"] != "race")
    race = profile["steps"][-1]
    size = 1 + sum(p["measured_speedup"] is not None for p in race["predictions"])
    calls = measure.calls[before:]
    first = [calls[i * size:(i + 1) * size] for i in range(3)]
    assert all(sum(spec is None for spec in one) == 1 for one in first)
    assert [one.index(None) for one in first] == [0, size - 1, size - 2]
    assert sum(spec is None for spec in calls) == 6  # vanilla in every round


def test_configurations_the_data_cannot_order_are_measured_more_then_the_higher_mean_taken(
        tmp_path, monkeypatch, capsys):
    # Every configuration is equally fast: the race runs every round it may, and the pick
    # is the highest mean, whatever its gamma or budget; the others are within noise.
    measure = noisy_measure(lambda spec: 1.5)
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--candidates", "3", "--precision",
                        "0.001"], capsys)
    assert code == 0, err
    profile = yaml.safe_load(out.read_text())
    race = profile["steps"][-1]
    assert race["name"] == "race" and race["chosen"]["rounds"] == 8
    raced = [p for p in race["predictions"] if p["measured_speedup"] is not None]
    # The highest mean of those that ran every round (one that dropped out after fewer,
    # its interval below the leader's round by round, may show a higher noisy mean).
    last = [w["speedup"] for w in race["within_noise"] if w["rounds"] == 8]
    assert last and race["chosen"]["speedup"] >= max(last)
    assert len(race["within_noise"]) == len(raced) - 1
    assert "the higher mean taken" in race["notes"]


def test_a_configuration_below_the_leader_drops_out_of_the_race(tmp_path, monkeypatch, capsys):
    # One configuration is clearly fastest: the others' intervals fall below it after the
    # minimum rounds and they are measured no more.
    measure = noisy_measure(lambda spec: 2.0 if (spec.drafter, spec.min_tokens, spec.gamma)
                            == ("vegas", 64, 4) else 1.2, noise=0.01)
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--candidates", "3"], capsys)
    assert code == 0, err
    profile = yaml.safe_load(out.read_text())
    assert profile["tuned"]["gamma"] == 4 and profile["results"]["rounds"] == 3
    rows = [t for t in csv_rows(tmp_path / "p.trials.csv") if t["step"] == "race"]
    assert {int(float(t["rounds"])) for t in rows} == {3}


def test_the_best_streaming_configuration_is_what_over_streaming_compares_with(
        tmp_path, monkeypatch, capsys):
    # Streaming at the larger budget is the best streaming configuration; vegas wins.
    def speedup(spec):
        if spec.drafter == "streaming":
            return 1.2 if spec.min_tokens == 64 else 1.1
        return 1.5

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", noisy_measure(speedup, noise=0.01))
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--candidates", "4"], capsys)
    assert code == 0, err
    r = yaml.safe_load(out.read_text())["results"]
    assert r["speedup_over_streaming"] == pytest.approx(1.5 / 1.2, rel=0.03)
    assert r["tokens_per_second"] / r["streaming_tokens_per_second"] == pytest.approx(
        r["speedup_over_streaming"], rel=0.01)


def test_a_pick_on_the_edge_of_an_axis_extends_it_once_and_the_profile_names_the_edge(
        tmp_path, monkeypatch, capsys):
    # Throughput grows with the budget and with gamma: the largest budget and the probe
    # gamma are edges. The tuner measures the next budget out (twice the largest) and a
    # longer gamma, once, and the pick there is named as lying on the edge.
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", noisy_measure(
        lambda spec: 1.0 + spec.min_tokens / 100 + spec.gamma / 10, noise=0.005))
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--candidates", "2"], capsys)
    assert code == 0, err
    profile = yaml.safe_load(out.read_text())
    extend = next(s for s in profile["steps"] if s["name"] == "extend")
    assert "budget up to 128 slots" in extend["notes"] and "gamma up to 5" in extend["notes"]
    rows = [t for t in csv_rows(tmp_path / "p.trials.csv") if t["step"] == "extend"]
    assert {(int(float(t["budget"])), int(float(t["gamma"]))) for t in rows} >= {(128, 4)}
    race = profile["steps"][-1]
    assert any(edge.startswith("budget: ") for edge in race["edges"])
    assert "Search edges" in (tmp_path / "p.report.md").read_text()


def test_the_vllm_target_measures_only_what_the_fork_runs(tmp_path, monkeypatch, capsys):
    measure = noisy_measure(lambda spec: 1.4)
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out)], capsys)
    assert code == 0, err
    from vegas_tune.space import fits_target

    measured = [spec for spec in measure.calls if spec is not None]
    assert measured and all(fits_target(spec, "vllm") is None for spec in measured)
    assert {spec.drafter for spec in measured} == {"vegas", "streaming"}
    assert all(spec.spread == 0 for spec in measured)
    # The vegas target searches scores, windows and the spread too; where the spread is
    # fastest the profile runs it, and writes it, and the engine's settings carry it.
    measure = noisy_measure(lambda spec: 1.8 if spec.spread else 1.4)
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    code, _, err = run([*FAST, "--out", str(tmp_path / "q.yaml"), "--target", "vegas"], capsys)
    assert code == 0, err
    vegas = [s for s in measure.calls if s is not None and s.drafter == "vegas"]
    assert {(s.score, s.window, s.spread) for s in vegas} >= {
        ("logit", 0.0, 0), ("weight", 0.75, 0), ("logit", 0.0, SPREAD), ("weight", 0.0, SPREAD)}
    assert all(s.window == 0.0 for s in vegas if s.spread)
    written = yaml.safe_load((tmp_path / "q.yaml").read_text())
    assert written["target"] == "vegas" and written["tuned"]["spread"] == SPREAD
    assert written["exports"]["vegas"]["spread"] == SPREAD
    assert f"spread {SPREAD} (fork: 0)" in written["exports"]["vllm"]["note"]
    code, _, err = run(["validate", str(tmp_path / "q.yaml")], capsys)
    assert code == 0, err


def csv_rows(path) -> list[dict]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


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
    assert configs[0] == "vanilla" and "vanilla" not in configs[1:]
    assert "below 1" in profile["schedule"][0]["reason"]
    assert profile["recommended"] is True and profile["workload"]["batch_size"] == 8
    serve = profile["exports"]["vllm"]["serve_config"]
    assert serve["max-num-seqs"] == 8 and serve["max-model-len"] == 512 + 12
    # Each size swept and raced at its own batch size.
    for step in ("sweep", "race"):
        assert sorted(s["batch_size"] for s in profile["steps"] if s["name"] == step) == [1, 4, 8]
    # --num-prompts 2: batch 1 decodes those two; larger batches one prompt per sequence,
    # not copies of the two (their greedy sequences would be copies too).
    assert {b: len(p) for b, p in measure.prompts.items()} == {1: 2, 4: 4, 8: 8}
    assert measure.prompts[1] < measure.prompts[4] < measure.prompts[8]
    assert profile["workload"]["num_prompts"] == 8
    code, stdout, _ = run(["validate", str(out)], capsys)
    assert code == 0, stdout
    code, stdout, _ = run(["show", str(out)], capsys)
    assert code == 0 and "batch 1-3: vanilla" in stdout and "batch 4-7: " in stdout
    assert " slots, gamma " in stdout.split("batch 4-7: ")[1].splitlines()[0]
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


def test_sizes_below_the_largest_sweep_the_selections_it_raced(tmp_path, monkeypatch, capsys):
    # The vegas target: nine selections. The largest size sweeps them all; the sizes below
    # it sweep the ones the largest size raced, and streaming.
    measure = batch_aware_measure(lambda batch, spec: 1.2 + 0.3 * spec.window)
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--batch-size", "1,4", "--target", "vegas",
                        "--candidates", "2"], capsys)
    assert code == 0, err

    def swept(batch):
        return {(s.drafter, s.score if s.drafter == "vegas" else None, s.window)
                for b, s in measure.calls if b == batch and s is not None and s.gamma == 4}

    assert len(swept(4)) == 9
    raced = {(s["drafter"], s["score"] if s["drafter"] == "vegas" else None, s["window"])
             for s in csv_rows(tmp_path / "p.trials.csv")
             if s["step"] == "race" and s["batch_size"] == "4" and s["config"] != "vanilla"}
    raced = {(d, sc, float(w)) for d, sc, w in raced}
    assert swept(1) == raced | {("streaming", None, 0.0)} and len(swept(1)) < 9
    # The largest size was tuned first; the profile lists the steps smallest size first.
    first_at = [b for b, s in measure.calls if s is None]
    assert first_at[0] == 4, first_at
    profile = yaml.safe_load(out.read_text())
    batches = [s["batch_size"] for s in profile["steps"]]
    assert batches == sorted(batches) and set(batches) == {1, 4}


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
    # The budget's clock moves only with measurements (0.05 s each), so where the budget
    # ends does not depend on how busy the machine running the test is.
    clock = [1000.0]

    def slow(self, spec, report=None):
        clock[0] += 0.05
        return inner(self, spec, report)

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", slow)
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
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
    # Out of time during the sweep: its fastest finished run beside its vanilla run is all
    # there is to say (one round each, no interval), so the profile runs vanilla.
    out = tmp_path / "q.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--time-budget", "0.18"], capsys)
    assert code == 3, err
    profile = yaml.safe_load(out.read_text())
    (entry,) = profile["schedule"]
    assert entry["config"] == "vanilla" and entry["results"]["speedup_interval"] is None
    assert entry["results"]["rounds"] == 1 and profile["cut_short"][0].startswith("sweep")


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
    code, _, err = run([*FAST, "--out", str(out), "--budgets", MANY_BUDGETS,
                        "--time-budget", "0.3"], capsys)
    assert code == 2 and not out.exists()
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "before any trial finished" in lines[0], err
    assert "Traceback" not in err


def test_cpu_out_of_memory_is_a_failed_trial_not_an_internal_error(tmp_path, monkeypatch,
                                                                  capsys):
    # The CPU allocator raises a RuntimeError, not torch.OutOfMemoryError: still a size
    # that did not fit, recorded in the profile, while the other sizes go on.
    inner = batch_aware_measure(lambda batch, spec: 1.5)

    def cpu_allocator(self, spec, report=None):
        if self.workload.batch_size == 8:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                               "DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 68719476736 bytes. Error code 12")
        return inner(self, spec, report)

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", cpu_allocator)
    out = tmp_path / "p.yaml"
    code, _, err = run([*FAST, "--out", str(out), "--batch-size", "1,8"], capsys)
    assert code == 0, err
    profile = yaml.safe_load(out.read_text())
    assert [e["batch_size"] for e in profile["schedule"]] == [1]
    (item,) = profile["not_tuned"]
    assert item["batch_size"] == 8 and "out of memory" in item["reason"]
    assert "can't allocate memory" in item["reason"]


def context_aware_measure(speedup_at, noise: float = 0.02, seed: int = 0, stop_at=None):
    """A fake ``Measurer.measure`` that knows its context (the prompts' length) and batch
    size: vanilla at 100 tokens/s per sequence, a configuration ``speedup_at(ctx, batch,
    spec)`` times that; the calls are recorded as ``measure.calls`` (ctx, batch, spec).
    The first call at context ``stop_at`` raises KeyboardInterrupt (Ctrl-C)."""
    rng = random.Random(seed)

    def measure(self, spec, report=None):
        ctx = len(self.workload.prompts[0].ids)
        batch = self.workload.batch_size
        if ctx == stop_at:
            raise KeyboardInterrupt
        measure.calls.append((ctx, batch, spec))
        factor = math.exp(rng.gauss(0.0, noise)) * 100.0 * batch
        if spec is None:
            return fake_measurement(factor, 1.0, 0)
        return fake_measurement(factor * speedup_at(ctx, batch, spec), 2.0, spec.gamma)

    measure.calls = []
    return measure


def test_a_context_list_tunes_each_context_and_writes_context_bands(tmp_path, monkeypatch,
                                                                     capsys):
    # Vegas loses at the short context and batch 1 only; a window share helps, so the
    # race's picks differ by selection.
    def speedup(ctx, batch, spec):
        return (0.8 if ctx == 256 and batch == 1 else 1.4 + 0.2 * batch / 4) + 0.3 * spec.window

    measure = context_aware_measure(speedup)
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    out = tmp_path / "p.yaml"
    # Three rounds a race: enough for intervals, and a test of seconds.
    quick = ["--batch-size", "1,4", "--target", "vegas", "--max-rounds", "3"]
    code, _, err = run([*FAST, *quick, "--out", str(out), "--ctx", "512,256", "--storage",
                        str(tmp_path / "s.journal"), "--study-name", "two"], capsys)
    assert code == 0, err
    profile = yaml.safe_load(out.read_text())
    assert profile["workload"]["contexts"] == [256, 512] and profile["workload"]["ctx"] == 512
    bands = [(e["ctx_min"], e["ctx_max"], e["ctx"], e["batch_min"], e["batch_max"],
              e["batch_size"]) for e in profile["schedule"]]
    assert bands == [(1, 362, 256, 1, 3, 1), (1, 362, 256, 4, 4, 4),
                     (363, 512, 512, 1, 3, 1), (363, 512, 512, 4, 4, 4)]
    assert profile["schedule"][0]["config"] == "vanilla"
    assert "vanilla" not in [e["config"] for e in profile["schedule"][1:]]
    assert profile["workload"]["batch_size"] == 4 and profile["recommended"] is True
    assert profile["exports"]["vllm"]["serve_config"]["max-model-len"] == 512 + 12
    code, stdout, _ = run(["validate", str(out)], capsys)
    assert code == 0, stdout
    # Each context's prompts are as long as it; the longest context and largest size
    # are tuned first, then the shortest context.
    assert {ctx for ctx, _, _ in measure.calls} == {256, 512}
    assert [(c, b) for c, b, s in measure.calls if s is None][0] == (512, 4)
    first_short = next(i for i, (c, _, _) in enumerate(measure.calls) if c == 256)
    assert all(c == 256 for c, _, _ in measure.calls[first_short:])

    def swept(ctx, batch):
        return {(s.drafter, s.score if s.drafter == "vegas" else None, s.window)
                for c, b, s in measure.calls
                if (c, b) == (ctx, batch) and s is not None and s.gamma == 4}

    # The first point sweeps every selection; every other point, at either context,
    # the ones it raced, and streaming.
    race = next(s for s in profile["steps"] if s["name"] == "race" and s["ctx"] == 512
                and s["batch_size"] == 4)
    raced = {(p["drafter"], p["score"] if p["drafter"] == "vegas" else None, p["window"])
             for p in race["predictions"] if p["measured_tokens_per_second"] is not None}
    assert len(swept(512, 4)) == 9
    for point in ((512, 1), (256, 4), (256, 1)):
        assert swept(*point) == raced | {("streaming", None, 0.0)}, point
    # Steps, studies and trials name their context; the steps run shortest context first.
    assert [s["ctx"] for s in profile["steps"]] == sorted(s["ctx"] for s in profile["steps"])
    assert {s["study"] for s in profile["steps"] if s["name"] == "sweep"} == {
        f"two:sweep@{b}/ctx{c}" for c in (256, 512) for b in (1, 4)}
    assert {row["ctx"] for row in csv_rows(tmp_path / "p.trials.csv")} == {"256", "512"}
    assert "step sweep @ ctx 256, batch 1" in err
    report = (tmp_path / "p.report.md").read_text()
    assert "## Schedule by context and batch size" in report
    assert "| ctx 1-362, batch 1-3 | 1 at ctx 256 | vanilla |" in report
    code, stdout, _ = run(["show", str(out)], capsys)
    # The schedule as a table: a row per batch range, a column per context band.
    assert code == 0 and "ctx 363 and above (tuned 512)" in stdout
    assert re.search(r"^\s+4 and above\s+K \d", stdout, re.M), stdout

    # One context: the profile it always was (no context keys, the same study names), and
    # its schedule is the longest context's band above, measured the same way first.
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", context_aware_measure(speedup))
    one = tmp_path / "one.yaml"
    code, _, err = run([*FAST, *quick, "--out", str(one), "--ctx", "512", "--storage",
                        str(tmp_path / "one.journal"), "--study-name", "one"], capsys)
    assert code == 0, err
    single = yaml.safe_load(one.read_text())
    assert "contexts" not in single["workload"] and not single["not_tuned"]
    for item in (*single["schedule"], *single["steps"]):
        assert not {"ctx", "ctx_min", "ctx_max"} & set(item), item
    assert {s["study"] for s in single["steps"] if s["name"] == "sweep"} == {
        "one:sweep@1", "one:sweep@4"}
    assert "ctx" not in csv_rows(tmp_path / "one.trials.csv")[0]
    longest = [{k: v for k, v in e.items() if k not in ("ctx_min", "ctx_max", "ctx")}
               for e in profile["schedule"] if e["ctx"] == 512]
    assert single["schedule"] == longest


def test_a_context_list_cut_short_resumes_keeping_the_finished_context(tmp_path, monkeypatch, capsys):
    def speedup(ctx, batch, spec):
        return 1.5

    out, storage = tmp_path / "p.yaml", str(tmp_path / "s.journal")
    argv = [*FAST, "--out", str(out), "--ctx", "256,512", "--storage", storage,
            "--study-name", "cut"]
    # Ctrl-C at the first measurement of the second context: the first is finished.
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure",
                        context_aware_measure(speedup, stop_at=256))
    code, _, err = run(argv, capsys)
    assert code == 130, err
    profile = yaml.safe_load(out.read_text())
    assert profile["workload"]["contexts"] == [512]
    assert [e["ctx"] for e in profile["schedule"]] == [512]
    assert profile["not_tuned"] == [{"batch_size": 1, "ctx": 256,
                                     "reason": "not reached: the run was cut short"}]
    assert "sweep at batch 1 at ctx 256" in profile["cut_short"][0]
    code, stdout, _ = run(["validate", str(out)], capsys)
    assert code == 0, stdout
    finished = completed_trials(storage, "cut:sweep@1/ctx512")
    assert finished
    # Resumed: the longest context's trials are kept, not measured again.
    resumed = context_aware_measure(speedup)
    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", resumed)
    code, _, err = run([*argv, "--resume"], capsys)
    assert code == 0, err
    assert resumed.calls and {ctx for ctx, _, _ in resumed.calls} == {256}
    assert completed_trials(storage, "cut:sweep@1/ctx512") == finished
    profile = yaml.safe_load(out.read_text())
    assert [e["ctx"] for e in profile["schedule"]] == [256, 512] and not profile["not_tuned"]
