"""Tuning outputs for people: a trials table, three plots and a Markdown report.

Everything takes plain data (trial dicts, the profile dict), so it can be written and
tested without running the tuner. Every file is written atomically: a reader never sees
a half-written table, image or report.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import uuid
from collections.abc import Callable
from pathlib import Path

from vegas_core.errors import VegasError
from vegas_core.schedule import range_words

# Columns that lead the trials table, in this order; any other keys follow.
TRIAL_COLUMNS = ("step", "batch_size", "ctx", "number", "state", "config", "chosen", "drafter", "score",
                 "window", "spread", "budget", "gamma", "sparsity", "min_tokens", "collect",
                 "granularity", "mean_accepted_length", "tokens_per_second", "speedup")
TABLE_FORMATS = (".csv", ".parquet")
SWEEP_STEP = "sweep"
RACE_STEP = "race"
VANILLA_CONFIG = "vanilla"
COMPLETE = "COMPLETE"
BEST_TRIALS_PER_STEP = 3
# Trials are ranked by the first of these a step has: what it measured, else its proxy.
TRIAL_RANKING = ("tokens_per_second", "mean_accepted_length")
# Columns of the best-trials tables, shown when the step's trials have them.
BEST_TRIAL_COLUMNS = ("number", "drafter", "score", "window", "spread", "budget", "gamma",
                      "mean_accepted_length", "tokens_per_second")
# A measured figure's confidence interval: in trial rows and step mappings as
# ``<name>_low`` / ``<name>_high``, in the profile's results as ``<name>_interval``.
LOW_SUFFIX, HIGH_SUFFIX, INTERVAL_SUFFIX = "_low", "_high", "_interval"
# Keys of a step's ``chosen`` / ``within_noise`` mapping that are measurements, not settings.
MEASUREMENT_KEYS = ("tokens_per_second", "vanilla_tokens_per_second", "speedup",
                    "mean_accepted_length", "rounds")
# A speedup interval is judged against this: no difference from vanilla decoding.
NO_SPEEDUP = 1.0
# provenance.engine_path starts with this on the PyTorch reference (CPU) path.
REFERENCE_ENGINE = "pytorch-reference"
FIGURE_SIZE_IN = (6.4, 4.0)
FIGURE_DPI = 120
CHOSEN_COLOR = "tab:red"
VANILLA_COLOR = "tab:green"
# Opacity of the vanilla interval band: visible, without hiding the points over it.
BAND_ALPHA = 0.15
ERRORBAR_CAPSIZE = 3
MISSING = "n/a"
STREAMING_COLOR = "tab:orange"
# The schedule heat map: a diverging map (red: slower than vanilla, green: faster), grey
# where a size was not tuned at a context, small enough text for two lines per cell.
HEATMAP_COLOURS = "RdYlGn"
NOT_TUNED_COLOUR = "lightgrey"
HEATMAP_FONT_SIZE = 8
# The least speedup either side of 1 the colour scale spans.
HEATMAP_MIN_SPREAD = 0.1
# The cost model is judged against this: a prediction further off than this share of the
# measured throughput is named in the report.
COST_MODEL_TOLERANCE = 0.10


# --- Trials table --------------------------------------------------------------------

def write_trials_table(trials: list[dict], path) -> Path:
    """Write one row per trial to ``path`` (``.csv`` or ``.parquet``) and return the path.

    The usual trial keys (``TRIAL_COLUMNS``) come first, other keys after them; a key a
    trial lacks is NaN. Nested values (lists, dicts) are stored as JSON strings, so both
    formats hold the same flat table.
    """
    import pandas as pd  # deferred (0.3 s to import): commands that write no table skip it

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in TABLE_FORMATS:
        raise VegasError(f"trials table {path} must end in {' or '.join(TABLE_FORMATS)}")
    rows = [{key: _flat(value) for key, value in trial.items()} for trial in trials]
    extra = [key for row in rows for key in row if key not in TRIAL_COLUMNS]
    columns = [c for c in TRIAL_COLUMNS if any(c in row for row in rows)] or list(TRIAL_COLUMNS)
    table = pd.DataFrame(rows, columns=columns + list(dict.fromkeys(extra)))
    for column in table.columns:
        table[column] = _uniform(table[column])
    if suffix == ".csv":
        _atomic_write(path, lambda tmp: table.to_csv(tmp, index=False))
    else:
        _atomic_write(path, lambda tmp: table.to_parquet(tmp, index=False))
    return path


def _flat(value):
    """A value both CSV and Parquet store: nested data as JSON, other objects as text."""
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, sort_keys=True, default=str)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)  # e.g. an optuna TrialState, which Parquet cannot store


def _uniform(column):
    """A column Parquet can store: mixed text and numbers become text (numbers kept as such)."""
    if column.dtype != object:
        return column
    kinds = {"number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v)
             for v in column if not _is_missing(v)}
    if len(kinds) <= 1:
        return column
    return column.map(lambda v: None if _is_missing(v) else str(v))


# --- Plots ---------------------------------------------------------------------------

def acceptance_figure(trials: list[dict], tuned: dict | None = None, batch: int | None = None):
    """The figure ``plot_acceptance_vs_budget`` saves (a matplotlib ``Figure``).

    Points: the sweep's runs at ``batch`` (every size's when None), mean accepted length
    against the budget in slots, one line per selection (drafter, score, window) at the
    sweep's gamma. Mark: ``tuned["min_tokens"]``, the profile's budget."""
    runs = [t for t in trials if t.get("step") == SWEEP_STEP and t.get("drafter") not in
            (None, VANILLA_CONFIG) and (batch is None or t.get("batch_size") == batch)]
    top = max((t.get("gamma") or 0 for t in runs), default=0)
    by_selection: dict[str, list[dict]] = {}
    for t in runs:
        if t.get("gamma") == top:
            by_selection.setdefault(_selection_words(t), []).append(t)
    figure, axes = _figure()
    for label, rows in sorted(by_selection.items()):
        points = _series(rows, "budget", "mean_accepted_length")
        if points:
            axes.plot(*zip(*points), "-o", label=label)
    if not by_selection:
        _say_empty(axes, "no completed sweep runs")
    budget = (tuned or {}).get("min_tokens")
    if _is_number(budget):
        axes.axvline(budget, color=CHOSEN_COLOR, linestyle="--", label=f"tuned: {budget} slots")
    if by_selection:
        axes.set_xscale("log", base=2)
    axes.set_xlabel("draft budget (KV slots per layer and sequence)")
    axes.set_ylabel(f"mean accepted length at gamma {top}" if top else "mean accepted length")
    axes.set_title("Acceptance vs budget")
    _decorate(axes)
    return figure


def plot_acceptance_vs_budget(trials: list[dict], path, tuned: dict | None = None,
                              batch: int | None = None) -> Path:
    """PNG of mean accepted length against the budget for the sweep's runs at ``batch``
    (see ``acceptance_figure``); ``tuned`` is the profile's ``tuned`` mapping."""
    _save(acceptance_figure(trials, tuned, batch), path)
    return Path(path)


