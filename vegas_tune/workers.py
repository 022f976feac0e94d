"""``vegas-tune --devices``: one tuning worker per device on one study, one profile.

The parent process loads no model. It settles the study (refuses, resumes or discards it,
as one run would), then starts a ``vegas-tune`` worker per device with the same
settings, the same storage and study name and ``--resume``: the workers split the
trials through the storage (see ``vegas_tune.tuner``). A GPU worker sees its GPU alone
(``CUDA_VISIBLE_DEVICES``), so graphs, kernels and the hardware fingerprint are those of
one GPU; CPU workers share the cores. The workers' progress lines are relayed with the
device in front. Each worker writes its profile in a folder of its own; every worker
chooses from the same trials, so the profiles agree, and the parent moves the first
finished worker's files to ``--out``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from vegas_core.errors import VegasError
from vegas_core.yamlio import read_yaml_file

log = logging.getLogger("vegas_tune")

# Set by the parent in each worker's environment: the worker's index. A worker ignores
# --devices and --new-study (the parent has handled both), wherever they came from.
WORKER_ENV = "VEGAS_TUNE_WORKER"
# The parent's command line, for the worker's profile provenance.
COMMAND_ENV = "VEGAS_TUNE_WORKER_COMMAND"
# Exit codes of a worker that finished with a profile (recommended or not) or was
# interrupted after writing one.
PROFILE_CODES = (0, 3, 130)
# The profile fields every worker must agree on.
AGREED_FIELDS = ("recommended", "tuned", "schedule", "not_tuned")


def parse_devices(text: str) -> list[str]:
    """``all``, or a comma-separated list of ``cpu``, ``cuda`` and ``cuda:N`` (``cpu``
    may repeat: CPU workers share the cores)."""
    text = str(text).strip()
    if text == "all":
        return ["all"]
    devices = [d.strip() for d in text.split(",")]
    for d in devices:
        index = d.partition(":")[2]
        if not (d == "cpu" or d == "cuda" or (d.startswith("cuda:") and index.isdigit())):
            raise VegasError(f"--devices '{text}': '{d}' is not a device; give all, or a "
                             "comma-separated list of cuda:N (or cpu)")
    gpus = [_gpu_index(d) for d in devices if d != "cpu"]
    if len(set(gpus)) != len(gpus):
        raise VegasError(f"--devices '{text}': a GPU is listed twice; one worker per GPU")
    return devices


def _gpu_index(device: str) -> int:
    return int(device.partition(":")[2] or 0)


def resolve_devices(devices: list[str]) -> list[str]:
    """``all`` -> every visible GPU; checks that each listed GPU exists."""
    count = torch.cuda.device_count()
    if devices == ["all"]:
        if count == 0:
            raise VegasError("--devices all: no GPU is visible here; list CPU workers "
                             "(--devices cpu,cpu) or leave --devices out")
        return [f"cuda:{i}" for i in range(count)]
    for d in devices:
        if d != "cpu" and _gpu_index(d) >= count:
            raise VegasError(f"--devices: {d} does not exist here ({count} GPUs visible)")
    return devices


def worker_argv(argv: list[str], device: str, storage: str, study_name: str,
                out: Path) -> list[str]:
    """The parent's tune arguments for one worker: without --devices and --new-study,
    with its device, the shared storage and study, --resume, its own --out and --json."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--devices":
            skip = True
            continue
        if arg.startswith("--devices=") or arg == "--new-study":
            continue
        kept.append(arg)
    if kept and kept[0] == "tune":
        kept = kept[1:]
    return ["tune", *kept, "--device", "cuda" if device.startswith("cuda") else device,
            "--storage", storage, "--study-name", study_name, "--resume",
            "--out", str(out), "--json"]


class _Relay(threading.Thread):
    """Copies a worker's stderr to ours, line by line, with its device in front."""

    def __init__(self, stream, prefix: str) -> None:
        super().__init__(daemon=True)
        self.stream, self.prefix = stream, prefix
        self.last = ""

    def run(self) -> None:
        for line in self.stream:
            line = line.rstrip("\n")
            if line:
                self.last = line
                sys.stderr.write(f"{self.prefix} {line.removeprefix('vegas-tune: ')}\n")
                sys.stderr.flush()


