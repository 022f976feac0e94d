"""The tuning steps as optuna studies in one storage, for one or more batch sizes.

1. ``sparsity`` (shared by every batch size): at the probe gamma, a grid of sparsity
   ratios; objective: mean accepted length. One measurement each, at the smallest batch
   size: greedy acceptance on fixed prompts does not vary between runs, nor with the
   batch size. Chosen: the smallest ratio within ``tolerance`` of the plateau.
Then, for each batch size B, smallest first:
2. ``costs``: one vanilla run and three probe runs (the probe gamma and gamma 1 at step
   1's sparsity, the probe gamma at another step-1 ratio) time the steps at B and say how
   acceptance there differs from step 1's.
3. ``gamma``: the cost model (``vegas_tune.costmodel``) predicts tokens/s at B for every
   gamma up to ``gamma_max`` and every step-1 sparsity, from step 1's acceptance and the
   step costs; the ``gamma_candidates`` best predicted are measured.
4. ``refine``: TPE over sparsity (around step 3's choice), ``score`` and ``window`` with
   gamma fixed (``refine_trials``; 0 skips it).
5. ``baselines``: the chosen configuration, vanilla decoding and the ``streaming``
   drafter in interleaved rounds, so the size's speedups and intervals come from one run.
Steps 3 to 5 measure each configuration in rounds, each round beside a vanilla run, until
the speedup's 95% interval is within ``precision`` of its mean or ``max_rounds`` are done;
a configuration whose interval falls wholly below the best one's stops early (pruned).
Their objective is the mean speedup over vanilla, and each chooses the cheapest of the
configurations whose intervals overlap the best one's (``stats.choose_within_noise``).

Every trial's metrics are stored as user attributes. Finished trials survive a crash or
Ctrl-C; a rerun with ``resume`` continues each study where it stopped. When the time
budget runs out, or on Ctrl-C, ``run`` returns what the finished trials support
(``TuneResult.cut_short`` says what was cut).

Several workers (processes, hosts) may share one storage and study. Each trial claims
what it measures (a ``claim`` key: the configuration and batch size) before measuring,
and the lowest-numbered live trial of a claim measures it: a later one backs off (failed,
with its reason in ``backed_off``), so every grid point, gamma candidate, TPE
configuration and baselines run is measured once. A trial left running by a dead worker
is marked failed (at once on the same host, by the RDB heartbeat elsewhere; anywhere, once
it has gone UNNAMED_TRIAL_SECONDS without naming its worker, which a live worker does as
the trial starts) and its configuration queued again. Every step ends when no worker has
a trial of it running, so each worker chooses from the same trials and writes the same
profile.
A batch size that does not fit in memory is recorded in ``TuneResult.not_tuned``; the
other sizes go on.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vegas_core import SpecConfig
from vegas_core.errors import VegasError
from vegas_tune.costmodel import (ProbeRun, StepCosts, batch_acceptance, draft_read_share,
                                  expected_tokens, predict_tokens_per_second)
from vegas_tune.interrupts import DeferredInterrupts
from vegas_tune.measure import Measurement, Measurer, interleave, ratio_estimate, series_attrs
from vegas_tune.progress import ProgressCallback, ProgressEvent
from vegas_tune.stats import Estimate, choose_within_noise, estimate

log = logging.getLogger("vegas_tune")

STEPS = ("sparsity", "costs", "gamma", "refine", "baselines")
BASELINES = ("chosen", "vanilla", "streaming")
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
REFINE_WINDOWS = (0.0, 0.25, 0.5, 0.75)
# Rounds before a configuration may stop for precision: fewer give intervals too wide
# (t quantile 12.7 at two samples) to stop on.
MIN_ROUNDS = 3
# Rounds a configuration needs for an interval at all: when the time budget runs out
# mid-configuration, it stops at this many.
MIN_INTERVAL_ROUNDS = 2
# A measurement below this many decoded tokens per configuration is timing noise.
MIN_TOKENS_PER_MEASUREMENT = 64
# A steady window shorter than this is warned about: timer and launch jitter dominate.
MIN_TIMED_SECONDS = 0.1
# The measurements of the costs step: vanilla, the probe (probe gamma), a short probe
# (gamma 1, same sparsity) and a sparse probe (probe gamma, another step-1 ratio): the
# cost model's lines in gamma and in K/V share (``vegas_tune.costmodel``).
COSTS_CONFIGS = ("vanilla", "probe", "short", "sparse")
SHORT_PROBE_GAMMA = 1
# Decimals of a refined sparsity ratio: finer steps change no budget by a token at the
# contexts tuned here, and the profile stays readable.
SPARSITY_DIGITS = 4


class BudgetSpent(VegasError):
    """--time-budget ran out; ``Tuner.run`` turns it into a cut-short result."""


class StepFailed(VegasError):
    """Every trial of a step failed (e.g. out of memory at this batch size)."""


class DuplicateTrial(Exception):
    """A trial that backs off: a lower-numbered live trial (another worker's) measures
    its configuration, or no queued grid point was left for it. Recorded as failed, with
    the reason in ``backed_off``; not a measurement (the trials table leaves it out)."""


@dataclass
class TuneOptions:
    probe_gamma: int = 8
    gamma_max: int = 8
    sparsity_grid: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3)
    tolerance: float = 0.03
    min_tokens: int = 256
    gamma_candidates: int = 3
    refine_trials: int = 8  # at the largest batch size
    refine_trials_below: int = 2  # at each smaller size, starting from the largest's choice
    seed: int = 0
    time_budget: float | None = None  # seconds for the whole run
    max_rounds: int = 8  # measurement rounds per configuration, at most
    precision: float = 0.02  # stop when the 95% interval is within this share of the mean


@dataclass
class StepResult:
    name: str
    study: str
    trials: int
    chosen: dict
    notes: str = ""
    predictions: list[dict] = field(default_factory=list)
    within_noise: list[dict] = field(default_factory=list)
    batch_size: int | None = None  # None: shared by every batch size


@dataclass
class SizeResult:
    """What was measured at one batch size.

    ``spec``: the best speculative configuration measured there; ``figures``: its
    results in the profile's ``Results`` shape (``<name>`` and ``<name>_interval``),
    with null where not measured (streaming, when the run was cut before ``baselines``;
    intervals, when measured once)."""

    batch_size: int
    spec: SpecConfig
    figures: dict


@dataclass
class TuneResult:
    sizes: list[SizeResult]  # ascending; the sizes with a measurement
    steps: list[StepResult]
    trials: list[dict]  # every trial of every step, flat, for the report
    not_tuned: list[tuple[int, str]] = field(default_factory=list)  # (batch size, why)
    cut_short: list[str] = field(default_factory=list)  # steps stopped early, in words
    interrupted: bool = False  # stopped by Ctrl-C (else finished or out of time)


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
    return JournalStorage(JournalFileBackend(url))


def _rdb_url(url: str) -> str:
    """``postgresql://`` with the PostgreSQL driver that is installed: SQLAlchemy's
    default for that scheme changed from psycopg2 to psycopg (3) in 2.1, and the
    ``postgres`` extra installs psycopg."""
    import importlib.util

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


class Tuner:
    """Runs the steps; ``progress`` receives a ``ProgressEvent`` per finished trial.

    ``measurers`` maps each batch size to tune to a ``Measurer`` of that size (same model
    and prompts). ``fingerprint`` names what the measurements depend on (model, hardware,
    workload, measurement settings); it is stored with the studies, and resuming a study
    recorded with another fingerprint is refused. ``new_study`` discards the studies of
    this name in the storage and starts over. ``started`` (``time.monotonic()``) is when
    the run began, so that ``options.time_budget`` also covers what came before the
    tuner (loading the model, building prompts); by default, now.
    """

    def __init__(self, measurers: dict[int, Measurer], storage: str, study_name: str,
                 options: TuneOptions, *, resume: bool, new_study: bool = False,
                 fingerprint: dict | None = None, progress: ProgressCallback | None = None,
                 started: float | None = None):
        import optuna

        # Optuna logs every failed trial with a traceback; the tuner reports failures itself.
        debug = log.isEnabledFor(logging.DEBUG)
        optuna.logging.set_verbosity(optuna.logging.WARNING if debug else optuna.logging.ERROR)
        if not measurers:
            raise VegasError("no batch size to tune")
        self.measurers = dict(sorted(measurers.items()))
        self.options = options
        self.storage = open_storage(storage)
        self.storage_url = storage
        self.study_name, self.resume = study_name, resume
        # As the storage will return it (JSON: tuples become lists), for comparing.
        self.fingerprint = json.loads(json.dumps(fingerprint or {}))
        self.progress = progress
        began = time.monotonic() if started is None else started
        self.deadline = began + options.time_budget if options.time_budget else None
        self._where: tuple[str, int | None, int] | None = None  # (step, batch, total trials)
        self._interrupts = DeferredInterrupts()
        self._waited = 0.0  # seconds spent waiting for other workers in this step
        check_study(self.storage, storage, study_name, resume=resume, new_study=new_study,
                    fingerprint=self.fingerprint)

    @property
    def sizes(self) -> list[int]:
        return list(self.measurers)

    # ---- studies ---------------------------------------------------------------------

    def _our_studies(self) -> list:
        return _studies_named(self.storage, self.study_name)

    def _study_name(self, step: str, batch: int | None) -> str:
        return f"{self.study_name}:{step}" + ("" if batch is None else f"@{batch}")

    def _study(self, step: str, sampler, batch: int | None = None, direction: str = "maximize"):
        import optuna

        study = optuna.create_study(storage=self.storage, study_name=self._study_name(step, batch),
                                    sampler=sampler, direction=direction, load_if_exists=True)
        if "fingerprint" not in study.user_attrs:
            study.set_user_attr("fingerprint", self.fingerprint)
        _fail_dead_local_trials(study)
        return study

    def _existing(self, step: str, batch: int | None):
        """The study of ``step`` at ``batch`` if the storage has it, else None."""
        import optuna

        name = self._study_name(step, batch)
        if not any(s.study_name == name for s in self._our_studies()):
            return None
        return optuna.load_study(study_name=name, storage=self.storage)

    def _out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _remaining_seconds(self) -> float | None:
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise BudgetSpent("--time-budget ran out")
        return left

    def _complete(self, study) -> list:
        from optuna.trial import TrialState

        return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))

    def _finished(self, study) -> int:
        """Trials that count as done: complete, pruned, or failed with a recorded
        reason (out of memory: not retried). A trial killed mid-run counts as not done."""
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED)
                   or (t.state == TrialState.FAIL and "failed_reason" in t.user_attrs)
                   for t in trials)

    def _label(self, step: str, batch: int | None) -> str:
        multi = len(self.measurers) > 1
        return f"{step} @ batch {batch}" if batch is not None and multi else step

    def _report(self, step: str, done: int, total: int, best: str | None,
                unit: str = "trials") -> None:
        if self.progress:
            self.progress(ProgressEvent(step, done, total, best, unit))

    def _run(self, study, objective, total: int, step: str, batch: int | None,
             grid: list[tuple[dict, str]] | None = None,
             best: Callable[[list], str | None] | None = None, quiet: bool = False) -> list:
        """Run trials until ``total`` are done, counting earlier runs' and other
        workers' trials, then wait until no worker has a trial of the step running. With
        ``grid`` ((params, claim) pairs), exactly those parameter sets are measured: each
        one not yet done (or queued, or running elsewhere) is queued, and only queued
        trials run. ``best(complete trials)`` describes the best so far for progress
        reports; ``quiet`` leaves progress to the objective."""
        from optuna.trial import TrialState

        label = self._label(step, batch)
        self._where = (step, batch, total)

        def report(_study=None, _trial=None) -> None:
            if quiet:
                return
            complete = self._complete(study)
            self._report(label, self._finished(study), total,
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
            before = self._finished(study)
            if grid is not None:
                self._queue_missing(study, grid)
            trials = study.get_trials(deepcopy=False)
            waiting = sum(t.state == TrialState.WAITING for t in trials)
            running = sum(t.state == TrialState.RUNNING for t in trials)
            wanted = waiting if grid is not None else max(total - before, waiting)
            if wanted and not stalled:
                # Out-of-memory trials fail with their reason, duplicates back off; the
                # study goes on.
                study.optimize(named, n_trials=wanted, timeout=self._remaining_seconds(),
                               callbacks=[report],
                               catch=(torch.cuda.OutOfMemoryError, DuplicateTrial))
                # Sampled trials that were all duplicates: the space is used up.
                stalled = grid is None and self._finished(study) == before
            elif running:
                with self._interrupts.interruptible():
                    time.sleep(POLL_SECONDS)  # other workers' trials of this step
                self._check_wait(study)
            else:
                break
        self._where = None
        self._waited = 0.0
        complete = self._complete(study)
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

    def _claim(self, study, trial, claim: str) -> None:
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

    # ---- measuring -------------------------------------------------------------------

    def _guard_memory(self, trial, claim: str, measure: Callable[[], object]):
        """Claim ``claim`` for ``trial`` (see ``_claim``), then run ``measure``; an
        out-of-memory trial fails with its reason recorded (not retried on resume) and
        the tuner goes on."""
        self._claim(trial.study, trial, claim)
        try:
            with self._interrupts.interruptible():
                return measure()
        except torch.cuda.OutOfMemoryError as e:
            trial.set_user_attr("failed_reason", f"out of memory: {str(e).splitlines()[0]}")
            torch.cuda.empty_cache()
            raise

    def _store(self, trial, attrs: dict, spec: SpecConfig | None) -> None:
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        if spec is not None:
            for key, value in spec.to_dict().items():
                trial.set_user_attr(f"spec_{key}", value)

    def _measure_once(self, trial, spec: SpecConfig | None, batch: int) -> dict:
        """One measurement of a queued grid point, for what does not vary between runs
        (acceptance) or only feeds a prediction (step costs)."""
        measurer = self.measurers[batch]
        attrs = self._guard_memory(trial, trial.user_attrs["claim"],
                                   lambda: measurer.measure(spec)).as_attrs()
        self._store(trial, attrs, spec)
        return attrs

    def _stop_rounds(self, done: int, precise: bool) -> bool:
        """After ``done`` rounds: stop when the interval is precise enough (and
        ``MIN_ROUNDS`` are done), or when the time budget is spent and there are enough
        rounds for an interval."""
        if done < MIN_INTERVAL_ROUNDS:
            return False
        return (done >= MIN_ROUNDS and precise) or self._out_of_time()

    def _measure_against_vanilla(self, trial, spec: SpecConfig, incumbent: Estimate | None,
                                 batch: int) -> Estimate:
        """Rounds of (vanilla, ``spec``) until the speedup's interval is within
        ``precision`` of its mean, ``max_rounds`` are done, or the interval falls wholly
        below ``incumbent``'s (then the trial is pruned, its rounds kept)."""
        import optuna

        raced = False

        def after_round(done: int, samples: dict[str, list[Measurement]]) -> bool:
            nonlocal raced
            if done < MIN_INTERVAL_ROUNDS:
                return False
            speedup = ratio_estimate(samples["config"], samples["vanilla"])
            raced = incumbent is not None and speedup.below(incumbent)
            return raced or self._stop_rounds(
                done, speedup.relative_half_width <= self.options.precision)

        claim = trial.user_attrs.get("claim") or _claim_of(spec)
        samples = self._guard_memory(trial, claim, lambda: interleave(
            self.measurers[batch], {"vanilla": None, "config": spec}, self.options.max_rounds,
            after_round))
        attrs = series_attrs(samples["config"], samples["vanilla"])
        self._store(trial, attrs, spec)
        speedup = Estimate.from_attrs(attrs, "speedup")
        if raced:
            raise optuna.TrialPruned(f"speedup {speedup.words()} below the best "
                                     f"{incumbent.words()}")
        return speedup

    def _incumbent(self, study) -> Estimate | None:
        measured = [e for e in map(_speedup_of, self._complete(study)) if e is not None]
        return max(measured, key=lambda e: e.mean) if measured else None

    def _spec(self, **changes) -> SpecConfig:
        base = dict(drafter="vegas", gamma=self.options.probe_gamma, sparsity=0.05,
                    min_tokens=self.options.min_tokens)
        return SpecConfig(**{**base, **changes})

    # ---- the steps -------------------------------------------------------------------

    def step_sparsity(self) -> StepResult:
        import optuna

        batch = self.sizes[0]
        grid = sorted(set(self.options.sparsity_grid))
        study = self._study("sparsity", optuna.samplers.RandomSampler(seed=self.options.seed))

        def objective(trial) -> float:
            spec = self._spec(sparsity=trial.suggest_float("sparsity", grid[0], grid[-1]))
            trial.set_user_attr("batch_size", batch)
            return self._measure_once(trial, spec, batch)["mean_accepted_length"]

        done = self._run(study, objective, len(grid), "sparsity", None,
                         grid=[({"sparsity": x}, _claim_of(self._spec(sparsity=x))) for x in grid],
                         best=_acceptance_words)
        chosen, plateau = self._plateau_choice(done)
        notes = (f"plateau {plateau:.2f} accepted tokens; smallest ratio within "
                 f"{self.options.tolerance:.0%}: {chosen.params['sparsity']} "
                 f"({chosen.value:.2f}); measured at batch {batch}, used for every size")
        return StepResult("sparsity", study.study_name, len(done),
                          {"sparsity": chosen.params["sparsity"],
                           "mean_accepted_length": round(chosen.value, 4)}, notes)

    def _plateau_choice(self, done: list) -> tuple:
        plateau = max(t.value for t in done)
        ok = [t for t in done if t.value >= plateau * (1 - self.options.tolerance)]
        return min(ok, key=lambda t: t.params["sparsity"]), plateau

    def _acceptance(self) -> dict[float, list[float]]:
        """Step 1's per-position acceptance by sparsity (finished grid points)."""
        import optuna

        study = self._study("sparsity", optuna.samplers.RandomSampler())
        return {t.params["sparsity"]: t.user_attrs["acceptance_by_position"]
                for t in self._complete(study)}

    def step_costs(self, batch: int, sparsity: float) -> StepCosts:
        """Time vanilla and the probes at ``batch``, one run each: the probe gamma at
        ``sparsity`` (step 1's choice), gamma 1 there (unless the probe gamma is 1), and
        the probe gamma at the step-1 ratio whose budget differs most (the smallest
        below, else the largest above; none when every ratio gives the same budget)."""
        import optuna

        study = self._study("costs", optuna.samplers.RandomSampler(), batch)
        specs = {"vanilla": None, "probe": self._spec(sparsity=sparsity)}
        if self.options.probe_gamma != SHORT_PROBE_GAMMA:
            specs["short"] = self._spec(gamma=SHORT_PROBE_GAMMA, sparsity=sparsity)
        other = self._sparse_probe_ratio(sparsity, batch)
        if other is not None:
            specs["sparse"] = self._spec(sparsity=other)

        def objective(trial) -> float:
            name = trial.suggest_categorical("config", list(COSTS_CONFIGS))
            trial.set_user_attr("batch_size", batch)
            attrs = self._measure_once(trial, specs[name], batch)
            if name == "vanilla" and attrs["steady_seconds"] < MIN_TIMED_SECONDS:
                log.warning("each measurement at batch %d times only %.0f ms of decoding: "
                            "timings that short are noisy; raise --max-new-tokens or "
                            "--num-prompts", batch, 1e3 * attrs["steady_seconds"])
            return attrs["tokens_per_second"]

        done = self._run(study, objective, len(specs), "costs", batch,
                         grid=[({"config": c}, c) for c in specs])
        by_name = {t.params["config"]: t.user_attrs for t in done}
        if set(by_name) != set(specs):
            raise StepFailed(f"step '{self._label('costs', batch)}' could not time vanilla "
                             "and every probe")

        def probe(name: str) -> ProbeRun | None:
            if name not in specs:
                return None
            spec = specs[name]
            return _probe_run(by_name[name], spec, self._share(spec.sparsity, batch))

        return StepCosts(by_name["vanilla"]["decode_step_seconds"], probe("probe"),
                         short=probe("short"), sparse=probe("sparse"))

    def _sparse_probe_ratio(self, sparsity: float, batch: int) -> float | None:
        share = self._share(sparsity, batch)
        others = sorted(r for r in self._acceptance() if self._share(r, batch) != share)
        below = [r for r in others if r < sparsity]
        if below:
            return below[0]
        return others[-1] if others else None

    def _share(self, sparsity: float, batch: int) -> float:
        """The share of a vanilla step's K/V reads a draft step makes at the mean prefix
        of ``batch``'s workload (the budget's share, in full-attention layers)."""
        measurer = self.measurers[batch]
        w, config = measurer.workload, measurer.model.config
        prefix = statistics.fmean(len(p.ids) for p in w.prompts) + w.max_new_tokens / 2
        windows = [config.window.size if config.window and config.window.applies(i) else None
                   for i in range(config.num_layers)]
        return draft_read_share(sparsity, self.options.min_tokens, max(1, round(prefix)),
                                windows)

    def step_gamma(self, batch: int, costs: StepCosts) -> StepResult:
        import optuna

        # Step 1 measured acceptance at the smallest size; the probes say how it differs here.
        acceptance = batch_acceptance(self._acceptance(), costs.probes)
        gamma_top = min(self.options.gamma_max, self.options.probe_gamma)
        predicted = {(g, s): predict_tokens_per_second(a, costs, g, batch, self._share(s, batch))
                     for s, a in acceptance.items() for g in range(1, gamma_top + 1)}
        candidates = sorted(sorted(predicted, key=predicted.get, reverse=True)
                            [: self.options.gamma_candidates])
        study = self._study("gamma", optuna.samplers.RandomSampler(seed=self.options.seed), batch)
        gammas = sorted({g for g, _ in candidates})
        ratios = sorted({s for _, s in candidates})

        def objective(trial) -> float:
            gamma = trial.suggest_int("gamma", gammas[0], gammas[-1])
            sparsity = trial.suggest_float("sparsity", ratios[0], ratios[-1])
            trial.set_user_attr("batch_size", batch)
            trial.set_user_attr("predicted_tokens_per_second", predicted[(gamma, sparsity)])
            spec = self._spec(gamma=gamma, sparsity=sparsity)
            return self._measure_against_vanilla(trial, spec, self._incumbent(study), batch).mean

        done = self._run(study, objective, len(candidates), "gamma", batch,
                         grid=[({"gamma": g, "sparsity": s},
                                _claim_of(self._spec(gamma=g, sparsity=s))) for g, s in candidates],
                         best=lambda d: _best_words(d, ("gamma", "sparsity")))
        chosen, tied = choose_within_noise(
            done, _speedup_of, lambda t: (t.params["gamma"], t.params["sparsity"]))
        measured = {(t.params["gamma"], t.params["sparsity"]): t.user_attrs
                    for t in study.get_trials(deepcopy=False) if _speedup_of(t) is not None}
        predictions = []
        for (g, s), p in sorted(predicted.items()):
            m = measured.get((g, s), {})
            speedup = Estimate.from_attrs(m, "speedup")
            predictions.append({
                "gamma": g, "sparsity_ratio": s, "predicted_tokens_per_second": round(p, 3),
                "predicted_mean_accepted_length": round(expected_tokens(acceptance[s], g), 4),
                "measured_tokens_per_second": _rounded(m.get("tokens_per_second")),
                "measured_mean_accepted_length": _rounded(m.get("mean_accepted_length"), 4),
                "measured_speedup": _rounded(speedup and speedup.mean, 4),
                "measured_speedup_interval": _interval(speedup)})
        probes = ", ".join(f"gamma {p.gamma} at {p.sparsity:g}" for p in costs.probes)
        notes = (f"cost model from probes ({probes}) and step 1's acceptance, "
                 f"over gamma 1..{gamma_top} and the step-1 ratios; measured the "
                 f"{len(candidates)} best predicted"
                 + _tie_note(tied, "the smallest gamma, then the smallest sparsity"))
        keys = ("gamma", "sparsity")
        return StepResult("gamma", study.study_name, self._finished(study),
                          {**chosen.params, **_chosen_figures(chosen)}, notes,
                          predictions, [_noise_row(t, keys) for t in tied], batch)

    def step_refine(self, batch: int, gamma: int, sparsity: float,
                    reference: SpecConfig | None = None,
                    gamma_winner=None) -> StepResult | None:
        """TPE over sparsity, score and window at ``gamma``.

        Without ``reference`` (the largest batch size) it runs ``refine_trials``, the gamma
        step's winner first. Below, ``reference`` is the largest size's choice: score and
        window rank tokens the same way at every batch size, so ``refine_trials_below``
        trials start from it (its score and window at this size's sparsity, then its
        sparsity too) and the choice is the best of them and ``gamma_winner``, the gamma
        step's trial, which is not measured again."""
        import optuna

        total = self.options.refine_trials if reference is None else self.options.refine_trials_below
        if total < 1:
            return None
        low, high = max(sparsity / 2, 1e-3), min(sparsity * 2, 1.0)
        sampler = optuna.samplers.TPESampler(seed=self.options.seed, n_startup_trials=4)
        study = self._study("refine", sampler, batch)
        winner = {"sparsity": sparsity, "score": "logit", "window": 0.0}
        if not study.get_trials(deepcopy=False):
            for params in _refine_starts(winner, reference, low, high)[:total]:
                start = self._spec(gamma=gamma, sparsity=round(params["sparsity"], SPARSITY_DIGITS),
                                   score=params["score"], window=params["window"])
                study.enqueue_trial(params, user_attrs={"claim": _claim_of(start)})
        known = [gamma_winner] if self._keeps_gamma_winner(batch) and gamma_winner else []

        def incumbent() -> Estimate | None:
            measured = [e for e in map(_speedup_of, self._complete(study) + known) if e]
            return max(measured, key=lambda e: e.mean) if measured else None

        def objective(trial) -> float:
            spec = self._spec(gamma=gamma,
                              # Rounded as the profile writes it, so the profile
                              # names exactly what was measured.
                              sparsity=round(trial.suggest_float("sparsity", low, high,
                                                                 log=True), SPARSITY_DIGITS),
                              score=trial.suggest_categorical("score", ["logit", "weight"]),
                              window=trial.suggest_categorical("window", list(REFINE_WINDOWS)))
            trial.set_user_attr("batch_size", batch)
            return self._measure_against_vanilla(trial, spec, incumbent(), batch).mean

        keys = ("sparsity", "score", "window")
        try:
            done = self._run(study, objective, total, "refine", batch,
                             best=lambda d: _best_words(d, keys))
        except StepFailed:
            # Below the largest size every trial may be pruned against the gamma step's
            # winner: then the winner stands.
            if not known:
                raise
            done = []
        chosen, tied = _refine_choice(done + known)
        start = ("" if reference is None else
                 f", starting from batch {self.sizes[-1]}'s choice (score {reference.score}, "
                 f"window {reference.window:g}, sparsity {reference.sparsity:g}) beside the "
                 f"gamma step's winner")
        notes = (f"TPE over sparsity [{low:.3g}, {high:.3g}], score and window at gamma "
                 f"{gamma}{start}; {len(done)} complete, {self._finished(study) - len(done)} "
                 f"stopped early or failed"
                 + _tie_note(tied, "the smallest sparsity, then no window and logit scores"))
        return StepResult("refine", study.study_name, self._finished(study),
                          {**_refine_params(chosen), **_chosen_figures(chosen)}, notes,
                          within_noise=[{**_refine_params(t), **_chosen_figures(t)}
                                        for t in tied], batch_size=batch)

    def baselines(self, batch: int, chosen: SpecConfig) -> dict[str, dict]:
        """The chosen configuration, vanilla and streaming at ``batch``, measured in
        interleaved rounds until the speedup's interval is within ``precision`` (or
        ``max_rounds``)."""
        import optuna

        study = self._study("baselines", optuna.samplers.RandomSampler(seed=self.options.seed),
                            batch)
        configs = {"vanilla": None, "chosen": chosen, "streaming": _streaming_like(chosen)}
        label = self._label("baselines", batch)

        def after_round(done: int, samples: dict[str, list[Measurement]]) -> bool:
            if done < MIN_INTERVAL_ROUNDS:
                return False
            speedup = ratio_estimate(samples["chosen"], samples["vanilla"])
            self._report(label, done, self.options.max_rounds,
                         f"{speedup.words()} over vanilla", unit="rounds")
            return self._stop_rounds(done, speedup.relative_half_width <= self.options.precision)

        def objective(trial) -> float:
            trial.set_user_attr("spec", chosen.to_dict())
            trial.set_user_attr("batch_size", batch)
            samples = self._guard_memory(trial, trial.user_attrs["claim"], lambda: interleave(
                self.measurers[batch], configs, self.options.max_rounds, after_round))
            vanilla = samples["vanilla"]
            series = {name: series_attrs(samples[name], vanilla)
                      for name in ("chosen", "streaming")}
            series["vanilla"] = {
                **Measurement.average(vanilla).as_attrs(),
                **estimate([m.tokens_per_second for m in vanilla]).attrs("tokens_per_second"),
                "rounds": len(vanilla),
                "round_tokens_per_second": [round(m.tokens_per_second, 3) for m in vanilla]}
            series["chosen"].update(
                ratio_estimate(samples["chosen"], samples["streaming"]).attrs("speedup_over_streaming"))
            trial.set_user_attr("series", series)
            return series["chosen"]["speedup"]

        # A baselines trial of another chosen configuration (an earlier run that refined
        # less) measured something else: measure this one.
        if _matching_baselines(self._complete(study), chosen) is None:
            self._run(study, objective, 1, "baselines", batch,
                      grid=[({}, "baselines " + _claim_of(chosen))], quiet=True)
        return _matching_baselines(self._complete(study), chosen)

    # ---- the run ---------------------------------------------------------------------

    def _tune_size(self, batch: int, sparsity: float, reference: SpecConfig | None
                   ) -> tuple[SpecConfig, list[StepResult]]:
        costs = self.step_costs(batch, sparsity)
        s2 = self.step_gamma(batch, costs)
        gamma, s2_sparsity = s2.chosen["gamma"], s2.chosen["sparsity"]
        s3 = self.step_refine(batch, gamma, s2_sparsity, reference,
                              self._gamma_choice(batch))
        c = s3.chosen if s3 else {"sparsity": s2_sparsity, "score": "logit", "window": 0.0}
        spec = self._spec(gamma=gamma, sparsity=round(c["sparsity"], SPARSITY_DIGITS),
                          score=c["score"], window=c["window"])
        self.baselines(batch, spec)
        return spec, [s for s in (s2, s3) if s is not None]

    def order(self) -> list[int]:
        """The order sizes are tuned in: the largest first (where speculation pays most,
        and where the full refine step runs), then the rest from the smallest, so a run
        cut short leaves the largest size tuned and the schedule's lower ranges measured."""
        return self.sizes[-1:] + self.sizes[:-1]

    def run(self) -> TuneResult:
        """Every step at every size. When the budget runs out or Ctrl-C stops it, the
        result holds what the finished trials support (``cut_short`` says what was cut);
        it raises only when no trial at all has finished."""
        steps: list[StepResult] = []
        not_tuned: list[tuple[int, str]] = []
        cut: list[str] = []
        interrupted = False
        chosen: dict[int, SpecConfig] = {}
        try:
            # Ctrl-C waits for the storage write in flight: it stops the next measurement.
            with self._interrupts:
                s1 = self.step_sparsity()
                steps.append(s1)
                largest = self.sizes[-1]
                for batch in self.order():
                    try:
                        chosen[batch], size_steps = self._tune_size(
                            batch, s1.chosen["sparsity"], chosen.get(largest))
                        steps += size_steps
                    except (StepFailed, torch.cuda.OutOfMemoryError) as error:
                        if isinstance(error, torch.cuda.OutOfMemoryError):
                            error = f"out of memory: {str(error).splitlines()[0]}"
                        not_tuned.append((batch, str(error)))
                        log.warning("batch %d not tuned: %s", batch, error)
                        _free_device_memory(self.measurers[batch])
                self._interrupts.check()
        except (BudgetSpent, KeyboardInterrupt) as stop:
            interrupted = isinstance(stop, KeyboardInterrupt)
            cut.append(self._cut_words("Ctrl-C" if interrupted else "--time-budget"))
        sizes = []
        for batch in self.sizes:
            if any(b == batch for b, _ in not_tuned):
                continue
            size = self._size_result(batch, chosen.get(batch))
            if size is not None:
                sizes.append(size)
            elif cut:
                not_tuned.append((batch, "not reached: the run was cut short"))
        if not sizes and cut:
            fallback = self._step1_result()
            if fallback is None:
                if interrupted:
                    raise KeyboardInterrupt
                raise VegasError("--time-budget ran out before any trial finished; raise it "
                                 "or tune a smaller workload (--num-prompts, --ctx, "
                                 "--max-rounds)")
            sizes.append(fallback)
            not_tuned = [(b, why) for b, why in not_tuned if b != fallback.batch_size]
        if not sizes:
            reasons = "; ".join(f"batch {b}: {why}" for b, why in not_tuned)
            raise VegasError(f"no batch size could be tuned ({reasons}); lower --batch-size "
                             "or --ctx")
        if not any(s.name == "sparsity" for s in steps):
            steps.insert(0, self._sparsity_summary_from_trials())
        # The shared step first, then each size's steps, smallest size first (the order
        # of the schedule), whatever order the sizes were tuned in.
        steps.sort(key=lambda s: -1 if s.batch_size is None else s.batch_size)
        return TuneResult(sizes, steps, self.all_trials(), sorted(not_tuned), cut, interrupted)

    def _cut_words(self, by: str) -> str:
        if self._where is None:
            return f"stopped by {by} between steps"
        step, batch, total = self._where
        study = self._existing(step, batch)
        done = self._finished(study) if study is not None else 0
        where = "" if batch is None else f" at batch {batch}"
        order = self.order()
        later = order[order.index(batch) + 1:] if batch is not None else []
        plural = "s" if len(later) > 1 else ""
        rest = (f"; batch size{plural} {', '.join(map(str, later))} not reached"
                if later else "")
        return f"{step}{where}: {done} of {total} trials finished when {by} stopped the run{rest}"

    def _size_result(self, batch: int, spec: SpecConfig | None) -> SizeResult | None:
        """The best of what was measured at ``batch``: the baselines of its chosen
        configuration, else its best configuration measured against vanilla, else the
        probe beside vanilla in the costs step (one run each); None when nothing was."""
        if spec is not None:
            study = self._existing("baselines", batch)
            series = study and _matching_baselines(self._complete(study), spec)
            if series:
                return SizeResult(batch, spec, _figures(series["chosen"], series["vanilla"],
                                                        series["streaming"]))
        best = self._best_measured(batch)
        if best is not None:
            return SizeResult(batch, _spec_of(best), _figures(best.user_attrs))
        costs = self._existing("costs", batch)
        by_name = {t.params["config"]: t for t in self._complete(costs)} if costs else {}
        if "probe" in by_name:
            probe = by_name["probe"]
            vanilla = by_name.get("vanilla")
            return SizeResult(batch, _spec_of(probe), _single_figures(
                probe.user_attrs, vanilla.user_attrs if vanilla else None))
        return None

    def _best_measured(self, batch: int):
        """The refine step's choice at ``batch`` if it finished a trial (below the largest
        size, together with the gamma step's winner), else the gamma step's; None when
        neither finished one."""
        refine = self._existing("refine", batch)
        done = self._complete(refine) if refine else []
        winner = self._gamma_choice(batch)
        if self._keeps_gamma_winner(batch) and winner is not None:
            done = done + [winner]
        return _refine_choice(done)[0] if done else None

    def _keeps_gamma_winner(self, batch: int) -> bool:
        """Whether ``batch``'s choice weighs the gamma step's winner beside its refine
        trials: below the largest size, where refine does not measure the winner again."""
        return batch != self.sizes[-1]

    def _gamma_choice(self, batch: int):
        """The gamma step's chosen trial at ``batch``; None before it finished one."""
        gamma = self._existing("gamma", batch)
        done = self._complete(gamma) if gamma else []
        if not done:
            return None
        return choose_within_noise(
            done, _speedup_of, lambda t: (t.params["gamma"], t.params["sparsity"]))[0]

    def _step1_result(self) -> SizeResult | None:
        """Step 1's choice among its finished trials, measured once without vanilla: all a
        run cut short in step 1 can say."""
        study = self._existing("sparsity", None)
        done = self._complete(study) if study else []
        if not done:
            return None
        chosen, _ = self._plateau_choice(done)
        return SizeResult(self.sizes[0], _spec_of(chosen), _single_figures(chosen.user_attrs, None))

    def _sparsity_summary_from_trials(self) -> StepResult:
        study = self._existing("sparsity", None)
        done = self._complete(study) if study else []
        if not done:
            return StepResult("sparsity", self._study_name("sparsity", None), 0, {},
                              "cut short before any trial finished")
        chosen, plateau = self._plateau_choice(done)
        return StepResult("sparsity", study.study_name, len(done),
                          {"sparsity": chosen.params["sparsity"],
                           "mean_accepted_length": round(chosen.value, 4)},
                          f"cut short: {len(done)} of {len(set(self.options.sparsity_grid))} "
                          f"ratios measured; plateau {plateau:.2f}")

    def all_trials(self) -> list[dict]:
        """Every trial of every step as a flat row with its ``batch_size``; a baselines
        trial becomes one row per configuration (``config``: chosen, vanilla,
        streaming)."""
        import optuna

        rows = []
        for summary in self._our_studies():
            step, _, batch = summary.study_name.partition(":")[2].partition("@")
            study = optuna.load_study(study_name=summary.study_name, storage=self.storage)
            for t in study.get_trials(deepcopy=False):
                if "backed_off" in t.user_attrs:
                    continue  # not a measurement: another trial measured it
                row = {"step": step, "batch_size": int(batch) if batch else
                       t.user_attrs.get("batch_size"), "number": t.number,
                       "state": t.state.name, "value": t.value, **t.params}
                attrs = {k: v for k, v in t.user_attrs.items() if not k.startswith("spec")
                         and k not in ("worker", "series", "batch_size", "claim")}
                if "series" in t.user_attrs:
                    rows += [{**row, "config": name, **_trial_row(series)}
                             for name, series in t.user_attrs["series"].items()]
                else:
                    rows.append({**row, **_trial_row(attrs)})
        return rows


def _probe_run(attrs: dict, spec: SpecConfig, share: float) -> ProbeRun:
    """A probe measurement: the steady window's iterations where there are any, else
    every timed iteration."""
    steady = attrs["steady_iterations"]
    seconds = attrs["steady_seconds"] if steady else attrs["decode_seconds"]
    return ProbeRun(spec.gamma, spec.sparsity, share,
                    seconds / max(steady or attrs["iterations"], 1),
                    attrs["draft_step_seconds"], tuple(attrs["acceptance_by_position"]))


def _free_device_memory(measurer: Measurer) -> None:
    """After an out-of-memory size: drop the model's kept cache so the next size starts
    from free memory."""
    from vegas_core.graphs import release_workspace

    release_workspace(measurer.model.net)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _streaming_like(spec: SpecConfig) -> SpecConfig:
    """The streaming drafter with ``spec``'s gamma and budget: the peer at equal cost."""
    return SpecConfig(drafter="streaming", gamma=spec.gamma, sparsity=spec.sparsity,
                      min_tokens=spec.min_tokens)


def _matching_baselines(complete: list, spec: SpecConfig) -> dict | None:
    matching = [t for t in complete if t.user_attrs.get("spec") == spec.to_dict()]
    return dict(matching[-1].user_attrs["series"]) if matching else None


def _refine_choice(done: list) -> tuple:
    """Among trials measured against vanilla (refine trials, and the gamma step's winner
    below the largest size): the best, or within noise the cheaper, fewer K/V entries
    read, then the paper's rule (no window, logit scores)."""
    return choose_within_noise(done, _speedup_of, lambda t: _refine_key(_spec_of(t)))


def _refine_key(spec: SpecConfig) -> tuple:
    return spec.sparsity, spec.window, spec.score != "logit"


def _refine_params(trial) -> dict:
    """What the refine step varies, as the trial measured it (sparsity rounded)."""
    spec = _spec_of(trial)
    return {"sparsity": spec.sparsity, "score": spec.score, "window": spec.window}


def _refine_starts(winner: dict, reference: SpecConfig | None, low: float,
                   high: float) -> list[dict]:
    """The refine step's first trials. At the largest size: the gamma step's winner, so
    refining can only keep or improve it. Below: the largest size's score and window at
    this size's sparsity, then at its sparsity too where that lies in the range; the
    winner itself is already measured."""
    if reference is None:
        return [winner]
    starts = [{**winner, "score": reference.score, "window": reference.window},
              {"sparsity": reference.sparsity, "score": reference.score,
               "window": reference.window}]
    starts = [p for p in starts if low <= p["sparsity"] <= high and p != winner]
    return [p for i, p in enumerate(starts) if p not in starts[:i]]


def _spec_of(trial) -> SpecConfig:
    """The configuration a trial measured (stored as ``spec_<field>`` attributes)."""
    fields = {k.removeprefix("spec_"): v for k, v in trial.user_attrs.items()
              if k.startswith("spec_")}
    return SpecConfig(**fields)


def _pair(attrs: dict, name: str, as_name: str, digits: int) -> dict:
    """``{as_name: mean, as_name_interval: [low, high]}`` from stored attributes; null
    where missing."""
    value = attrs.get(name) if attrs else None
    low, high = (attrs.get(f"{name}_low"), attrs.get(f"{name}_high")) if attrs else (None, None)
    return {as_name: None if value is None else round(value, digits),
            f"{as_name}_interval": (None if low is None or high is None
                                    else [round(low, digits), round(high, digits)])}


def _figures(chosen: dict, vanilla: dict | None = None, streaming: dict | None = None) -> dict:
    """A configuration's figures in the profile's ``Results`` shape, from a series
    (``measure.series_attrs``; with the baselines' vanilla and streaming series when
    measured)."""
    van = (_pair(vanilla, "tokens_per_second", "vanilla_tokens_per_second", 3) if vanilla
           else _pair(chosen, "vanilla_tokens_per_second", "vanilla_tokens_per_second", 3))
    return {**_pair(chosen, "tokens_per_second", "tokens_per_second", 3), **van,
            **_pair(streaming, "tokens_per_second", "streaming_tokens_per_second", 3),
            **_pair(chosen, "speedup", "speedup", 4),
            **_pair(chosen if streaming else None, "speedup_over_streaming",
                    "speedup_over_streaming", 4),
            **_acceptance_figures(chosen), "rounds": chosen["rounds"]}


def _single_figures(config: dict, vanilla: dict | None) -> dict:
    """Figures from one run of a configuration (and of vanilla): no intervals."""
    tps = config["tokens_per_second"]
    van = vanilla["tokens_per_second"] if vanilla else None
    return {"tokens_per_second": round(tps, 3), "tokens_per_second_interval": None,
            "vanilla_tokens_per_second": None if van is None else round(van, 3),
            "vanilla_tokens_per_second_interval": None,
            "streaming_tokens_per_second": None, "streaming_tokens_per_second_interval": None,
            "speedup": None if not van else round(tps / van, 4), "speedup_interval": None,
            "speedup_over_streaming": None, "speedup_over_streaming_interval": None,
            **_acceptance_figures(config), "rounds": 1}


def _acceptance_figures(attrs: dict) -> dict:
    return {"mean_accepted_length": round(attrs["mean_accepted_length"], 4),
            "acceptance_by_position": [round(a, 4) for a in attrs["acceptance_by_position"]],
            "selection_overhead": round(attrs["selection_overhead"], 5)}


def _acceptance_words(done: list) -> str:
    top = max(done, key=lambda t: t.value)
    return f"sparsity {top.params['sparsity']:g}: {top.value:.2f} tokens per iteration"


def _claim_of(spec: SpecConfig | None) -> str:
    """What a trial measures, as a claim key: the configuration (vanilla: None)."""
    return "vanilla" if spec is None else json.dumps(spec.to_dict(), sort_keys=True)


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


def _speedup_of(trial) -> Estimate | None:
    return Estimate.from_attrs(trial.user_attrs, "speedup")


def _best_words(done: list, keys: tuple[str, ...]) -> str:
    top = max(done, key=lambda t: t.value)
    params = ", ".join(f"{k} {top.params[k]:.3g}" if isinstance(top.params[k], float)
                       else f"{k} {top.params[k]}" for k in keys)
    return f"{params}: {_speedup_of(top).words()}"


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _interval(e: Estimate | None) -> list[float] | None:
    return None if e is None else [round(e.low, 4), round(e.high, 4)]


def _chosen_figures(trial) -> dict:
    speedup = _speedup_of(trial)
    return {"tokens_per_second": round(trial.user_attrs["tokens_per_second"], 3),
            "speedup": round(speedup.mean, 4), "speedup_low": round(speedup.low, 4),
            "speedup_high": round(speedup.high, 4)}


def _noise_row(trial, keys: tuple[str, ...]) -> dict:
    return {**{k: trial.params[k] for k in keys}, **_chosen_figures(trial)}


def _tie_note(tied: list, rule: str) -> str:
    if not tied:
        return ""
    return (f"; {len(tied)} other configuration(s) within noise of the best (overlapping "
            f"95% intervals): chose {rule}")


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


def min_new_tokens(probe_gamma: int) -> int:
    """The fewest new tokens per prompt that time a speculative iteration at
    ``probe_gamma``: the first iteration captures graphs and is not timed, and a steady
    window needs a second one even when every draft token is accepted."""
    return 2 * (probe_gamma + 1)


def warn_if_hard_to_time(decoded_per_measurement: int) -> None:
    """Warn, before any work, about a workload that decodes too few tokens per
    measurement to time well (the refusals are ``preflight.check_values``')."""
    if decoded_per_measurement < MIN_TOKENS_PER_MEASUREMENT:
        log.warning("each measurement decodes only %d tokens (batches x --max-new-tokens): "
                    "expect wide intervals; raise --max-new-tokens or --num-prompts",
                    decoded_per_measurement)


def ctx_label(ctx: int) -> str:
    """8192 -> '8k', 2000 -> '2000'."""
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def parse_ctx(text: str | int) -> int:
    """'2048', '8k', '64k', '128K' -> tokens (k = 1024)."""
    raw = str(text).strip().lower()
    try:
        value = int(raw[:-1]) * 1024 if raw.endswith("k") else int(raw)
    except ValueError:
        raise VegasError(f"--ctx '{text}' is not a token count; use e.g. 2048, 8k or 64k") from None
    if value < 16:
        raise VegasError(f"--ctx must be at least 16 tokens, got {value}")
    return value


def sparsity_grid(text: str) -> tuple[float, ...]:
    try:
        grid = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        raise VegasError(f"--sparsity-grid '{text}': give comma-separated ratios, e.g. 0.01,0.05,0.1") from None
    if not grid or any(not 0 < x <= 1 for x in grid):
        raise VegasError(f"--sparsity-grid '{text}': every ratio must be in (0, 1]")
    return grid



def batch_sizes(text: str | int) -> tuple[int, ...]:
    """'1,16,64' -> (1, 16, 64): batch sizes to tune, each a whole number >= 1, no
    repeats; returned ascending."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        raise VegasError(f"--batch-size '{text}' is not a whole number or a comma-separated "
                         "list of them, e.g. 1,16,64") from None
    bad = [s for s in sizes if s < 1]
    if bad:
        raise VegasError(f"--batch-size '{text}': every size must be >= 1, got {bad[0]}")
    repeated = sorted({s for s in sizes if sizes.count(s) > 1})
    if repeated:
        raise VegasError(f"--batch-size '{text}': {repeated[0]} is given twice; list each "
                         "size once")
    return tuple(sorted(sizes))
