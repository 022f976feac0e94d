"""The optuna side of tuning: storages, studies, and trials that several workers share.

Each step of a tune is an optuna study named ``<study-name>:<step>`` (``@<batch>`` for a
per-size step, then ``/ctx<tokens>`` in a tune of several contexts) in one storage. ``Studies`` runs a step's trials: a grid of queued points
(each measured once, whoever measures it) or sampled trials, until the step has its
trials and no worker has one of them running.

Several workers (processes, hosts) may share one storage and study. Each trial claims
what it measures (a ``claim`` key: the configuration and batch size) before measuring,
and the lowest-numbered live trial of a claim measures it: a later one backs off (failed,
with its reason in ``backed_off``), so every point is measured once. A trial left running
by a dead worker is marked failed (at once on the same host, by the RDB heartbeat
elsewhere; anywhere, once it has gone UNNAMED_TRIAL_SECONDS without naming its worker,
which a live worker does as the trial starts) and its configuration queued again. Every
step ends when no worker has a trial of it running, so each worker chooses from the same
trials and writes the same profile.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import logging
import os
import socket
import time
import warnings
from collections.abc import Callable

import torch

from vegas_core.errors import VegasError
from vegas_tune.interrupts import DeferredInterrupts
from vegas_tune.progress import ProgressCallback, ProgressEvent

log = logging.getLogger("vegas_tune")
# optuna is imported inside the functions that use it (here, in steps and in tuner): it
# takes 0.2 s and SQLAlchemy with it, which the commands that only read profiles
# (validate, show, diff, export) and the engine's own imports do without.

# How long a worker waits for other workers' running trials before giving up on them.
WAIT_FOR_OTHERS_SECONDS = 3600
POLL_SECONDS = 1
# How long a claim waits for a lower-numbered running trial to say what it measures (a
# trial states its claim right after its parameters are sampled).
CLAIM_WAIT_SECONDS = 30
HEARTBEAT_SECONDS = 60
# A worker names itself in a trial as it starts; a running trial still unnamed after this
# long was left by a process killed in between (optuna had already marked it running).
UNNAMED_TRIAL_SECONDS = 30
GRACE_SECONDS = 300
# Between a study's batch size and its context, in a tune of several contexts:
# ``<study-name>:sweep@16/ctx4096``.
CONTEXT_MARK = "/ctx"


class BudgetSpent(VegasError):
    """--time-budget ran out; ``Tuner.run`` turns it into a cut-short result."""


class StepFailed(VegasError):
    """Every trial of a step failed (e.g. out of memory at this batch size)."""


class DuplicateTrial(Exception):
    """A trial that backs off: a lower-numbered live trial (another worker's) measures
    its configuration, or no queued grid point was left for it. Recorded as failed, with
    the reason in ``backed_off``; not a measurement (the trials table leaves it out)."""


def open_storage(url: str):
    """A journal file (path ending in .journal or .log) or an RDB URL (sqlite://,
    postgresql://, mysql://)."""
    import optuna

    if "://" in url:
        try:
            with warnings.catch_warnings():
                # "heartbeat_interval is experimental": optuna's notice, not the user's.
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(_rdb_url(url),
                                                  heartbeat_interval=HEARTBEAT_SECONDS,
                                                  grace_period=GRACE_SECONDS)
        except Exception as e:
            raise VegasError(f"cannot open storage '{url}': {type(e).__name__}: {e}") from e
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    os.makedirs(os.path.dirname(os.path.abspath(url)), exist_ok=True)
    try:
        return JournalStorage(JournalFileBackend(url))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        # optuna replays every line of the file: a file that is not a journal fails there.
        raise VegasError(f"storage {url} is not an optuna journal ({type(e).__name__}); give "
                         "a journal file a tune wrote, or a new path") from None


def _rdb_url(url: str) -> str:
    """``postgresql://`` with the PostgreSQL driver that is installed: SQLAlchemy's
    default for that scheme changed from psycopg2 to psycopg (3) in 2.1, and the
    ``postgres`` extra installs psycopg."""
    if not url.startswith(("postgresql://", "postgres://")):
        return url
    rest = url.partition("://")[2]
    if importlib.util.find_spec("psycopg") is not None:
        return "postgresql+psycopg://" + rest
    if importlib.util.find_spec("psycopg2") is not None:
        return "postgresql+psycopg2://" + rest
    raise VegasError(f"storage '{url}' needs a PostgreSQL driver; install it with: "
                     "pip install 'vegas-tune[postgres]'")


def _worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _fail_dead_local_trials(study) -> None:
    """Trials left RUNNING by a killed process are marked failed, so their configurations
    run again: on this host, those whose worker process is gone; anywhere, those that
    never named a worker within UNNAMED_TRIAL_SECONDS of starting (the process died
    between optuna starting the trial and the objective's first line). Other hosts' named
    trials are left to the heartbeat."""
    from optuna.trial import TrialState

    host = socket.gethostname()
    # optuna stamps datetime_start with the local wall clock, naive.
    unnamed_since = datetime.datetime.now() - datetime.timedelta(seconds=UNNAMED_TRIAL_SECONDS)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker")
        if worker is None:
            dead = t.datetime_start is not None and t.datetime_start < unnamed_since
        else:
            name, _, pid = worker.partition(":")
            dead = name == host and pid.isdigit() and not _alive(int(pid))
        if dead:
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            log.info("trial %d of %s was left running by a dead process; marked failed",
                     t.number, study.study_name)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a previous run of this very process id cannot still be running
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Studies:
    """The studies of one tune in one storage, and the running of their trials.

    ``fingerprint`` names what the measurements depend on; it is stored with each study.
    ``deadline`` (``time.monotonic()``) ends every step's trials when it passes
    (``BudgetSpent``); ``progress`` receives a ``ProgressEvent`` per finished trial;
    ``sized`` says whether steps are labelled with their batch size in progress lines.
    ``context`` is the context being tuned in a tune of several (None in a tune of one,
    whose study names and labels name none): the tuner sets it before each context's
    steps, and every study name and label names it."""

    def __init__(self, storage: str, study_name: str, fingerprint: dict,
                 deadline: float | None, progress: ProgressCallback | None, sized: bool):
        self.storage = open_storage(storage)
        self.storage_url = storage
        self.study_name = study_name
        # As the storage will return it (JSON: tuples become lists), for comparing.
        self.fingerprint = json.loads(json.dumps(fingerprint))
        self.deadline = deadline
        self.progress = progress
        self.sized = sized
        self.context: int | None = None
        self.interrupts = DeferredInterrupts()
        self.where: tuple[str, int | None, int] | None = None  # (step, batch, total trials)
        self._waited = 0.0  # seconds spent waiting for other workers in this step

    def ours(self) -> list:
        return _studies_named(self.storage, self.study_name)

    def name(self, step: str, batch: int | None) -> str:
        return (f"{self.study_name}:{step}" + ("" if batch is None else f"@{batch}")
                + ("" if self.context is None else f"{CONTEXT_MARK}{self.context}"))

    def study(self, step: str, sampler, batch: int | None = None, direction: str = "maximize"):
        import optuna

        study = optuna.create_study(storage=self.storage, study_name=self.name(step, batch),
                                    sampler=sampler, direction=direction, load_if_exists=True)
        if "fingerprint" not in study.user_attrs:
            study.set_user_attr("fingerprint", self.fingerprint)
        _fail_dead_local_trials(study)
        return study

    def existing(self, step: str, batch: int | None):
        """The study of ``step`` at ``batch`` if the storage has it, else None."""
        import optuna

        name = self.name(step, batch)
        if not any(s.study_name == name for s in self.ours()):
            return None
        return optuna.load_study(study_name=name, storage=self.storage)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _stop_when_out_of_time(self, study, _trial) -> None:
        """After each trial: no new one once the budget is spent, on this object's clock
        (``time.monotonic``, as ``deadline``), not optuna's own timeout's."""
        if self.out_of_time():
            study.stop()

    def remaining_seconds(self) -> float | None:
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise BudgetSpent("--time-budget ran out")
        return left

    def complete(self, study) -> list:
        from optuna.trial import TrialState

        return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))

    def finished(self, study) -> int:
        """Trials that count as done: complete, pruned, or failed with a recorded
        reason (out of memory: not retried). A trial killed mid-run counts as not done."""
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED)
                   or (t.state == TrialState.FAIL and "failed_reason" in t.user_attrs)
                   for t in trials)

    def label(self, step: str, batch: int | None) -> str:
        where = ([f"ctx {self.context}"] if self.context is not None else []) + (
            [f"batch {batch}"] if batch is not None and self.sized else [])
        return f"{step} @ {', '.join(where)}" if where else step

    def report(self, step: str, done: int, total: int, best: str | None,
               unit: str = "trials") -> None:
        if self.progress:
            self.progress(ProgressEvent(step, done, total, best, unit))

    def run(self, study, objective, total: int, step: str, batch: int | None,
            grid: list[tuple[dict, str]] | None = None,
            best: Callable[[list], str | None] | None = None, quiet: bool = False) -> list:
        """Run trials until ``total`` are done, counting earlier runs' and other
        workers' trials, then wait until no worker has a trial of the step running. With
        ``grid`` ((params, claim) pairs), exactly those parameter sets are measured: each
        one not yet done (or queued, or running elsewhere) is queued, and only queued
        trials run. ``best(complete trials)`` describes the best so far for progress
        reports; ``quiet`` leaves progress to the objective."""
        from optuna.trial import TrialState

        label = self.label(step, batch)
        self.where = (step, batch, total)

        def report(_study=None, _trial=None) -> None:
            if quiet:
                return
            complete = self.complete(study)
            self.report(label, self.finished(study), total,
                        best(complete) if best and complete else None)

        if grid is not None:
            measure_point = objective

            def objective(trial):  # noqa: F811 (a grid runs queued points only)
                if "claim" not in trial.user_attrs:
                    # Another worker took the last queued point: optuna sampled afresh.
                    trial.set_user_attr("backed_off", "no queued grid point was left")
                    raise DuplicateTrial("no queued grid point was left")
                return measure_point(trial)

        def named(trial, measure=objective):
            # First thing: a trial without a worker is taken for a dead process's.
            trial.set_user_attr("worker", _worker_id())
            return measure(trial)

        report()
        stalled = False
        while True:
            self._fail_dead_trials(study)
            before = self.finished(study)
            if grid is not None:
                self._queue_missing(study, grid)
            trials = study.get_trials(deepcopy=False)
            waiting = sum(t.state == TrialState.WAITING for t in trials)
            running = sum(t.state == TrialState.RUNNING for t in trials)
            wanted = waiting if grid is not None else max(total - before, waiting)
            if wanted and not stalled:
                # Out-of-memory trials fail with their reason, duplicates back off; the
                # study goes on.
                self.remaining_seconds()  # BudgetSpent once the budget is gone
                study.optimize(named, n_trials=wanted,
                               callbacks=[report, self._stop_when_out_of_time],
                               catch=(torch.cuda.OutOfMemoryError, DuplicateTrial))
                # Sampled trials that were all duplicates: the space is used up.
                stalled = grid is None and self.finished(study) == before
            elif running:
                with self.interrupts.interruptible():
                    time.sleep(POLL_SECONDS)  # other workers' trials of this step
                self._check_wait(study)
            else:
                break
        self.where = None
        self._waited = 0.0
        complete = self.complete(study)
        if not complete:
            reasons = {t.user_attrs["failed_reason"] for t in study.get_trials(deepcopy=False)
                       if "failed_reason" in t.user_attrs}
            why = "; ".join(sorted(reasons)) or f"see the trials in {self.storage_url}"
            raise StepFailed(f"step '{label}' finished no trial (all failed or pruned): {why}")
        return complete

    def _queue_missing(self, study, grid: list[tuple[dict, str]]) -> None:
        """Queue each grid point that no trial holds (queued, running, finished, or
        failed for a recorded reason such as out of memory)."""
        trials = study.get_trials(deepcopy=False)
        for params, claim in grid:
            if not any(t.user_attrs.get("claim") == claim and _holds(t) for t in trials):
                study.enqueue_trial(params, user_attrs={"claim": claim})

    def _fail_dead_trials(self, study) -> None:
        """Trials of dead workers: marked failed, so their configurations run again."""
        import optuna

        _fail_dead_local_trials(study)
        if isinstance(self.storage, optuna.storages.RDBStorage):
            optuna.storages.fail_stale_trials(study)

    def _check_wait(self, study) -> None:
        """Count a poll of waiting for other workers; give up after
        ``WAIT_FOR_OTHERS_SECONDS`` without a step finishing."""
        self._waited += POLL_SECONDS
        if self._waited > WAIT_FOR_OTHERS_SECONDS:
            raise StepFailed(f"waited {WAIT_FOR_OTHERS_SECONDS} s for other workers' trials of "
                             f"{study.study_name}; none finished (is a worker hung?)")

    def claim(self, study, trial, claim: str) -> None:
        """State what ``trial`` measures; raise DuplicateTrial when a lower-numbered
        trial holds the same claim (a worker that got there first)."""
        from optuna.trial import TrialState

        trial.set_user_attr("claim", claim)
        waited = 0.0
        while True:
            unsure = False
            for t in study.get_trials(deepcopy=False):
                if t.number >= trial.number:
                    continue
                if t.user_attrs.get("claim") == claim and _holds(t):
                    trial.set_user_attr("backed_off", f"trial {t.number} measures it")
                    raise DuplicateTrial(f"trial {t.number} measures {claim}")
                # A trial just started may not have stated its claim yet.
                unsure |= t.state == TrialState.RUNNING and "claim" not in t.user_attrs
            if not unsure or waited >= CLAIM_WAIT_SECONDS:
                return
            time.sleep(POLL_SECONDS / 10)
            waited += POLL_SECONDS / 10

    def all_trials(self) -> list[dict]:
        """Every trial of every step as a flat row with its ``batch_size`` (and ``ctx``, in
        a tune of several contexts) and the configuration it measured (``drafter`` ``vanilla`` for vanilla; ``budget`` is the
        budget in slots); a race trial becomes one row per configuration (``config``:
        vanilla, c1, c2, ...)."""
        import optuna

        rows = []
        for summary in self.ours():
            step, _, where = summary.study_name.partition(":")[2].partition("@")
            batch, _, ctx = where.partition(CONTEXT_MARK)
            study = optuna.load_study(study_name=summary.study_name, storage=self.storage)
            for t in study.get_trials(deepcopy=False):
                if "backed_off" in t.user_attrs:
                    continue  # not a measurement: another trial measured it
                row = {"step": step, "batch_size": int(batch) if batch else
                       t.user_attrs.get("batch_size"), **({"ctx": int(ctx)} if ctx else {}),
                       "number": t.number,
                       "state": t.state.name, "value": t.value, **t.params}
                spec = {k.removeprefix("spec_"): v for k, v in t.user_attrs.items()
                        if k.startswith("spec_")}
                if spec:
                    row.update(spec, budget=spec.get("min_tokens"))
                elif t.user_attrs.get("claim") == "vanilla":
                    row["drafter"] = "vanilla"
                attrs = {k: v for k, v in t.user_attrs.items() if not k.startswith("spec")
                         and k not in ("worker", "series", "batch_size", "claim", "chosen")}
                if "series" in t.user_attrs:
                    chosen = t.user_attrs.get("chosen")
                    rows += [{**row, "config": name, "chosen": name == chosen,
                              **_trial_row(series)}
                             for name, series in t.user_attrs["series"].items()]
                else:
                    rows.append({**row, **_trial_row(attrs)})
        return rows


