"""The tuner: for each batch size (and context), the best configuration its target can run.

A configuration is a drafter's selection rule (``vegas_tune.space``: the drafter, and for
vegas its score and window share), a draft budget in KV slots, and gamma. Each batch size
is tuned by four steps (``vegas_tune.steps``): ``sweep`` (every selection x budget once,
at the probe gamma), ``extend`` (an axis whose edge holds a best prediction, extended
once), ``focus`` (the best pairs once at their best predicted gamma) and ``race`` (the
best predictions beside vanilla, in interleaved rounds). The pick
is the configuration with the highest mean speedup in the race; its figures and the best
streaming configuration's come from the same rounds.

Sizes run the largest first (where speculation pays most, and where a run cut short
should have its answer), then the rest from the smallest. Below the largest size the
sweep covers the selections the largest size raced, and streaming.

Several contexts (``--ctx 4k,16k,32k``) repeat that at each: the longest first, then the
rest from the shortest, each with its own prompts and measurers. The first point tuned
(the longest context, the largest size) sweeps every selection; every other point, at
any context, sweeps the selections it raced, and streaming. Each context's studies are
named with it (``Studies.context``); a tune of one context names none, as before.

Every trial's metrics are stored as user attributes in the studies (``vegas_tune.studies``).
Finished trials survive a crash or Ctrl-C; a rerun with ``resume`` continues each study
where it stopped. When the time budget runs out, or on Ctrl-C, ``run`` returns what the
finished trials support (``TuneResult.cut_short`` says what was cut). A batch size that
does not fit in memory is recorded in ``TuneResult.not_tuned``; the other sizes go on.
The time budget covers every context.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from vegas_core import SpecConfig
from vegas_core.errors import VegasError
from vegas_core.graphs import release_workspace
from vegas_core.spec_config import MAX_GAMMA
from vegas_tune.measure import Measurer
from vegas_tune.options import TuneOptions, parse_whole_numbers
from vegas_tune.progress import ProgressCallback
from vegas_tune.space import Selection, longest_prefix, selections
from vegas_tune.steps import (MIN_TOKENS_PER_MEASUREMENT, SWEEP, VANILLA, Measuring, Search,
                              StepResult, Steps, best_of, over, spec_of)
from vegas_tune.studies import BudgetSpent, StepFailed, Studies, check_study

log = logging.getLogger("vegas_tune")

# The shortest --ctx taken, in tokens.
MIN_CONTEXT = 16


@dataclass
class SizeResult:
    """What was measured at one batch size (and context).

    ``spec``: the best speculative configuration measured there; ``figures``: its
    results in the profile's ``Results`` shape (``<name>`` and ``<name>_interval``),
    with null where not measured (streaming, when the run was cut before the race;
    intervals, when measured once). ``ctx``: the context (``--ctx``) it was tuned at."""

    batch_size: int
    spec: SpecConfig
    figures: dict
    ctx: int


class NotTuned(NamedTuple):
    """A (context, batch size) with no result, and why."""

    ctx: int
    batch_size: int
    reason: str


@dataclass
class TuneResult:
    sizes: list[SizeResult]  # by context, then batch size, ascending; those measured
    steps: list[StepResult]
    trials: list[dict]  # every trial of every step, flat, for the report
    not_tuned: list[NotTuned] = field(default_factory=list)  # ascending, as ``sizes``
    cut_short: list[str] = field(default_factory=list)  # steps stopped early, in words
    interrupted: bool = False  # stopped by Ctrl-C (else finished or out of time)


def gamma_limit(max_new_tokens: int, warmup_iterations: int = 0) -> int:
    """The largest gamma a workload of ``max_new_tokens`` per prompt, timed after
    ``warmup_iterations``, can time (see ``steps.min_new_tokens``)."""
    return min(MAX_GAMMA, max_new_tokens // (2 + warmup_iterations) - 1)


def usable_budgets(budgets: tuple[int, ...], ctx: int) -> tuple[int, ...]:
    """The budgets below the prompt length (a budget that covers the prompt drafts
    densely); ``VegasError`` when none is."""
    kept = tuple(b for b in budgets if b < ctx)
    if not kept:
        raise VegasError(f"--budgets {','.join(map(str, budgets))}: every budget covers the "
                         f"whole {ctx}-token prompt; give budgets below --ctx")
    if len(kept) < len(budgets):
        log.warning("budgets %s cover the whole %d-token prompt and are not searched",
                    ", ".join(str(b) for b in budgets if b >= ctx), ctx)
    return kept


@dataclass
class ContextWorkload:
    """What every search at one context shares: ``prompt_tokens``, the context a budget is
    judged sparse against (the prompt; for spans, the deepest span's context: shallower
    spans draft densely where a budget covers them, as the start of a real generation
    does), the budgets below it, and the engine's longest prefix for the workload."""

    prompt_tokens: int
    budgets: tuple[int, ...]
    longest_prefix: int

    @classmethod
    def of(cls, workload, budgets: tuple[int, ...]) -> ContextWorkload:
        prompt_tokens = max(len(p.ids) for p in workload.prompts)
        return cls(prompt_tokens, usable_budgets(budgets, prompt_tokens),
                   longest_prefix(workload.longest_sequence, 0))


