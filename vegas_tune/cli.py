"""``vegas-tune``: tune, bench, validate, show, diff, export, doctor.

``vegas-tune`` with no subcommand (or with options only) runs ``tune``. Settings come
from, in order of precedence: flags, ``VEGAS_TUNE_<NAME>`` environment variables, the
``--config`` YAML file, the defaults.

Exit codes: 0 done; 1 internal error; 2 bad input; 3 tuned, but no configuration beat
vanilla decoding (the profile says ``recommended: false``); ``diff`` exits 1 when the new
profile regresses; 130 interrupted.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
import typer
from rich.console import Console

from vegas_core.backend import attention_backend
from vegas_core.cli import EXIT_INTERRUPTED, run_app, show_defaults
from vegas_core.errors import VegasError
from vegas_core.graphs import prefer_expandable_segments
from vegas_core.loading import load_model
from vegas_core.loading.embedded import DEFAULT_MODEL, embedded_path
from vegas_core.loading.memory import available_bytes, gib
from vegas_core.schedule import range_words
from vegas_core.spec_config import SpecConfig
from vegas_core.yamlio import read_yaml
from vegas_tune import pipeline
from vegas_tune.datasets import check_dataset, load_prompts
from vegas_tune.export import (check_table_options, check_target, recommendation_note,
                               render_export)
from vegas_tune.grid import (GRID_BEST, GRID_TOP, GridResult, PassCutShort,
                             compare as race_configs, grid_markdown, grid_points, parse_gammas,
                             partial_path, read_partial, regret_words, row_words, run_grid,
                             spec_of_row, write_json, write_partial)
from vegas_tune.hardware import fingerprint
from vegas_tune.measure import Measurer, Workload, interleave, out_of_memory, series_attrs
from vegas_tune.options import (DEFAULT_WORDS, TuneOptions, option_default, option_default_text,
                                option_help, option_names, parse_budgets, parse_target)
from vegas_tune.pipeline import STUDY_HARDWARE_KEYS, git_revision, settings_fingerprint
from vegas_tune.preflight import (check_device, check_model_size, check_out, check_tune,
                                  check_values, flag)
from vegas_tune.profile import (Profile, diff_profiles, incomparable, load_profile,
                                profile_to_dict, write_text_atomically)
from vegas_tune.progress import ProgressEvent, ProgressReporter
from vegas_tune.report import plot_schedule_heatmap
from vegas_tune.schedule_view import schedule_table_lines
from vegas_tune.settings import TuneSettings, study_location
from vegas_tune.spans import DEFAULT_SPAN_TOKENS, SPAN_WARMUP_ITERATIONS
from vegas_tune.space import longest_prefix, tuned_words
from vegas_tune.stats import Estimate
from vegas_tune.steps import min_new_tokens
from vegas_tune.studies import check_study
from vegas_tune.tuner import batch_sizes, parse_contexts, parse_ctx, usable_budgets
from vegas_tune.workers import (COMMAND_ENV, WORKER_ENV, parse_devices, resolve_devices,
                                run_workers)

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  help="Tune Vegas self-speculative decoding for a model, GPU and context "
                       "length; write a deployable profile.")
stderr = Console(stderr=True, soft_wrap=True)
log = logging.getLogger("vegas_tune")

# `bench` rounds: the default, and the fewest that give an interval.
BENCH_ROUNDS = 3
MIN_BENCH_ROUNDS = 2
# grid: --time-budget ran out before the pass finished (its points kept for --resume).
EXIT_GRID_CUT_SHORT = 3
# Distinct prompts per trial when --num-prompts is not given and the smallest batch is smaller.
MIN_PROMPTS = 4
# `show --plot`: the heat map's format, and the file name an error suggests.
PNG_SUFFIX = ".png"
HEATMAP_EXAMPLE = "schedule.png"
SUBCOMMANDS = ("tune", "bench", "grid", "validate", "show", "diff", "export", "doctor")
ENV_PREFIX = "VEGAS_TUNE_"
# SpecConfig fields whose errors start with the field's name (``--gamma`` on the CLI).
SPEC_FIELDS = ("gamma", "sparsity", "window", "min_tokens")
# The workload and the run: name -> (default, parser). Booleans are parsed from "1/true/yes".
RUN_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "model": ("smollm2-135m", str),
    "ctx": ("4k", parse_contexts),
    "dataset": ("mixed", str),
    "out": (None, Path),
    "device": ("auto", str),
    "devices": (None, parse_devices),
    "dtype": ("auto", str),
    "storage": (None, str),
    "study_name": (None, str),
    "resume": (False, "bool"),
    "batch_size": ("1", batch_sizes),
    "max_new_tokens": (64, int),
    "temperature": (0.0, float),
    "num_prompts": (None, int),  # None: the smallest batch size, at least MIN_PROMPTS
    "spans": (0, int),
    "span_tokens": (DEFAULT_SPAN_TOKENS, int),
    "new_study": (False, "bool"),
    "json": (False, "bool"),
    "log_level": ("INFO", str),
}
# How each of the tuner's options (``vegas_tune.options``, their one home) is parsed.
OPTION_PARSERS = {"target": parse_target, "budgets": parse_budgets, "probe_gamma": int,
                  "candidates": int, "max_rounds": int, "precision": float, "seed": int,
                  "time_budget": float}
TUNE_DEFAULTS: dict[str, tuple[Any, Any]] = {
    **RUN_DEFAULTS, **{name: (option_default(name), OPTION_PARSERS[name])
                       for name in option_names()}}


# What --help shows for the settings whose default is None (worked out at run time).
DEFAULT_DESCRIPTIONS = {
    "out": "profiles/<model>/<gpu>-<ctx>.yaml",
    "storage": "<profile>.optuna.journal beside the profile",
    "study_name": "<model>-<gpu>-<ctx>",
    "num_prompts": f"the smallest batch size, at least {MIN_PROMPTS}",
    "devices": "one process, on --device",
    **DEFAULT_WORDS,
}


def default_text(name: str) -> str:
    """A tune setting's default as ``--help`` and docs/tuning.md show it."""
    if name in option_names():
        return option_default_text(name)
    default = TUNE_DEFAULTS[name][0]
    if default is None:
        return DEFAULT_DESCRIPTIONS[name]
    return str(default).lower() if isinstance(default, bool) else str(default)


