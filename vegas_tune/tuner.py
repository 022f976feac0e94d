"""The three tuning steps as optuna studies in one storage.

1. ``sparsity``: at the probe gamma, a grid of sparsity ratios; objective: mean accepted
   length. Chosen: the smallest ratio within ``tolerance`` of the plateau (the best).
2. ``gamma``: the cost model predicts tokens/s for gamma = 1..gamma_max from step 1's
   per-position acceptance and step costs; the best predicted candidates are measured.
3. ``refine``: TPE over sparsity (around step 1's choice), ``score`` and ``window`` with
   gamma fixed; objective: tokens/s; clearly losing trials are pruned after a batch.
Then ``baselines`` measures the chosen configuration, vanilla decoding and the
``streaming`` drafter at the same point, so the speedups are ratios from one run.

Every trial's metrics are stored as user attributes. Finished trials survive a crash or
Ctrl-C; a rerun with ``resume`` continues each study where it stopped, and several
processes may share one storage.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vegas_core import SpecConfig
from vegas_core.errors import VegasError
from vegas_tune.costmodel import StepCosts, predict_tokens_per_second
from vegas_tune.measure import Measurer

log = logging.getLogger("vegas_tune")

STEPS = ("sparsity", "gamma", "refine", "baselines")
BASELINES = ("chosen", "vanilla", "streaming")
# How long a worker waits for other workers' running trials before giving up on them.
WAIT_FOR_OTHERS_SECONDS = 3600
POLL_SECONDS = 5
HEARTBEAT_SECONDS = 60
GRACE_SECONDS = 300
REFINE_WINDOWS = (0.0, 0.25, 0.5, 0.75)


@dataclass
class TuneOptions:
    probe_gamma: int = 8
    gamma_max: int = 8
    sparsity_grid: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3)
    tolerance: float = 0.03
    min_tokens: int = 256
    gamma_candidates: int = 3
    refine_trials: int = 8
    seed: int = 0
    time_budget: float | None = None  # seconds for the whole run


@dataclass
class StepResult:
    name: str
    study: str
    trials: int
    chosen: dict
    notes: str = ""
    predictions: list[dict] = field(default_factory=list)


@dataclass
class TuneResult:
    spec: SpecConfig
    steps: list[StepResult]
    baselines: dict[str, dict]  # config name -> measurement attrs
    trials: list[dict]  # every trial of every step, flat, for the report


def open_storage(url: str):
    """A journal file (path ending in .journal or .log) or an RDB URL (sqlite://,
    postgresql://, mysql://)."""
    import optuna

    if "://" in url:
        try:
            return optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_SECONDS,
                                              grace_period=GRACE_SECONDS)
        except Exception as e:
            raise VegasError(f"cannot open storage '{url}': {type(e).__name__}: {e}") from e
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    os.makedirs(os.path.dirname(os.path.abspath(url)), exist_ok=True)
    return JournalStorage(JournalFileBackend(url))


