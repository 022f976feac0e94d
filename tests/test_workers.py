"""Several tuning workers on one study: a journal file and a real PostgreSQL server,
``--devices`` with two CPU workers, a worker killed mid-trial, and a worker on other
hardware refused."""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.test_tune_cli import FAST, fake_measurement, run

BUDGETS = "32,48,64,96"
# FAST without its --device: --devices gives each worker one.
ANY_DEVICE = [a for i, a in enumerate(FAST) if "--device" not in FAST[max(i - 1, 0):i + 1]]
# Long enough decoding that a trial is still running when the test looks for one.
SLOW = ["--max-new-tokens", "40"]
AGREED = ("recommended", "tuned", "schedule", "not_tuned", "steps")
# Two workers share the machine's cores, as --devices makes CPU workers do.
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def tune_argv(storage: str, out: Path, *extra: str, devices: str | None = None) -> list[str]:
    device = ["--devices", devices] if devices else ["--device", "cpu"]
    return [sys.executable, "-m", "vegas_tune.cli", *ANY_DEVICE, *device, "--budgets",
            BUDGETS, "--storage", storage, "--study-name", "shared", "--out", str(out), *extra]


def open_storage(url: str):
    from vegas_tune.studies import open_storage as tuner_storage

    return tuner_storage(url)


def studies(url: str) -> dict[str, list]:
    """Study name -> its trials, for the study named "shared"."""
    import optuna

    storage = open_storage(url)
    return {s.study_name: optuna.load_study(study_name=s.study_name, storage=storage).trials
            for s in optuna.get_all_study_summaries(storage)
            if s.study_name.startswith("shared:")}


def assert_measured_once(url: str) -> dict[str, list]:
    """Every claim (sweep and extend point, race) was measured by exactly one finished
    trial; the sweep is whole."""
    from optuna.trial import TrialState

    found = studies(url)
    for name, trials in found.items():
        finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
        claims = collections.Counter(t.user_attrs["claim"] for t in finished)
        assert claims and max(claims.values()) == 1, (name, claims)
        assert not any(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in trials)
    swept = [t for t in found["shared:sweep@1"] if t.state == TrialState.COMPLETE]
    # vanilla, two selections x the budgets, a short probe of each
    assert len(swept) == 1 + 2 * len(BUDGETS.split(",")) + 2
    assert len([t for t in found["shared:race@1"] if t.state == TrialState.COMPLETE]) == 1
    return found


def workers_of(found: dict[str, list]) -> set[str]:
    return {t.user_attrs["worker"] for trials in found.values() for t in trials
            if "worker" in t.user_attrs and "backed_off" not in t.user_attrs}


def test_resuming_a_study_another_worker_is_creating_is_allowed(tmp_path):
    """Two workers started together: one has created the study and not yet recorded its
    fingerprint. The other resumes it; a study with finished trials and no fingerprint
    (made by an older vegas-tune) is still refused."""
    import optuna

    from vegas_core.errors import VegasError
    from vegas_tune.studies import check_study, open_storage

    storage = open_storage(str(tmp_path / "s.journal"))
    study = optuna.create_study(storage=storage, study_name="shared:sweep@1")
    fingerprint = {"ctx": 64}
    check_study(storage, "s.journal", "shared", resume=True, new_study=False,
                fingerprint=fingerprint)
    study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=1.0))
    with pytest.raises(VegasError, match="older vegas-tune"):
        check_study(storage, "s.journal", "shared", resume=True, new_study=False,
                    fingerprint=fingerprint)


def test_two_workers_on_a_journal_split_the_work_and_write_the_same_profile(tmp_path):
    storage = str(tmp_path / "shared.journal")
    procs = [subprocess.Popen(tune_argv(storage, tmp_path / f"w{i}.yaml", "--resume"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=ONE_THREAD) for i in range(2)]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] in ([0, 0], [3, 3]), errors
    found = assert_measured_once(storage)
    assert len(workers_of(found)) == 2  # both measured
    profiles = [yaml.safe_load((tmp_path / f"w{i}.yaml").read_text()) for i in range(2)]
    for key in AGREED:
        assert profiles[0][key] == profiles[1][key], key


