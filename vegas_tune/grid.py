"""Exhaustive grids and regret: is the tuner's pick the best configuration there is?

``run_grid`` measures every point of a declared space (``vegas_tune.space``: the
target's selections x budgets x gammas) once on one workload with the tuner's
``Measurer``, vanilla interleaved every few points so that each point's speedup is over
a vanilla run measured minutes, not an hour, away. ``compare`` then races named
configurations (the grid's best, the picks of one or more profiles) beside vanilla in
interleaved rounds: the regret of a pick is 1 - its throughput over the best's, round by
round, with a 95% interval. ``vegas-tune grid`` is the command.
"""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vegas_core import SpecConfig
from vegas_core.errors import VegasError
from vegas_tune.measure import (Measurer, interleave, out_of_memory, out_of_memory_words,
                                series_attrs)
from vegas_tune.profile import write_text_atomically
from vegas_tune.space import Point, selections
from vegas_tune.stats import Estimate, estimate

# A vanilla run between every this many grid points by default.
VANILLA_EVERY = 8
GRID_BEST = "grid #"  # + rank: the grid's best points by their one run
# Grid points re-measured beside the picks: the best of one run each is partly luck, so
# the best of these in the comparison's rounds is the reference.
GRID_TOP = 3
# The fewest rounds that give a regret an interval.
MIN_COMPARE_ROUNDS = 2


def parse_gammas(text: str) -> tuple[int, ...]:
    """'4-12' -> 4..12; '6,8,10' -> those; ascending, each >= 1."""
    raw = str(text).strip()
    try:
        if "-" in raw:
            low, high = (int(x) for x in raw.split("-", 1))
            gammas = list(range(low, high + 1))
        else:
            gammas = [int(x) for x in raw.split(",")]
    except ValueError:
        raise VegasError(f"--gammas '{text}': give a range (4-12) or a list (6,8,10)") from None
    if not gammas or min(gammas) < 1:
        raise VegasError(f"--gammas '{text}': every gamma must be >= 1")
    return tuple(sorted(set(gammas)))


def grid_points(target: str, budgets: tuple[int, ...], gammas: tuple[int, ...]) -> list[Point]:
    return [Point(s, b, g) for s in selections(target) for b in budgets for g in gammas]


@dataclass
class GridResult:
    rows: list[dict]  # one per point: its configuration, tokens/s, speedup, accepted length
    vanilla: list[dict]  # the vanilla runs, in order, with the index of the point after them
    wall_seconds: float  # the whole pass, vanilla runs included

    @property
    def measured(self) -> list[dict]:
        """The rows of points that ran (not those that did not fit in memory)."""
        return [r for r in self.rows if r.get("out_of_memory") is None]

    @property
    def out_of_memory_rows(self) -> list[dict]:
        """The rows of points that did not fit in memory (their allocator's message)."""
        return [r for r in self.rows if r.get("out_of_memory") is not None]

    def best(self) -> dict:
        if not self.measured:
            raise VegasError("no point of the grid fitted in memory: lower --batch-size, "
                             "--ctx or the budgets")
        return max(self.measured, key=lambda r: r["speedup"])

    def top(self, count: int) -> list[dict]:
        return sorted(self.measured, key=lambda r: -r["speedup"])[:count]

    def to_json(self) -> dict:
        return {"rows": self.rows, "vanilla": self.vanilla, "wall_seconds": self.wall_seconds}

    @classmethod
    def from_json(cls, data: dict) -> GridResult:
        return cls(data["rows"], data["vanilla"], data["wall_seconds"])


class PassCutShort(Exception):
    """``run_grid`` stopped because ``out_of_time`` said so; ``kept`` is the partial result
    it handed to ``checkpoint`` last (every point it holds closed by a vanilla run)."""

    def __init__(self, kept: GridResult) -> None:
        super().__init__(f"{len(kept.rows)} points kept")
        self.kept = kept