def _selection_words(row: dict) -> str:
    """``vegas weight, window 0.5`` / ``streaming``: a row's selection rule."""
    if row.get("drafter") != "vegas":
        return str(row.get("drafter"))
    window, spread = row.get("window"), row.get("spread")
    return (f"vegas {row.get('score')}" + (f", window {window:g}" if window else "")
            + (f", spread {spread}" if spread else ""))


def _configuration_words(row: dict) -> str:
    """``vegas weight, 256 slots``: a prediction's or trial's selection and budget."""
    budget = row.get("budget") if row.get("budget") is not None else row.get("min_tokens")
    return f"{_selection_words(row)}, {_cell(budget)} slots"


def throughput_figure(predictions: list[dict], tuned: dict | None = None,
                      results: dict | None = None, trials: list[dict] | None = None):
    """The figure ``plot_throughput_vs_gamma`` saves (a matplotlib ``Figure``).

    Predicted tokens/s as a line per configuration whose whole curve the profile keeps
    (the pick's and the best streaming one's); measured tokens/s as points with error
    bars where an interval exists (the race's trial rows, else the predictions' measured
    values);
    vanilla decoding's throughput from ``results`` as a horizontal line with its
    interval as a band; ``tuned["gamma"]`` marked "tuned".
    """
    figure, axes = _figure()
    by_config: dict[str, list[dict]] = {}
    for p in predictions:
        by_config.setdefault(_configuration_words(p), []).append(p)
    predicted = False
    for label, rows in sorted(by_config.items()):
        line = _series(rows, "gamma", "predicted_tokens_per_second")
        if len(line) > 1:  # a curve over gamma (single points are other curves' bests)
            axes.plot(*zip(*line), "-", marker=".", label=f"predicted, {label}")
            predicted = True
    measured = _measured_by_gamma(trials or [], predictions)
    if measured:
        xs, ys, errors = zip(*measured)
        lows, highs = zip(*errors)
        axes.errorbar(xs, ys, yerr=[lows, highs], fmt="o", markersize=8,
                      capsize=ERRORBAR_CAPSIZE, label="measured")
    if not predicted and not measured:
        _say_empty(axes, "no gamma predictions")
    results = results or {}
    vanilla = results.get("vanilla_tokens_per_second")
    if _is_number(vanilla):
        axes.axhline(vanilla, color=VANILLA_COLOR, label=f"vanilla {vanilla:.1f} tokens/s")
        band = _interval_of(results, "vanilla_tokens_per_second")
        if band:
            axes.axhspan(*band, color=VANILLA_COLOR, alpha=BAND_ALPHA,
                         label=f"vanilla {_level(results)}interval")
    tuned_gamma = (tuned or {}).get("gamma")
    if _is_number(tuned_gamma):
        axes.axvline(tuned_gamma, color=CHOSEN_COLOR, linestyle="--",
                     label=f"tuned: {tuned_gamma}")
    axes.set_xlabel("gamma (draft tokens per iteration)")
    axes.set_ylabel("tokens/s")
    axes.set_title("Throughput vs gamma")
    _decorate(axes)
    return figure


def plot_throughput_vs_gamma(predictions: list[dict], path, tuned: dict | None = None,
                             results: dict | None = None,
                             trials: list[dict] | None = None) -> Path:
    """PNG of predicted (line) and measured (points) tokens/s against gamma.

    Each prediction has ``gamma``, ``predicted_tokens_per_second`` and
    ``measured_tokens_per_second`` (None where it was not measured). ``tuned`` is the
    profile's ``tuned`` mapping (its gamma is marked), ``results`` the profile's results
    (vanilla's throughput and interval), ``trials`` the trial rows (the race's
    intervals); see ``throughput_figure``.
    """
    _save(throughput_figure(predictions, tuned, results, trials), path)
    return Path(path)


def batch_figure(profile: dict):
    """The figure ``plot_throughput_vs_batch`` saves (a matplotlib ``Figure``).

    One point per schedule entry, at the batch size it was measured at: vanilla decoding,
    the streaming drafter and the best speculative configuration found there (filled
    where the schedule runs it, hollow where it lost to vanilla), each with its
    interval as an error bar; log-scaled batch axis."""
    entries = profile.get("schedule") or []
    figure, axes = _figure()
    series = (("vanilla_tokens_per_second", "vanilla", VANILLA_COLOR),
              ("streaming_tokens_per_second", "best streaming", STREAMING_COLOR),
              ("tokens_per_second", "best speculative (hollow: vanilla runs)", CHOSEN_COLOR))
    drawn = False
    for name, label, color in series:
        measured = [e for e in entries if _is_number((e.get("results") or {}).get(name))]
        if not measured:
            continue
        xs = [e["batch_size"] for e in measured]
        ys = [e["results"][name] for e in measured]
        errors = [_bar(e["results"], name) for e in measured]
        best = name == "tokens_per_second"
        axes.errorbar(xs, ys, yerr=[list(side) for side in zip(*errors)], color=color,
                      marker="o", capsize=ERRORBAR_CAPSIZE, label=label,
                      markerfacecolor="none" if best else color)
        drawn = True
        chosen = [(x, y) for x, y, e in zip(xs, ys, measured)
                  if best and e.get("config") != VANILLA_CONFIG]
        if chosen:
            axes.plot(*zip(*chosen), "o", color=color, markersize=8,
                      label="chosen: runs speculatively")
    if not drawn:
        _say_empty(axes, "no measured batch size")
    else:
        axes.set_xscale("log", base=2)
        axes.set_xticks([e["batch_size"] for e in entries])
        axes.set_xticklabels([str(e["batch_size"]) for e in entries])
    axes.set_xlabel("batch size (concurrent sequences)")
    axes.set_ylabel("tokens/s (steady state)")
    axes.set_title("Throughput vs batch size")
    _decorate(axes)
    return figure


