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
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from vegas_core.cli import run_app
from vegas_core.errors import VegasError
from vegas_tune.tuner import TuneOptions, parse_ctx, sparsity_grid

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  help="Tune Vegas self-speculative decoding for a model, GPU and context "
                       "length; write a deployable profile.")
stderr = Console(stderr=True, soft_wrap=True)
log = logging.getLogger("vegas_tune")

# Prompts per trial when --num-prompts is not given and the batch is smaller.
MIN_PROMPTS = 4
SUBCOMMANDS = ("tune", "bench", "validate", "show", "diff", "export", "doctor")
ENV_PREFIX = "VEGAS_TUNE_"

# name -> (default, parser). Booleans are parsed from "1/true/yes".
TUNE_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "model": ("smollm2-135m", str),
    "ctx": ("4k", parse_ctx),
    "dataset": ("mixed", str),
    "out": (None, Path),
    "device": ("auto", str),
    "dtype": ("auto", str),
    "storage": (None, str),
    "study_name": (None, str),
    "resume": (False, "bool"),
    "time_budget": (None, float),
    "seed": (0, int),
    "batch_size": (1, int),
    "max_new_tokens": (64, int),
    "temperature": (0.0, float),
    "num_prompts": (None, int),  # None: the batch size, at least MIN_PROMPTS
    "probe_gamma": (8, int),
    "gamma_max": (8, int),
    "sparsity_grid": ("0.01,0.02,0.05,0.1,0.2,0.3", sparsity_grid),
    "tolerance": (0.03, float),
    "min_tokens": (256, int),
    "gamma_candidates": (3, int),
    "refine_trials": (8, int),
    "json": (False, "bool"),
    "log_level": ("INFO", str),
}


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise VegasError(f"{name}: '{value}' is not a boolean; use true or false")


def resolve_settings(flags: dict[str, Any], config_file: Path | None) -> dict[str, Any]:
    """flag > VEGAS_TUNE_* environment > config file > default, each parsed and checked."""
    config: dict[str, Any] = {}
    if config_file is not None:
        if not config_file.is_file():
            raise VegasError(f"config file not found: {config_file}")
        try:
            loaded = yaml.safe_load(config_file.read_text()) or {}
        except yaml.YAMLError as e:
            raise VegasError(f"{config_file}: not valid YAML ({str(e).splitlines()[0]})") from e
        if not isinstance(loaded, dict):
            raise VegasError(f"{config_file}: expected a mapping of option: value")
        for key, value in loaded.items():
            name = str(key).replace("-", "_")
            if name not in TUNE_DEFAULTS:
                raise VegasError(f"{config_file}: unknown option '{key}'; options: "
                                 f"{', '.join(k.replace('_', '-') for k in TUNE_DEFAULTS)}")
            config[name] = value
    settings = {}
    for name, (default, parse) in TUNE_DEFAULTS.items():
        env = os.environ.get(ENV_PREFIX + name.upper())
        for source, value in (("flag", flags.get(name)), ("env", env), ("config", config.get(name))):
            if value is not None:
                break
        else:
            source, value = "default", default
        if value is None:
            settings[name] = None
            continue
        try:
            settings[name] = _parse_bool(name, value) if parse == "bool" else parse(value)
        except VegasError:
            raise
        except (TypeError, ValueError) as e:
            raise VegasError(f"--{name.replace('_', '-')} '{value}' (from {source}) is invalid: {e}") from e
    return settings


