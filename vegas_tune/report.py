"""Tuning outputs for people: a trials table, two plots and a Markdown report.

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

# Columns that lead the trials table, in this order; any other keys follow.
TRIAL_COLUMNS = ("step", "number", "state", "sparsity", "gamma", "min_tokens", "collect",
                 "score", "granularity", "window", "mean_accepted_length",
                 "tokens_per_second", "predicted_tokens_per_second")
TABLE_FORMATS = (".csv", ".parquet")
SPARSITY_STEP = "sparsity"
BEST_TRIALS_PER_STEP = 3
# Trials are ranked by the first of these a step has: what it measured, else its proxy.
TRIAL_RANKING = ("tokens_per_second", "mean_accepted_length", "predicted_tokens_per_second")
# Columns of the best-trials tables, shown when the step's trials have them.
BEST_TRIAL_COLUMNS = ("number", "sparsity", "gamma", "min_tokens", "collect", "score",
                      "granularity", "window", "mean_accepted_length", "tokens_per_second",
                      "predicted_tokens_per_second")
FIGURE_SIZE_IN = (6.4, 4.0)
FIGURE_DPI = 120
CHOSEN_COLOR = "tab:red"
MISSING = "n/a"


# --- Trials table --------------------------------------------------------------------

def write_trials_table(trials: list[dict], path) -> Path:
    """Write one row per trial to ``path`` (``.csv`` or ``.parquet``) and return the path.

    The usual trial keys (``TRIAL_COLUMNS``) come first, other keys after them; a key a
    trial lacks is NaN. Nested values (lists, dicts) are stored as JSON strings, so both
    formats hold the same flat table.
    """
    import pandas as pd

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

def plot_acceptance_vs_sparsity(trials: list[dict], path, chosen: float | None = None) -> Path:
    """PNG of mean accepted length against sparsity for the sparsity step's trials.

    ``chosen`` (the selected sparsity ratio) is marked with a vertical line.
    """
    points = _series([t for t in trials if t.get("step") == SPARSITY_STEP],
                     "sparsity", "mean_accepted_length")
    figure, axes = _figure()
    if points:
        xs, ys = zip(*points)
        axes.plot(xs, ys, "o", label="trial")
    else:
        _say_empty(axes, "no completed sparsity trials")
    if chosen is not None:
        axes.axvline(chosen, color=CHOSEN_COLOR, linestyle="--", label=f"chosen {chosen:g}")
    axes.set_xlabel("sparsity ratio (share of the context the drafter attends to)")
    axes.set_ylabel("mean accepted length (tokens per iteration)")
    axes.set_title("Acceptance vs sparsity")
    _finish(figure, axes, path)
    return Path(path)


def plot_throughput_vs_gamma(predictions: list[dict], path, chosen: int | None = None) -> Path:
    """PNG of predicted (line) and measured (points) tokens/s against gamma.

    Each prediction has ``gamma``, ``predicted_tokens_per_second`` and
    ``measured_tokens_per_second`` (None where it was not measured); ``chosen`` marks
    the selected gamma.
    """
    predicted = _series(predictions, "gamma", "predicted_tokens_per_second")
    measured = _series(predictions, "gamma", "measured_tokens_per_second")
    figure, axes = _figure()
    if predicted:
        axes.plot(*zip(*predicted), "-", marker=".", label="predicted")
    if measured:
        axes.plot(*zip(*measured), "o", markersize=8, label="measured")
    if not predicted and not measured:
        _say_empty(axes, "no gamma predictions")
    if chosen is not None:
        axes.axvline(chosen, color=CHOSEN_COLOR, linestyle="--", label=f"chosen {chosen}")
    axes.set_xlabel("gamma (draft tokens per iteration)")
    axes.set_ylabel("tokens/s")
    axes.set_title("Throughput vs gamma")
    _finish(figure, axes, path)
    return Path(path)


def _series(rows: list[dict], x: str, y: str) -> list[tuple[float, float]]:
    """(x, y) pairs of the rows that have both as numbers, sorted by x."""
    return sorted((row[x], row[y]) for row in rows
                  if _is_number(row.get(x)) and _is_number(row.get(y)))


def _figure():
    # A bare Figure on the Agg canvas, not pyplot: no global backend switch, and no
    # figure left open in pyplot's registry of the calling process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIGURE_SIZE_IN, dpi=FIGURE_DPI)
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _say_empty(axes, message: str) -> None:
    axes.text(0.5, 0.5, message, ha="center", va="center", transform=axes.transAxes)


def _finish(figure, axes, path) -> None:
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
    axes.grid(True, alpha=0.3)
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
    sections = [
        _title(profile),
        _summary(profile),
        _changes(profile, previous),
        _workload(profile.get("workload") or {}),
        _steps_table(profile.get("steps") or []),
        _predictions_tables(profile.get("steps") or []),
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
    ("recommended", None),
    *((f"tuned.{k}", None) for k in ("drafter", "gamma", "sparsity_ratio", "min_tokens",
                                         "collect", "score", "granularity", "window")),
    ("results.tokens_per_second", ".1f"), ("results.vanilla_tokens_per_second", ".1f"),
    ("results.streaming_tokens_per_second", ".1f"), ("results.speedup", ".2f"),
    ("results.speedup_over_streaming", ".2f"), ("results.mean_accepted_length", ".2f"),
    ("results.selection_overhead", "percent"),
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
    ctx = (profile.get("workload") or {}).get("ctx", MISSING)
    return f"# Vegas tuning: {model} on {_gpu_label(profile.get('hardware') or {})}, ctx {ctx}"


def _gpu_label(hardware: dict) -> str:
    name, count = hardware.get("gpu_name"), hardware.get("gpu_count") or 0
    if not name:
        return f"CPU ({hardware.get('cpu') or MISSING})"
    return f"{count} x {name}" if count > 1 else name


def _summary(profile: dict) -> str:
    results = profile.get("results") or {}
    tuned = profile.get("tuned") or {}
    speed = (f"{_num(results.get('tokens_per_second'), '.1f')} tokens/s vs "
             f"{_num(results.get('vanilla_tokens_per_second'), '.1f')} vanilla "
             f"({_speedup(results.get('speedup'))}) and "
             f"{_num(results.get('streaming_tokens_per_second'), '.1f')} streaming "
             f"({_speedup(results.get('speedup_over_streaming'))})")
    if not profile.get("recommended"):
        return ("**Not recommended: no configuration beat vanilla decoding** for this model, "
                f"hardware and workload; keep vanilla decoding. Best found: {speed}.")
    lines = [f"**Recommended**: {_pairs(tuned)}.",
             "",
             f"- Throughput: {speed}.",
             f"- Mean accepted length: {_num(results.get('mean_accepted_length'), '.2f')} "
             "tokens per iteration.",
             f"- Selection overhead: {_percent(results.get('selection_overhead'))} of decode time."]
    by_position = results.get("acceptance_by_position")
    if by_position:
        lines.append("- Acceptance by draft position: "
                     + ", ".join(_num(rate, ".2f") for rate in by_position) + ".")
    return "\n".join(lines)


def _workload(workload: dict) -> str:
    if not workload:
        return ""
    return "## Workload\n\n" + _pairs(workload) + "."


def _steps_table(steps: list[dict]) -> str:
    if not steps:
        return ""
    rows = [[_cell(step.get("name", MISSING)), _cell(step.get("trials")),
             _pairs(step.get("chosen") or {}), _cell(step.get("notes") or "")] for step in steps]
    return "## Steps\n\n" + _table(["step", "trials", "chosen", "notes"], rows)


def _predictions_tables(steps: list[dict]) -> str:
    tables = []
    for step in steps:
        predictions = step.get("predictions") or []
        if not predictions:
            continue
        rows = [[_cell(p.get("gamma")), _num(p.get("predicted_tokens_per_second"), ".1f"),
                 _num(p.get("measured_tokens_per_second"), ".1f")]
                for p in sorted(predictions, key=lambda p: p.get("gamma") or 0)]
        tables.append(f"## Throughput by gamma ({step.get('name', MISSING)} step)\n\n"
                      + _table(["gamma", "predicted tokens/s", "measured tokens/s"], rows))
    return "\n\n".join(tables)


def _best_trials(trials: list[dict]) -> str:
    by_step: dict[str, list[dict]] = {}
    for trial in trials:
        by_step.setdefault(str(trial.get("step", MISSING)), []).append(trial)
    tables = []
    for step, step_trials in by_step.items():
        metric = next((m for m in TRIAL_RANKING
                       if any(_is_number(t.get(m)) for t in step_trials)), None)
        if metric is None:
            continue
        ranked = sorted((t for t in step_trials if _is_number(t.get(metric))),
                        key=lambda t: t[metric], reverse=True)[:BEST_TRIALS_PER_STEP]
        columns = [c for c in BEST_TRIAL_COLUMNS if any(not _is_missing(t.get(c)) for t in ranked)]
        rows = [[_cell(t.get(c)) for c in columns] for t in ranked]
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


def _speedup(value) -> str:
    return f"{value:.2f}x" if _is_number(value) else MISSING


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