def plot_throughput_vs_batch(profile: dict, path) -> Path:
    """PNG of tokens/s against batch size for vanilla, streaming and the chosen
    configuration, from the profile's ``schedule`` (see ``batch_figure``)."""
    _save(batch_figure(profile), path)
    return Path(path)


def schedule_heatmap_figure(profile: dict):
    """The figure ``plot_schedule_heatmap`` saves (a matplotlib ``Figure``).

    One cell per measured batch size (rows, smallest at the top) and context (columns,
    shortest at the left; one column for a profile tuned at one context), coloured by the
    speedup over vanilla of what the schedule runs there (1 where it runs vanilla: the
    colour is what serving gets) and annotated with its K (0: vanilla; then the best
    speculative speedup measured, which lost) and the speedup. A size not tuned at a
    context (e.g. out of memory) is a grey cell marked so."""
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    workload = profile.get("workload") or {}
    sizes = list(workload.get("batch_sizes") or [])
    contexts = list(workload.get("contexts") or [workload.get("ctx")])
    # Schedule entries carry their context only where several were tuned.
    cells = {(e["batch_size"], e.get("ctx") or contexts[-1]): e
             for e in profile.get("schedule") or []}
    speedups = np.full((len(sizes), len(contexts)), np.nan)
    figure, axes = _figure()
    for row, size in enumerate(sizes):
        for column, ctx in enumerate(contexts):
            entry = cells.get((size, ctx))
            if entry is None:
                axes.text(column, row, "not tuned", ha="center", va="center",
                          fontsize=HEATMAP_FONT_SIZE)
                continue
            measured = (entry.get("results") or {}).get("speedup")
            vanilla = entry.get("config") == VANILLA_CONFIG
            speedups[row, column] = NO_SPEEDUP if vanilla else (
                measured if _is_number(measured) else np.nan)
            figure_words = f"{measured:.2f}x" if _is_number(measured) else MISSING
            label = (f"K 0\n(best {figure_words})" if vanilla
                     else f"K {entry['config']['gamma']}\n{figure_words}")
            axes.text(column, row, label, ha="center", va="center",
                      fontsize=HEATMAP_FONT_SIZE)
    known = speedups[~np.isnan(speedups)]
    # Centred on no speedup (white), red below and green above; a spread of at least
    # HEATMAP_MIN_SPREAD either side, so one value or all-vanilla still draws.
    low = min([NO_SPEEDUP - HEATMAP_MIN_SPREAD, *known])
    high = max([NO_SPEEDUP + HEATMAP_MIN_SPREAD, *known])
    colours = _colour_map(HEATMAP_COLOURS)
    image = axes.imshow(np.ma.masked_invalid(speedups), cmap=colours, aspect="auto",
                        norm=TwoSlopeNorm(vmin=low, vcenter=NO_SPEEDUP, vmax=high))
    figure.colorbar(image, ax=axes, label="speedup over vanilla (vanilla runs: 1)")
    axes.set_xticks(range(len(contexts)), [str(ctx) for ctx in contexts])
    axes.set_yticks(range(len(sizes)), [str(size) for size in sizes])
    axes.set_xlabel("context (tokens per sequence)")
    axes.set_ylabel("batch size (concurrent sequences)")
    axes.set_title("Schedule: K and speedup by batch size and context")
    return figure


def _colour_map(name: str):
    """``name``'s colour map with grey for cells with no value (a size not tuned)."""
    from matplotlib import colormaps

    return colormaps[name].with_extremes(bad=NOT_TUNED_COLOUR)


def plot_schedule_heatmap(profile: dict, path) -> Path:
    """PNG heat map of the schedule over batch size and context: K and the speedup over
    vanilla in each cell (see ``schedule_heatmap_figure``)."""
    _save(schedule_heatmap_figure(profile), path)
    return Path(path)


def _bar(values: dict, name: str) -> tuple[float, float]:
    """(below, above) error-bar lengths of ``values[name]``; 0 without an interval."""
    interval = _interval_of(values, name)
    if interval is None:
        return 0.0, 0.0
    return max(values[name] - interval[0], 0.0), max(interval[1] - values[name], 0.0)


def _measured_by_gamma(trials: list[dict],
                       predictions: list[dict]) -> list[tuple[float, float, tuple]]:
    """(gamma, tokens/s, (below, above)) of the measured gammas, error bar lengths 0
    where no interval exists. The race's trial rows carry intervals; the profile's
    predictions only the means, so they are the fallback."""
    rows = [t for t in trials if t.get("step") == RACE_STEP and t.get("config") != VANILLA_CONFIG
            and t.get("state", COMPLETE) == COMPLETE]
    source, key = ((rows, "tokens_per_second")
                   if _series(rows, "gamma", "tokens_per_second")
                   else (predictions, "measured_tokens_per_second"))
    points = []
    for row in source:
        gamma, mean = row.get("gamma"), row.get(key)
        if not (_is_number(gamma) and _is_number(mean)):
            continue
        interval = _interval_of(row, "tokens_per_second")
        below, above = (mean - interval[0], interval[1] - mean) if interval else (0.0, 0.0)
        # An interval that misses its mean (rounding) must not give a negative bar.
        points.append((gamma, mean, (max(below, 0.0), max(above, 0.0))))
    return sorted(points, key=lambda point: point[0])


def _series(rows: list[dict], x: str, y: str) -> list[tuple[float, float]]:
    """(x, y) pairs of the rows that have both as numbers, sorted by x."""
    return sorted((row[x], row[y]) for row in rows
                  if _is_number(row.get(x)) and _is_number(row.get(y)))


def _figure():
    # A bare Figure on the Agg canvas, not pyplot: no global backend switch, and no
    # figure left open in pyplot's registry of the calling process. Deferred (0.5 s to
    # import): only the plots need matplotlib.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI)
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _say_empty(axes, message: str) -> None:
    axes.text(0.5, 0.5, message, ha="center", va="center", transform=axes.transAxes)


