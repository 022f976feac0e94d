"""The tuning steps at one batch size: ``sweep``, ``extend``, ``focus`` and ``race``.

1. ``sweep``: vanilla once, then every (selection, budget) of the search once at the
   probe gamma, and one of each cost family (drafter and score) again at half the probe
   gamma (the short probes). Each run
   gives acceptance at every draft position and the step times, at this batch size.
2. ``extend``: the cost model (``vegas_tune.costmodel``) predicts tokens/s for every
   (selection, budget, gamma). Where a drafter's best prediction lies on the edge of an
   axis, or a budget edge's best pair is predicted within ``EDGE_MARGIN`` of it, that axis
   is extended once: the next budget out (twice the largest, half the smallest), or a
   longer probe gamma where the best gamma is the largest with known acceptance. No
   extension, no trials.
3. ``focus``: the best predicted pairs (``FOCUS_PAIRS``) are measured once at their
   best predicted gamma: a pair's acceptance shifts with gamma, and pairs within a few
   percent of each other are ranked by one sweep run each.
4. ``race``: the best predicted (selection, budget) pairs (``TuneOptions.candidates`` of
   them) and each drafter's best two, each at its best predicted gamma and the gammas
   either side, are measured with vanilla in interleaved rounds. After ``MIN_ROUNDS``
   each is judged by its throughput over the leader's, round by round: one that is
   surely slower drops out, and the race ends when one is left, when no one left can
   beat the leader by more than ``precision``, or after ``max_rounds``
   (``race_verdict``). The pick is the highest mean: configurations the data cannot
   order are measured more, never broken towards the smaller parameter.

``Measuring`` is the one way a step measures: it claims the configuration (several
workers share a study), turns an out-of-memory error into a failed trial with its
reason, and stores every metric on the trial.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from vegas_core import SpecConfig
from vegas_core.spec_config import MAX_GAMMA
from vegas_tune.costmodel import Curve, Run, expected_tokens, per_token_extra
from vegas_tune.measure import (Measurement, Measurer, out_of_memory, out_of_memory_words, race,
                                ratio_estimate, series_attrs)
from vegas_tune.options import TuneOptions
from vegas_tune.space import MAX_WINDOW, MIN_BUDGET, Point, Selection
from vegas_tune.stats import Estimate, estimate
from vegas_tune.studies import StepFailed, Studies

log = logging.getLogger("vegas_tune")

SWEEP, EXTEND, FOCUS, RACE = "sweep", "extend", "focus", "race"
STEPS = (SWEEP, EXTEND, FOCUS, RACE)
# Pairs the focus step measures at their best predicted gamma. Pairs within 2% of each
# other are ranked by one sweep run (about 1% noise) at a gamma whose acceptance is not
# theirs: SmolLM2 8k at batch 64 on an H100, one sweep ranked the grid's best pair 7th.
FOCUS_PAIRS = 8
VANILLA = "vanilla"
# Pairs of each drafter raced (each at its best predicted gamma and either side), beside
# the best pairs overall: the profile's "over streaming" compares with the best streaming
# configuration raced, and one drafter's pairs can lie within the model's error of each
# other. Gemma3-270M 32k at batch 128 on an H100: streaming at 2048 slots was predicted
# 1.2% below 1024 slots and not raced; the grid measured it 5% faster (tuner-regret.md).
DRAFTER_PAIRS = 2
# Rounds before a configuration may drop out or the race stop for precision: fewer give
# intervals too wide (t quantile 12.7 at two samples) to decide on.
MIN_ROUNDS = 3
# Rounds a configuration needs for an interval at all: when the time budget runs out
# mid-race, it stops at this many.
MIN_INTERVAL_ROUNDS = 2
# A measurement below this many decoded tokens per configuration is timing noise.
MIN_TOKENS_PER_MEASUREMENT = 64
# A steady window shorter than this is warned about: timer and launch jitter dominate.
MIN_TIMED_SECONDS = 0.1
# The gamma axis grows by half the probe gamma (at least this) when extended.
MIN_GAMMA_STEP = 2
# A budget edge is extended when its best pair is predicted within this of the drafter's
# best, not only when it holds the best: the sweep predicts other gammas from one run per
# pair. Gemma3-270M 32k at batch 128 (H100, 73fb8ab): streaming's best after the sweep lay
# at 512 slots and its 1024-slot edge was never extended; after the focus runs 1024 was
# streaming's best, and a grid (this engine's streaming rule) had measured 2048 slots 3.5%
# faster than 1024.
EDGE_MARGIN = 0.10


@dataclass
class StepResult:
    name: str
    study: str
    trials: int
    chosen: dict
    notes: str = ""
    predictions: list[dict] = field(default_factory=list)
    within_noise: list[dict] = field(default_factory=list)
    batch_size: int | None = None
    edges: list[str] = field(default_factory=list)  # axes whose edge the pick lies on
    ctx: int | None = None  # the context tuned, in a tune of several (the tuner sets it)


def claim_of(spec: SpecConfig | None) -> str:
    """What a trial measures, as a claim key: the configuration (vanilla: ``vanilla``)."""
    return VANILLA if spec is None else json.dumps(spec.to_dict(), sort_keys=True)


def spec_of_claim(claim: str) -> SpecConfig | None:
    return None if claim == VANILLA else SpecConfig(**json.loads(claim))


def spec_of(trial) -> SpecConfig:
    """The configuration a trial measured (stored as ``spec_<field>`` attributes)."""
    values = {k.removeprefix("spec_"): v for k, v in trial.user_attrs.items()
              if k.startswith("spec_")}
    return SpecConfig(**values)


def spec_of_series(entry: dict) -> SpecConfig:
    """The configuration of a race series entry, which holds its figures beside its
    configuration's fields. Every field the entry has, not ``to_dict``'s keys: those leave
    the options out at 0 and would drop a raced ``spread``. An entry recorded before the
    fork's rule existed has no rule: this engine's, the default."""
    return SpecConfig(**{f.name: entry[f.name] for f in fields(SpecConfig) if f.name in entry})


def min_new_tokens(gamma: int, warmup_iterations: int = 0) -> int:
    """The fewest new tokens per prompt that time a speculative iteration at ``gamma``:
    the first iteration captures graphs and is not timed, and a steady window needs a
    second one even when every draft token is accepted; a warm-up's iterations (spans)
    come before both."""
    return (2 + warmup_iterations) * (gamma + 1)


class Measuring:
    """Claim, guard against out-of-memory, measure, store: every step's measurements."""

    def __init__(self, studies: Studies, measurers: dict[int, Measurer], options: TuneOptions):
        self.studies, self.measurers, self.options = studies, measurers, options

    def guarded(self, trial, claim: str, measure: Callable[[], object]):
        """Claim ``claim`` for ``trial`` (``Studies.claim``), then run ``measure``, whose
        measurements retry once after freeing kept graphs
        (``Measurer.measure_freeing_graphs``). Out of memory even so (on a GPU or the
        CPU, ``measure.out_of_memory``), the trial fails with its reason recorded (not
        retried on resume) and the tuner goes on."""
        self.studies.claim(trial.study, trial, claim)
        try:
            with self.studies.interrupts.interruptible():
                return measure()
        except (RuntimeError, MemoryError) as e:
            if not out_of_memory(e):
                raise
            reason = out_of_memory_words(e)
            trial.set_user_attr("failed_reason", f"out of memory: {reason}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if isinstance(e, torch.OutOfMemoryError):
                raise
            # The CPU allocator's failure, as the one type the studies and the tuner
            # record as out of memory (a failed trial, a size not tuned), not a bug.
            raise torch.OutOfMemoryError(reason) from e

    @staticmethod
    def store(trial, attrs: dict, spec: SpecConfig | None) -> None:
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        if spec is not None:
            for key, value in spec.to_dict().items():
                trial.set_user_attr(f"spec_{key}", value)

    def once(self, trial, batch: int) -> dict:
        """One measurement of the queued configuration a trial claims."""
        claim = trial.user_attrs["claim"]
        spec = spec_of_claim(claim)
        trial.set_user_attr("batch_size", batch)
        measurer = self.measurers[batch]
        attrs = self.guarded(trial, claim,
                             lambda: measurer.measure_freeing_graphs(spec)).as_attrs()
        self.store(trial, attrs, spec)
        return attrs

    def may_stop(self, done: int) -> bool:
        """Whether a race may stop for lack of time after ``done`` rounds."""
        return done >= MIN_INTERVAL_ROUNDS and self.studies.out_of_time()


@dataclass
class Search:
    """What one batch size searches: ``selections`` x ``budgets`` at ``probe_gamma``;
    ``longest_prefix`` turns a budget into the engine's (ratio, min_tokens) pair;
    ``gamma_limit`` is the largest gamma the workload can time."""

    batch: int
    selections: list[Selection]
    budgets: tuple[int, ...]
    probe_gamma: int
    longest_prefix: int
    gamma_limit: int
    ctx: int

    def spec(self, point: Point) -> SpecConfig:
        return point.spec(self.longest_prefix)

    @property
    def short_probes(self) -> list[Point]:
        """One configuration of each cost family (``cost_family``) again at half the probe
        gamma: what a drafted token costs beyond its draft forward
        (``costmodel.per_token_extra``). Families differ in it: on Gemma3 32k at batch 128
        (H100) a drafted token cost vegas's weight rules 1.0 ms beyond its draft forward
        where the one probe, a logit rule, gave 0.53 ms, and the weight rules' predictions
        fell up to 23% short."""
        gamma = self.probe_gamma // 2
        if gamma < 1:
            return []
        middle = self.budgets[len(self.budgets) // 2]
        firsts = {}
        for selection in self.selections:
            firsts.setdefault(cost_family(selection), selection)
        return [Point(s, middle, gamma) for s in firsts.values()]

    def sweep_points(self) -> list[Point]:
        points = [Point(s, b, self.probe_gamma) for s in self.selections for b in self.budgets]
        return points + self.short_probes


def cost_family(selection: Selection) -> tuple[str, str, str]:
    """Selections whose drafted tokens cost the same beyond their draft forward: one
    drafter, score and rule (the window moves which slots are read, not how many)."""
    score = selection.score if selection.drafter == "vegas" else ""
    return selection.drafter, score, selection.rule


class Landscape:
    """The cost model at one batch size, from its sweep, extend and focus runs."""

    def __init__(self, trials: list, batch: int, search: Search):
        self.batch, self.search = batch, search
        runs: dict[tuple[Selection, int], list[Run]] = {}
        self.vanilla: dict | None = None
        for t in trials:
            if t.user_attrs.get("claim") == VANILLA:
                self.vanilla = t.user_attrs
                continue
            point = Point.of(spec_of(t))
            runs.setdefault(point.curve, []).append(_run_of(t.user_attrs, point.gamma, batch))
        self.extras = {}  # cost family -> per_token_extra, from its short probe
        for short in search.short_probes:
            by_gamma = {r.gamma: r for r in runs.get(short.curve, [])}
            if {search.probe_gamma, short.gamma} <= set(by_gamma):
                self.extras[cost_family(short.selection)] = per_token_extra(
                    by_gamma[search.probe_gamma], by_gamma[short.gamma])
        floor = self.vanilla["decode_step_seconds"] if self.vanilla else 0.0
        self.curves = {key: Curve(r, self.extra_for(key[0]), floor) for key, r in runs.items()}

    def extra_for(self, selection: Selection) -> float:
        """The per-token extra of ``selection``'s cost family; a family without its probe
        (a run cut short; a storage from a tuner that probed one family) takes the mean of
        those measured, none measured 0."""
        found = self.extras.get(cost_family(selection))
        if found is not None:
            return found
        return sum(self.extras.values()) / len(self.extras) if self.extras else 0.0

    def predict(self, point: Point) -> float:
        return self.curves[point.curve].tokens_per_second(point.gamma, self.batch)

    def points(self) -> list[Point]:
        """Every point the model predicts: each curve at gamma 1 to its top gamma."""
        return [Point(sel, budget, g) for (sel, budget), curve in self.curves.items()
                for g in range(1, curve.top_gamma + 1)]

    def ranked(self) -> list[Point]:
        """Every point, the fastest predicted first (ties: the smaller point)."""
        return sorted(self.points(), key=lambda p: (-self.predict(p), p))

    def measured(self, point: Point) -> bool:
        """Whether a run of ``point``'s pair at its gamma is in the model."""
        curve = self.curves.get(point.curve)
        return curve is not None and any(r.gamma == point.gamma for r in curve.runs)

    def curve_bests(self) -> list[Point]:
        """Each curve at its best predicted gamma, the fastest first."""
        seen: set = set()
        bests = []
        for point in self.ranked():
            if point.curve not in seen:
                seen.add(point.curve)
                bests.append(point)
        return bests

    def best(self, drafter: str | None = None, budget: int | None = None) -> Point | None:
        for point in self.ranked():
            if ((drafter is None or point.selection.drafter == drafter)
                    and (budget is None or point.budget == budget)):
                return point
        return None

    def budgets_of(self, selection: Selection) -> list[int]:
        return sorted(b for s, b in self.curves if s == selection)

    def prediction_row(self, point: Point) -> dict:
        curve = self.curves[point.curve]
        return {**_point_fields(point, self.search),
                "predicted_tokens_per_second": round(self.predict(point), 3),
                "predicted_mean_accepted_length": round(
                    expected_tokens(curve.acceptance, point.gamma), 4)}


def _run_of(attrs: dict, gamma: int, batch: int) -> Run:
    """A sweep measurement as the cost model's ``Run``: the steady window's iterations
    where there are any, else every timed iteration."""
    steady = attrs["steady_iterations"]
    seconds = attrs["steady_seconds"] if steady else attrs["decode_seconds"]
    tokens = attrs["steady_tokens"] if steady else attrs["decode_tokens"]
    iterations = max(steady or attrs["iterations"], 1)
    return Run(gamma, seconds / iterations, attrs["draft_step_seconds"],
               tuple(attrs["acceptance_by_position"]), tokens / (iterations * batch))


def _point_fields(point: Point, search: Search) -> dict:
    spec = search.spec(point)
    return {"drafter": spec.drafter, "score": spec.score, "window": spec.window,
            **spec.options_set(), "budget": point.budget, "gamma": point.gamma,
            "sparsity_ratio": spec.sparsity}


class Steps:
    """The steps at any batch size, on shared studies and measurements."""

    def __init__(self, studies: Studies, measuring: Measuring, options: TuneOptions):
        self.studies, self.measuring, self.options = studies, measuring, options

    def _grid_study(self, step: str, batch: int):
        import optuna  # deferred: see vegas_tune.studies

        return self.studies.study(step, optuna.samplers.RandomSampler(seed=self.options.seed),
                                  batch)

    def _measure_grid(self, step: str, search: Search, specs: list[SpecConfig | None]) -> list:
        """Measure each of ``specs`` once at ``search.batch`` (queued grid points)."""
        batch = search.batch
        study = self._grid_study(step, batch)

        def objective(trial) -> float:
            attrs = self.measuring.once(trial, batch)
            if trial.user_attrs["claim"] == VANILLA and attrs["steady_seconds"] < MIN_TIMED_SECONDS:
                log.warning("each measurement at batch %d times only %.0f ms of decoding: "
                            "timings that short are noisy; raise --max-new-tokens or "
                            "--num-prompts", batch, 1e3 * attrs["steady_seconds"])
            return attrs["tokens_per_second"]

        grid = [({}, claim_of(spec)) for spec in specs]
        return self.studies.run(study, objective, len(grid), step, batch, grid=grid,
                                best=_sweep_words)

    # ---- 1. sweep ---------------------------------------------------------------------

    def sweep(self, search: Search) -> tuple[Landscape, StepResult]:
        points = search.sweep_points()
        done = self._measure_grid(SWEEP, search, [None] + [search.spec(p) for p in points])
        landscape = Landscape(done, search.batch, search)
        best = landscape.best()
        notes = (f"{len(search.selections)} selection(s) x budgets "
                 f"{', '.join(map(str, search.budgets))} at gamma {search.probe_gamma}, "
                 f"vanilla, and {len(search.short_probes)} short probe(s) at gamma "
                 f"{search.probe_gamma // 2 if search.short_probes else '-'}; best predicted: "
                 + (f"{best.words()} ({landscape.predict(best):.1f} tok/s)" if best else "none"))
        chosen = _point_fields(best, search) if best else {}
        return landscape, StepResult(SWEEP, self.studies.name(SWEEP, search.batch),
                                     self.studies.finished(self._grid_study(SWEEP, search.batch)),
                                     chosen, notes, batch_size=search.batch)

    # ---- 2. extend --------------------------------------------------------------------

    @staticmethod
    def extension(landscape: Landscape, search: Search) -> tuple[list[Point], list[str]]:
        """Points that extend an axis near each drafter's best prediction, and what each
        extends, in words: the budget axis past an edge whose best pair is predicted within
        ``EDGE_MARGIN`` of the drafter's best, and gamma past the best's top gamma."""
        points: list[Point] = []
        words: list[str] = []
        budgets = search.budgets
        for drafter in dict.fromkeys(s.drafter for s in search.selections):
            best = landscape.best(drafter)
            if best is None:
                continue
            floor = (1 - EDGE_MARGIN) * landscape.predict(best)
            for edge, beyond, way in ((budgets[-1], 2 * budgets[-1], "up"),
                                      (budgets[0], budgets[0] // 2, "down")):
                near = landscape.best(drafter, budget=edge)
                if (MIN_BUDGET <= beyond < search.ctx and near is not None
                        and landscape.predict(near) >= floor):
                    points.append(Point(near.selection, beyond, search.probe_gamma))
                    words.append(f"budget {way} to {beyond} slots for {near.selection.words()}")
            top = landscape.curves[best.curve].top_gamma
            longer = min(top + max(MIN_GAMMA_STEP, top // 2), search.gamma_limit)
            if best.gamma == top and longer > top:
                points.append(best.with_gamma(longer))
                words.append(f"gamma up to {longer} for {best.selection.words()}, "
                             f"{best.budget} slots")
        return list(dict.fromkeys(points)), words

    def landscape(self, search: Search, through: str) -> Landscape:
        """The cost model from the finished runs of the steps up to ``through`` at this
        size: never a later step's, which another worker may already be measuring, so
        that every worker sees the same model after each step."""
        steps = (SWEEP, EXTEND, FOCUS)
        studies = [self.studies.existing(step, search.batch)
                   for step in steps[: steps.index(through) + 1]]
        runs = [t for study in studies if study is not None
                for t in self.studies.complete(study)]
        return Landscape(runs, search.batch, search)

    def extend(self, landscape: Landscape, search: Search
               ) -> tuple[Landscape, StepResult | None]:
        points, words = self.extension(landscape, search)
        if not points:
            return landscape, None
        try:
            done = self._measure_grid(EXTEND, search, [search.spec(p) for p in points])
        except StepFailed:
            done = []  # every extension failed (out of memory): the sweep's answer stands
        study = self._grid_study(EXTEND, search.batch)
        failed = sorted({t.user_attrs["failed_reason"].split(":")[0]
                         for t in study.get_trials(deepcopy=False)
                         if "failed_reason" in t.user_attrs})
        extended = self.landscape(search, EXTEND)
        best = extended.best()
        notes = (f"the best predictions lay on or near an axis's edge: tried {'; '.join(words)}; "
                 f"{len(done)} of {len(points)} measured"
                 + (f" (the others: {', '.join(failed)})" if failed else "")
                 + f"; best predicted now: {best.words()} ({extended.predict(best):.1f} tok/s)")
        return extended, StepResult(EXTEND, study.study_name, self.studies.finished(study),
                                    _point_fields(best, search), notes, batch_size=search.batch)

    # ---- 3. focus ---------------------------------------------------------------------

    def focus(self, landscape: Landscape, search: Search
               ) -> tuple[Landscape, StepResult | None]:
        """Measure each of the ``FOCUS_PAIRS`` best pairs once at its best predicted
        gamma (unless a run there exists): its acceptance at that gamma, and a second
        point of its time line."""
        points = [p for p in landscape.curve_bests()[:FOCUS_PAIRS] if not landscape.measured(p)]
        if not points:
            return landscape, None
        try:
            self._measure_grid(FOCUS, search, [search.spec(p) for p in points])
        except StepFailed:
            return landscape, None  # every run failed (out of memory): the sweep's answer stands
        focused = self.landscape(search, FOCUS)
        study = self._grid_study(FOCUS, search.batch)
        best = focused.best()
        notes = (f"the {len(points)} best predicted (selection, budget) pairs not yet measured "
                 f"at their best gamma, once each there; best predicted now: {best.words()} "
                 f"({focused.predict(best):.1f} tok/s)")
        return focused, StepResult(FOCUS, study.study_name, self.studies.finished(study),
                                   _point_fields(best, search), notes, batch_size=search.batch)

    # ---- 4. race ----------------------------------------------------------------------

    def candidates(self, landscape: Landscape) -> list[Point]:
        """Each of the ``candidates`` best (selection, budget) pairs at its best predicted
        gamma and the gammas either side, then each drafter's ``DRAFTER_PAIRS`` best pairs
        the same way, where not among them.

        Pairs, not the best points: near its best gamma a pair's curve is flat, so the
        best points are mostly one pair at adjacent gammas, while pairs that differ in
        selection by 2% are known from one sweep run each (SmolLM2 8k, batch 64, H100:
        the 4 best points, one pair at gammas 9-12, left out the grid's best pair). And
        either side: the measured best gamma of a pair lay one from its prediction."""
        bests = landscape.curve_bests()
        pairs = bests[: self.options.candidates]
        for drafter in dict.fromkeys(s.drafter for s in landscape.search.selections):
            pairs += [p for p in bests if p.selection.drafter == drafter][:DRAFTER_PAIRS]
        chosen: list[Point] = []
        for best in dict.fromkeys(pairs):
            top = landscape.curves[best.curve].top_gamma
            chosen += [best.with_gamma(g) for g in (best.gamma, best.gamma - 1, best.gamma + 1)
                       if 1 <= g <= top]
        return chosen

    def race(self, landscape: Landscape, search: Search) -> tuple[dict, StepResult]:
        """Race the candidates; returns (the race: ``series`` by name, ``chosen`` name,
        ``specs`` by name) and the step's summary."""
        import optuna  # deferred: see vegas_tune.studies

        batch = search.batch
        points = self.candidates(landscape)
        if not points:
            raise StepFailed(f"step '{self.studies.label(RACE, batch)}': the sweep measured no "
                             "speculative configuration to race")
        specs = {f"c{i + 1}": search.spec(p) for i, p in enumerate(points)}
        configs: dict[str, SpecConfig | None] = {VANILLA: None, **specs}
        study = self.studies.study(RACE, optuna.samplers.RandomSampler(seed=self.options.seed),
                                   batch)
        claim = "race " + json.dumps({n: s.to_dict() for n, s in specs.items()}, sort_keys=True)
        label = self.studies.label(RACE, batch)
        o = self.options

        def decide(done: int, samples: dict[str, list[Measurement]]) -> set[str]:
            rounds = {n: [m.tokens_per_second for m in samples[n]] for n in specs
                      if len(samples[n]) == done}
            live, decided = race_verdict(rounds, o.precision)
            if len(rounds) > 1 and done >= MIN_ROUNDS:
                leader = ratio_estimate(samples[live[0]], samples[VANILLA])
                self.studies.report(label, done, o.max_rounds,
                                    f"{leader.words()} over vanilla, {len(live)} racing",
                                    unit="rounds")
            if decided or self.measuring.may_stop(done):
                return set()
            return set(live) | {VANILLA}

        def objective(trial) -> float:
            trial.set_user_attr("batch_size", batch)
            measurer = self.measuring.measurers[batch]
            samples = self.measuring.guarded(
                trial, trial.user_attrs["claim"],
                lambda: race(measurer, configs, o.max_rounds, decide))
            result = race_result(samples, specs, search)
            trial.set_user_attr("series", result["series"])
            trial.set_user_attr("chosen", result["chosen"])
            return result["series"][result["chosen"]]["speedup"]

        done = self.studies.run(study, objective, 1, RACE, batch, grid=[({}, claim)], quiet=True)
        trial = [t for t in done if t.user_attrs.get("claim") == claim][-1]
        series, name = trial.user_attrs["series"], trial.user_attrs["chosen"]
        result = {"series": series, "chosen": name,
                  "specs": {n: spec_of_series(s) for n, s in series.items() if n != VANILLA}}
        return result, self._race_summary(result, landscape, points, search, study)

    def _race_summary(self, result: dict, landscape: Landscape, points: list[Point],
                      search: Search, study) -> StepResult:
        series, name = result["series"], result["chosen"]
        chosen = Point.of(result["specs"][name])
        pick = Estimate.from_attrs(series[name], "speedup")
        tied = [n for n in result["specs"] if n != name and Estimate.from_attrs(
            series[n], "speedup").overlaps(pick)]
        rounds = max(s["rounds"] for s in series.values())
        notes = (f"raced {len(points)} configurations beside vanilla for {rounds} rounds "
                 f"(those whose interval fell below the leader's dropped out after "
                 f"{MIN_ROUNDS}); picked the highest mean")
        if tied:
            notes += (f"; {len(tied)} other(s) within noise after measuring more (overlapping "
                      "95% intervals): the higher mean taken")
        streaming = best_of(series, result["specs"], "streaming")
        edges = edge_words(chosen, landscape, search)
        return StepResult(RACE, study.study_name, self.studies.finished(study),
                          {**_point_fields(chosen, search), **_race_figures(series[name])},
                          notes, self._predictions(landscape, series, result["specs"], chosen,
                                                   streaming),
                          [{**_point_fields(Point.of(result["specs"][n]), search),
                            **_race_figures(series[n])} for n in tied],
                          search.batch, edges)

    def _predictions(self, landscape: Landscape, series: dict, specs: dict, chosen: Point,
                     streaming: str | None) -> list[dict]:
        """The prediction rows a profile keeps: each curve's best gamma, every gamma of
        the pick's curve and of the best streaming one's, every raced configuration (with
        what the race measured)."""
        keep = [Point(sel, b, curve.best_gamma(landscape.batch))
                for (sel, b), curve in landscape.curves.items()]
        for point in [chosen] + ([Point.of(specs[streaming])] if streaming else []):
            top = landscape.curves[point.curve].top_gamma
            keep += [point.with_gamma(g) for g in range(1, top + 1)]
        raced = {Point.of(s): n for n, s in specs.items()}
        keep += list(raced)
        rows = []
        for point in sorted(dict.fromkeys(keep)):
            row = landscape.prediction_row(point)
            measured = series.get(raced.get(point, ""))
            speedup = Estimate.from_attrs(measured, "speedup") if measured else None
            rows.append({**row,
                         "measured_tokens_per_second": _rounded(
                             measured and measured["tokens_per_second"]),
                         "measured_mean_accepted_length": _rounded(
                             measured and measured["mean_accepted_length"], 4),
                         "measured_speedup": _rounded(speedup and speedup.mean, 4),
                         "measured_speedup_interval": None if speedup is None else
                         [round(speedup.low, 4), round(speedup.high, 4)]})
        return rows


def race_verdict(rounds: dict[str, list[float]], precision: float) -> tuple[list[str], bool]:
    """After each round of a race: (the names still racing, the leader first; whether the
    race is decided). ``rounds``: each racing configuration's tokens/s, round by round
    (all of them the same rounds).

    The leader has the highest mean. Before ``MIN_ROUNDS`` nothing is decided. Then each
    other configuration is judged by its throughput over the leader's, round by round (a
    paired ratio: drift between rounds cancels): one whose 95% interval lies wholly below
    1 drops out, and the race is decided when one is left, or when no one left can beat
    the leader by more than ``precision`` (every interval's top at most 1 + precision):
    picking the leader then costs at most that share."""
    names = sorted(rounds, key=lambda n: -estimate(rounds[n]).mean if len(rounds[n]) > 1
                   else -rounds[n][0])
    if len(rounds[names[0]]) < MIN_ROUNDS or len(names) == 1:
        return names, len(names) == 1
    leader = rounds[names[0]]
    ratios = {n: estimate([a / b for a, b in zip(rounds[n], leader)]) for n in names[1:]}
    live = [names[0]] + [n for n in names[1:] if ratios[n].high >= 1.0]
    decided = all(ratios[n].high <= 1.0 + precision for n in live[1:])
    return live, decided


def race_result(samples: dict[str, list[Measurement]], specs: dict[str, SpecConfig],
                search: Search) -> dict:
    """The race's series by name (each candidate's configuration fields beside its
    figures) and the pick: the highest mean speedup among those that ran the last round."""
    vanilla = samples[VANILLA]
    rounds = len(vanilla)
    series: dict[str, dict] = {VANILLA: {
        "drafter": VANILLA, **Measurement.average(vanilla).as_attrs(),
        **estimate([m.tokens_per_second for m in vanilla]).attrs("tokens_per_second"),
        "rounds": rounds, "round_tokens_per_second": [round(m.tokens_per_second, 3)
                                                      for m in vanilla]}}
    for name, spec in specs.items():
        point = Point.of(spec)
        series[name] = {**spec.to_dict(), "budget": point.budget,
                        **series_attrs(samples[name], vanilla[:len(samples[name])])}
    finalists = [n for n in specs if len(samples[n]) == max(len(samples[m]) for m in specs)]
    chosen = max(finalists, key=lambda n: series[n]["speedup"])
    return {"series": series, "chosen": chosen}


def best_of(series: dict, specs: dict[str, SpecConfig], drafter: str) -> str | None:
    """The name of ``drafter``'s best raced configuration (highest mean speedup)."""
    names = [n for n, s in specs.items() if s.drafter == drafter]
    return max(names, key=lambda n: series[n]["speedup"]) if names else None


def over(series: dict, name: str, other: str) -> Estimate:
    """``name``'s throughput over ``other``'s, round by round (the rounds both ran)."""
    mine, theirs = series[name]["round_tokens_per_second"], series[other]["round_tokens_per_second"]
    return estimate([a / b for a, b in zip(mine, theirs)])


def edge_words(point: Point, landscape: Landscape, search: Search) -> list[str]:
    """Each axis on whose measured edge ``point`` lies, with the predicted figure there."""
    words = []
    figure = f"{landscape.predict(point):.1f} tok/s predicted there"
    budgets = landscape.budgets_of(point.selection)
    if len(budgets) > 1 and point.budget == budgets[-1]:
        words.append(f"budget: {point.budget} slots is the largest measured for "
                     f"{point.selection.words()} ({figure})")
    elif len(budgets) > 1 and point.budget == budgets[0]:
        words.append(f"budget: {point.budget} slots is the smallest measured for "
                     f"{point.selection.words()} ({figure})")
    top = landscape.curves[point.curve].top_gamma
    if point.gamma == top:
        if top >= MAX_GAMMA:
            why = "the engine's maximum"
        elif top >= search.gamma_limit:
            why = (f"the longest the workload can time; --max-new-tokens "
                   f"{min_new_tokens(top + MIN_GAMMA_STEP)} would allow more")
        else:
            why = "a tune extends each axis once"
        words.append(f"gamma: {top} is the largest with measured acceptance, {why} ({figure})")
    if point.selection.drafter == "vegas" and point.selection.window == MAX_WINDOW:
        words.append(f"window: {MAX_WINDOW:g} is the engine's largest sink-and-recent share "
                     f"({figure})")
    return words


def _race_figures(series: dict) -> dict:
    speedup = Estimate.from_attrs(series, "speedup")
    return {"tokens_per_second": round(series["tokens_per_second"], 3),
            "speedup": round(speedup.mean, 4), "speedup_low": round(speedup.low, 4),
            "speedup_high": round(speedup.high, 4), "rounds": series["rounds"]}


def _sweep_words(done: list) -> str | None:
    runs = [t for t in done if t.user_attrs.get("claim") != VANILLA]
    if not runs:
        return None
    top = max(runs, key=lambda t: t.user_attrs["mean_accepted_length"])
    point = Point.of(spec_of(top))
    return (f"{point.selection.words()}, {point.budget} slots: "
            f"{top.user_attrs['mean_accepted_length']:.2f} tokens per iteration")


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