def _holds(trial) -> bool:
    """Whether a trial holds its claim: queued, running, finished, or failed for a
    recorded reason (not retried); a killed run or a duplicate does not."""
    from optuna.trial import TrialState

    return (trial.state in (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE,
                            TrialState.PRUNED)
            or (trial.state == TrialState.FAIL and "failed_reason" in trial.user_attrs))


def _studies_named(storage, study_name: str) -> list:
    import optuna

    return [s for s in optuna.get_all_study_summaries(storage)
            if s.study_name.partition(":")[0] == study_name]


def check_study(storage, storage_url: str, study_name: str, *, resume: bool, new_study: bool,
                fingerprint: dict) -> None:
    """Start fresh, resume, or refuse, before any measuring.

    A study holding finished trials is continued only with ``resume``, and only when it
    recorded the same values for every key of ``fingerprint`` (a caller may check a part
    early, before the model is loaded, and the whole later). A study whose run failed
    before finishing a trial, with no worker in it, is discarded, as is any with
    ``new_study``. ``storage`` is an opened storage (``open_storage``), or None to open
    ``storage_url``.
    """
    import optuna
    from optuna.trial import TrialState

    storage = storage or open_storage(storage_url)
    ours = _studies_named(storage, study_name)
    if not ours:
        return
    studies = [optuna.load_study(study_name=s.study_name, storage=storage) for s in ours]
    for study in studies:
        _fail_dead_local_trials(study)
    states = {t.state for study in studies for t in study.get_trials(deepcopy=False)}
    # A run that failed before finishing any trial, with no other worker in it, left
    # nothing to keep: a corrected rerun starts over without needing --resume.
    abandoned = not states & {TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING}
    if new_study or (abandoned and not resume):
        why = "--new-study" if new_study else "it has no finished trial"
        log.info("discarding study '%s' in %s (%s)", study_name, storage_url, why)
        for s in ours:
            optuna.delete_study(study_name=s.study_name, storage=storage)
        return
    if not resume:
        raise VegasError(
            f"study '{study_name}' already has trials in {storage_url}; pass --resume to "
            f"continue it, --new-study to discard it, or --study-name to start another")
    recorded = next((s.user_attrs["fingerprint"] for s in studies
                     if "fingerprint" in s.user_attrs), None)
    if recorded is None and abandoned:
        # A worker started at the same moment has created the study but not yet recorded
        # its fingerprint (``_study`` does so right after): nothing finished to protect.
        return
    wanted = json.loads(json.dumps(fingerprint))  # as the storage returns it: lists, not tuples
    other_hardware = recorded is not None and recorded.get("hardware") != wanted.get("hardware")
    if other_hardware and "hardware" in wanted:
        raise VegasError(
            f"study '{study_name}' in {storage_url} was measured on "
            f"{_hardware_words(recorded.get('hardware'))}; this worker runs on "
            f"{_hardware_words(wanted['hardware'])}: the workers of one study must share one "
            "hardware type; tune this one under another --study-name")
    if recorded is None or any(recorded.get(k) != v for k, v in wanted.items()):
        raise VegasError(
            f"--resume: study '{study_name}' in {storage_url} measured another workload "
            f"({_fingerprint_difference(recorded, wanted)}); rerun with those settings, pass "
            f"--new-study to discard it, or --study-name to start another")


def _trial_row(attrs: dict) -> dict:
    return {k: " ".join(f"{a:.3f}" for a in v) if k == "acceptance_by_position" else v
            for k, v in attrs.items()}


def _hardware_words(hardware: dict | None) -> str:
    if not hardware:
        return "unrecorded hardware (an older vegas-tune made the study)"
    gpu = (f"{hardware['gpu_name']} ({hardware['gpu_memory_gb']} GB, driver "
           f"{hardware['driver']}, CUDA {hardware['cuda']})" if hardware.get("gpu_name")
           else "the CPU")
    return f"{gpu} with torch {hardware.get('torch')}"


def _fingerprint_difference(old: dict | None, new: dict) -> str:
    if old is None:
        return "the study records no workload: an older vegas-tune made it"
    keys = [k for k in new if old.get(k) != new.get(k)]
    return "; ".join(f"{k}: {old.get(k)!r} then, {new.get(k)!r} now" for k in keys)