def _decorate(axes) -> None:
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
    axes.grid(True, alpha=0.3)


def _save(figure, path) -> None:
    figure.tight_layout()
    _atomic_write(Path(path), lambda tmp: figure.savefig(tmp, format="png"))


# --- Markdown report -----------------------------------------------------------------

def write_report(profile: dict, trials: list[dict], path, images: dict[str, str],
                 previous: dict | None = None) -> Path:
    """Write a short Markdown report of a tuning run to ``path`` and return the path.

    ``profile`` is the tuned profile (``recommended``, ``tuned``, ``model``,
    ``workload``, ``hardware``, ``results``, ``steps``, ``provenance``); ``trials`` the
    rows of ``write_trials_table``; ``images`` maps a caption to an image path, linked
    relative to the report's folder; ``previous``, the profile this run replaces, adds a
    section on what changed. Missing fields read "n/a".
    """
    path = Path(path)
    steps = profile.get("steps") or []
    sections = [
        _title(profile),
        _summary(profile),
        _schedule(profile),
        _cut_short(profile),
        _changes(profile, previous),
        _workload(profile.get("workload") or {}),
        _race(profile, trials),
        _edges(steps),
        _steps_table(steps),
        _within_noise(steps, profile.get("results") or {}),
        _cost_model(steps),
        _predictions_tables(steps),
        _best_trials(trials),
        _trial_cost(trials),
        _images(images, path.parent),
        _hardware(profile.get("hardware") or {}),
        _provenance(profile.get("provenance") or {}),
    ]
    text = "\n\n".join(s for s in sections if s) + "\n"
    _atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path


# What a re-run's report compares with the profile it replaces: the choice, the headline
# results, and what it ran on and with.
_CHANGE_FIELDS = (
    ("target", None), ("recommended", None),
    *((f"tuned.{k}", None) for k in ("drafter", "gamma", "sparsity_ratio", "min_tokens",
                                         "collect", "score", "granularity", "window",
                                         "rule", "spread")),
    ("results.tokens_per_second", ".1f"), ("results.vanilla_tokens_per_second", ".1f"),
    ("results.streaming_tokens_per_second", ".1f"), ("results.speedup", ".2f"),
    ("results.speedup_over_streaming", ".2f"), ("results.mean_accepted_length", ".2f"),
    ("results.selection_overhead", "percent"), ("results.rounds", None),
    ("provenance.engine_path", None), ("provenance.git_revision", None),
    ("hardware.torch", None), ("hardware.triton", None),
)
# Differences here make the two runs measure different things, not one thing better.
_LIKE_FOR_LIKE = ("model.id", "model.dtype", "model.weights_sha256", "workload.ctx",
                  "workload.batch_size", "workload.max_new_tokens", "workload.temperature",
                  "workload.dataset_sha256", "workload.num_prompts", "hardware.gpu_name",
                  "hardware.gpu_count")


def _field(profile: dict, dotted: str):
    """profile["a"]["b"] for "a.b"; None where a level is missing."""
    value = profile
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _changes(profile: dict, previous: dict | None) -> str:
    if previous is None:
        return ""
    old_run = previous.get("provenance") or {}
    lines = ["## Changes from the previous profile", "",
             f"This run replaced a profile made {old_run.get('started') or MISSING} "
             f"(git {old_run.get('git_revision') or MISSING}).", ""]
    unlike = [f"{f} ({_field(previous, f)} -> {_field(profile, f)})" for f in _LIKE_FOR_LIKE
              if _field(previous, f) != _field(profile, f)]
    if unlike:
        lines += ["Not like for like: " + "; ".join(unlike) + ".", ""]
    rows = []
    for name, spec in _CHANGE_FIELDS:
        before, after = _field(previous, name), _field(profile, name)
        if before == after:
            continue
        if spec == "percent":
            cells = [_percent(before), _percent(after)]
        elif spec:
            cells = [_num(before, spec), _num(after, spec)]
        else:
            cells = [_cell(before), _cell(after)]
        rows.append([name, *cells])
    if not rows:
        return "\n".join(lines + ["Nothing changed in the tuned values or the results."])
    return "\n".join(lines) + "\n" + _table(["field", "before", "after"], rows)


def _title(profile: dict) -> str:
    model = (profile.get("model") or {}).get("id", MISSING)
    workload = profile.get("workload") or {}
    ctx = ", ".join(map(str, workload.get("contexts") or [workload.get("ctx", MISSING)]))
    return f"# Vegas tuning: {model} on {_gpu_label(profile.get('hardware') or {})}, ctx {ctx}"


def _gpu_label(hardware: dict) -> str:
    name, count = hardware.get("gpu_name"), hardware.get("gpu_count") or 0
    if not name:
        return f"CPU ({hardware.get('cpu') or MISSING})"
    return f"{count} x {name}" if count > 1 else name


def _summary(profile: dict) -> str:
    """The verdict first (with, when not recommended, why in plain words), then the
    headline figures, each with its interval where the profile has one."""
    results = profile.get("results") or {}
    tuned = profile.get("tuned") or {}
    schedule = profile.get("schedule") or []
    at = f" at {_headline_words(profile)}" if len(schedule) > 1 else ""
    others = (f" (the schedule below covers the other "
              f"{'contexts and sizes' if _head_ctx(profile) else 'sizes'})" if at else "")
    target = f" (tuned for {profile['target']})" if profile.get("target") else ""
    if profile.get("recommended"):
        lines = [f"**Recommended{at}**{others}{target}: {_pairs(tuned)}."]
    else:
        lines = [f"**Not recommended{at}: keep vanilla decoding** there for this model, "
                 f"hardware and workload{others}. {_why_not_recommended(profile)}",
                 "",
                 f"Best found{target}: {_pairs(tuned)}."]
    lines += ["",
              f"- Speedup: {_mean_interval(results, 'speedup', '.2f', 'x')} over vanilla"
              f"{_interval_note(results)}; "
              f"{_mean_interval(results, 'speedup_over_streaming', '.2f', 'x')} over the best "
              "streaming configuration found.",
              f"- Throughput: {_mean_interval(results, 'tokens_per_second', '.1f')} tokens/s vs "
              f"{_mean_interval(results, 'vanilla_tokens_per_second', '.1f')} vanilla and "
              f"{_mean_interval(results, 'streaming_tokens_per_second', '.1f')} the best "
              "streaming configuration.",
              f"- Mean accepted length: {_num(results.get('mean_accepted_length'), '.2f')} "
              "tokens per iteration.",
              f"- Selection overhead: {_percent(results.get('selection_overhead'))} of decode time."]
    by_position = results.get("acceptance_by_position")
    if by_position:
        lines.append("- Acceptance by draft position: "
                     + ", ".join(_num(rate, ".2f") for rate in by_position) + ".")
    return "\n".join(lines)