def run_workers(devices: list[str], argv: list[str], out: Path, storage: str,
                study_name: str, command: str) -> tuple[dict | None, int]:
    """Run one worker per device to the end; move one worker's files to ``out``.
    -> (that worker's summary, exit code)."""
    cpu_workers = devices.count("cpu")
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.stem}.workers-", dir=out.parent))
    procs, relays, outs = [], [], []
    try:
        for i, device in enumerate(devices):
            folder = scratch / f"worker-{i}"
            folder.mkdir()
            worker_out = folder / out.name
            if out.exists():  # the profile being replaced, for the report's comparison
                shutil.copy2(out, worker_out)
            env = {**os.environ, WORKER_ENV: str(i), COMMAND_ENV: command}
            if device.startswith("cuda"):
                env["CUDA_VISIBLE_DEVICES"] = str(_gpu_index(device))
            else:
                env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cpu_workers))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "vegas_tune.cli",
                 *worker_argv(argv, device, storage, study_name, worker_out)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
            relays.append(_Relay(procs[-1].stderr, f"[{device} #{i}]"))
            relays[-1].start()
            outs.append(worker_out)
        log.info("started %d workers (%s) on study %s in %s", len(devices),
                 ", ".join(devices), study_name, storage)
        results = _wait(procs)
        for relay in relays:
            relay.join(timeout=5)
        return _collect(results, relays, outs, devices, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _wait(procs) -> list[tuple[int, str]]:
    """(exit code, stdout) of each worker. Ctrl-C reaches the workers from the terminal;
    when only the parent got it, it is passed on, and the workers are awaited."""
    results = []
    for proc in procs:
        while True:
            try:
                stdout, _ = proc.communicate()
                break
            except KeyboardInterrupt:
                for other in procs:
                    if other.poll() is None:
                        other.send_signal(signal.SIGINT)
        results.append((proc.returncode, stdout))
    return results


def _collect(results, relays, outs, devices, out: Path) -> tuple[dict | None, int]:
    summaries = {}
    for i, (code, stdout) in enumerate(results):
        if code in PROFILE_CODES and outs[i].exists():
            try:
                summaries[i] = json.loads(stdout)
            except json.JSONDecodeError:
                pass
    failed = [(i, code) for i, (code, _) in enumerate(results) if code not in PROFILE_CODES]
    for i, code in failed:
        log.warning("worker %d (%s) exited with %d: %s", i, devices[i], code,
                    relays[i].last or "no output")
    if not summaries:
        if any(code == 130 for code, _ in results):
            raise KeyboardInterrupt
        i, code = failed[0] if failed else (0, results[0][0])
        error = VegasError(f"no worker wrote a profile; worker {i} ({devices[i]}) exited with "
                           f"{code}: {relays[i].last or 'no output'}")
        error.exit_code = code
        raise error
    first = min(summaries)
    _check_agreement(outs, summaries, devices)
    summary = _move_files(outs[first], out, summaries[first])
    codes = {results[i][0] for i in summaries}
    code = 130 if 130 in codes else results[first][0]
    if failed and code != 130:
        code = failed[0][1]
    return summary, code


def _check_agreement(outs, summaries, devices) -> None:
    """Workers choose from the same trials: their profiles agree. Say so if not."""
    profiles = {i: read_yaml_file(outs[i], "profile") for i in summaries}
    first = min(profiles)
    for i, profile in profiles.items():
        differing = [k for k in AGREED_FIELDS if profile.get(k) != profiles[first].get(k)]
        if differing:
            log.warning("worker %d (%s) wrote a profile that differs from worker %d's in %s",
                        i, devices[i], first, ", ".join(differing))


def _move_files(worker_out: Path, out: Path, summary: dict) -> dict:
    """Move a worker's profile and the files beside it (same stem) to ``out``'s place;
    the summary's paths follow."""
    moved = {}
    out.parent.mkdir(parents=True, exist_ok=True)
    for path in worker_out.parent.iterdir():
        if path.name.startswith(worker_out.stem):
            target = out.parent / (out.stem + path.name[len(worker_out.stem):])
            os.replace(path, target)
            moved[str(path)] = str(target)
    summary = dict(summary)
    summary["profile"] = str(out)
    summary["files"] = {k: moved.get(v, v) for k, v in summary.get("files", {}).items()}
    return summary