def run_grid(measurer: Measurer, points: list[Point], longest_prefix: int,
             vanilla_every: int = VANILLA_EVERY,
             progress: Callable[[int, int, dict], None] | None = None,
             start: GridResult | None = None,
             checkpoint: Callable[[GridResult], None] | None = None,
             out_of_time: Callable[[], bool] | None = None) -> GridResult:
    """Measure each point once, vanilla before the first and after every
    ``vanilla_every`` points (and after the last). A point's speedup is over the
    geometric mean of the vanilla runs on either side of it.

    ``checkpoint(partial)`` is called after every vanilla run but the last, with the points
    it closes: a pass stopped at any moment loses at most the points since. ``start``, such
    a partial result, is continued: its points are kept, and the pass goes on with a fresh
    vanilla run (this process's, maybe another machine's state) before the next point.
    ``wall_seconds`` sums the passes' measuring time up to their last kept vanilla run.

    ``out_of_time()``, asked before each point after this call's first, stops the pass:
    a vanilla run closes the points measured since the last one, ``checkpoint`` gets them,
    and ``PassCutShort`` is raised (so every call measures at least one point)."""
    clock = time.perf_counter()
    before = start.wall_seconds if start else 0.0
    vanilla: list[dict] = list(start.vanilla) if start else []
    rows: list[dict] = list(start.rows) if start else []
    first = len(rows)

    def measure_vanilla(index: int) -> None:
        m = measurer.measure_freeing_graphs(None)
        vanilla.append({"before_point": index, "tokens_per_second": m.tokens_per_second,
                        "wall_seconds": m.wall_seconds})

    def elapsed() -> float:
        return before + time.perf_counter() - clock

    for index in range(first, len(points)):
        if out_of_time is not None and index > first and out_of_time():
            measure_vanilla(index)
            kept = GridResult(list(rows), list(vanilla), elapsed())
            if checkpoint:
                checkpoint(kept)
            raise PassCutShort(kept)
        if index % vanilla_every == 0 or index == first:
            measure_vanilla(index)
            if checkpoint and index:
                checkpoint(GridResult(list(rows), list(vanilla), elapsed()))
        point = points[index]
        spec = point.spec(longest_prefix)
        m = reason = None
        try:
            m = measurer.measure_freeing_graphs(spec)
        except (RuntimeError, MemoryError) as e:
            if not out_of_memory(e):
                raise
            reason = out_of_memory_words(e)
        if m is None:
            # A point that does not fit beside the cache is a finding of the grid (the
            # tuner records such a trial as failed), not the end of the pass. Out of the
            # handler, what the failed attempt allocated is garbage: free it first.
            rows.append({**_point_row(point, spec), "tokens_per_second": None,
                         "out_of_memory": reason})
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        else:
            rows.append({**_point_row(point, spec), "tokens_per_second": m.tokens_per_second,
                         "mean_accepted_length": m.mean_accepted_length,
                         "selection_overhead": m.selection_overhead,
                         "wall_seconds": m.wall_seconds})
        if progress:
            progress(index + 1, len(points), rows[-1])
    measure_vanilla(len(points))
    for index, row in enumerate(rows):
        if row.get("out_of_memory") is not None:
            continue
        # The last vanilla run at or before the point (a resumed pass's own), and the
        # first after it (the one that closed the point's stretch).
        earlier = [v for v in vanilla if v["before_point"] <= index][-1]
        later = next(v for v in vanilla if v["before_point"] > index)
        row["vanilla_tokens_per_second"] = math.sqrt(earlier["tokens_per_second"]
                                                     * later["tokens_per_second"])
        row["speedup"] = row["tokens_per_second"] / row["vanilla_tokens_per_second"]
    return GridResult(rows, vanilla, elapsed())


def partial_path(out: Path) -> Path:
    """Where a pass that writes ``out`` keeps its finished points until it ends."""
    return out.with_name(out.name + ".partial")