def _why_not_recommended(profile: dict) -> str:
    """Plain sentences saying why a profile is not recommended: what the speedup's
    interval shows, and, on the PyTorch reference path, why no speedup could show."""
    results = profile.get("results") or {}
    interval = _interval_of(results, "speedup")
    speedup = _mean_interval(results, "speedup", ".2f", "x")
    level = _level(results)
    if interval and interval[1] < NO_SPEEDUP:
        why = (f"Speculation is slower here: it ran at {speedup} vanilla decoding's "
               f"throughput, and the whole {level}interval lies below 1.")
    elif interval and interval[0] <= NO_SPEEDUP:
        why = (f"No measurable difference: the speedup over vanilla decoding, {speedup}, has "
               f"a {level}interval that contains 1, so the two are within noise of each "
               "other here.")
    elif interval:
        why = (f"The speedup over vanilla decoding measured {speedup}, yet the profile is "
               "marked not recommended.")
    elif _is_number(results.get("speedup")) and results["speedup"] < NO_SPEEDUP:
        why = f"Speculation is slower here: it ran at {speedup} vanilla decoding's throughput."
    else:
        why = f"No configuration beat vanilla decoding measurably ({speedup})."
    engine = str((profile.get("provenance") or {}).get("engine_path") or "")
    if engine.startswith(REFERENCE_ENGINE):
        why += (" This run measured on the PyTorch reference path (the CPU path), where the "
                "draft's sparse attention is a masked full attention: it reads every K/V "
                "entry, as vanilla decoding does, so speculation cannot show a speedup there "
                "by construction. The profile still records acceptance (mean accepted length "
                f"{_num(results.get('mean_accepted_length'), '.2f')}, acceptance by draft "
                "position), which carries over to a GPU: tune on one for throughput.")
    return why


def _workload(workload: dict) -> str:
    if not workload:
        return ""
    return "## Workload\n\n" + _pairs(workload) + "."


def _race(profile: dict, trials: list[dict]) -> str:
    """The race at the headline size: every raced configuration beside vanilla, each
    figure with its interval; the pick and the best streaming configuration marked."""
    batch = (profile.get("workload") or {}).get("batch_size")
    head_ctx = _head_ctx(profile)
    rows = [t for t in trials if t.get("step") == RACE_STEP and t.get("config")
            and t.get("state", COMPLETE) == COMPLETE and t.get("batch_size") in (None, batch)
            and t.get("ctx") == head_ctx]
    if not rows:
        return ""
    latest = max(t.get("number") or 0 for t in rows)
    rows = [t for t in rows if (t.get("number") or 0) == latest]
    streaming = [t for t in rows if t.get("drafter") == "streaming"]
    # As the profile's streaming figures (tuner.race_size): a streaming pick is the best
    # streaming configuration, even beside one that dropped out with a higher mean.
    best_streaming = next((t for t in streaming if t.get("chosen")), None) or (
        max(streaming, key=lambda t: t.get("speedup") or 0) if streaming else None)
    table = []
    for t in sorted(rows, key=lambda t: -(t.get("speedup") or (1.0 if t.get("config") ==
                                                                   VANILLA_CONFIG else 0))):
        vanilla = t.get("config") == VANILLA_CONFIG
        marks = [m for m, on in (("the pick", t.get("chosen")),
                                 ("best streaming", t is best_streaming)) if on]
        what = "vanilla (no speculation)" if vanilla else (
            f"{_configuration_words(t)}, gamma {_cell(t.get('gamma'))}"
            + (f" ({', '.join(marks)})" if marks else ""))
        table.append([what, _mean_interval(t, "tokens_per_second", ".1f"),
                      "1.00x (reference)" if vanilla else _mean_interval(t, "speedup", ".2f", "x"),
                      _num(t.get("mean_accepted_length"), ".2f"), _cell(t.get("rounds"))])
    results = profile.get("results") or {}
    intro = (f"Mean [low, high] ({_level(results)}interval) over interleaved rounds: each "
             "round measures vanilla and every configuration still racing one after another, "
             "so drift between rounds affects all of them alike. A configuration whose "
             "interval fell wholly below the leader's stopped early (fewer rounds); the pick "
             "is the highest mean of those that ran to the end.")
    if len(profile.get("schedule") or []) > 1:
        intro = f"At {_headline_words(profile)}. " + intro
    return ("## Race\n\n" + intro + "\n\n"
            + _table(["configuration", "tokens/s", "speedup vs vanilla",
                      "mean accepted length", "rounds"], table))


def _edges(steps: list[dict]) -> str:
    """The axes on whose searched edge a size's pick lies, with the figure there."""
    lines = [f"- {_step_label(step)}: {edge}" for step in steps for edge in step.get("edges") or []]
    if not lines:
        return ""
    return ("## Search edges\n\nThe pick lies on the edge of what was searched here (the "
            "tuner extends each axis once where a best prediction lies on its edge):\n\n"
            + "\n".join(lines))


def _steps_table(steps: list[dict]) -> str:
    if not steps:
        return ""
    rows = [[_cell(step.get("name", MISSING)), _batch_cell(step), _cell(step.get("trials")),
             _measured_pairs(step.get("chosen") or {}), _cell(step.get("notes") or "")]
            for step in steps]
    return "## Steps\n\n" + _table(["step", "batch", "trials", "chosen", "notes"], rows)


def _batch_cell(step: dict) -> str:
    batch = step.get("batch_size")
    ctx = "" if step.get("ctx") is None else f" at ctx {step['ctx']}"
    return ("all" if batch is None else _cell(batch)) + ctx


