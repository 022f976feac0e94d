"""From settings to files: load, build the workload, tune, write profile and report."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from vegas_core import __version__ as engine_version
from vegas_core import load_model
from vegas_core.backend import attention_backend
from vegas_core.errors import VegasError
from vegas_core.loading.embedded import EMBEDDED, HUB_IDS
from vegas_core.loading.header import read_model_header
from vegas_tune.datasets import Prompt, dataset_fingerprint, load_prompts
from vegas_tune.hardware import fingerprint
from vegas_tune.measure import Measurer, Workload
from vegas_core.schedule import context_bands
from vegas_tune.profile import (CONTEXT_ENTRY_KEYS, SCHEMA_VERSION, VANILLA, Tuned,
                                build_exports, load_profile, profile_from_dict,
                                profile_to_dict, write_profile)
from vegas_tune.report import (plot_acceptance_vs_budget, plot_throughput_vs_batch,
                               plot_throughput_vs_gamma, write_report, write_trials_table)
from vegas_tune.progress import ProgressCallback
from vegas_tune.stats import CONFIDENCE
from vegas_tune.preflight import check_storage, check_values, named
from vegas_tune.space import Point, selections
from vegas_tune.steps import RACE
from vegas_tune.studies import check_study
from vegas_tune.settings import TuneSettings, study_location
from vegas_tune.spans import SpanLayout, prompts_for_rows, reference_continuations, span_rows
from vegas_tune.tuner import Tuner, warn_if_hard_to_time

log = logging.getLogger("vegas_tune")

EXIT_NOT_RECOMMENDED = 3
# What must match for workers to share a study: measurements from another GPU, memory
# size, driver, CUDA or torch would mix in one profile.
STUDY_HARDWARE_KEYS = ("gpu_name", "gpu_memory_gb", "driver", "cuda", "torch")
EXIT_INTERRUPTED = 130
HASH_CHUNK = 1 << 24


def distinct_prompts(num_prompts: int, batch_sizes: tuple[int, ...]) -> int:
    """How many distinct prompts a workload over ``batch_sizes`` decodes: ``num_prompts``,
    or the largest batch size when it is larger. A batch size below ``num_prompts`` decodes
    the first ``num_prompts`` in batches; a larger one decodes one distinct prompt per
    sequence. Repeating a few prompts to fill a large batch would make its greedy
    sequences copies of each other, so acceptance there would be that of a few prompts."""
    return max(num_prompts, *batch_sizes)


def weights_sha256(path: Path | None) -> str | None:
    if path is None:
        return None
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) or sorted(path.glob("*.gguf"))
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def model_path_record(spec: str, path: Path | None, folder: Path | None = None) -> str | None:
    """``model.path`` of a profile: where the weights came from, in words that still mean
    something on another machine. An embedded model is its name (the file lies in its
    package's installation) and a hub id stays the id (the files lie in the local cache);
    a file or folder is relative to ``folder`` (the working folder; ``../`` where it
    lies outside), never a machine's absolute path. None for random weights."""
    if path is None:
        return None
    if spec in EMBEDDED or not Path(spec).expanduser().exists():  # embedded, or a hub id
        return spec
    return Path(os.path.relpath(path.resolve(), (folder or Path.cwd()).resolve())).as_posix()


def git_revision() -> str | None:
    """HEAD of the checkout this code runs from, with "+dirty" when tracked files differ
    from it (the profile was then made by code no commit holds); None outside a checkout."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=here,
                                 timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if not head:
        return None
    changes = git("status", "--porcelain", "--untracked-files=no")
    return head + "+dirty" if changes else head


def run_tune(settings: TuneSettings,
             progress: ProgressCallback | None = None) -> tuple[dict, int]:
    """Tune, write every file, and return (summary, exit code): 0 when the largest tuned
    batch size runs speculatively, 3 when it runs vanilla, 130 when Ctrl-C cut the run
    short (the profile is written all the same, from the finished trials)."""
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    hardware = fingerprint(settings.device)
    out, storage, study_name = study_location(settings, hardware)
    stem = out.with_suffix("")
    # The CLI has checked these with the names they came from; callers of this API have not.
    check_values({**vars(settings.options), "ctx": settings.contexts,
                  "batch_size": settings.batch_sizes,
                  "max_new_tokens": settings.max_new_tokens,
                  "num_prompts": settings.num_prompts, "temperature": settings.temperature,
                  "spans": settings.spans, "span_tokens": settings.span_tokens,
                  "resume": settings.resume, "new_study": settings.new_study})
    if "://" not in storage:
        check_storage(storage, "--storage")
    layout = settings.span_layout()
    # Every input that needs no weights is checked here, before anything is written and
    # before the model loads: the dataset's records become prompts by the tokenizer of
    # the model's header. (A hub id has no header before it is resolved: after loading.)
    prompts = prepare_workload(settings, layout)  # by context
    with removed_on_refusal(storage):
        # Refuse a --resume of another workload (or a rerun without --resume) before loading.
        check_study(None, storage, study_name, resume=settings.resume,
                    new_study=settings.new_study,
                    fingerprint=settings_fingerprint(settings, hardware))
        # A warning only for a run that goes on: after the last refusal that needs no model.
        smallest = settings.batch_sizes[0]
        rows = (prompts_for_rows(settings.num_prompts, layout) * layout.spans if layout
                else settings.num_prompts)
        batches = -(-rows // smallest)
        warn_if_hard_to_time(batches * smallest * (layout.span_tokens if layout else
                                                   settings.max_new_tokens))
        log.info("loading %s", settings.model)
        model = load_model(settings.model, device=settings.device, dtype=settings.dtype)
        if prompts is None:
            if model.tokenizer is None:
                raise VegasError(f"{settings.model} has no tokenizer; the tuner needs one to "
                                 "build prompts")
            check_positions(settings, model.config.max_position_embeddings)
            prompts = build_prompts(model.tokenizer, settings, layout)
        measurers = {ctx: (context_measurers(model, settings, own) if layout is None
                           else span_measurers(model, settings, layout, own, ctx))
                     for ctx, own in prompts.items()}
        log.info("model %s on %s; %d prompts of %s tokens from %s; batch sizes %s; study %s "
                 "in %s", model.label, hardware.get("gpu_name") or "CPU",
                 len(prompts[settings.ctx]), ", ".join(map(str, settings.contexts)),
                 settings.dataset, ", ".join(map(str, settings.batch_sizes)), study_name,
                 storage)
        every_prompt = [prompt for own in prompts.values() for prompt in own]
        fp = {**settings_fingerprint(settings, hardware),
              "dtype": str(model.dtype).removeprefix("torch."),
              "dataset_sha256": dataset_fingerprint(every_prompt)}
        tuner = Tuner(measurers, storage, study_name, settings.options,
                      resume=settings.resume, new_study=False, fingerprint=fp,
                      progress=progress, started=t0)
        result = tuner.run()

    schedule = context_schedule(result.sizes, settings.several_contexts, CONFIDENCE)
    head = schedule[-1]
    # The longest context with entries: the headline's (the profile's ctx, its exports').
    tuned_contexts = sorted({size.ctx for size in result.sizes})
    ctx = tuned_contexts[-1]
    recommended = head["config"] != VANILLA
    tuned = head["config"] if recommended else head["measured"]
    profile = {
        "schema_version": SCHEMA_VERSION,
        "target": settings.options.target,
        "recommended": recommended,
        "tuned": tuned,
        "model": {"id": settings.model, "path": model_path_record(settings.model, model.path),
                  "architecture": model.config.family, "dtype": str(model.dtype).removeprefix("torch."),
                  "weights_sha256": weights_sha256(model.path), "dummy": model.is_dummy},
        "workload": {"ctx": ctx, "batch_size": head["batch_size"],
                     "batch_sizes": list(settings.batch_sizes),
                     "max_new_tokens": settings.max_new_tokens,
                     "temperature": settings.temperature, "dataset": settings.dataset,
                     "dataset_sha256": dataset_fingerprint(every_prompt),
                     "num_prompts": len(prompts[ctx]),
                     **({"spans": layout.spans, "span_tokens": layout.span_tokens,
                         "span_warmup_iterations": layout.warmup_iterations} if layout
                       else {}),
                     **({"contexts": tuned_contexts} if settings.several_contexts else {})},
        "hardware": hardware,
        "results": head["results"],
        "schedule": schedule,
        "not_tuned": [{"batch_size": n.batch_size, "reason": n.reason,
                       **({"ctx": n.ctx} if settings.several_contexts else {})}
                      for n in result.not_tuned],
        "cut_short": result.cut_short,
        "steps": [{"name": s.name, "study": s.study, "batch_size": s.batch_size,
                   "ctx": s.ctx, "trials": s.trials, "chosen": s.chosen, "notes": s.notes,
                   "predictions": s.predictions, "within_noise": s.within_noise,
                   "edges": s.edges}
                  for s in result.steps],
        "provenance": {"tool_version": engine_version, "git_revision": git_revision(),
                       "command": settings.command, "started": started.isoformat(timespec="seconds"),
                       "duration_seconds": round(time.monotonic() - t0, 1),
                       "engine_path": attention_backend(model.device)},
        "exports": build_exports(HUB_IDS.get(settings.model, settings.model), Tuned(**tuned),
                                 head["batch_size"], ctx + settings.max_new_tokens,
                                 settings.options.target).model_dump(),
    }
    validated = profile_from_dict(profile, source=str(out))
    previous = previous_profile(out)
    write_profile(validated, out)
    paths = write_artifacts(profile_to_dict(validated), result, stem, previous)
    paths["profile"] = str(out)
    paths["storage"] = storage
    summary = {"profile": str(out), "target": settings.options.target,
               "recommended": recommended, "tuned": tuned,
               "results": profile["results"],
               "schedule": [{k: e[k] for k in ("batch_min", "batch_max", "batch_size",
                                               *CONTEXT_ENTRY_KEYS, "config") if k in e}
                            | {"speedup": e["results"]["speedup"],
                               "speedup_interval": e["results"]["speedup_interval"]}
                            for e in schedule],
               "not_tuned": profile["not_tuned"], "cut_short": result.cut_short,
               "duration_seconds": profile["provenance"]["duration_seconds"], "files": paths}
    if result.interrupted:
        return summary, EXIT_INTERRUPTED
    return summary, 0 if recommended else EXIT_NOT_RECOMMENDED


def build_prompts(tokenizer, settings: TuneSettings,
                  layout: SpanLayout | None) -> dict[int, list[Prompt]]:
    """The workload's prompts at each context of ``settings.contexts``, ascending."""
    count = prompt_count(settings, layout)
    return {ctx: load_prompts(tokenizer, settings.dataset, ctx, count, settings.seed)
            for ctx in settings.contexts}


def context_measurers(model, settings: TuneSettings,
                      prompts: list[Prompt]) -> dict[int, Measurer]:
    """A measurer per batch size on ``prompts`` (one context's): each size decodes the
    first ``distinct_prompts`` of them."""
    measurers = {}
    for size in settings.batch_sizes:
        own = prompts[:distinct_prompts(settings.num_prompts, (size,))]
        measurers[size] = Measurer(model, Workload(own, size, settings.max_new_tokens,
                                                   settings.temperature, settings.seed))
    return measurers


def prompt_count(settings: TuneSettings, layout: SpanLayout | None) -> int:
    """Distinct prompts the workload needs: one per sequence of the largest batch (at
    least ``--num-prompts``), or, for long generations, one per ``layout.spans`` rows."""
    rows = distinct_prompts(settings.num_prompts, settings.batch_sizes)
    return prompts_for_rows(rows, layout) if layout else rows


def span_measurers(model, settings: TuneSettings, layout: SpanLayout,
                   prompts: list[Prompt], ctx: int) -> dict[int, Measurer]:
    """A measurer per batch size for a long-generation workload at context ``ctx``
    (``prompts`` are of that length): every prompt decoded once to the deepest span
    (vegas_tune.spans), then each batch size's rows, a (prompt, span) pair each, as many
    as a trial decodes (``distinct_prompts`` rows)."""
    log.info("long generations: %s; decoding %d prompts %d tokens deep once for their "
             "contexts", layout.words(), len(prompts), layout.reference_tokens)
    started = time.monotonic()
    continuations = reference_continuations(
        model, [p.ids for p in prompts], layout.reference_tokens,
        batch_size=max(settings.batch_sizes), temperature=settings.temperature,
        seed=settings.seed)
    log.info("reference outputs decoded in %.1f s", time.monotonic() - started)
    contexts = span_rows(prompts, continuations, layout)
    measurers = {}
    for size in settings.batch_sizes:
        own = contexts[:prompts_for_rows(distinct_prompts(settings.num_prompts, (size,)),
                                         layout) * layout.spans]
        measurers[size] = Measurer(model, Workload(
            own, size, layout.max_new_tokens, settings.temperature, settings.seed,
            warmup_iterations=layout.warmup_iterations,
            positions=ctx + settings.max_new_tokens))
    return measurers


def prepare_workload(settings: TuneSettings,
                     layout: SpanLayout | None) -> dict[int, list[Prompt]] | None:
    """The workload's prompts by context, built and checked without the model's weights: its config
    (positions) and tokenizer come from its header (``read_model_header``). Raises
    ``VegasError`` for a model, context or dataset the run would refuse after loading:
    a model without a tokenizer, ctx + new tokens beyond the model's positions, a
    dataset file that cannot be read, decoded or cut into enough prompts. None for a hub
    id, whose header is read after loading."""
    try:
        header = read_model_header(settings.model)
    except VegasError as e:
        raise named("--model", e) from None
    if header is None:
        return None
    if header.tokenizer is None:
        raise VegasError(f"{settings.model} has no tokenizer; the tuner needs one to build "
                         "prompts")
    check_positions(settings, header.config.max_position_embeddings)
    return build_prompts(header.tokenizer, settings, layout)


def check_positions(settings: TuneSettings, limit: int) -> None:
    """The prompts and the tokens generated after them fit the model's ``limit`` (at the
    longest context, ``settings.ctx``)."""
    if settings.ctx + settings.max_new_tokens > limit:
        raise VegasError(f"--ctx {settings.ctx} + --max-new-tokens {settings.max_new_tokens} "
                         f"exceeds {settings.model}'s maximum of {limit} positions; lower --ctx")


@contextlib.contextmanager
def removed_on_refusal(storage: str) -> Iterator[None]:
    """A journal file ``storage`` that this run creates, and the folders it creates for
    it, are removed again when the run is refused (``VegasError``): a refused run leaves
    nothing behind. A journal that existed before (``--resume``, workers sharing it) is
    kept, and so is every journal after Ctrl-C (its trials resume). Database storages
    are left to their server."""
    if "://" in storage:
        yield
        return
    journal = Path(storage).expanduser().absolute()
    existed = journal.exists()
    made_folders = []  # deepest first: the order they can be removed in
    folder = journal.parent
    while not folder.exists():
        made_folders.append(folder)
        folder = folder.parent
    try:
        yield
    except VegasError:
        if not existed:
            journal.unlink(missing_ok=True)
        for made in made_folders:
            try:
                made.rmdir()
            except OSError:
                break  # something else was written there: not ours to remove
        raise


def context_schedule(sizes: list, several_contexts: bool, confidence: float) -> list[dict]:
    """Schedule entries (profile data) from the tuner's results: ``build_schedule``'s at
    one context; at several, a band of them per context with entries, shortest first,
    each entry naming its band's contexts (``context_bands``) and the context measured."""
    contexts = sorted({size.ctx for size in sizes})
    if not several_contexts:
        return build_schedule(sizes, confidence)
    schedule = []
    for ctx, (low, high) in zip(contexts, context_bands(contexts)):
        band = build_schedule([size for size in sizes if size.ctx == ctx], confidence)
        schedule += [{**entry, "ctx_min": low, "ctx_max": high, "ctx": ctx} for entry in band]
    return schedule


def build_schedule(sizes: list, confidence: float) -> list[dict]:
    """Schedule entries (profile data) from the tuner's per-size results, ascending.

    A live batch size uses the entry measured at the largest tuned size at or below it
    (the first entry also covers the sizes below it): speculation pays more as the batch
    grows, so this errs towards vanilla between measured sizes. An entry runs its
    configuration only when the speedup's whole interval lies above 1."""
    entries = []
    for index, size in enumerate(sizes):
        following = sizes[index + 1].batch_size - 1 if index + 1 < len(sizes) else size.batch_size
        tuned = tuned_settings(size.spec)
        results = {**size.figures, "confidence": confidence}
        interval = results["speedup_interval"]
        wins = interval is not None and interval[0] > 1.0
        entries.append({
            "batch_min": 1 if index == 0 else entries[-1]["batch_max"] + 1,
            "batch_max": following, "batch_size": size.batch_size,
            "config": tuned if wins else VANILLA,
            **({} if wins else {"measured": tuned}),
            "results": results, "reason": schedule_reason(size.spec, results, wins)})
    return entries


def tuned_settings(spec) -> dict:
    """A ``SpecConfig`` as the profile's ``Tuned`` mapping (``sparsity_ratio``)."""
    return dict(drafter=spec.drafter, gamma=spec.gamma, sparsity_ratio=spec.sparsity,
                min_tokens=spec.min_tokens, collect=spec.collect, score=spec.score,
                granularity=spec.granularity, window=spec.window, rule=spec.rule,
                spread=spec.spread)


def schedule_reason(spec, results: dict, wins: bool) -> str:
    """One sentence: why this entry runs what it runs."""
    what = config_words(spec)
    speedup, interval = results["speedup"], results["speedup_interval"]
    if speedup is None:
        return (f"vanilla: the best configuration found ({what}) was not measured against "
                "vanilla before the run was cut short")
    if interval is None:
        return (f"vanilla: {what} measured {speedup:.2f}x vanilla once, with no interval to "
                "rest a recommendation on (the run was cut short)")
    words = f"{speedup:.2f}x [{interval[0]:.2f}, {interval[1]:.2f}]"
    if wins:
        streaming = results.get("speedup_over_streaming")
        beside = (f", {streaming:.2f}x the best streaming configuration"
                  if streaming is not None else "")
        return f"{what}: {words} vanilla{beside}; the whole interval lies above 1"
    side = "below 1" if interval[1] < 1.0 else "not wholly above 1"
    return f"vanilla: the best speculative configuration ({what}) measured {words}, {side}"


def config_words(spec) -> str:
    """``vegas weight, 256 slots, gamma 8``: a configuration as the schedule names it."""
    return Point.of(spec).words()


def settings_fingerprint(settings: TuneSettings, hardware: dict) -> dict:
    """What a study's measurements depend on, as far as the settings say; the tuner adds
    the model's dtype and the prompts' hash. Resuming a study recorded with another
    fingerprint would mix workloads in one profile, so it is refused. The number of
    candidates and the time budget are left out: resuming with more is the point. The
    selection rule the target measures under is in it: a study recorded before the fork's
    rule existed measured this engine's under either target."""
    o = settings.options
    return {"model": settings.model, "device": hardware.get("gpu_name") or "cpu",
            "hardware": {k: hardware.get(k) for k in STUDY_HARDWARE_KEYS},
            "ctx": settings.ctx, "dataset": settings.dataset, "num_prompts": settings.num_prompts,
            **({"contexts": list(settings.contexts)} if settings.several_contexts else {}),
            **({"spans": settings.spans, "span_tokens": settings.span_tokens}
               if settings.spans else {}),
            "batch_sizes": list(settings.batch_sizes), "max_new_tokens": settings.max_new_tokens,
            "temperature": settings.temperature, "seed": settings.seed,
            "target": o.target, "selection_rule": selections(o.target)[0].rule,
            "budgets": list(o.budgets), "probe_gamma": o.probe_gamma,
            "max_rounds": o.max_rounds, "precision": o.precision}


def previous_profile(out: Path) -> dict | None:
    """The profile a run is about to replace at ``out``, for its report to say what
    changed; None when there is none or it does not load (it is replaced all the same)."""
    if not out.exists():
        return None
    try:
        return profile_to_dict(load_profile(out))
    except VegasError as error:
        log.warning("not comparing with the profile being replaced: %s", error)
        return None


def write_artifacts(profile: dict, result, stem: Path,
                    previous: dict | None = None) -> dict[str, str]:
    """The trials table, the three plots and the Markdown report beside the profile
    (comparing with ``previous``, the profile replaced, when given).

    ``stem`` is the profile's path without its ``.yaml``; every file keeps all of it:
    ``my.v2.yaml`` gets ``my.v2.trials.csv``, ``my.v2.acceptance.png``,
    ``my.v2.throughput.png``, ``my.v2.batch.png`` and ``my.v2.report.md``. ``profile`` is the validated
    profile as a dict; the plots mark its own tuned values, so they agree with it.
    """
    def beside(suffix: str) -> Path:
        # Not stem.with_suffix: that replaces a dotted stem's last part ("my.v2" -> "my").
        return stem.with_name(stem.name + suffix)

    head_batch = profile["workload"]["batch_size"]
    # A tune of several contexts plots the headline's context (the longest tuned).
    head_ctx = (profile.get("schedule") or [{}])[-1].get("ctx")
    race = next((step for step in profile["steps"]
                 if step["name"] == RACE and step.get("batch_size") == head_batch
                 and step.get("ctx") == head_ctx), {})
    trials_path = write_trials_table(result.trials, beside(".trials.csv"))
    at_head_ctx = [t for t in result.trials if t.get("ctx") == head_ctx]
    acceptance = beside(".acceptance.png")
    plot_acceptance_vs_budget(at_head_ctx, acceptance, tuned=profile["tuned"], batch=head_batch)
    throughput = beside(".throughput.png")
    head_trials = [t for t in at_head_ctx if t.get("batch_size") in (None, head_batch)]
    plot_throughput_vs_gamma(race.get("predictions") or [], throughput, tuned=profile["tuned"],
                             results=profile["results"], trials=head_trials)
    by_batch = beside(".batch.png")
    plot_throughput_vs_batch(profile if head_ctx is None else
                             {**profile, "schedule": [e for e in profile["schedule"]
                                                      if e.get("ctx") == head_ctx]}, by_batch)
    report = write_report(profile, result.trials, beside(".report.md"),
                          {"acceptance vs budget": acceptance.name,
                           "throughput vs gamma": throughput.name,
                           "throughput vs batch size": by_batch.name}, previous=previous)
    return {"trials": str(trials_path), "acceptance_plot": str(acceptance),
            "throughput_plot": str(throughput), "batch_plot": str(by_batch),
            "report": str(report)}