def read_partial(path: Path, key: dict) -> GridResult:
    """The partial pass kept at ``path``; refused unless it was measured for ``key`` (the
    model, workload, space and hardware: points measured under others would be compared
    as if they were not)."""
    try:
        data = json.loads(path.read_text())
        recorded, result = data["key"], GridResult.from_json(data["grid"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise VegasError(f"{path}: not a partial grid ({e}); delete it to start over") from None
    differs = sorted(k for k in set(key) | set(recorded) if key.get(k) != recorded.get(k))
    if differs:
        raise VegasError(f"{path} holds a grid of another {', '.join(differs)}: give the "
                         "same options to resume it, or delete it to start over")
    return result


def write_partial(path: Path, key: dict, result: GridResult) -> None:
    write_json({"key": key, "grid": result.to_json()}, path)


def _point_row(point: Point, spec: SpecConfig) -> dict:
    return {"drafter": spec.drafter, "score": spec.score, "window": spec.window,
            **spec.options_set(), "rule": spec.rule, "budget": point.budget,
            "gamma": point.gamma, "sparsity": spec.sparsity, "min_tokens": spec.min_tokens}


def row_words(row: dict) -> str:
    """``vegas logit window 0.5, 2048 slots, gamma 6``; ``streaming, 1024 slots, gamma 5``."""
    spread = f" spread {row['spread']}" if row.get("spread") else ""
    selection = (f"vegas {row['score']} window {row['window']}{spread}"
                 if row["drafter"] == "vegas" else row["drafter"])
    return f"{selection}, {row['budget']} slots, gamma {row['gamma']}"


def spec_of_row(row: dict) -> SpecConfig:
    # Rows written before the fork's rule existed ran this engine's.
    return SpecConfig(drafter=row["drafter"], gamma=row["gamma"], sparsity=row["sparsity"],
                      min_tokens=row["min_tokens"], score=row["score"], window=row["window"],
                      rule=row.get("rule", "engine"), spread=row.get("spread", 0))


def compare(measurer: Measurer, configs: dict[str, SpecConfig], rounds: int,
            references: list[str]) -> dict:
    """Race ``configs`` (name -> configuration) and vanilla for ``rounds`` interleaved
    rounds. Returns each one's series (``measure.series_attrs``), the reference (the
    name among ``references`` with the highest mean throughput) and each name's
    throughput over the reference's, round by round (``ratios``); configurations that
    are the same are measured once."""
    if rounds < MIN_COMPARE_ROUNDS:
        raise VegasError(f"--rounds must be at least {MIN_COMPARE_ROUNDS} for an interval")
    distinct: dict[str, SpecConfig] = {}
    alias: dict[str, str] = {}
    for name, spec in configs.items():
        same = next((n for n, s in distinct.items() if s == spec), None)
        if same is None:
            distinct[name] = spec
        alias[name] = same or name
    samples = interleave(measurer, {"vanilla": None, **distinct}, rounds,
                         lambda done, s: False)
    series = {name: series_attrs(samples[alias[name]], samples["vanilla"]) for name in configs}
    reference = max(references, key=lambda n: series[n]["tokens_per_second"])
    out = {"series": series, "rounds": rounds, "reference": reference, "ratios": {}}
    ref = samples[alias[reference]]
    for name in configs:
        ratio = estimate([a.tokens_per_second / b.tokens_per_second
                          for a, b in zip(samples[alias[name]], ref)])
        out["ratios"][name] = {"ratio": ratio.mean, "ratio_low": ratio.low,
                               "ratio_high": ratio.high}
    return out


def regret_words(ratio: dict) -> str:
    """``regret 1.2% [0.8%, 1.6%]`` from a ``compare`` ratio (1 - ratio, interval swapped)."""
    e = Estimate(ratio["ratio"], ratio["ratio_low"], ratio["ratio_high"], 0)
    return (f"regret {100 * (1 - e.mean):.1f}% [{100 * (1 - e.high):.1f}%, "
            f"{100 * (1 - e.low):.1f}%]")


def grid_markdown(result: GridResult, title: str, lines: list[str]) -> str:
    """The grid as a Markdown table, fastest first, under ``title`` and ``lines``."""
    table = ["| drafter | score | window | spread | budget | gamma | tokens/s | speedup | "
             "accepted |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(result.measured, key=lambda r: -r["speedup"]) + result.out_of_memory_rows:
        vegas = r["drafter"] == "vegas"
        figures = ("out of memory | - | -" if r.get("out_of_memory") is not None else
                   f"{r['tokens_per_second']:.1f} | {r['speedup']:.3f}x | "
                   f"{r['mean_accepted_length']:.2f}")
        table.append(f"| {r['drafter']} | {r['score'] if vegas else '-'} | "
                     f"{r['window'] if vegas else '-'} | {r.get('spread', 0) if vegas else '-'} | "
                     f"{r['budget']} | {r['gamma']} | "
                     f"{figures} |")
    return "\n".join([f"# {title}", "", *lines, "", *table]) + "\n"


def write_json(data: dict, path: Path) -> None:
    """``data`` as JSON at ``path``, atomically; an unwritable path is a one-line
    ``VegasError``."""
    write_text_atomically(path, json.dumps(data, indent=1) + "\n", "the grid")