def _head_ctx(profile: dict) -> int | None:
    """The context the headline was measured at; None in a profile of one context."""
    schedule = profile.get("schedule") or [{}]
    return schedule[-1].get("ctx")


def _headline_words(profile: dict) -> str:
    """``batch 64, the largest size tuned`` (``, at ctx 32768, the longest context`` in a
    profile of several contexts)."""
    batch = (profile.get("workload") or {}).get("batch_size")
    ctx = _head_ctx(profile)
    longest = "" if ctx is None else f", at ctx {ctx}, the longest context"
    return f"batch {batch}, the largest size tuned{longest}"


def _within_noise(steps: list[dict], results: dict) -> str:
    """Each step's choice beside the configurations it could not tell apart from it."""
    rows = []
    for step in steps:
        alternatives = step.get("within_noise") or []
        if not alternatives:
            continue
        name = _step_label(step)
        for values, mark in [(step.get("chosen") or {}, " (chosen)"),
                             *((alternative, "") for alternative in alternatives)]:
            rows.append([name, _settings(values) + mark,
                         _mean_interval(values, "speedup", ".2f", "x"),
                         _mean_interval(values, "tokens_per_second", ".1f")])
    if not rows:
        return ""
    intro = (f"These raced configurations still have a speedup whose {_level(results)}"
             "interval overlaps the pick's after the race's rounds: the data cannot order "
             "them, and the pick is the higher mean (never the smaller parameter).")
    return ("## Within noise\n\n" + intro + "\n\n"
            + _table(["step", "configuration", "speedup vs vanilla", "tokens/s"], rows))


def _predictions_tables(steps: list[dict]) -> str:
    tables = []
    for step in steps:
        predictions = step.get("predictions") or []
        if not predictions:
            continue
        rows = [[_configuration_words(p), _cell(p.get("gamma")),
                 _num(p.get("predicted_tokens_per_second"), ".1f"),
                 _num(p.get("measured_tokens_per_second"), ".1f"),
                 _signed_percent(_prediction_error(p)),
                 _mean_interval(p, "measured_speedup", ".2f", "x")]
                for p in sorted(predictions, key=lambda p: (
                    -(p.get("predicted_tokens_per_second") or 0)))]
        tables.append(f"## Predictions ({_step_label(step)})\n\n"
                      "Each configuration's best gamma, every gamma of the pick's and of the "
                      "best streaming configuration's, and every raced one; fastest predicted "
                      "first.\n\n"
                      + _table(["configuration", "gamma", "predicted tokens/s",
                                "measured tokens/s", "prediction error", "measured speedup"],
                               rows))
    return "\n\n".join(tables)


def _step_label(step: dict) -> str:
    """``gamma @ batch 64``, or the bare name for a step shared by every size."""
    name = _cell(step.get("name", MISSING))
    return _at(name, step.get("batch_size"), step.get("ctx"))


def _at(name: str, batch, ctx) -> str:
    """``race @ batch 64``, ``race @ batch 64, ctx 4096``; the bare name without either."""
    where = ([f"batch {batch}"] if _is_number(batch) else []) + (
        [f"ctx {ctx}"] if _is_number(ctx) else [])
    return f"{name} @ {', '.join(where)}" if where else name


def _prediction_error(prediction: dict) -> float | None:
    """(predicted - measured) / measured, where the point was measured."""
    predicted = prediction.get("predicted_tokens_per_second")
    measured = prediction.get("measured_tokens_per_second")
    if not (_is_number(predicted) and _is_number(measured)) or measured <= 0:
        return None
    return predicted / measured - 1.0


def _signed_percent(fraction) -> str:
    return f"{100 * fraction:+.1f}%" if _is_number(fraction) else MISSING


def _cost_model(steps: list[dict]) -> str:
    """How far the cost model's predictions land from the measurements, over every
    measured point of every gamma step, and where they miss by more than the tolerance."""
    points = [(step, p, _prediction_error(p)) for step in steps
              for p in step.get("predictions") or []]
    points = [(step, p, error) for step, p, error in points if error is not None]
    if not points:
        return ""
    worst = max(abs(error) for _, _, error in points)
    misses = [(step, p, error) for step, p, error in points
              if abs(error) > COST_MODEL_TOLERANCE]
    lines = ["## Cost model", "",
             "At each batch size the cost model predicts tokens/s for every configuration "
             "and gamma from the sweep's runs (acceptance by draft position and step times at "
             "the probe gamma) and short probes' cost per drafted token "
             f"(vegas_tune.costmodel); the race then measures the best predicted. Over "
             f"{len(points)} raced points the prediction error ranges "
             f"from {_signed_percent(min(e for *_, e in points))} to "
             f"{_signed_percent(max(e for *_, e in points))} (largest "
             f"{100 * worst:.1f}%; tolerance {COST_MODEL_TOLERANCE:.0%})."]
    if misses:
        lines += ["", "Outside the tolerance:", ""]
        for step, p, error in misses:
            lines.append(
                f"- {_step_label(step)}, {_configuration_words(p)}, gamma {p.get('gamma')}: "
                "predicted "
                f"{_num(p.get('predicted_tokens_per_second'), '.1f')}, measured "
                f"{_num(p.get('measured_tokens_per_second'), '.1f')} tokens/s "
                f"({_signed_percent(error)}). {_miss_reason(p, error)}")
    else:
        lines += ["", "Every measured point lies within the tolerance."]
    return "\n".join(lines)


def _miss_reason(prediction: dict, error: float) -> str:
    """Where a miss comes from: tokens/s = batch x accepted length / iteration time, so
    the prediction's ratio to the measurement splits into the accepted lengths' ratio
    (the sweep's acceptance against what the race accepted) and the iteration times'."""
    assumed = prediction.get("predicted_mean_accepted_length")
    accepted = prediction.get("measured_mean_accepted_length")
    if not (_is_number(assumed) and _is_number(accepted)) or accepted <= 0:
        return "No accepted lengths were recorded to tell acceptance from timing."
    acceptance = assumed / accepted - 1.0
    # (1 + error) = (assumed / accepted) x (measured time / predicted time)
    timing = (1.0 + error) / (1.0 + acceptance) - 1.0
    parts = [f"accepted length assumed {assumed:.2f}, measured {accepted:.2f} "
             f"({_signed_percent(acceptance)})",
             f"iteration time predicted {_signed_percent(-timing / (1.0 + timing))} off "
             "the measured one"]
    cause = ("acceptance: the race accepted differently from the sweep's run at the probe "
             "gamma"
             if abs(acceptance) >= abs(timing) else
             "timing: the line from the probe gamma down to this gamma did not hold here")
    return f"{'; '.join(parts)}; mostly {cause}."