def _setup_logging(level: str, debug: bool) -> None:
    numeric = logging.getLevelName("DEBUG" if debug else level.upper())
    if not isinstance(numeric, int):
        raise VegasError(f"--log-level '{level}': use DEBUG, INFO, WARNING or ERROR")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("vegas-tune: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(numeric)
    log.propagate = False


@app.callback()
def _root() -> None:
    """Tune Vegas for a model, GPU and context length; write a deployable profile."""


@app.command()
def tune(
    model: Optional[str] = typer.Option(None, help="Embedded name, .gguf, HF folder or hub id, dummy:<preset>. [default: smollm2-135m]"),
    ctx: Optional[str] = typer.Option(None, help="Prompt length: 2048, 8k, 64k, 128K. [default: 4k]"),
    dataset: Optional[str] = typer.Option(None, help="mixed, code, prose, retrieval, a .jsonl/.csv/.parquet file with a text or prompt column, or a HF dataset id. [default: mixed]"),
    out: Optional[Path] = typer.Option(None, help="Profile path. [default: profiles/<model>/<gpu>-<ctx>.yaml]"),
    device: Optional[str] = typer.Option(None, help="cpu, cuda, cuda:N, auto."),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16, float16, auto."),
    storage: Optional[str] = typer.Option(None, help="Optuna storage: a .journal file or an RDB URL (sqlite:///x.db, postgresql://...). [default: beside the profile]"),
    study_name: Optional[str] = typer.Option(None, help="Study name prefix. [default: <model>-<gpu>-<ctx>]"),
    resume: Optional[bool] = typer.Option(None, "--resume", help="Continue the study in the storage."),
    time_budget: Optional[float] = typer.Option(None, help="Seconds for the whole run."),
    seed: Optional[int] = typer.Option(None, help="Seed for samplers and sampling."),
    batch_size: Optional[int] = typer.Option(None, help="Sequences decoded together. [default: 1]"),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens generated per prompt. [default: 64]"),
    temperature: Optional[float] = typer.Option(None, help="0 = greedy. [default: 0]"),
    num_prompts: Optional[int] = typer.Option(None, help="Prompts per trial; a last batch they do not fill is filled by wrapping around. [default: the batch size, at least 4]"),
    probe_gamma: Optional[int] = typer.Option(None, help="Gamma of step 1. [default: 8]"),
    gamma_max: Optional[int] = typer.Option(None, help="Largest gamma of step 2. [default: 8]"),
    sparsity_grid: Optional[str] = typer.Option(None, help="Step 1 ratios, comma-separated."),
    tolerance: Optional[float] = typer.Option(None, help="Step 1: within this share of the plateau. [default: 0.03]"),
    min_tokens: Optional[int] = typer.Option(None, help="Smallest draft budget. [default: 256]"),
    gamma_candidates: Optional[int] = typer.Option(None, help="Step 2: best predicted gammas measured. [default: 3]"),
    refine_trials: Optional[int] = typer.Option(None, help="Step 3 trials. [default: 8]"),
    json_out: Optional[bool] = typer.Option(None, "--json", help="Print one JSON summary to stdout."),
    log_level: Optional[str] = typer.Option(None, help="DEBUG, INFO, WARNING, ERROR."),
    config: Optional[Path] = typer.Option(None, help="YAML file of option: value."),
    debug: bool = typer.Option(False, help="Tracebacks and debug logs."),
) -> int:
    """Run the three-step tuner and write a profile, its trials, plots and report."""
    from vegas_tune.pipeline import TuneSettings, run_tune

    flags = {k: v for k, v in locals().items() if k not in ("config", "debug", "json_out")}
    flags["json"] = json_out
    s = resolve_settings(flags, config)
    _setup_logging(s["log_level"], debug)
    options = TuneOptions(probe_gamma=s["probe_gamma"], gamma_max=s["gamma_max"],
                          sparsity_grid=s["sparsity_grid"], tolerance=s["tolerance"],
                          min_tokens=s["min_tokens"], gamma_candidates=s["gamma_candidates"],
                          refine_trials=s["refine_trials"], seed=s["seed"],
                          time_budget=s["time_budget"])
    if s["num_prompts"] is None:
        s["num_prompts"] = max(MIN_PROMPTS, s["batch_size"])
    _check_positive(s, "batch_size", "max_new_tokens", "num_prompts", "probe_gamma",
                    "gamma_max", "min_tokens", "gamma_candidates", "refine_trials")
    settings = TuneSettings(
        model=s["model"], ctx=s["ctx"], dataset=s["dataset"], out=s["out"], device=s["device"],
        dtype=s["dtype"], storage=s["storage"], study_name=s["study_name"], resume=s["resume"],
        seed=s["seed"], batch_size=s["batch_size"], max_new_tokens=s["max_new_tokens"],
        temperature=s["temperature"], num_prompts=s["num_prompts"], options=options,
        command="vegas-tune " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    with _progress() as bar:
        tasks: dict[str, int] = {}

        def progress(step: str, done: int, total: int) -> None:
            if step not in tasks:
                tasks[step] = bar.add_task(f"step {step}", total=total)
            bar.update(tasks[step], completed=done, total=total)

        try:
            summary, code = run_tune(settings, progress)
        except KeyboardInterrupt:
            log.warning("interrupted: finished trials are kept in the storage; rerun with --resume")
            raise
    if s["json"]:
        print(json.dumps(summary, indent=1))
    else:
        _print_summary(summary)
    return code


def _check_positive(settings: dict, *names: str) -> None:
    for name in names:
        if settings[name] < 1:
            raise VegasError(f"--{name.replace('_', '-')} must be >= 1, got {settings[name]}")


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("trials"), TimeElapsedColumn(), console=stderr, transient=True)


def _print_summary(summary: dict) -> None:
    r, t = summary["results"], summary["tuned"]
    verdict = "recommended" if summary["recommended"] else "NOT recommended (no configuration beat vanilla)"
    stderr.print(f"profile: {summary['profile']} ({verdict})")
    stderr.print(f"tuned: gamma {t['gamma']}, sparsity {t['sparsity_ratio']}, min_tokens "
                 f"{t['min_tokens']}, score {t['score']}, window {t['window']}")
    stderr.print(f"{r['tokens_per_second']:.1f} tok/s vs vanilla {r['vanilla_tokens_per_second']:.1f} "
                 f"(x{r['speedup']:.2f}) and streaming {r['streaming_tokens_per_second']:.1f} "
                 f"(x{r['speedup_over_streaming']:.2f}); mean accepted length "
                 f"{r['mean_accepted_length']:.2f}")
    stderr.print(f"report: {summary['files']['report']}")


@app.command()
def bench(
    model: str = typer.Option("smollm2-135m", help="Model spec."),
    ctx: str = typer.Option("4k", help="Prompt length."),
    dataset: str = typer.Option("mixed", help="Dataset (as for tune)."),
    drafter: str = typer.Option("vegas", help="Drafter."),
    gamma: int = typer.Option(6), sparsity: float = typer.Option(0.05),
    min_tokens: int = typer.Option(256), collect: str = typer.Option("two"),
    score: str = typer.Option("logit"), granularity: str = typer.Option("layer"),
    window: float = typer.Option(0.0),
    batch_size: int = typer.Option(1), max_new_tokens: int = typer.Option(64),
    num_prompts: Optional[int] = typer.Option(None, help="[default: the batch size]"),
    temperature: float = typer.Option(0.0),
    seed: int = typer.Option(0), device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
    json_out: bool = typer.Option(False, "--json", help="Print JSON to stdout."),
    debug: bool = typer.Option(False, help="Show tracebacks."),
) -> None:
    """Measure one configuration against vanilla decoding on one workload."""
    from vegas_core import SpecConfig, load_model
    from vegas_tune.datasets import load_prompts
    from vegas_tune.measure import Measurer, Workload

    _check_positive(dict(batch_size=batch_size, max_new_tokens=max_new_tokens,
                         num_prompts=num_prompts or batch_size),
                    "batch_size", "max_new_tokens", "num_prompts")
    spec = SpecConfig(drafter=drafter, gamma=gamma, sparsity=sparsity, min_tokens=min_tokens,
                      collect=collect, score=score, granularity=granularity, window=window)
    loaded = load_model(model, device=device, dtype=dtype)
    prompts = load_prompts(loaded.tokenizer, dataset, parse_ctx(ctx), num_prompts or batch_size,
                           seed)
    measurer = Measurer(loaded, Workload(prompts, batch_size, max_new_tokens, temperature, seed))
    with stderr.status("measuring vanilla decoding ..."):
        vanilla = measurer.measure(None)
    with stderr.status(f"measuring {drafter} ..."):
        ours = measurer.measure(spec)
    result = {"model": loaded.label, "spec": spec.to_dict(), "measured": ours.as_attrs(),
              "vanilla": vanilla.as_attrs(),
              "speedup": ours.tokens_per_second / vanilla.tokens_per_second}
    if json_out:
        print(json.dumps(result, indent=1))
        return
    stderr.print(f"{loaded.label}: steady state {drafter} {ours.tokens_per_second:.1f} tok/s, vanilla "
                 f"{vanilla.tokens_per_second:.1f} tok/s (x{result['speedup']:.2f}); mean "
                 f"accepted length {ours.mean_accepted_length:.2f}; selection overhead "
                 f"{100 * ours.selection_overhead:.1f}%")


@app.command()
def validate(profile: Path = typer.Argument(..., help="Profile YAML."),
             debug: bool = typer.Option(False, help="Show tracebacks.")) -> None:
    """Check a profile against the schema (exit 2 if invalid)."""
    from vegas_tune.profile import load_profile

    p = load_profile(profile)
    typer.echo(f"{profile}: valid (schema {p.schema_version}; gamma {p.tuned.gamma}, sparsity "
               f"{p.tuned.sparsity_ratio}; recommended {str(p.recommended).lower()})")


@app.command()
def show(profile: Path = typer.Argument(..., help="Profile YAML."),
         json_out: bool = typer.Option(False, "--json", help="The whole profile as JSON."),
         debug: bool = typer.Option(False, help="Show tracebacks.")) -> None:
    """Print a profile's tuned values, results and provenance."""
    from vegas_tune.profile import load_profile, profile_to_dict

    p = load_profile(profile)
    if json_out:
        print(json.dumps(profile_to_dict(p), indent=1))
        return
    r = p.results
    hw = p.hardware.gpu_name or f"CPU ({p.hardware.cpu})"
    typer.echo(f"{profile}\n  model {p.model.id} ({p.model.dtype}) on {hw}; ctx {p.workload.ctx}, "
               f"batch {p.workload.batch_size}, dataset {p.workload.dataset}")
    typer.echo(f"  tuned: {p.tuned.drafter} gamma {p.tuned.gamma}, sparsity {p.tuned.sparsity_ratio}, "
               f"min_tokens {p.tuned.min_tokens}, collect {p.tuned.collect}, score {p.tuned.score}, "
               f"granularity {p.tuned.granularity}, window {p.tuned.window}")
    typer.echo(f"  {r.tokens_per_second:.1f} tok/s; vanilla {r.vanilla_tokens_per_second:.1f} "
               f"(x{r.speedup:.2f}); streaming {r.streaming_tokens_per_second:.1f} "
               f"(x{r.speedup_over_streaming:.2f}); mean accepted length {r.mean_accepted_length:.2f}")
    typer.echo(f"  recommended: {str(p.recommended).lower()}; made {p.provenance.started} by "
               f"`{p.provenance.command}`")


@app.command()
def diff(old: Path = typer.Argument(...), new: Path = typer.Argument(...),
         tolerance: float = typer.Option(0.05, help="Allowed relative loss before a regression."),
         debug: bool = typer.Option(False, help="Show tracebacks.")) -> int:
    """Compare two profiles; exit 1 when NEW regresses beyond the tolerance (a CI gate)."""
    from vegas_tune.profile import diff_profiles, load_profile

    if not 0 <= tolerance < 1:
        raise VegasError(f"--tolerance must be in [0, 1), got {tolerance}")
    d = diff_profiles(load_profile(old), load_profile(new), tolerance)
    typer.echo(d.format())
    return 1 if d.regressed else 0


@app.command()
def export(profile: Path = typer.Argument(...),
           target: str = typer.Option("vllm", help="vllm (the authors' fork) or vegas (this engine)."),
           fmt: str = typer.Option("yaml", "--format", help="yaml or json."),
           out: Optional[Path] = typer.Option(None, help="Write here instead of stdout."),
           debug: bool = typer.Option(False, help="Show tracebacks.")) -> None:
    """Print a profile's serving config: `vllm serve --config` YAML, or JSON."""
    from vegas_tune.export import render_export
    from vegas_tune.profile import load_profile

    text = render_export(load_profile(profile), target, fmt)
    if out is None:
        typer.echo(text, nl=not text.endswith("\n"))
        return
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(text)
    tmp.replace(out)
    stderr.print(f"wrote {out}")


@app.command()
def doctor(debug: bool = typer.Option(False, help="Show tracebacks.")) -> int:
    """Check the GPU, torch, triton, kernels, memory and the embedded model."""
    import torch

    from vegas_core.attention import attention_backend
    from vegas_core.loading.embedded import DEFAULT_MODEL, embedded_path
    from vegas_tune.hardware import fingerprint

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
        rows.append(("GPU memory free", f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB"))
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
    # `vegas-tune --model X --ctx 64k` runs `tune`; --help alone shows every command.
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("--help", "-h")):
        argv = ["tune", *argv]
    sys.exit(run_app(app, argv, prog_name="vegas-tune"))


if __name__ == "__main__":
    main()
