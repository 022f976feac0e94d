"""The three tuning steps as optuna studies in one storage.

1. ``sparsity``: at the probe gamma, a grid of sparsity ratios; objective: mean accepted
   length (one measurement each: greedy acceptance on fixed prompts does not vary).
   Chosen: the smallest ratio within ``tolerance`` of the plateau (the best).
2. ``gamma``: the cost model predicts tokens/s for gamma = 1..gamma_max from step 1's
   per-position acceptance and step costs; the best predicted candidates are measured.
3. ``refine``: TPE over sparsity (around step 1's choice), ``score`` and ``window`` with
   gamma fixed.
Steps 2 and 3 measure each configuration in rounds, each round beside a vanilla run, until
the speedup's 95% interval is within ``precision`` of its mean or ``max_rounds`` are done;
a configuration whose interval falls wholly below the best one's stops early (pruned).
Their objective is the mean speedup over vanilla, and each chooses the cheapest of the
configurations whose intervals overlap the best one's (``stats.choose_within_noise``).
Then ``baselines`` measures the chosen configuration, vanilla decoding and the
``streaming`` drafter in interleaved rounds, so the profile's speedups and intervals
come from one run.

Every trial's metrics are stored as user attributes. Finished trials survive a crash or
Ctrl-C; a rerun with ``resume`` continues each study where it stopped, and several
processes may share one storage.
"""

from __future__ import annotations

import json
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
from vegas_tune.measure import Measurement, Measurer, interleave, ratio_estimate, series_attrs
from vegas_tune.progress import ProgressCallback, ProgressEvent
from vegas_tune.stats import Estimate, choose_within_noise, estimate

log = logging.getLogger("vegas_tune")

STEPS = ("sparsity", "gamma", "refine", "baselines")
BASELINES = ("chosen", "vanilla", "streaming")
# How long a worker waits for other workers' running trials before giving up on them.
WAIT_FOR_OTHERS_SECONDS = 3600
POLL_SECONDS = 5
HEARTBEAT_SECONDS = 60
GRACE_SECONDS = 300
REFINE_WINDOWS = (0.0, 0.25, 0.5, 0.75)
# Rounds before a configuration may stop for precision: fewer give intervals too wide
# (t quantile 12.7 at two samples) to stop on.
MIN_ROUNDS = 3
# A measurement below this many decoded tokens per configuration is timing noise.
MIN_TOKENS_PER_MEASUREMENT = 64
# A steady window shorter than this is warned about: timer and launch jitter dominate.
MIN_TIMED_SECONDS = 0.1


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