def _schedule(profile: dict) -> str:
    """The schedule by batch size (by context, then batch size, in a profile of several
    contexts): what each range runs, its figures measured at one size, and a sentence
    saying why it was chosen."""
    entries = profile.get("schedule") or []
    if not entries:
        return ""
    banded = entries[0].get("ctx") is not None
    rows, reasons = [], []
    for index, e in enumerate(entries):
        r = e.get("results") or {}
        following = entries[index + 1] if index + 1 < len(entries) else None
        band_ends = following is None or following.get("ctx") != e.get("ctx")
        span = range_words(e.get("batch_min"), e.get("batch_max"), band_ends)
        measured = _cell(e.get("batch_size"))
        if banded:
            last_band = e.get("ctx") == entries[-1].get("ctx")
            span = f"ctx {range_words(e.get('ctx_min'), e.get('ctx_max'), last_band)}, batch {span}"
            measured += f" at ctx {_cell(e.get('ctx'))}"
        config = e.get("config")
        runs = ("vanilla" if config == VANILLA_CONFIG
                else f"{_configuration_words(config)}, gamma {config.get('gamma')}")
        rows.append([span, measured, _cell(runs),
                     _mean_interval(r, "vanilla_tokens_per_second", ".1f"),
                     _mean_interval(r, "streaming_tokens_per_second", ".1f"),
                     _mean_interval(r, "tokens_per_second", ".1f"),
                     _mean_interval(r, "speedup", ".2f", "x"),
                     _mean_interval(r, "speedup_over_streaming", ".2f", "x"),
                     _num(r.get("mean_accepted_length"), ".2f")])
        reasons.append(f"- **{span}**: {e.get('reason') or MISSING}.")
    intro = ("Each range runs what was best where it was measured (the largest tuned size "
             "at or below it; sizes above the last range use the last entry). Figures are "
             "of the best speculative configuration found at that size, beside vanilla and "
             "the best streaming configuration found there; a range runs it only when its "
             "speedup's "
             f"{_level(entries[-1].get('results') or {})}interval lies wholly above 1.")
    if banded:
        intro = ("One band of entries per context tuned, shortest first: a band covers the "
                 "contexts (tokens per live sequence) nearer its own than its neighbours' "
                 "(boundaries at their geometric mean; contexts above the last band use it). "
                 "Within a band, " + intro[0].lower() + intro[1:])
    table = _table(["context and batch" if banded else "batch", "measured at", "runs",
                    "vanilla tokens/s", "best streaming tokens/s",
                    "best speculative tokens/s", "vs vanilla", "vs best streaming",
                    "accepted"], rows)
    title = "## Schedule by context and batch size" if banded else "## Schedule by batch size"
    return title + "\n\n" + intro + "\n\n" + table + "\n\n" + "\n".join(reasons)


def _cut_short(profile: dict) -> str:
    """The steps a time budget or Ctrl-C stopped, and the sizes not tuned, with why."""
    cut = profile.get("cut_short") or []
    not_tuned = profile.get("not_tuned") or []
    if not cut and not not_tuned:
        return ""
    lines = ["## Cut short and not tuned", ""]
    if cut:
        lines.append("The run stopped before it finished; this profile holds what its "
                     "finished trials support:")
        lines += [f"- {line}" for line in cut]
    if not_tuned:
        if cut:
            lines.append("")
        lines.append("Batch sizes without a schedule entry:")
        lines += [f"- batch {item.get('batch_size')}"
                  + ("" if item.get("ctx") is None else f" at ctx {item['ctx']}")
                  + f": {item.get('reason')}" for item in not_tuned]
    return "\n".join(lines)


def _best_trials(trials: list[dict]) -> str:
    by_step: dict[str, list[dict]] = {}
    for trial in trials:
        # The race's rows are the Race table.
        if trial.get("step") != RACE_STEP:
            label = _at(str(trial.get("step", MISSING)), trial.get("batch_size"),
                        trial.get("ctx"))
            by_step.setdefault(label, []).append(trial)
    tables = []
    for step, step_trials in by_step.items():
        metric = next((m for m in TRIAL_RANKING
                       if any(_is_number(t.get(m)) for t in step_trials)), None)
        if metric is None:
            continue
        ranked = sorted((t for t in step_trials if _is_number(t.get(metric))),
                        key=lambda t: t[metric], reverse=True)[:BEST_TRIALS_PER_STEP]
        columns = [c for c in BEST_TRIAL_COLUMNS if any(not _is_missing(t.get(c)) for t in ranked)]
        rows = [[_cell_with_interval(t, c) for c in columns] for t in ranked]
        tables.append(f"### {step} (by {metric.replace('_', ' ')})\n\n"
                      + _table([c.replace("_", " ") for c in columns], rows))
    return "## Best trials\n\n" + "\n\n".join(tables) if tables else ""


def _trial_cost(trials: list[dict]) -> str:
    """What a trial cost beside what it measured: wall time over timed decode time, and
    the one-time prefill (later trials find the prompts' K/V in the cache)."""
    timed = [t for t in trials if _is_number(t.get("wall_seconds"))
             and _is_number(t.get("decode_seconds")) and t["decode_seconds"] > 0]
    if not timed:
        return ""
    ratios = sorted(t["wall_seconds"] / t["decode_seconds"] for t in timed)
    prefills = sorted((t.get("prefill_seconds") or 0.0 for t in timed), reverse=True)
    lines = ["## Trial cost", "",
             f"- {len(timed)} measured trials: wall time / timed decode time, median "
             f"{statistics.median(ratios):.2f}x (range {ratios[0]:.2f}x to {ratios[-1]:.2f}x).",
             f"- One-time setup: the longest prefill of a trial took {_seconds(prefills[0])}; "
             f"the median trial's took {_seconds(statistics.median(prefills))} (prompt K/V "
             "are computed once and reused)."]
    steady = [t["steady_iterations"] / t["iterations"] for t in timed
              if _is_number(t.get("steady_iterations")) and t.get("iterations")]
    if steady:
        lines.append(f"- Throughput is the steady-state rate (every sequence of the batch "
                     f"still decoding): median {statistics.median(steady):.0%} of a trial's "
                     "decode iterations.")
    return "\n".join(lines)