class Tuner:
    """Runs the steps; ``progress`` receives a ``ProgressEvent`` per finished trial.

    ``measurers`` maps each context to tune (``--ctx``) to a map of each batch size to a
    ``Measurer`` of that size (one model; prompts of that context). ``fingerprint`` names
    what the measurements depend on (model, hardware, workload, measurement settings); it
    is stored with the studies, and resuming a study recorded with another fingerprint is
    refused. ``new_study`` discards the studies of this name in the storage and starts
    over. ``started`` (``time.monotonic()``) is when the run began, so that
    ``options.time_budget`` also covers what came before the tuner (loading the model,
    building prompts); by default, now.
    """

    def __init__(self, measurers: dict[int, dict[int, Measurer]], storage: str,
                 study_name: str, options: TuneOptions, *, resume: bool,
                 new_study: bool = False, fingerprint: dict | None = None,
                 progress: ProgressCallback | None = None, started: float | None = None):
        import optuna  # deferred: see vegas_tune.studies

        # Optuna logs every failed trial with a traceback; the tuner reports failures itself.
        debug = log.isEnabledFor(logging.DEBUG)
        optuna.logging.set_verbosity(optuna.logging.WARNING if debug else optuna.logging.ERROR)
        if not measurers or not all(measurers.values()):
            raise VegasError("no batch size to tune")
        self.measurers = {ctx: dict(sorted(by_size.items()))
                          for ctx, by_size in sorted(measurers.items())}
        if len({tuple(by_size) for by_size in self.measurers.values()}) > 1:
            raise VegasError("every context must have the same batch sizes to tune")
        self.options = options
        began = time.monotonic() if started is None else started
        deadline = began + options.time_budget if options.time_budget else None
        check_study(None, storage, study_name, resume=resume, new_study=new_study,
                    fingerprint=fingerprint or {})
        self.studies = Studies(storage, study_name, fingerprint or {}, deadline, progress,
                               sized=len(self.sizes) > 1)
        workload = next(iter(self.measurers[self.contexts[0]].values())).workload
        self.max_new_tokens = workload.max_new_tokens
        self.warmup_iterations = workload.warmup_iterations
        self.context = self.contexts[-1]  # where the run starts (``order``)
        self.workloads = {ctx: ContextWorkload.of(next(iter(by_size.values())).workload,
                                                  options.budgets)
                          for ctx, by_size in self.measurers.items()}

    @property
    def contexts(self) -> list[int]:
        return list(self.measurers)

    @property
    def sizes(self) -> list[int]:
        return list(next(iter(self.measurers.values())))

    @property
    def several_contexts(self) -> bool:
        return len(self.measurers) > 1

    def order(self) -> list[tuple[int, int]]:
        """The (context, batch size) pairs in the order they are tuned. Contexts: the
        longest first, then the rest from the shortest; within each, the largest size
        first, then the rest from the smallest. Speculation pays most at the longest
        context and the largest size, so a run cut short has that answer first, then the
        schedule's lower ranges."""
        contexts = self.contexts[-1:] + self.contexts[:-1]
        sizes = self.sizes[-1:] + self.sizes[:-1]
        return [(ctx, batch) for ctx in contexts for batch in sizes]

    def at_context(self, ctx: int) -> None:
        """Work at ``ctx`` from now on: every study name and label names it in a tune of
        several contexts (one context's studies keep the names they had without one)."""
        self.context = ctx
        self.studies.context = ctx if self.several_contexts else None

    def search(self, ctx: int, batch: int, raced: list[Selection] | None = None) -> Search:
        """What ``batch`` searches at ``ctx``: every selection of the target at the first
        point tuned (the longest context, the largest size); elsewhere, those that point
        raced (``raced``), and streaming."""
        allowed = selections(self.options.target)
        chosen = allowed if raced is None else [s for s in allowed
                                                if s in raced or s.drafter == "streaming"]
        limit = gamma_limit(self.max_new_tokens, self.warmup_iterations)
        workload = self.workloads[ctx]
        return Search(batch, chosen, workload.budgets, min(self.options.probe_gamma, limit),
                      workload.longest_prefix, limit, workload.prompt_tokens)

    def _tune_size(self, steps: Steps, search: Search) -> tuple[dict, list[StepResult]]:
        landscape, sweep = steps.sweep(search)
        landscape, extend = steps.extend(landscape, search)
        landscape, focus = steps.focus(landscape, search)
        race, summary = steps.race(landscape, search)
        return race, [s for s in (sweep, extend, focus, summary) if s is not None]

    def run(self) -> TuneResult:
        """Every step at every (context, size). When the budget runs out or Ctrl-C stops
        it, the result holds what the finished trials support (``cut_short`` says what was
        cut); it raises only when no trial at all has finished."""
        steps: list[StepResult] = []
        not_tuned: list[NotTuned] = []
        cut: list[str] = []
        interrupted = False
        races: dict[tuple[int, int], dict] = {}
        raced: list[Selection] | None = None
        context_steps: Steps | None = None  # the steps at self.context
        try:
            # Ctrl-C waits for the storage write in flight: it stops the next measurement.
            with self.studies.interrupts:
                for ctx, batch in self.order():
                    if context_steps is None or ctx != self.context:
                        if context_steps is not None:
                            # Done with the last context: its prompts' K/V would crowd
                            # this one's (a long context's fill much of a GPU).
                            _release_context(context_steps.measuring.measurers)
                        self.at_context(ctx)
                        context_steps = Steps(self.studies, Measuring(
                            self.studies, self.measurers[ctx], self.options), self.options)
                    point = (ctx, batch)
                    try:
                        races[point], size_steps = self._tune_size(
                            context_steps, self.search(ctx, batch, raced))
                        for step in size_steps:
                            step.ctx = self.studies.context  # None: one context
                        steps += size_steps
                        if raced is None:
                            raced = [Selection.of(s) for s in races[point]["specs"].values()]
                    except (StepFailed, torch.cuda.OutOfMemoryError) as error:
                        if isinstance(error, torch.cuda.OutOfMemoryError):
                            error = f"out of memory: {str(error).splitlines()[0]}"
                        not_tuned.append(NotTuned(ctx, batch, str(error)))
                        log.warning("%s not tuned: %s", self._point_words(ctx, batch), error)
                        _free_device_memory(self.measurers[ctx][batch])
                self.studies.interrupts.check()
        except (BudgetSpent, KeyboardInterrupt) as stop:
            interrupted = isinstance(stop, KeyboardInterrupt)
            cut.append(self._cut_words("Ctrl-C" if interrupted else "--time-budget"))
        sizes = []
        failed = {(n.ctx, n.batch_size) for n in not_tuned}
        for ctx in self.contexts:
            self.at_context(ctx)
            for batch in self.sizes:
                if (ctx, batch) in failed:
                    continue
                size = (race_size(batch, races[ctx, batch], ctx) if (ctx, batch) in races
                        else self._partial_size(ctx, batch))
                if size is not None:
                    sizes.append(size)
                elif cut:
                    not_tuned.append(NotTuned(ctx, batch, "not reached: the run was cut short"))
        if not sizes and cut:
            if interrupted:
                raise KeyboardInterrupt
            raise VegasError("--time-budget ran out before any trial finished; raise it or "
                             "tune a smaller workload (--num-prompts, --ctx, --budgets)")
        if not sizes:
            reasons = "; ".join(f"{self._point_words(n.ctx, n.batch_size)}: {n.reason}"
                                for n in not_tuned)
            raise VegasError(f"no batch size could be tuned ({reasons}); lower --batch-size "
                             "or --ctx")
        # Each (context, size)'s steps in step order, shortest context and smallest size
        # first (the schedule's order), whatever order they were tuned in.
        steps.sort(key=lambda s: (s.ctx or 0, s.batch_size))
        return TuneResult(sizes, steps, self.all_trials(), sorted(not_tuned), cut, interrupted)

    def _point_words(self, ctx: int, batch: int) -> str:
        """``batch 16``, or ``batch 16 at ctx 4096`` in a tune of several contexts."""
        return f"batch {batch}" + (f" at ctx {ctx}" if self.several_contexts else "")

    def _cut_words(self, by: str) -> str:
        where = self.studies.where
        if where is None:
            return f"stopped by {by} between steps"
        step, batch, total = where
        study = self.studies.existing(step, batch)
        done = self.studies.finished(study) if study is not None else 0
        order = self.order()
        here = (self.context, batch)
        later = order[order.index(here) + 1:] if here in order else []
        sizes = [b for c, b in later if c == here[0]]
        contexts = list(dict.fromkeys(c for c, _ in later if c != here[0]))
        missed = ([f"batch size{'s' if len(sizes) > 1 else ''} {', '.join(map(str, sizes))}"]
                  if sizes else []) + (
            [f"context{'s' if len(contexts) > 1 else ''} {', '.join(map(str, contexts))}"]
            if contexts else [])
        rest = f"; {' and '.join(missed)} not reached" if missed else ""
        return (f"{step} at {self._point_words(self.context, batch)}: {done} of {total} "
                f"trials finished when {by} "
                f"stopped the run{rest}")

    def _partial_size(self, ctx: int, batch: int) -> SizeResult | None:
        """What a size cut short before its race can say: its fastest sweep run beside
        the sweep's vanilla run, one round each (no interval: it runs vanilla); None when
        the sweep finished no speculative run. The studies are at ``ctx``
        (``at_context``)."""
        study = self.studies.existing(SWEEP, batch)
        done = self.studies.complete(study) if study else []
        runs = [t for t in done if t.user_attrs.get("claim") != VANILLA]
        if not runs:
            return None
        best = max(runs, key=lambda t: t.user_attrs["tokens_per_second"])
        vanilla = next((t.user_attrs for t in done if t.user_attrs.get("claim") == VANILLA), None)
        return SizeResult(batch, spec_of(best), _single_figures(best.user_attrs, vanilla), ctx)

    def all_trials(self) -> list[dict]:
        return self.studies.all_trials()