@dataclass
class TuneResult:
    spec: SpecConfig
    steps: list[StepResult]
    baselines: dict[str, dict]  # config name -> measurement attrs, with intervals
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
    """Runs the steps; ``progress`` receives a ``ProgressEvent`` per finished trial.

    ``fingerprint`` names what the measurements depend on (model, hardware, workload,
    measurement settings); it is stored with the studies, and resuming a study recorded
    with another fingerprint is refused. ``new_study`` discards the studies of this name
    in the storage and starts over.
    """

    def __init__(self, measurer: Measurer, storage: str, study_name: str, options: TuneOptions,
                 *, resume: bool, new_study: bool = False, fingerprint: dict | None = None,
                 progress: ProgressCallback | None = None):
        import optuna

        # Optuna logs every failed trial with a traceback; the tuner reports failures itself.
        debug = log.isEnabledFor(logging.DEBUG)
        optuna.logging.set_verbosity(optuna.logging.WARNING if debug else optuna.logging.ERROR)
        self.measurer, self.options = measurer, options
        self.storage = open_storage(storage)
        self.storage_url = storage
        self.study_name, self.resume = study_name, resume
        # As the storage will return it (JSON: tuples become lists), for comparing.
        self.fingerprint = json.loads(json.dumps(fingerprint or {}))
        self.progress = progress
        self.batch = measurer.workload.batch_size
        self.deadline = time.monotonic() + options.time_budget if options.time_budget else None
        check_study(self.storage, storage, study_name, resume=resume, new_study=new_study,
                    fingerprint=self.fingerprint)

    # ---- studies ---------------------------------------------------------------------

    def _our_studies(self) -> list:
        return _studies_named(self.storage, self.study_name)

    def _study(self, step: str, sampler, direction: str = "maximize"):
        import optuna

        study = optuna.create_study(storage=self.storage, study_name=f"{self.study_name}:{step}",
                                    sampler=sampler, direction=direction, load_if_exists=True)
        if "fingerprint" not in study.user_attrs:
            study.set_user_attr("fingerprint", self.fingerprint)
        _fail_dead_local_trials(study)
        return study

    def _remaining_seconds(self) -> float | None:
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise VegasError("--time-budget ran out before this step could finish a trial; "
                             "raise it or tune a smaller workload (--num-prompts, --ctx, "
                             "--max-rounds)")
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

    def _report(self, step: str, done: int, total: int, best: str | None,
                unit: str = "trials") -> None:
        if self.progress:
            self.progress(ProgressEvent(step, done, total, best, unit))

    def _run(self, study, objective, total: int, step: str,
             grid: list[dict] | None = None,
             best: Callable[[list], str | None] | None = None, quiet: bool = False) -> list:
        """Run trials until ``total`` are done, counting earlier runs' and other
        workers' trials. With ``grid``, exactly those parameter sets are measured: each
        one not yet done (or running elsewhere) is queued, and only queued trials run.
        ``best(complete trials)`` describes the best so far for progress reports;
        ``quiet`` leaves progress to the objective."""
        from optuna.trial import TrialState

        def report(_study=None, _trial=None) -> None:
            if quiet:
                return
            complete = self._complete(study)
            self._report(step, self._finished(study), total,
                         best(complete) if best and complete else None)

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

    # ---- measuring -------------------------------------------------------------------

    def _guard_memory(self, trial, measure: Callable[[], object]):
        """Run ``measure``; an out-of-memory trial fails with its reason recorded (not
        retried on resume) and the tuner goes on."""
        trial.set_user_attr("worker", _worker_id())
        try:
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

    def _measure_once(self, trial, spec: SpecConfig | None) -> dict:
        """One measurement, for what does not vary between runs (acceptance) or only
        feeds a prediction (step costs)."""
        attrs = self._guard_memory(trial, lambda: self.measurer.measure(spec)).as_attrs()
        self._store(trial, attrs, spec)
        return attrs

    def _measure_against_vanilla(self, trial, spec: SpecConfig,
                                 incumbent: Estimate | None) -> Estimate:
        """Rounds of (vanilla, ``spec``) until the speedup's interval is within
        ``precision`` of its mean, ``max_rounds`` are done, or the interval falls wholly
        below ``incumbent``'s (then the trial is pruned, its rounds kept)."""
        import optuna

        raced = False

        def after_round(done: int, samples: dict[str, list[Measurement]]) -> bool:
            nonlocal raced
            if done < 2:
                return False
            speedup = ratio_estimate(samples["config"], samples["vanilla"])
            raced = incumbent is not None and speedup.below(incumbent)
            return raced or (done >= MIN_ROUNDS
                             and speedup.relative_half_width <= self.options.precision)

        samples = self._guard_memory(trial, lambda: interleave(
            self.measurer, {"vanilla": None, "config": spec}, self.options.max_rounds,
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

        grid = sorted(set(self.options.sparsity_grid))
        study = self._study("sparsity", optuna.samplers.RandomSampler(seed=self.options.seed))

        def objective(trial) -> float:
            spec = self._spec(sparsity=trial.suggest_float("sparsity", grid[0], grid[-1]))
            return self._measure_once(trial, spec)["mean_accepted_length"]

        def best(done: list) -> str:
            top = max(done, key=lambda t: t.value)
            return f"sparsity {top.params['sparsity']:g}: {top.value:.2f} tokens per iteration"

        done = self._run(study, objective, len(grid), "sparsity",
                         grid=[{"sparsity": x} for x in grid], best=best)
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
            spec = self._spec(gamma=gamma, sparsity=sparsity)
            return self._measure_against_vanilla(trial, spec, self._incumbent(study)).mean

        done = self._run(study, objective, len(candidates), "gamma",
                         grid=[{"gamma": g} for g in candidates],
                         best=lambda d: _best_words(d, ("gamma",)))
        chosen, tied = choose_within_noise(done, _speedup_of, lambda t: (t.params["gamma"],))
        measured = {t.params["gamma"]: t.user_attrs for t in study.get_trials(deepcopy=False)
                    if _speedup_of(t) is not None}
        predictions = []
        for g, p in predicted.items():
            m = measured.get(g, {})
            speedup = Estimate.from_attrs(m, "speedup")
            predictions.append({
                "gamma": g, "predicted_tokens_per_second": round(p, 3),
                "measured_tokens_per_second": _rounded(m.get("tokens_per_second")),
                "measured_speedup": _rounded(speedup and speedup.mean, 4),
                "measured_speedup_interval": _interval(speedup)})
        notes = (f"cost model from gamma={self.options.probe_gamma} at sparsity {sparsity}; "
                 f"measured the {len(candidates)} best predicted"
                 + _tie_note(tied, "the smallest gamma"))
        return StepResult("gamma", study.study_name, self._finished(study),
                          {"gamma": chosen.params["gamma"], **_chosen_figures(chosen)}, notes,
                          predictions, [_noise_row(t, ("gamma",)) for t in tied])

    def step_refine(self, gamma: int, sparsity: float) -> StepResult:
        import optuna

        low, high = max(sparsity / 2, 1e-3), min(sparsity * 2, 1.0)
        sampler = optuna.samplers.TPESampler(seed=self.options.seed, n_startup_trials=4)
        study = self._study("refine", sampler)
        if not study.get_trials(deepcopy=False):
            # The step-2 winner first, so refining can only keep or improve it.
            study.enqueue_trial({"sparsity": sparsity, "score": "logit", "window": 0.0})

        def objective(trial) -> float:
            spec = self._spec(gamma=gamma,
                              sparsity=trial.suggest_float("sparsity", low, high, log=True),
                              score=trial.suggest_categorical("score", ["logit", "weight"]),
                              window=trial.suggest_categorical("window", list(REFINE_WINDOWS)))
            return self._measure_against_vanilla(trial, spec, self._incumbent(study)).mean

        keys = ("sparsity", "score", "window")
        done = self._run(study, objective, self.options.refine_trials, "refine",
                         best=lambda d: _best_words(d, keys))
        # Cheaper: fewer K/V entries read, then the paper's rule (no window, logit scores).
        chosen, tied = choose_within_noise(
            done, _speedup_of,
            lambda t: (t.params["sparsity"], t.params["window"], t.params["score"] != "logit"))
        notes = (f"TPE over sparsity [{low:.3g}, {high:.3g}], score and window at gamma "
                 f"{gamma}; {len(done)} complete, {self._finished(study) - len(done)} "
                 f"stopped early or failed"
                 + _tie_note(tied, "the smallest sparsity, then no window and logit scores"))
        return StepResult("refine", study.study_name, self._finished(study),
                          {**chosen.params, **_chosen_figures(chosen)}, notes,
                          within_noise=[_noise_row(t, keys) for t in tied])

    def _baseline_measurement(self, name: str) -> dict:
        """One vanilla measurement per storage, for the cost model: reused on resume."""
        import optuna

        study = self._study(f"baselines-{name}", optuna.samplers.RandomSampler())
        for t in self._complete(study):
            if t.user_attrs.get("config") == name:
                return dict(t.user_attrs)

        def objective(trial) -> float:
            trial.set_user_attr("config", name)
            return self._measure_once(trial, None)["tokens_per_second"]

        self._run(study, objective, 1, f"baseline {name}")
        attrs = next(dict(t.user_attrs) for t in self._complete(study)
                     if t.user_attrs.get("config") == name)
        if attrs["steady_seconds"] < MIN_TIMED_SECONDS:
            log.warning("each measurement times only %.0f ms of decoding: timings that short "
                        "are noisy; raise --max-new-tokens or --num-prompts",
                        1e3 * attrs["steady_seconds"])
        return attrs

    def baselines(self, chosen: SpecConfig) -> dict[str, dict]:
        """The chosen configuration, vanilla and streaming, measured in interleaved rounds
        until the speedup's interval is within ``precision`` (or ``max_rounds``)."""
        import optuna

        study = self._study("baselines", optuna.samplers.RandomSampler(seed=self.options.seed))
        configs = {"vanilla": None, "chosen": chosen,
                   "streaming": SpecConfig(drafter="streaming", gamma=chosen.gamma,
                                           sparsity=chosen.sparsity, min_tokens=chosen.min_tokens)}

        def matching() -> list:
            return [t for t in self._complete(study)
                    if t.user_attrs.get("spec") == chosen.to_dict()]

        def after_round(done: int, samples: dict[str, list[Measurement]]) -> bool:
            if done < 2:
                return False
            speedup = ratio_estimate(samples["chosen"], samples["vanilla"])
            self._report("baselines", done, self.options.max_rounds,
                         f"{speedup.words()} over vanilla", unit="rounds")
            return done >= MIN_ROUNDS and speedup.relative_half_width <= self.options.precision

        def objective(trial) -> float:
            trial.set_user_attr("spec", chosen.to_dict())
            samples = self._guard_memory(trial, lambda: interleave(
                self.measurer, configs, self.options.max_rounds, after_round))
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
        if not matching():
            self._run(study, objective, self._finished(study) + 1, "baselines", quiet=True)
        return dict(matching()[-1].user_attrs["series"])

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
        """Every trial of every step as a flat row; the baselines trial becomes one row
        per configuration (``config``: chosen, vanilla, streaming)."""
        import optuna

        rows = []
        for summary in self._our_studies():
            step = summary.study_name.partition(":")[2]
            study = optuna.load_study(study_name=summary.study_name, storage=self.storage)
            for t in study.get_trials(deepcopy=False):
                row = {"step": step, "number": t.number, "state": t.state.name,
                       "value": t.value, **t.params}
                attrs = {k: v for k, v in t.user_attrs.items()
                         if not k.startswith("spec") and k not in ("worker", "series")}
                if "series" in t.user_attrs:
                    rows += [{**row, "config": name, **_trial_row(series)}
                             for name, series in t.user_attrs["series"].items()]
                else:
                    rows.append({**row, **_trial_row(attrs)})
        return rows



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
    wanted = json.loads(json.dumps(fingerprint))  # as the storage returns it: lists, not tuples
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