def _images(images: dict[str, str], report_dir: Path) -> str:
    if not images:
        return ""
    links = []
    for caption, image in images.items():
        image = Path(image)
        # Absolute paths are made relative, so the report and its images move together.
        href = Path(os.path.relpath(image, report_dir)) if image.is_absolute() else image
        links.append(f"![{caption}]({href.as_posix()})")
    return "## Plots\n\n" + "\n\n".join(links)


def _hardware(hardware: dict) -> str:
    if not hardware:
        return ""
    gpu = _gpu_label(hardware)
    if hardware.get("gpu_name") and hardware.get("gpu_memory_gb"):
        gpu += f" ({hardware['gpu_memory_gb']} GiB)"
    return ("## Hardware\n\n"
            f"{gpu}; driver {hardware.get('driver') or MISSING}; "
            f"CUDA {hardware.get('cuda') or MISSING}; torch {hardware.get('torch') or MISSING}; "
            f"triton {hardware.get('triton') or MISSING}; CPU {hardware.get('cpu') or MISSING} "
            f"({hardware.get('cpu_count') or MISSING} cores).")


def _provenance(provenance: dict) -> str:
    if not provenance:
        return ""
    lines = ["## Provenance", ""]
    if provenance.get("command"):
        lines += [f"Command: `{provenance['command']}`", ""]
    lines.append(f"Started {provenance.get('started') or MISSING}, took "
                 f"{_duration(provenance.get('duration_seconds'))}; vegas-tune "
                 f"{provenance.get('tool_version') or MISSING}, git "
                 f"{provenance.get('git_revision') or MISSING}, engine "
                 f"{provenance.get('engine_path') or MISSING}.")
    return "\n".join(lines)


# --- Formatting helpers --------------------------------------------------------------

def _is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and not math.isnan(value))


def _num(value, spec: str) -> str:
    return format(value, spec) if _is_number(value) else MISSING


def _percent(fraction) -> str:
    return f"{100 * fraction:.1f}%" if _is_number(fraction) else MISSING


def _duration(seconds) -> str:
    if not _is_number(seconds):
        return MISSING
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value < 60 else _duration(value)


def _cell(value) -> str:
    if _is_missing(value):
        return MISSING
    if isinstance(value, float):
        return f"{value:.4g}"
    # Table cells are one line, and "|" would end the cell.
    return str(value).replace("|", "\\|").replace("\n", " ")


def _pairs(values: dict) -> str:
    return ", ".join(f"{key}={_cell(value)}" for key, value in values.items()) or MISSING


def _interval_of(values: dict, name: str) -> tuple[float, float] | None:
    """(low, high) of ``name``: ``<name>_interval: [low, high]`` (profile results,
    predictions) or ``<name>_low`` and ``<name>_high`` (trial rows, step mappings)."""
    pair = values.get(name + INTERVAL_SUFFIX)
    if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
        pair = (values.get(name + LOW_SUFFIX), values.get(name + HIGH_SUFFIX))
    low, high = pair
    return (low, high) if _is_number(low) and _is_number(high) else None


def _mean_interval(values: dict, name: str, spec: str, unit: str = "") -> str:
    """``values[name]`` as "mean [low, high]", e.g. ``1.42x [1.38, 1.46]``; the mean
    alone where there is no interval."""
    mean = values.get(name)
    if not _is_number(mean):
        return MISSING
    interval = _interval_of(values, name)
    text = f"{mean:{spec}}{unit}"
    return text + (f" [{interval[0]:{spec}}, {interval[1]:{spec}}]" if interval else "")


def _level(results: dict) -> str:
    """The confidence level with a trailing space, "95% ", or "" when unknown."""
    confidence = results.get("confidence")
    return f"{confidence:.0%} " if _is_number(confidence) else ""


def _interval_note(results: dict) -> str:
    """" (95% interval, 5 rounds)" from the results, or "" when they say neither."""
    parts = []
    if _is_number(results.get("confidence")):
        parts.append(f"{_level(results)}interval")
    rounds = results.get("rounds")
    if _is_number(rounds):
        parts.append(f"{rounds} round" + ("" if rounds == 1 else "s"))
    return f" ({', '.join(parts)})" if parts else ""


def _is_bound(key: str, values: dict) -> bool:
    """Whether ``key`` is the interval of another key of ``values`` (``speedup_low``)."""
    return any(key.endswith(suffix) and key[:-len(suffix)] in values
               for suffix in (LOW_SUFFIX, HIGH_SUFFIX, INTERVAL_SUFFIX))


def _cell_with_interval(values: dict, key: str) -> str:
    """A table cell of ``values[key]``, with its interval where ``values`` has one."""
    interval = _interval_of(values, key)
    if interval is None or not _is_number(values.get(key)):
        return _cell(values.get(key))
    return f"{_cell(values[key])} [{_cell(interval[0])}, {_cell(interval[1])}]"


def _measured_pairs(values: dict) -> str:
    """``key=value`` pairs, each interval folded into its value: ``speedup=1.42 [1.38, 1.46]``."""
    return ", ".join(f"{key}={_cell_with_interval(values, key)}" for key in values
                     if not _is_bound(key, values)) or MISSING


def _settings(values: dict) -> str:
    """The settings of a step mapping, its measurements left out."""
    return _pairs({key: value for key, value in values.items()
                   if key not in MEASUREMENT_KEYS and not _is_bound(key, values)})


def _table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of cells already formatted (and escaped) by ``_cell``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# --- Files ---------------------------------------------------------------------------

def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write`` on a temporary file beside ``path``, then move it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique name (not mkstemp, whose 0600 mode would stick to the final file) in the
    # same folder, so os.replace is a rename on one filesystem.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