class Settings(dict):
    """Resolved tune settings by name; ``labels[name]`` is how to name each one's source
    in an error: ``--ctx`` (flag or default), ``VEGAS_TUNE_CTX``, ``tune.yaml: ctx``."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: dict[str, str] = {}


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("is not a boolean; use true or false")


def _parse_int(value: Any) -> int:
    # YAML gives bools and floats as such: `batch_size: true` or `2.5` is a mistake.
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError("is not a whole number")
    try:
        return int(value) if isinstance(value, (int, float)) else int(str(value).strip())
    except ValueError:
        raise ValueError("is not a whole number") from None


def _parse_float(value: Any) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError("is not a number") from None
    if not math.isfinite(number):
        raise ValueError("is not a finite number")
    return number


def _parse_setting(name: str, parse: Any, value: Any, label: str) -> Any:
    """``value`` parsed for setting ``name``; an error names ``label``, where it came from."""
    try:
        if parse == "bool":
            return _parse_bool(value)
        if parse is int:
            return _parse_int(value)
        if parse is float:
            return _parse_float(value)
        if parse in (parse_budgets, batch_sizes, parse_contexts) and isinstance(value,
                                                                                 (list, tuple)):
            value = ",".join(map(str, value))  # a YAML list of budgets, sizes or contexts
        return parse(value if parse is not Path else str(value))
    except VegasError as e:
        # The parsers name the flag; a value from elsewhere names its own source.
        message, own = str(e), flag(name)
        if label != own and message.startswith(own):
            message = label + message[len(own):]
        elif label not in message:
            message = f"{label}: {message}"
        raise VegasError(message) from None
    except (TypeError, ValueError) as e:
        raise VegasError(f"{label} '{value}' {e}") from None


def _read_config(config_file: Path) -> dict[str, Any]:
    if not config_file.is_file():
        raise VegasError(f"--config {config_file}: file not found")
    try:
        text = config_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise VegasError(f"--config {config_file}: cannot read it as UTF-8 text ({e})") from None
    # read_yaml refuses anchors and aliases (a "billion laughs" file) and huge texts.
    loaded = read_yaml(text, str(config_file)) or {}
    if not isinstance(loaded, dict):
        raise VegasError(f"{config_file}: expected a mapping of option: value")
    return loaded


def resolve_settings(flags: dict[str, Any], config_file: Path | None) -> Settings:
    """flag > VEGAS_TUNE_* environment > config file > default, each parsed. The result's
    ``labels`` say where each value came from, for error messages."""
    config: dict[str, Any] = {}
    config_keys: dict[str, str] = {}
    if config_file is not None:
        for key, value in _read_config(config_file).items():
            name = str(key).replace("-", "_")
            if name not in TUNE_DEFAULTS:
                raise VegasError(f"{config_file}: unknown option '{key}'; options: "
                                 f"{', '.join(k.replace('_', '-') for k in TUNE_DEFAULTS)}")
            config[name] = value
            config_keys[name] = str(key)
    settings = Settings()
    for name, (default, parse) in TUNE_DEFAULTS.items():
        env_name = ENV_PREFIX + name.upper()
        labels = {"flag": flag(name), "env": env_name, "default": flag(name),
                  "config": f"{config_file}: {config_keys.get(name, name)}"}
        candidates = (("flag", flags.get(name)), ("env", os.environ.get(env_name)),
                      ("config", config.get(name)))
        source, value = next(((k, v) for k, v in candidates if v is not None),
                             ("default", default))
        settings.labels[name] = labels[source]
        settings[name] = None if value is None else _parse_setting(name, parse, value,
                                                                   labels[source])
    return settings


def _setup_logging(level: str, debug: bool) -> None:
    """Log lines as ``vegas-tune: ...`` on stderr (``level`` is checked by
    ``check_values``)."""
    numeric = logging.getLevelName("DEBUG" if debug else level.upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("vegas-tune: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(numeric)
    log.propagate = False


@app.callback()
def _root() -> None:
    """Tune Vegas for a model, GPU and context length; write a deployable profile."""


@app.command()
@show_defaults({**{name: default_text(name) for name in TUNE_DEFAULTS}, "config": "none"},
               {"json_out": "json"})
def tune(
    model: Optional[str] = typer.Option(None, help="Embedded name, .gguf, HF folder or hub id, dummy:<preset>."),
    ctx: Optional[str] = typer.Option(None, help="Prompt length: 2048, 8k, 64k, 128K; a comma-separated list (4k,16k,32k) tunes each and writes a schedule of context bands."),
    dataset: Optional[str] = typer.Option(None, help="mixed, code, prose, retrieval, a .jsonl/.csv/.parquet file with a text or prompt column, or a HF dataset id."),
    out: Optional[Path] = typer.Option(None, help="Profile path."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda, cuda:N, auto."),
    devices: Optional[str] = typer.Option(None, help="One worker per device on one study, one profile: all (every GPU), or cuda:0,cuda:1,... (cpu for CPU workers)."),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16, float16, auto."),
    storage: Optional[str] = typer.Option(None, help="Optuna storage: a .journal file or an RDB URL (sqlite:///x.db, postgresql://...)."),
    study_name: Optional[str] = typer.Option(None, help="Study name prefix."),
    resume: Optional[bool] = typer.Option(None, "--resume", help="Continue the study in the storage."),
    new_study: Optional[bool] = typer.Option(None, "--new-study", help="Discard the study of this name in the storage and start over."),
    time_budget: Optional[float] = typer.Option(None, help=option_help("time_budget")),
    seed: Optional[int] = typer.Option(None, help=option_help("seed")),
    batch_size: Optional[str] = typer.Option(None, help="Sequences decoded together; a comma-separated list (1,16,64,128,256) tunes each size and writes a schedule."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens generated per prompt."),
    temperature: Optional[float] = typer.Option(None, help="0 = greedy."),
    num_prompts: Optional[int] = typer.Option(None, help="Distinct prompts per trial at batch sizes below it, decoded in batches (a last batch they do not fill wraps around); a larger batch size decodes one distinct prompt per sequence. With --spans: distinct (prompt, span) sequences."),
    spans: Optional[int] = typer.Option(None, help="Long generations: time this many spans spread over --max-new-tokens, from contexts holding the prompt and the start of its own output, instead of decoding every token (0: every token from the prompt)."),
    span_tokens: Optional[int] = typer.Option(None, help=f"Tokens each span decodes (--spans), timed after its first {SPAN_WARMUP_ITERATIONS} iterations."),
    target: Optional[str] = typer.Option(None, help=option_help("target")),
    budgets: Optional[str] = typer.Option(None, help=option_help("budgets")),
    probe_gamma: Optional[int] = typer.Option(None, help=option_help("probe_gamma")),
    candidates: Optional[int] = typer.Option(None, help=option_help("candidates")),
    max_rounds: Optional[int] = typer.Option(None, help=option_help("max_rounds")),
    precision: Optional[float] = typer.Option(None, help=option_help("precision")),
    json_out: Optional[bool] = typer.Option(None, "--json", help="Print one JSON summary to stdout."),
    log_level: Optional[str] = typer.Option(None, help="DEBUG, INFO, WARNING, ERROR."),
    config: Optional[Path] = typer.Option(None, help="YAML file of option: value (flags and VEGAS_TUNE_<NAME> variables override it)."),
    debug: bool = typer.Option(False, help="Tracebacks and debug logs."),
) -> int:
    """Tune (sweep, extend, focus, race at each batch size) and write a profile, its trials,
    plots and report."""
    flags = {k: v for k, v in locals().items() if k not in ("config", "debug", "json_out")}
    flags["json"] = json_out
    s = resolve_settings(flags, config)
    # Every check that needs no model runs here, before the minutes of loading and
    # tuning: a bad value must not surface after the sweep has run.
    check_values(s, s.labels)
    if s["num_prompts"] is None:
        s["num_prompts"] = max(MIN_PROMPTS, s["batch_size"][0])
    worker = os.environ.get(WORKER_ENV) is not None
    if worker:  # started by --devices: the parent settled the study and the devices
        s["devices"], s["new_study"] = None, False
    if s["devices"] and s["device"] != "auto":
        raise VegasError(f"{s.labels['devices']} and {s.labels['device']}: give one of them "
                         "(--devices starts a worker per device)")
    _setup_logging(s["log_level"], debug)
    options = TuneOptions(**{name: s[name] for name in option_names()})
    settings = TuneSettings(
        model=s["model"], ctx=s["ctx"][-1], contexts=s["ctx"], dataset=s["dataset"], out=s["out"],
        device=s["device"],
        dtype=s["dtype"], storage=s["storage"], study_name=s["study_name"], resume=s["resume"],
        seed=s["seed"], batch_sizes=s["batch_size"], max_new_tokens=s["max_new_tokens"],
        temperature=s["temperature"], num_prompts=s["num_prompts"], options=options,
        command=os.environ.get(COMMAND_ENV) if worker else
        "vegas-tune " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        new_study=s["new_study"], spans=s["spans"], span_tokens=s["span_tokens"])
    if s["devices"]:
        return _tune_on_devices(settings, s)
    check_tune(settings, s.labels)
    with warnings.catch_warnings(), ProgressReporter(stderr) as progress:
        # optuna warns on stderr that RDB heartbeats are experimental: noise in a CLI
        # whose stderr carries progress lines and one-line errors.
        warnings.filterwarnings("ignore", message=".*heartbeat_interval.*")
        try:
            # Looked up at call time: tests stand in for pipeline.run_tune.
            summary, code = pipeline.run_tune(settings, progress)
        except KeyboardInterrupt:
            log.warning("interrupted: finished trials are kept in the storage; rerun with --resume")
            raise
    if s["json"]:
        print(json.dumps(summary, indent=1))
    else:
        _print_summary(summary)
    if code == EXIT_INTERRUPTED:
        log.warning("interrupted: the profile holds what the finished trials support; they "
                    "are kept in the storage: rerun with --resume to finish the run")
    return code


def _tune_on_devices(settings, s: Settings) -> int:
    """--devices: settle the study here, then one worker per device (vegas_tune.workers)."""
    devices = resolve_devices(s["devices"])
    first = replace(settings, device="cuda" if devices[0].startswith("cuda") else "cpu")
    check_tune(first, s.labels)
    # The dataset's contents too, before the study (and its journal) is made for workers.
    pipeline.prepare_workload(first, first.span_layout())
    # What each worker will see: one GPU (the fingerprint, the default paths).
    hardware = {**fingerprint(devices[0]), "gpu_count": 1 if devices[0] != "cpu" else 0}
    out, storage, study_name = study_location(settings, hardware)
    check_study(None, storage, study_name, resume=settings.resume,
                new_study=settings.new_study, fingerprint=settings_fingerprint(first, hardware))
    summary, code = run_workers(devices, sys.argv[1:], out, storage, study_name,
                                settings.command)
    if s["json"]:
        print(json.dumps(summary, indent=1))
    else:
        _print_summary(summary)
    return code


def _print_summary(summary: dict) -> None:
    r, t = summary["results"], summary["tuned"]
    verdict = ("recommended" if summary["recommended"] else
               "NOT recommended: the speedup's 95% interval does not lie above 1")
    stderr.print(f"profile: {summary['profile']} ({verdict} at batch "
                 f"{summary['schedule'][-1]['batch_size']})")
    if len(summary["schedule"]) > 1:
        for entry, where in zip(summary["schedule"], entry_ranges(summary["schedule"])):
            config = entry["config"]
            what = "vanilla" if config == "vanilla" else tuned_words(config)
            stderr.print(f"  {where}: {what} "
                         f"(measured at {measured_at(entry)}: speedup "
                         f"{_result_words(entry, 'speedup', 'x', 2)})")
    stderr.print(f"tuned for {summary['target']}: {tuned_words(t)}")
    stderr.print(f"speedup {_result_words(r, 'speedup', 'x', 2)} over vanilla, "
                 f"{_result_words(r, 'speedup_over_streaming', 'x', 2)} over the best streaming configuration "
                 f"(95% intervals, {r['rounds']} rounds)")
    stderr.print(f"{_result_words(r, 'tokens_per_second', ' tok/s', 1)} vs vanilla "
                 f"{_result_words(r, 'vanilla_tokens_per_second', ' tok/s', 1)}; mean "
                 f"accepted length {r['mean_accepted_length']:.2f}")
    for item in summary["not_tuned"]:
        stderr.print(f"not tuned: {point_words(item['batch_size'], item.get('ctx'))}: "
                     f"{item['reason']}")
    for line in summary["cut_short"]:
        stderr.print(f"cut short: {line}")
    stderr.print(f"report: {summary['files']['report']} ({summary['duration_seconds']:.0f} s)")


def entry_ranges(schedule: list[dict]) -> list[str]:
    """What each schedule entry covers, in words: ``batch 4-7``, the last of a band ``batch
    8 and above``; a profile of several contexts names the band first, ``ctx 1-5792,
    batch 4-7`` (the last band: ``ctx 5793 and above``)."""
    words = []
    for index, entry in enumerate(schedule):
        following = schedule[index + 1] if index + 1 < len(schedule) else None
        band_ends = following is None or following.get("ctx") != entry.get("ctx")
        batch = f"batch {range_words(entry['batch_min'], entry['batch_max'], band_ends)}"
        if entry.get("ctx") is None:
            words.append(batch)
            continue
        ctx = range_words(entry["ctx_min"], entry["ctx_max"],
                          last=entry["ctx"] == schedule[-1]["ctx"])
        words.append(f"ctx {ctx}, {batch}")
    return words


def measured_at(entry: dict) -> str:
    """``16``, or ``batch 16, ctx 4096`` for an entry of a profile of several contexts."""
    if entry.get("ctx") is None:
        return str(entry["batch_size"])
    return f"batch {entry['batch_size']}, ctx {entry['ctx']}"


def point_words(batch: int, ctx: int | None) -> str:
    """``batch 16``, or ``batch 16 at ctx 4096`` where a profile names contexts."""
    return f"batch {batch}" + ("" if ctx is None else f" at ctx {ctx}")


def _result_words(results: dict, name: str, unit: str, digits: int) -> str:
    """``1.42x [1.38, 1.46]``: a profile result with its confidence interval; ``1.42x
    (1 round)`` where it has none (one round), ``not measured`` where it has no value (a
    run cut short)."""
    value, interval = results.get(name), results.get(f"{name}_interval")
    if value is None:
        return "not measured"
    rounds = results.get("rounds")
    if interval is None:
        count = "" if rounds is None else f" ({rounds} round{'' if rounds == 1 else 's'})"
        return f"{value:.{digits}f}{unit}{count}"
    low, high = interval
    return Estimate(value, low, high, rounds or 0).words(unit, digits)


@app.command()
@show_defaults({"num_prompts": "the batch size", "json_out": "false"})
def bench(
    model: str = typer.Option("smollm2-135m", help="Model spec."),
    ctx: str = typer.Option("4k", help="Prompt length."),
    dataset: str = typer.Option("mixed", help="Dataset (as for tune)."),
    drafter: str = typer.Option("vegas", help="Drafter."),
    gamma: int = typer.Option(6), sparsity: float = typer.Option(0.05),
    min_tokens: int = typer.Option(256), collect: str = typer.Option("two"),
    score: str = typer.Option("logit"), granularity: str = typer.Option("layer"),
    window: float = typer.Option(0.0),
    rule: str = typer.Option("engine", help="engine, or fork: the vLLM fork's selection rule "
                             "(vegas and streaming; docs/drafters.md)."),
    batch_size: int = typer.Option(1), max_new_tokens: int = typer.Option(64),
    num_prompts: Optional[int] = typer.Option(None, help="Prompts measured."),
    temperature: float = typer.Option(0.0),
    seed: int = typer.Option(0), device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
    rounds: int = typer.Option(BENCH_ROUNDS, help="Rounds of (vanilla, configuration) "
                               "measured side by side; the speedup's 95% interval comes from them."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON to stdout."),
    debug: bool = typer.Option(False, help="Show tracebacks."),
) -> None:
    """Measure one configuration against vanilla decoding on one workload, in rounds."""
    if rounds < MIN_BENCH_ROUNDS:
        raise VegasError(f"--rounds must be at least {MIN_BENCH_ROUNDS} for an interval, got {rounds}")

    # Everything checked before the model loads (the same checks as tune's).
    check_values(dict(batch_size=batch_size, max_new_tokens=max_new_tokens,
                      num_prompts=num_prompts, temperature=temperature, seed=seed))
    tokens = parse_ctx(ctx)
    try:
        spec = SpecConfig(drafter=drafter, gamma=gamma, sparsity=sparsity,
                          min_tokens=min_tokens, collect=collect, score=score,
                          granularity=granularity, window=window, rule=rule)
    except VegasError as e:
        # SpecConfig says "gamma must be ..."; the user typed --gamma.
        field = str(e).split()[0]
        if field not in SPEC_FIELDS:
            raise
        raise VegasError(flag(field) + str(e)[len(field):]) from None
    check_dataset(dataset)
    dev, dt = check_device(device, dtype)
    check_model_size(model, dev, dt, ctx=tokens, max_new_tokens=max_new_tokens,
                     batch_size=batch_size, extra_tokens=gamma + 1)
    count = batch_size if num_prompts is None else num_prompts
    loaded = load_model(model, device=dev, dtype=dt)
    prompts = load_prompts(loaded.tokenizer, dataset, tokens, count, seed)
    measurer = Measurer(loaded, Workload(prompts, batch_size, max_new_tokens, temperature, seed))
    with stderr.status(f"measuring vanilla and {drafter}, {rounds} rounds ...") as status:
        def after_round(done: int, samples: dict) -> bool:
            status.update(f"measuring vanilla and {drafter}: round {done} of {rounds} done")
            return False

        samples = interleave(measurer, {"vanilla": None, "config": spec}, rounds, after_round)
    measured = series_attrs(samples["config"], samples["vanilla"])
    result = {"model": loaded.label, "spec": spec.to_dict(), "measured": measured,
              "speedup": measured["speedup"],
              "speedup_interval": [measured["speedup_low"], measured["speedup_high"]]}
    if json_out:
        print(json.dumps(result, indent=1))
        return
    tps, van, speedup = (Estimate.from_attrs(measured, name) for name in
                         ("tokens_per_second", "vanilla_tokens_per_second", "speedup"))
    stderr.print(f"{loaded.label}: steady state {drafter} {tps.words(' tok/s', 1)}, vanilla "
                 f"{van.words(' tok/s', 1)}; speedup {speedup.words()} (95% interval, "
                 f"{rounds} rounds); mean accepted length "
                 f"{measured['mean_accepted_length']:.2f}; selection overhead "
                 f"{100 * measured['selection_overhead']:.1f}%")


# The workload of a profile that a grid must share to compare with its pick.
LIKE_FOR_LIKE = ("ctx", "dataset", "max_new_tokens", "temperature")


@app.command()
# Only the options whose declared default is None: typer shows the others' itself.
@show_defaults({"num_prompts": "the batch size", "time_budget": "none"})
def grid(
    model: str = typer.Option(RUN_DEFAULTS["model"][0], help="Model spec."),
    ctx: str = typer.Option(RUN_DEFAULTS["ctx"][0], help="Prompt length."),
    dataset: str = typer.Option(RUN_DEFAULTS["dataset"][0], help="Dataset (as for tune)."),
    batch_size: int = typer.Option(1, help="Sequences decoded together (one size)."),
    max_new_tokens: int = typer.Option(RUN_DEFAULTS["max_new_tokens"][0]),
    num_prompts: Optional[int] = typer.Option(None, help="Distinct prompts."),
    temperature: float = typer.Option(0.0), seed: int = typer.Option(0),
    device: str = typer.Option("auto"), dtype: str = typer.Option("auto"),
    target: str = typer.Option(option_default("target"), help="The space: the selections "
                               "this target runs (as for tune)."),
    budgets: str = typer.Option(option_default_text("budgets"), help="Budgets in KV slots."),
    gammas: str = typer.Option("4-12", help="Gammas: a range (4-12) or a list (6,8,10)."),
    vanilla_every: int = typer.Option(8, help="A vanilla run between every this many points."),
    out: Path = typer.Option(Path("grid.json"), help="The grid as JSON; a Markdown table "
                                                     "beside it (.md)."),
    from_file: Optional[Path] = typer.Option(None, help="Take the grid from this earlier "
                                             "--out file instead of measuring it."),
    compare: Optional[list[Path]] = typer.Option(None, help="A profile whose pick at this "
                                                 "batch size is re-measured beside the grid's "
                                                 "best (repeat for several)."),
    rounds: int = typer.Option(5, help="Interleaved rounds of the comparison."),
    resume: bool = typer.Option(False, "--resume", help="Finish the pass an earlier run "
                                "left in <out>.partial (stopped or interrupted)."),
    time_budget: Optional[float] = typer.Option(
        None, help="Seconds for this run's pass, loading included: when they are spent, "
                   "the pass stops after the point in progress, keeps its points for "
                   "--resume and exits 3 (a pass that finishes in time is compared in full)."),
    debug: bool = typer.Option(False, help="Show tracebacks."),
) -> Optional[int]:
    """Measure every configuration of a space once (vanilla interleaved), then re-measure
    the best beside the picks of --compare profiles: their regret, in one run. Finished
    points are kept in <out>.partial until the pass ends: --resume goes on from them."""
    started = time.monotonic()
    tokens = parse_ctx(ctx)
    space_target, slots, gamma_list = parse_target(target), parse_budgets(budgets), parse_gammas(gammas)
    check_values(dict(batch_size=batch_size, max_new_tokens=max_new_tokens,
                      num_prompts=num_prompts, temperature=temperature, seed=seed,
                      budgets=slots, ctx=tokens))
    if max_new_tokens < min_new_tokens(gamma_list[-1]):
        raise VegasError(f"--max-new-tokens {max_new_tokens} is too few to time gamma "
                         f"{gamma_list[-1]}; use at least {min_new_tokens(gamma_list[-1])}")
    if vanilla_every < 1:
        raise VegasError(f"--vanilla-every must be >= 1, got {vanilla_every}")
    if time_budget is not None and not time_budget > 0:
        raise VegasError(f"--time-budget must be a number of seconds above 0, got {time_budget}")
    # Before minutes of measuring: the grid, its table and <out>.partial go beside --out.
    check_out(out, "--out", "the grid's file name", "grid.json")
    picks = {}
    for path in compare or []:
        p = load_profile(path)
        differs = [k for k in LIKE_FOR_LIKE if getattr(p.workload, k) != {
            "ctx": tokens, "dataset": dataset, "max_new_tokens": max_new_tokens,
            "temperature": temperature}[k]]
        if p.model.id != model or differs:
            raise VegasError(f"--compare {path}: tuned on another workload "
                             f"({', '.join((['model'] if p.model.id != model else []) + differs)}); "
                             "give this grid the profile's model, ctx, dataset, max-new-tokens "
                             "and temperature")
        entry = p.entry_for(batch_size)
        picks[str(path)] = entry.speculative.spec()
    check_dataset(dataset)
    dev, dt = check_device(device, dtype)
    check_model_size(model, dev, dt, ctx=tokens, max_new_tokens=max_new_tokens,
                     batch_size=batch_size, extra_tokens=gamma_list[-1] + 1)
    prefix = longest_prefix(tokens, max_new_tokens)
    points = grid_points(space_target, usable_budgets(slots, tokens), gamma_list)
    hardware = fingerprint(device)
    partial, start = partial_path(out), None
    if from_file is None:
        key = {"model": model, "dtype": str(dt), "ctx": tokens, "dataset": dataset,
               "batch_size": batch_size, "max_new_tokens": max_new_tokens,
               "num_prompts": num_prompts or batch_size, "temperature": temperature,
               "seed": seed, "vanilla_every": vanilla_every, "target": space_target,
               "points": [[p.selection.drafter, p.selection.score, p.selection.window,
                           p.budget, p.gamma] for p in points],
               "hardware": {k: hardware.get(k) for k in STUDY_HARDWARE_KEYS}}
        if partial.exists() and not resume:
            raise VegasError(f"{partial} holds an unfinished pass: pass --resume to finish "
                             "it, or delete it to start over")
        if resume:
            if not partial.exists():
                raise VegasError(f"--resume: no unfinished pass at {partial}")
            start = read_partial(partial, key)
    loaded = load_model(model, device=dev, dtype=dt)
    prompts = load_prompts(loaded.tokenizer, dataset, tokens, num_prompts or batch_size, seed)
    measurer = Measurer(loaded, Workload(prompts, batch_size, max_new_tokens, temperature, seed))
    if from_file is not None:
        try:
            result = GridResult.from_json(json.loads(from_file.read_text())["grid"])
        except (OSError, ValueError, KeyError) as e:
            raise VegasError(f"--from-file {from_file}: not a grid file ({e})") from None
    else:
        if start is not None:
            stderr.print(f"resuming {partial}: {len(start.rows)} of {len(points)} points "
                         "measured")
        with ProgressReporter(stderr) as reporter:
            measured = list(start.measured) if start else []

            def progress(done: int, total: int, row: dict) -> None:
                if row.get("out_of_memory") is None:
                    measured.append(row)
                fastest = max(measured, key=lambda r: r["tokens_per_second"], default=None)
                best = (f"{row_words(fastest)}: {fastest['tokens_per_second']:.0f} tok/s"
                        if fastest else None)
                reporter(ProgressEvent("grid", done, total, best, unit="points"))

            reporter(ProgressEvent("grid", len(start.rows) if start else 0, len(points),
                                   unit="points"))
            out_of_time = (None if time_budget is None else
                           lambda: time.monotonic() - started >= time_budget)
            try:
                result = run_grid(measurer, points, prefix, vanilla_every, progress, start,
                                  lambda kept: write_partial(partial, key, kept), out_of_time)
            except PassCutShort as cut:
                stderr.print(f"--time-budget {time_budget:g} s spent after "
                             f"{len(cut.kept.rows)} of {len(points)} points; they are kept in "
                             f"{partial}: rerun with --resume to go on")
                return EXIT_GRID_CUT_SHORT
            except KeyboardInterrupt:
                log.warning("interrupted: the points finished before the last vanilla run "
                            "are kept in %s; rerun with --resume", partial)
                raise
            except (RuntimeError, MemoryError) as e:
                if not out_of_memory(e):
                    raise
                # A vanilla run out of memory even after the kept graphs were freed (a
                # point that does not fit is recorded and the pass goes on).
                kept = (f"the points finished before the last vanilla run are kept in "
                        f"{partial}" if partial.exists() else "no point was finished")
                again = ("run again with --resume once the device has the memory free, or "
                         "start over with a lower --batch-size" if partial.exists() else
                         "free the device's memory or lower --batch-size")
                raise VegasError(f"out of memory ({str(e).split('. ')[0]}); {kept}: "
                                 f"{again}") from None
    best = result.best()
    data = {"command": "vegas-tune " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "git_revision": git_revision(), "hardware": hardware,
            "model": loaded.label, "dtype": str(dt), "workload": {"ctx": tokens, "dataset": dataset,
                                                "batch_size": batch_size,
                                                "max_new_tokens": max_new_tokens,
                                                "num_prompts": len(prompts)},
            "target": space_target, "points": len(result.rows), "grid": result.to_json()}
    lines = [f"- {loaded.label}; ctx {tokens}, batch {batch_size}, {dataset}, "
             f"{max_new_tokens} new tokens; target {space_target}: {len(result.rows)} points"
             + (f", {len(result.out_of_memory_rows)} of them out of memory (listed last)"
                if result.out_of_memory_rows else ""),
             f"- One timed pass: {result.wall_seconds:.0f} s; best: "
             f"{row_words(best)}: {best['speedup']:.3f}x vanilla",
             f"- Command: `{data['command']}`"]
    if picks:
        top = {f"{GRID_BEST}{rank}": spec_of_row(row)
               for rank, row in enumerate(result.top(GRID_TOP), start=1)}
        with stderr.status(f"comparing {len(picks)} pick(s) with the grid's best {len(top)} ..."):
            compared = race_configs(measurer, {**top, **picks}, rounds, list(top))
        data["compare"] = compared
        reference = compared["series"][compared["reference"]]
        lines.append(f"- Re-measured in {rounds} interleaved rounds: the grid's best "
                     f"{len(top)} by their one run, and each pick; the reference is "
                     f"{compared['reference']} ({reference['speedup']:.3f}x vanilla "
                     f"[{reference['speedup_low']:.3f}, {reference['speedup_high']:.3f}])")
        for name in picks:
            p = load_profile(name)
            series = compared["series"][name]
            lines.append(f"- {name} ({tuned_words(p.entry_for(batch_size).speculative)}): "
                         f"{series['speedup']:.3f}x vanilla [{series['speedup_low']:.3f}, "
                         f"{series['speedup_high']:.3f}]: {regret_words(compared['ratios'][name])}; "
                         f"tuner {p.provenance.duration_seconds:.0f} s = "
                         f"{p.provenance.duration_seconds / result.wall_seconds:.0%} of the "
                         "grid pass")
    write_json(data, out)
    partial.unlink(missing_ok=True)
    md = out.with_suffix(".md")
    write_text_atomically(md, grid_markdown(result, f"Grid: {model}, ctx {tokens}, batch "
                                                    f"{batch_size}", lines), "the grid table")
    for line in lines:
        typer.echo(line)
    stderr.print(f"wrote {out} and {md}")


@app.command()
def validate(profile: Path = typer.Argument(..., help="Profile YAML."),
             debug: bool = typer.Option(False, help="Show tracebacks.")) -> None:
    """Check a profile's types and meaning: limits, intervals, the recommendation and the
    exports (exit 2 with one line naming the first problem)."""
    p = load_profile(profile)
    # One context: "1-3: gamma 5"; several: "ctx 1-362, batch 1-3: gamma 5".
    ranges = [words.removeprefix("batch ")
              for words in entry_ranges([e.model_dump() for e in p.schedule])]
    sizes = ", ".join(f"{where}: "
                      + ("vanilla" if e.config == "vanilla" else f"gamma {e.config.gamma}")
                      for e, where in zip(p.schedule, ranges))
    typer.echo(f"{profile}: valid (schema {p.schema_version}; schedule {sizes}; at batch "
               f"{p.headline.batch_size} {tuned_words(p.tuned)}, speedup "
               f"{_result_words(p.results.model_dump(), 'speedup', 'x', 2)}; recommended "
               f"{str(p.recommended).lower()})")


@app.command()
def show(profile: Path = typer.Argument(..., help="Profile YAML."),
         json_out: bool = typer.Option(False, "--json", help="The whole profile as JSON."),
         plot: Optional[Path] = typer.Option(
             None, help="Also write a PNG heat map of the schedule here: batch size x "
                        "context, coloured by the speedup over vanilla, each cell "
                        "annotated with K (0: vanilla) and the speedup."),
         debug: bool = typer.Option(False, help="Show tracebacks.")) -> None:
    """Print a profile's tuned values, results and provenance, and its schedule: range by
    range, or for a profile tuned at several contexts a table of batch ranges by
    context bands."""
    if plot is not None:
        check_out(plot, "--plot", "the heat map's file name", HEATMAP_EXAMPLE)
        if plot.suffix.lower() != PNG_SUFFIX:
            raise VegasError(f"--plot {plot}: the heat map is a PNG; give a file name "
                             f"ending in {PNG_SUFFIX}, e.g. {plot.with_suffix(PNG_SUFFIX)}")
    p = load_profile(profile)
    if json_out:
        print(json.dumps(profile_to_dict(p), indent=1))
    else:
        _print_profile(p, profile)
    if plot is not None:
        plot_schedule_heatmap(profile_to_dict(p), plot)
        stderr.print(f"wrote {plot}")


def _print_profile(p: Profile, profile: Path) -> None:
    """What ``show`` prints of ``p`` (read from ``profile``) without --json."""
    r = p.results
    results = r.model_dump()

    def figure(name: str, unit: str, digits: int) -> str:
        return _result_words(results, name, unit, digits)

    hw = p.hardware.gpu_name or f"CPU ({p.hardware.cpu})"
    sizes = ", ".join(map(str, p.workload.batch_sizes))
    contexts = ", ".join(map(str, p.contexts))
    typer.echo(f"{profile}\n  model {p.model.id} ({p.model.dtype}) on {hw}; ctx {contexts}, "
               f"batch {sizes}, dataset {p.workload.dataset}")
    at = f" (batch {p.headline.batch_size})" if len(p.schedule) > 1 else ""
    if p.workload.contexts:
        at = f" (batch {p.headline.batch_size}, ctx {p.headline.ctx})"
    typer.echo(f"  tuned for {p.target}{at}: {tuned_words(p.tuned)}; collect {p.tuned.collect}, "
               f"granularity {p.tuned.granularity}, rule {p.tuned.rule}")
    typer.echo(f"  {figure('tokens_per_second', ' tok/s', 1)}; vanilla "
               f"{figure('vanilla_tokens_per_second', ' tok/s', 1)}; best streaming "
               f"{figure('streaming_tokens_per_second', ' tok/s', 1)}")
    typer.echo(f"  speedup {figure('speedup', 'x', 2)} over vanilla, "
               f"{figure('speedup_over_streaming', 'x', 2)} over the best streaming configuration; mean accepted "
               f"length {r.mean_accepted_length:.2f}")
    typer.echo(f"  means of {r.rounds} interleaved rounds, {r.confidence:.0%} confidence "
               "intervals in brackets")
    if p.workload.contexts:
        # One band per context: a table of batch ranges by context bands.
        lines = schedule_table_lines(p)
        typer.echo(f"  {lines[0]}:")
        for line in lines[1:]:
            typer.echo(f"    {line}")
        for item in p.not_tuned:
            typer.echo(f"    not tuned: batch {item.batch_size} at ctx {item.ctx}: {item.reason}")
        for line in p.cut_short:
            typer.echo(f"    cut short: {line}")
    elif len(p.schedule) > 1 or p.not_tuned or p.cut_short:
        typer.echo("  schedule:")
        entries = [e.model_dump() for e in p.schedule]
        for e, where in zip(entries, entry_ranges(entries)):
            what = "vanilla" if e["config"] == "vanilla" else tuned_words(e["config"])
            typer.echo(f"    {where}: {what} (measured at {measured_at(e)}: "
                       f"{_result_words(e['results'], 'speedup', 'x', 2)} over vanilla)")
        for item in p.not_tuned:
            typer.echo(f"    not tuned: {point_words(item.batch_size, item.ctx)}: {item.reason}")
        for line in p.cut_short:
            typer.echo(f"    cut short: {line}")
    typer.echo(f"  recommended: {str(p.recommended).lower()}; made {p.provenance.started} by "
               f"`{p.provenance.command}`")


@app.command()
def diff(old: Path = typer.Argument(...), new: Path = typer.Argument(...),
         tolerance: float = typer.Option(0.05, help="Allowed relative loss before a regression."),
         force: bool = typer.Option(False, "--force", help="Compare profiles of another "
                                    "model, workload or target anyway (the output says so)."),
         debug: bool = typer.Option(False, help="Show tracebacks.")) -> int:
    """Compare two profiles; exit 1 when NEW regresses beyond the tolerance (a CI gate).
    Profiles of another model, workload or target are refused (exit 2) unless --force;
    another machine is named in a warning above the diff."""
    if not 0 <= tolerance < 1:
        raise VegasError(f"--tolerance must be in [0, 1), got {tolerance}")
    before, after = load_profile(old), load_profile(new)
    workload, hardware = incomparable(before, after)
    if workload and not force:
        raise VegasError(f"{old} and {new} do not compare: {'; '.join(workload)}; diff "
                         "profiles of one model and workload (--force compares anyway)")
    for line in workload + hardware:
        # On stdout, above the diff: whoever reads the diff reads the warning first.
        typer.echo(f"WARNING: not like for like: {line}")
    d = diff_profiles(before, after, tolerance)
    typer.echo(d.format())
    return 1 if d.regressed else 0


@app.command()
def export(profile: Path = typer.Argument(...),
           target: Optional[str] = typer.Option(
               None, help="vllm (the authors' fork) or vegas (this engine). Default: the "
                          "target the profile was tuned for; another is refused unless --force."),
           fmt: str = typer.Option("yaml", "--format", help="yaml or json."),
           out: Optional[Path] = typer.Option(None, help="Write here instead of stdout."),
           force: bool = typer.Option(False, "--force", help="Export anyway: for another "
                                      "target than the profile's, or the measured speculative "
                                      "settings where the schedule runs vanilla."),
           serve_batch: Optional[int] = typer.Option(
               None, help="Concurrent sequences the server runs (max-num-seqs): the schedule "
                          "entry for it is exported. Default: the largest tuned size."),
           per_batch_size: bool = typer.Option(
               False, "--per-batch-size", help="vllm: add the whole schedule as vLLM's "
               "num_speculative_tokens_per_batch_size table (K per batch range, 0 where it "
               "runs vanilla); read by vLLM's dynamic speculative decoding, not by the fork. "
               "A profile tuned at several contexts gives its longest context's ranges."),
           context_ranges: bool = typer.Option(
               False, "--context-ranges", help="With --per-batch-size, for a profile tuned "
               "at several contexts: every context band, as [batch_lo, batch_hi, ctx_lo, "
               "ctx_hi, K] entries (the form proposed in vLLM's RFC 48627; no vLLM release "
               "reads it yet)."),
           debug: bool = typer.Option(False, help="Show tracebacks.")) -> None:
    """Print a profile's serving config: `vllm serve --config` YAML, or JSON, for one
    served concurrency. Where the schedule runs vanilla at that concurrency, vanilla
    decoding is exported (with a warning) unless --force."""
    if out is not None:
        check_out(out, "--out", "the export's file name", "serve.yaml")
    p = load_profile(profile)
    check_table_options(p, per_batch_size, context_ranges)
    target = target or p.target
    warning = check_target(p, target, force, str(profile))
    text = render_export(p, target, fmt, force=force, serve_batch=serve_batch,
                         per_batch_size=per_batch_size, context_ranges=context_ranges)
    # The table runs vanilla where the schedule does: no warning about the served entry.
    note = None if per_batch_size else recommendation_note(p, str(profile), force,
                                                           serve_batch=serve_batch)
    for line in (warning, note):
        if line:
            # Plain echo, not rich: rich would treat "[0.35, 0.41]" as possible markup.
            typer.echo(line, err=True)
    if out is None:
        typer.echo(text, nl=not text.endswith("\n"))
        return
    write_text_atomically(out, text, "the export")
    stderr.print(f"wrote {out}")


@app.command()
def doctor(debug: bool = typer.Option(False, help="Show tracebacks.")) -> int:
    """Show torch, CUDA, the GPU, triton, the attention backend, the CPU, free memory
    (GPU and host) and the embedded model; exit 2 when the embedded model is missing."""
    fp = fingerprint()
    ok = True
    rows = [("torch", fp["torch"]), ("CUDA", fp["cuda"] or "none (CPU build)"),
            ("GPU", f"{fp['gpu_count']} x {fp['gpu_name']} ({fp['gpu_memory_gb']} GB), driver "
                    f"{fp['driver']}" if fp["gpu_count"] else "none: tuning runs on the CPU (slow)"),
            ("triton", fp["triton"] or "not installed (needed only for GPU kernels)"),
            ("attention", attention_backend("cuda" if torch.cuda.is_available() else "cpu")),
            ("CPU", f"{fp['cpu']}, {fp['cpu_count']} cores")]
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        rows.append(("GPU memory free", f"{gib(free)} of {gib(total)}"))
    # What the preflight's memory estimate (weights + KV cache) is held against on the CPU.
    host_free = available_bytes(torch.device("cpu"))
    rows.append(("memory free", "unknown" if host_free is None else
                 f"{gib(host_free)} (the CPU: host memory within any container limit)"))
    try:
        rows.append(("embedded model", str(embedded_path(DEFAULT_MODEL))))
    except VegasError as e:
        rows.append(("embedded model", f"MISSING: {e}"))
        ok = False
    for name, value in rows:
        typer.echo(f"{name:16s} {value}")
    return 0 if ok else 2


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    prefer_expandable_segments()
    # `vegas-tune --model X --ctx 64k` runs `tune`; --help alone shows every command.
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("--help", "-h")):
        argv = ["tune", *argv]
    sys.exit(run_app(app, argv, prog_name="vegas-tune"))


if __name__ == "__main__":
    main()