def race_size(batch: int, race: dict, ctx: int) -> SizeResult:
    """A size's result at ``ctx`` from its race: the pick's rounds, vanilla's, and the best
    streaming configuration's (the pick itself when it is streaming)."""
    series, name, specs = race["series"], race["chosen"], race["specs"]
    streaming = name if specs[name].drafter == "streaming" else best_of(series, specs,
                                                                        "streaming")
    figures = _figures(series[name], series[VANILLA],
                       series[streaming] if streaming else None,
                       over(series, name, streaming) if streaming else None)
    return SizeResult(batch, specs[name], figures, ctx)


def _release_context(measurers: dict[int, Measurer]) -> None:
    """After a context's last size: free what its measurers keep (prompt K/V copies, the
    model's kept cache and graphs), so the next context starts from free memory."""
    for measurer in measurers.values():
        measurer.release()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _free_device_memory(measurer: Measurer) -> None:
    """After an out-of-memory size: drop the model's kept cache so the next size starts
    from free memory."""
    release_workspace(measurer.model.net)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _pair(attrs: dict | None, name: str, as_name: str, digits: int) -> dict:
    """``{as_name: mean, as_name_interval: [low, high]}`` from stored attributes; null
    where missing."""
    value = attrs.get(name) if attrs else None
    low, high = (attrs.get(f"{name}_low"), attrs.get(f"{name}_high")) if attrs else (None, None)
    return {as_name: None if value is None else round(value, digits),
            f"{as_name}_interval": (None if low is None or high is None
                                    else [round(low, digits), round(high, digits)])}