def _worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _fail_dead_local_trials(study) -> None:
    """Trials left RUNNING by a killed process on this host are marked failed, so their
    configurations run again; other hosts' trials are left to the heartbeat."""
    from optuna.trial import TrialState

    host = socket.gethostname()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker", "")
        name, _, pid = worker.partition(":")
        if name == host and pid.isdigit() and not _alive(int(pid)):
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
    """Runs the steps; ``progress(step, done, total)`` reports trials."""

    def __init__(self, measurer: Measurer, storage: str, study_name: str, options: TuneOptions,
                 *, resume: bool, progress: Callable[[str, int, int], None] | None = None):
        import optuna

        # Optuna logs every failed trial with a traceback; the tuner reports failures itself.
        debug = log.isEnabledFor(logging.DEBUG)
        optuna.logging.set_verbosity(optuna.logging.WARNING if debug else optuna.logging.ERROR)
        self.measurer, self.options = measurer, options
        self.storage = open_storage(storage)
        self.storage_url = storage
        self.study_name, self.resume = study_name, resume
        self.progress = progress
        self.batch = measurer.workload.batch_size
        self.deadline = time.monotonic() + options.time_budget if options.time_budget else None
        self._check_fresh_or_resume()

    # ---- studies ---------------------------------------------------------------------

    def _check_fresh_or_resume(self) -> None:
        import optuna

        existing = {s.study_name for s in optuna.get_all_study_summaries(self.storage)}
        ours = [f"{self.study_name}:{step}" for step in STEPS]
        if not self.resume and any(name in existing for name in ours):
            raise VegasError(
                f"study '{self.study_name}' already has trials in {self.storage_url}; pass "
                f"--resume to continue it, or --study-name to start another"
            )

    def _study(self, step: str, sampler, direction: str = "maximize", pruner=None):
        import optuna

        study = optuna.create_study(storage=self.storage, study_name=f"{self.study_name}:{step}",
                                    sampler=sampler, pruner=pruner, direction=direction,
                                    load_if_exists=True)
        _fail_dead_local_trials(study)
        return study

    def _remaining_seconds(self) -> float | None:
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise VegasError("--time-budget ran out before this step could finish a trial; "
                             "raise it or tune a smaller workload (--num-prompts, --ctx)")
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

    def _run(self, study, objective, total: int, step: str,
             grid: list[dict] | None = None) -> list:
        """Run trials until ``total`` are done, counting earlier runs' and other
        workers' trials. With ``grid``, exactly those parameter sets are measured: each
        one not yet done (or running elsewhere) is queued, and only queued trials run."""
        from optuna.trial import TrialState

        def report(_study=None, _trial=None) -> None:
            if self.progress:
                self.progress(step, self._finished(study), total)

        report()
        while self._finished(study) < total:
            before = self._finished(study)
            if grid is not None:
                self._queue_missing(study, grid)
                n_trials = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
            else:
                n_trials = total - before
            if n_trials:
                # An out-of-memory trial fails with its reason; the study goes on.
                study.optimize(objective, n_trials=n_trials, timeout=self._remaining_seconds(),
                               callbacks=[report], catch=(torch.cuda.OutOfMemoryError,))
            if self._finished(study) == before:
                self._wait_for_others(study)
                if self._finished(study) == before:
                    break
        complete = self._complete(study)
        if not complete:
            raise VegasError(f"step '{step}' finished no trial (all failed or pruned); see "
                             f"the trials' failed_reason in {self.storage_url}")
        return complete

    def _queue_missing(self, study, grid: list[dict]) -> None:
        from optuna.trial import TrialState

        taken = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
        trials = study.get_trials(deepcopy=False)
        for params in grid:
            same = [t for t in trials if t.params == params
                    or (t.state == TrialState.WAITING and t.system_attrs.get("fixed_params") == params)]
            if not any(t.state in taken or "failed_reason" in t.user_attrs for t in same):
                study.enqueue_trial(params)

    def _wait_for_others(self, study) -> None:
        """Grid points held by other workers' running trials: wait for them."""
        from optuna.trial import TrialState

        waited = 0.0
        while study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if waited > WAIT_FOR_OTHERS_SECONDS:
                break
            time.sleep(POLL_SECONDS)
            waited += POLL_SECONDS

    def _measure_trial(self, trial, spec: SpecConfig | None, prune: bool = False) -> dict:
        """Measure and store every metric on the trial. An out-of-memory trial fails
        with its reason recorded and the tuner goes on."""
        import optuna

        trial.set_user_attr("worker", _worker_id())

        def report(batch: int, tokens_per_second: float) -> None:
            if prune:
                trial.report(tokens_per_second, batch)
                if trial.should_prune():
                    raise optuna.TrialPruned()

        try:
            m = self.measurer.measure(spec, report)
        except torch.cuda.OutOfMemoryError as e:
            trial.set_user_attr("failed_reason", f"out of memory: {str(e).splitlines()[0]}")
            torch.cuda.empty_cache()
            raise
        attrs = m.as_attrs()
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        if spec is not None:
            for key, value in spec.to_dict().items():
                trial.set_user_attr(f"spec_{key}", value)
        return attrs

    def _spec(self, **changes) -> SpecConfig:
        base = dict(drafter="vegas", gamma=self.options.probe_gamma, sparsity=0.05,
                    min_tokens=self.options.min_tokens)
        return SpecConfig(**{**base, **changes})

    # ---- the steps -------------------------------------------------------------------

    def step_sparsity(self) -> StepResult:
        import optuna

        grid = sorted(set(self.options.sparsity_grid))
        study = self._study("sparsity", optuna.samplers.RandomSampler(seed=self.options.seed))

        def objective(trial) -> float:
            spec = self._spec(sparsity=trial.suggest_float("sparsity", grid[0], grid[-1]))
            return self._measure_trial(trial, spec)["mean_accepted_length"]

        done = self._run(study, objective, len(grid), "sparsity",
                         grid=[{"sparsity": x} for x in grid])
        plateau = max(t.value for t in done)
        ok = [t for t in done if t.value >= plateau * (1 - self.options.tolerance)]
        chosen = min(ok, key=lambda t: t.params["sparsity"])
        notes = (f"plateau {plateau:.2f} accepted tokens; smallest ratio within "
                 f"{self.options.tolerance:.0%}: {chosen.params['sparsity']} "
                 f"({chosen.value:.2f})")
        return StepResult("sparsity", study.study_name, len(done),
                          {"sparsity": chosen.params["sparsity"],
                           "mean_accepted_length": round(chosen.value, 4)}, notes)

    def step_gamma(self, sparsity: float) -> StepResult:
        import optuna

        base = self._study("sparsity", optuna.samplers.RandomSampler())
        probe = min(self._complete(base), key=lambda t: abs(t.params["sparsity"] - sparsity))
        vanilla = self._baseline_measurement("vanilla")
        attrs = probe.user_attrs
        costs = StepCosts(attrs["draft_step_seconds"], attrs["verify_step_seconds"],
                          attrs["selection_step_seconds"], vanilla["decode_step_seconds"],
                          self.options.probe_gamma)
        gammas = range(1, min(self.options.gamma_max, self.options.probe_gamma) + 1)
        predicted = {g: predict_tokens_per_second(attrs["acceptance_by_position"], costs, g,
                                                  self.batch) for g in gammas}
        candidates = sorted(sorted(predicted, key=predicted.get, reverse=True)
                            [: self.options.gamma_candidates])
        study = self._study("gamma", optuna.samplers.RandomSampler(seed=self.options.seed))

        def objective(trial) -> float:
            gamma = trial.suggest_int("gamma", candidates[0], candidates[-1])
            trial.set_user_attr("predicted_tokens_per_second", predicted[gamma])
            return self._measure_trial(trial, self._spec(gamma=gamma, sparsity=sparsity))[
                "tokens_per_second"]

        done = self._run(study, objective, len(candidates), "gamma",
                         grid=[{"gamma": g} for g in candidates])
        measured = {t.params["gamma"]: t.value for t in done}
        best = max(done, key=lambda t: t.value)
        predictions = [{"gamma": g, "predicted_tokens_per_second": round(p, 3),
                        "measured_tokens_per_second": (round(measured[g], 3)
                                                       if g in measured else None)}
                       for g, p in predicted.items()]
        notes = (f"cost model from gamma={self.options.probe_gamma} at sparsity {sparsity}; "
                 f"measured the {len(candidates)} best predicted")
        return StepResult("gamma", study.study_name, len(done),
                          {"gamma": best.params["gamma"],
                           "tokens_per_second": round(best.value, 3)}, notes, predictions)

    def step_refine(self, gamma: int, sparsity: float) -> StepResult:
        import optuna

        low, high = max(sparsity / 2, 1e-3), min(sparsity * 2, 1.0)
        sampler = optuna.samplers.TPESampler(seed=self.options.seed, n_startup_trials=4)
        pruner = optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=0)
        study = self._study("refine", sampler, pruner=pruner)
        if not study.get_trials(deepcopy=False):
            # The step-2 winner first, so refining can only keep or improve it.
            study.enqueue_trial({"sparsity": sparsity, "score": "logit", "window": 0.0})

        def objective(trial) -> float:
            spec = self._spec(gamma=gamma,
                              sparsity=trial.suggest_float("sparsity", low, high, log=True),
                              score=trial.suggest_categorical("score", ["logit", "weight"]),
                              window=trial.suggest_categorical("window", list(REFINE_WINDOWS)))
            return self._measure_trial(trial, spec, prune=True)["tokens_per_second"]

        done = self._run(study, objective, self.options.refine_trials, "refine")
        best = max(done, key=lambda t: t.value)
        notes = (f"TPE over sparsity [{low:.3g}, {high:.3g}], score and window at gamma "
                 f"{gamma}; {len(done)} complete")
        chosen = {**best.params, "tokens_per_second": round(best.value, 3)}
        return StepResult("refine", study.study_name, len(done), chosen, notes)

    def _baseline_measurement(self, name: str, spec: SpecConfig | None = None) -> dict:
        """Measure vanilla (or another baseline) once per storage: reused on resume."""
        import optuna

        study = self._study(f"baselines-{name}" if spec is None else "baselines",
                            optuna.samplers.RandomSampler())
        for t in self._complete(study):
            if t.user_attrs.get("config") == name:
                return dict(t.user_attrs)

        def objective(trial) -> float:
            trial.set_user_attr("config", name)
            return self._measure_trial(trial, spec)["tokens_per_second"]

        self._run(study, objective, 1, f"baseline {name}")
        return next(dict(t.user_attrs) for t in self._complete(study)
                    if t.user_attrs.get("config") == name)

    def baselines(self, chosen: SpecConfig) -> dict[str, dict]:
        """The chosen configuration, vanilla and streaming, measured one after another."""
        import optuna

        study = self._study("baselines", optuna.samplers.RandomSampler(seed=self.options.seed))
        specs = {"chosen": chosen, "vanilla": None,
                 "streaming": SpecConfig(drafter="streaming", gamma=chosen.gamma,
                                         sparsity=chosen.sparsity, min_tokens=chosen.min_tokens)}

        def objective(trial) -> float:
            name = trial.suggest_categorical("config", list(BASELINES))
            trial.set_user_attr("config", name)
            return self._measure_trial(trial, specs[name])["tokens_per_second"]

        done = self._run(study, objective, len(BASELINES), "baselines",
                         grid=[{"config": c} for c in BASELINES])
        return {t.params["config"]: dict(t.user_attrs) for t in done}

    def run(self) -> TuneResult:
        s1 = self.step_sparsity()
        s2 = self.step_gamma(s1.chosen["sparsity"])
        s3 = self.step_refine(s2.chosen["gamma"], s1.chosen["sparsity"])
        c = s3.chosen
        spec = self._spec(gamma=s2.chosen["gamma"], sparsity=round(c["sparsity"], 4),
                          score=c["score"], window=c["window"])
        baselines = self.baselines(spec)
        steps = [s1, s2, s3]
        return TuneResult(spec, steps, baselines, self.all_trials())

    def all_trials(self) -> list[dict]:
        import optuna

        rows = []
        for summary in optuna.get_all_study_summaries(self.storage):
            prefix, _, step = summary.study_name.partition(":")
            if prefix != self.study_name:
                continue
            study = optuna.load_study(study_name=summary.study_name, storage=self.storage)
            for t in study.get_trials(deepcopy=False):
                row = {"step": step, "number": t.number, "state": t.state.name,
                       "value": t.value, **t.params}
                for key, value in t.user_attrs.items():
                    if key == "acceptance_by_position":
                        value = " ".join(f"{a:.3f}" for a in value)
                    if not key.startswith("spec_") and key != "worker":
                        row[key] = value
                rows.append(row)
        return rows


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