def test_devices_runs_two_cpu_workers_on_postgresql(tmp_path, postgres_url):
    out = tmp_path / "p.yaml"
    proc = subprocess.run(tune_argv(postgres_url, out, "--json", devices="cpu,cpu"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 3), proc.stderr
    assert "[cpu #0]" in proc.stderr and "[cpu #1]" in proc.stderr  # combined progress
    assert "differs" not in proc.stderr  # the workers' profiles agreed
    summary = json.loads(proc.stdout)
    assert summary["profile"] == str(out) and out.is_file()
    assert Path(summary["files"]["report"]).parent == tmp_path
    assert not list(tmp_path.glob(".p.workers-*"))  # the workers' folders are gone
    found = assert_measured_once(postgres_url)
    assert len(workers_of(found)) == 2
    profile = yaml.safe_load(out.read_text())
    assert "--devices cpu,cpu" in profile["provenance"]["command"]


def test_a_worker_killed_mid_trial_loses_that_trial_only(tmp_path):
    from optuna.trial import TrialState

    storage = str(tmp_path / "shared.journal")
    first = subprocess.Popen(tune_argv(storage, tmp_path / "a.yaml", "--resume", *SLOW),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=ONE_THREAD)
    victim = subprocess.Popen(tune_argv(storage, tmp_path / "b.yaml", "--resume", *SLOW),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=ONE_THREAD)
    mine = f":{victim.pid}"
    deadline = time.time() + 300
    killed = None
    while killed is None and time.time() < deadline and victim.poll() is None:
        for name, trials in studies(storage).items() if os.path.exists(storage) else []:
            running = [t for t in trials if t.state == TrialState.RUNNING
                       and t.user_attrs.get("worker", "").endswith(mine)
                       and "claim" in t.user_attrs]
            if running:
                victim.send_signal(signal.SIGKILL)
                killed = (name, running[0].number, running[0].user_attrs["claim"])
                break
        time.sleep(0.05)
    assert killed is not None, "the second worker never ran a trial"
    victim.wait()
    _, err = first.communicate(timeout=600)
    assert first.returncode in (0, 3), err
    found = assert_measured_once(storage)
    name, number, claim = killed
    dead = next(t for t in found[name] if t.number == number)
    assert dead.state == TrialState.FAIL
    # The other worker measured that configuration after all.
    assert any(t.user_attrs.get("claim") == claim and t.state == TrialState.COMPLETE
               for t in found[name])


def test_a_trial_that_never_named_its_worker_is_failed_once_it_is_old(tmp_path, monkeypatch):
    """A process killed between optuna starting a trial and the objective's first line
    leaves a RUNNING trial with no worker: a resumed run must not wait for it forever."""
    import optuna
    from optuna.trial import TrialState

    from vegas_tune import studies as tuner

    study = optuna.create_study(storage=open_storage(str(tmp_path / "s.journal")),
                                study_name="orphan")
    orphan = study.ask()  # RUNNING, no worker named
    named = study.ask()
    named.set_user_attr("worker", f"{socket.gethostname()}:{os.getppid()}")  # alive
    tuner._fail_dead_local_trials(study)
    assert {t.state for t in study.get_trials()} == {TrialState.RUNNING}  # too young
    monkeypatch.setattr(tuner, "UNNAMED_TRIAL_SECONDS", -1)
    tuner._fail_dead_local_trials(study)
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {orphan.number: TrialState.FAIL, named.number: TrialState.RUNNING}


def test_a_worker_on_other_hardware_is_refused(tmp_path, monkeypatch, capsys):
    import vegas_tune.pipeline as pipeline
    from vegas_tune.hardware import fingerprint

    calls = []

    def measure(self, spec, report=None):
        calls.append(spec)
        return fake_measurement(120.0 if spec is not None else 100.0,
                                gamma=spec.gamma if spec else 0)

    monkeypatch.setattr("vegas_tune.measure.Measurer.measure", measure)
    argv = [*FAST, "--storage", str(tmp_path / "s.journal"), "--study-name", "gpu",
            "--out", str(tmp_path / "p.yaml")]
    code, _, _ = run(argv, capsys)
    assert code in (0, 3)
    other = {**fingerprint("cpu"), "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_memory_gb": 79.1,
             "driver": "550.54", "cuda": "12.4"}
    monkeypatch.setattr(pipeline, "fingerprint", lambda device: other)
    calls.clear()
    code, _, err = run([*argv, "--resume"], capsys)
    assert code == 2 and not calls
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: study 'gpu'") and "NVIDIA H100 80GB HBM3" in line
    assert "must share one hardware type" in line


@pytest.mark.parametrize("devices, fragment", [
    ("gpu0", "'gpu0' is not a device"),
    ("cuda:0,cuda:0", "a GPU is listed twice"),
    ("all", "no GPU is visible here"),
    ("cuda:3", "cuda:3 does not exist here"),
])
def test_bad_devices_are_refused_in_one_line(devices, fragment, tmp_path, capsys):
    import torch

    if torch.cuda.is_available() and devices in ("all", "cuda:3"):
        pytest.skip("this case needs a machine without GPUs")
    code, _, err = run([*ANY_DEVICE, "--devices", devices, "--out", str(tmp_path / "p.yaml")],
                       capsys)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1


def test_devices_and_device_together_are_refused(tmp_path, capsys):
    code, _, err = run([*FAST, "--devices", "cpu,cpu", "--out", str(tmp_path / "p.yaml")],
                       capsys)
    assert code == 2 and "--devices and --device: give one of them" in err