def _figures(chosen: dict, vanilla: dict, streaming: dict | None, over_streaming) -> dict:
    """A configuration's figures in the profile's ``Results`` shape, from race series
    (``measure.series_attrs``) and its ratio to the best streaming configuration."""
    ratio = over_streaming.attrs("speedup_over_streaming") if over_streaming else None
    return {**_pair(chosen, "tokens_per_second", "tokens_per_second", 3),
            **_pair(vanilla, "tokens_per_second", "vanilla_tokens_per_second", 3),
            **_pair(streaming, "tokens_per_second", "streaming_tokens_per_second", 3),
            **_pair(chosen, "speedup", "speedup", 4),
            **_pair(ratio, "speedup_over_streaming", "speedup_over_streaming", 4),
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


def warn_if_hard_to_time(decoded_per_measurement: int) -> None:
    """Warn, before any work, about a workload that decodes too few tokens per
    measurement to time well (the refusals are ``preflight.check_values``')."""
    if decoded_per_measurement < MIN_TOKENS_PER_MEASUREMENT:
        log.warning("each measurement decodes only %d tokens (batches x --max-new-tokens): "
                    "expect wide intervals; raise --max-new-tokens or --num-prompts",
                    decoded_per_measurement)


def parse_ctx(text: str | int) -> int:
    """'2048', '8k', '64k', '128K' -> tokens (k = 1024): one context. A list is ``tune``'s
    alone (``parse_contexts``); the commands that take one context refuse it here."""
    if "," in str(text):
        raise VegasError(f"--ctx '{text}': this command takes one context; a list such as "
                         "4k,16k is for tune")
    return _context(text, text)


def parse_contexts(text: str | int) -> tuple[int, ...]:
    """'4k,16k,32k' -> (4096, 16384, 32768): the contexts to tune, each as ``parse_ctx``
    reads one, none twice; returned ascending. One value is a tuple of one."""
    values = [_context(part, text) for part in str(text).split(",")]
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise VegasError(f"--ctx '{text}': {repeated[0]} tokens is given twice; list each "
                         "context once")
    return tuple(sorted(values))


def _context(part: str | int, given: str | int) -> int:
    """One context of ``given`` (the whole ``--ctx`` text, for the message) in tokens."""
    raw = str(part).strip().lower()
    try:
        value = int(raw[:-1]) * 1024 if raw.endswith("k") else int(raw)
    except ValueError:
        raise VegasError(f"--ctx '{given}' is not a token count or a comma-separated list of "
                         "them; use e.g. 2048, 8k or 4k,16k,32k") from None
    if value < MIN_CONTEXT:
        raise VegasError(f"--ctx must be at least {MIN_CONTEXT} tokens, got {value}")
    return value


def batch_sizes(text: str | int) -> tuple[int, ...]:
    """'1,16,64' -> (1, 16, 64): batch sizes to tune, each a whole number >= 1, no
    repeats; returned ascending."""
    return parse_whole_numbers(text, "--batch-size", " is not a whole number or a "
                               "comma-separated list of them, e.g. 1,16,64", 1,
                               "every size must be >= 1")
