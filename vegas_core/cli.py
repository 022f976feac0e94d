"""``vegas``: run the engine from the command line (``vegas generate``)."""

from __future__ import annotations

import inspect
import sys
import traceback
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from vegas_core.errors import VegasError
from vegas_core.generation import SpeculativeStats
from vegas_core.generation import generate as run_generate
from vegas_core.graphs import prefer_expandable_segments
from vegas_core.loading import load_model
from vegas_core.schedule import SpecSchedule
from vegas_core.spec_config import MAX_GAMMA, SpecConfig
from vegas_core.yamlio import read_yaml_file

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="The Vegas engine: load a model and generate.",
)
stderr = Console(stderr=True, soft_wrap=True)

EXIT_INTERRUPTED = 130
EXIT_BAD_INPUT = 2
# generate's options that only mean something when decoding speculatively (--drafter).
SPECULATIVE_OPTIONS = ("gamma", "sparsity", "min_tokens", "collect", "score", "granularity")
# A prompt file saved with a byte-order mark (common on Windows) still reads as UTF-8.
PROMPT_ENCODING = "utf-8-sig"


def _is(exc: BaseException, class_name: str) -> bool:
    # Newer typer vendors its own click copy, so match click's exceptions by class name.
    return any(c.__name__ == class_name for c in type(exc).__mro__)


def one_line(text: str) -> str:
    """``text`` on one line: libraries' messages can span several (SQLAlchemy appends a
    "Background on this error" line), and the error contract is one line."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def run_app(app: typer.Typer, argv: list[str] | None = None, prog_name: str | None = None) -> int:
    """Run a typer app with the project's error contract.

    Bad input (VegasError, usage errors): one line on stderr, exit code 2. Anything else
    is a bug: one line and exit code 1. ``--debug`` anywhere shows the traceback.
    """
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        result = app(args=argv, standalone_mode=False, prog_name=prog_name)
        return result if isinstance(result, int) else 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except VegasError as e:
        if debug:
            traceback.print_exc()
        print(f"error: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if _is(e, "Exit"):
            return e.exit_code
        if _is(e, "Abort"):
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        if _is(e, "NoArgsIsHelpError"):
            print(e.format_message(), file=sys.stderr)
            return EXIT_BAD_INPUT
        if _is(e, "UsageError"):
            ctx = getattr(e, "ctx", None)
            hint = f" (see {ctx.command_path} --help)" if ctx else ""
            print(f"error: {one_line(e.format_message())}{hint}", file=sys.stderr)
            return EXIT_BAD_INPUT
        # Anything else is a bug, not bad input.
        if debug:
            traceback.print_exc()
        print(f"internal error: {type(e).__name__}: {one_line(e)} (rerun with --debug for the "
              "traceback)",
              file=sys.stderr)
        return 1


def show_defaults(defaults: dict[str, str], option_names: dict[str, str] | None = None):
    """Decorator: append ``[default: X]`` to the help of each option named in
    ``defaults``, so help texts are never edited by hand and cannot drift from the
    defaults. ``option_names`` maps a parameter to its key in ``defaults`` where they
    differ (``json_out`` -> ``json``).

    For options declared ``Optional[...] = None`` (the real default is resolved at run
    time, after the environment and the config file), typer shows no default at all."""
    option_names = option_names or {}

    def decorate(command):
        for param in inspect.signature(command).parameters.values():
            info, name = param.default, option_names.get(param.name, param.name)
            if isinstance(info, typer.models.OptionInfo) and name in defaults:
                # Escaped: typer renders help as rich markup, where "[default: 4k]" vanishes.
                info.help = f"{info.help or ''} {escape(f'[default: {defaults[name]}]')}".strip()
        return command

    return decorate


@app.callback()
def _root() -> None:
    """The Vegas engine: load a model and generate."""


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
        TextColumn("{task.completed}/{task.total} tok"), TimeRemainingColumn(),
        console=stderr, transient=True,
    )


@app.command()
@show_defaults({"prompt": "none", "prompt_file": "none", "drafter": "none: vanilla decoding",
                "profile": "none"})
def generate(
    ctx: typer.Context,
    model: str = typer.Option("smollm2-135m", help="Embedded name, .gguf file, HF directory or hub id, or dummy:<preset>."),
    prompt: Optional[str] = typer.Option(None, help="The prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, help="Read the prompt from this file."),
    max_new_tokens: int = typer.Option(128, min=1, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Nucleus sampling mass (1 disables)."),
    top_k: int = typer.Option(0, min=0, help="Keep the k most likely tokens (0 disables)."),
    seed: int = typer.Option(0, help="Seed of the sampling generator."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the model's chat template."),
    ignore_eos: bool = typer.Option(False, help="Keep generating past EOS (for timing)."),
    drafter: Optional[str] = typer.Option(None, help="Decode speculatively with this drafter: vegas, streaming, quest, snapkv, specextend, oracle, dense."),
    profile: Optional[Path] = typer.Option(None, help="Decode with a tuned profile (vegas-tune's YAML): its schedule, followed as the context grows (one prompt: its entries for batch 1). Not with --drafter."),
    gamma: int = typer.Option(6, min=1, max=MAX_GAMMA, help="Draft tokens per iteration (with --drafter)."),
    sparsity: float = typer.Option(0.05, min=0.0, max=1.0, help="Draft budget as a share of the prefix (with --drafter)."),
    min_tokens: int = typer.Option(256, min=1, help="Smallest draft budget in tokens (with --drafter)."),
    collect: str = typer.Option("two", help="vegas: verify rows that select (two, all, last)."),
    score: str = typer.Option("logit", help="vegas: logit or weight."),
    granularity: str = typer.Option("layer", help="vegas: layer or kv_head."),
    device: str = typer.Option("auto", help="cpu, cuda, cuda:N or auto."),
    dtype: str = typer.Option("auto", help="float32, bfloat16, float16 or auto (bf16 on GPU, fp32 on CPU)."),
    debug: bool = typer.Option(False, help="Show tracebacks."),
) -> None:
    """Generate text from one prompt and report decode speed."""
    if (prompt is None) == (prompt_file is None):
        raise VegasError("give exactly one of --prompt or --prompt-file")
    if profile is not None:
        # Both would choose the decoding; mixing them would time neither as tuned.
        if drafter is not None:
            raise VegasError("--profile and --drafter both choose how to decode; give one")
        for name in SPECULATIVE_OPTIONS:
            if ctx.get_parameter_source(name).name != "DEFAULT":
                flag = "--" + name.replace("_", "-")
                raise VegasError(f"{flag} does not combine with --profile, which sets the "
                                 f"speculative settings; drop {flag}")
    elif drafter is None:
        # Silently ignoring e.g. --sparsity would time vanilla decoding as if it were tuned.
        for name in SPECULATIVE_OPTIONS:
            if ctx.get_parameter_source(name).name != "DEFAULT":
                flag = "--" + name.replace("_", "-")
                raise VegasError(f"{flag} applies only to speculative decoding; add --drafter "
                                 f"(e.g. --drafter vegas) or drop {flag}")
    if prompt_file is not None:
        prompt = read_prompt_file(prompt_file)
    if not prompt:
        # Refused here, not by prefill after the model has loaded (seconds to minutes).
        where = "--prompt" if prompt_file is None else f"--prompt-file {prompt_file}"
        raise VegasError(f"{where} is empty; give the text to continue")
    spec = None
    if drafter is not None:
        spec = SpecConfig(drafter=drafter, gamma=gamma, sparsity=sparsity, min_tokens=min_tokens,
                          collect=collect, score=score, granularity=granularity)
    if profile is not None:
        # Before loading the model: a bad profile fails in a moment, not after a load.
        spec = _profile_schedule(profile, model, batch=1)
    with stderr.status(f"loading {model} ..."):
        loaded = load_model(model, device=device, dtype=dtype)
    stderr.print(f"model: {loaded.label} on {loaded.device} ({str(loaded.dtype).removeprefix('torch.')})")
    if chat and loaded.tokenizer is not None:
        prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])

    with _progress() as bar:
        tasks: dict[str, int] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done)

        result = run_generate(loaded, [prompt], max_new_tokens, temperature=temperature,
                              top_p=top_p, top_k=top_k, seed=seed, ignore_eos=ignore_eos,
                              spec=spec, progress=progress)
    text = result.texts[0] if result.texts else " ".join(map(str, result.tokens[0]))
    typer.echo(text)
    s = result.stats
    stderr.print(
        f"prompt {s.prompt_tokens[0]} tok, prefill {s.prefill_seconds:.2f} s; "
        f"generated {s.new_tokens[0]} tok, decode {s.tokens_per_second:.1f} tok/s"
    )
    if isinstance(spec, SpecSchedule):
        configs = spec.configs_for(1)
        # A profile of one configuration for the batch decodes as that configuration.
        spec = configs[0] if len(configs) == 1 else spec
    if isinstance(s, SpeculativeStats):
        by_pos = " ".join(f"{a:.2f}" for a in s.acceptance_by_position)
        what = ("the profile's drafts" if isinstance(spec, SpecSchedule)
                else f"{spec.drafter} gamma={spec.gamma}")
        stderr.print(
            f"{what}: mean accepted length {s.mean_accepted_length:.2f} "
            f"over {s.iterations} iterations; acceptance by position {by_pos}; draft "
            f"{s.draft_seconds:.2f} s, verify {s.verify_seconds:.2f} s, selection "
            f"{s.selection_seconds:.3f} s ({100 * s.selection_overhead:.1f}% of decode)"
        )
    if s.iterations_by_config:
        ran = "; ".join(f"{name}: {n}" for name, n in s.iterations_by_config.items())
        each = f", {1000 * s.seconds_per_switch:.1f} ms each" if s.switches else ""
        switches = f"{s.switches} switch" + ("" if s.switches == 1 else "es")
        stderr.print(f"schedule followed: {switches}{each}; iterations by "
                     f"configuration: {ran}", markup=False, highlight=False)


def _profile_schedule(path: Path, model: str, batch: int) -> SpecSchedule:
    """The profile's schedule, its entries for ``batch`` prompts announced on stderr (one
    per band of contexts: the decode follows the context as it grows); a warning when
    the profile was tuned for another model than ``model``."""
    data = read_yaml_file(path, "profile")
    schedule = SpecSchedule.from_profile_data(data, str(path))
    # Cheap and advisory: model.id is the --model the tuner was given, so a path and a
    # name of the same model differ too.
    info = data.get("model")
    tuned_for = info.get("id") if isinstance(info, dict) else None
    if isinstance(tuned_for, str) and tuned_for != model:
        stderr.print(f"warning: profile {path} was tuned for {tuned_for}, not {model}; its "
                     "settings may not suit this model", markup=False, highlight=False)
    if not schedule.has_contexts:
        entries = [schedule.entry_for(batch)]
    else:
        bands = dict.fromkeys((e.ctx_min, e.ctx_max) for e in schedule.entries)
        entries = [schedule.entry_for(batch, low) for low, _ in bands]

    def chosen(entry) -> str:
        spec = entry.spec
        words = ("vanilla" if spec is None
                 else f"{spec.drafter} gamma {spec.gamma}, sparsity {spec.sparsity:g}")
        where = f"range {entry.batch_min}-{entry.batch_max}"
        if schedule.has_contexts:
            where = f"context {entry.ctx_min}-{entry.ctx_max}, {where}"
        return f"{words} ({where})"

    stderr.print(f"profile {path}: batch {batch} -> " + "; ".join(map(chosen, entries)),
                 markup=False, highlight=False)
    return schedule


def read_prompt_file(path: Path) -> str:
    """The file's text, decoded strictly: a prompt altered by replacement characters
    would be measured and answered as something the user did not write."""
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "prompt file not found"
        raise VegasError(f"--prompt-file {path}: {what}; pass a text file")
    try:
        return path.read_bytes().decode(PROMPT_ENCODING)
    except UnicodeDecodeError as e:
        raise VegasError(f"--prompt-file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} "
                         f"at offset {e.start}); convert it to UTF-8") from None
    except OSError as e:
        raise VegasError(f"--prompt-file {path}: cannot read it ({e.strerror or e})") from None


def main() -> None:
    prefer_expandable_segments()
    sys.exit(run_app(app, prog_name="vegas"))


if __name__ == "__main__":
    main()
