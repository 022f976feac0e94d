"""Checks of a tuning run's settings before any model is loaded.

A bad value found after the model has loaded (or after the sweep has run for minutes)
wastes the user's time, and an unwritable path found by the writer is a traceback or an
"internal error". Each check here raises ``VegasError`` with one line that names where
the value came from: the flag (``--precision``), the environment variable
(``VEGAS_TUNE_PRECISION``) or the config file and key (``tune.yaml: precision``);
``labels`` maps each setting's name to that name.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vegas_core.config import DUMMY_PREFIX
from vegas_core.errors import VegasError
from vegas_core.loading import resolve_device, resolve_dtype
from vegas_core.loading.header import read_model_config
from vegas_core.loading.memory import (check_model_fits, free_memory_words, gib,
                                       kv_cache_bytes, largest_batch_that_fits, weight_bytes)
from vegas_core.spec_config import MAX_GAMMA
from vegas_tune.datasets import check_dataset
from vegas_tune.settings import default_out
from vegas_tune.spans import DEFAULT_SPAN_TOKENS, SPAN_WARMUP_ITERATIONS, SpanLayout
from vegas_tune.steps import MIN_ROUNDS, min_new_tokens

# Settings that count something, so must be whole numbers >= 1.
POSITIVE_INTS = ("batch_size", "max_new_tokens", "num_prompts", "probe_gamma", "candidates",
                 "span_tokens")
# Settings that are draft lengths, bounded by what the engine accepts.
GAMMA_SETTINGS = ("probe_gamma",)
# numpy's seed range, which optuna's samplers pass the seed to.
MAX_SEED = 2**32 - 1
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
SQLITE_SCHEME = "sqlite"
SQLITE_IN_MEMORY = ":memory:"
JOURNAL_SUFFIX = ".optuna.journal"
# Every line of an optuna journal is a JSON object with this key (optuna's JournalOperation).
JOURNAL_ENTRY_KEY = "op_code"
# A journal's first line is one small operation; this much of a file tells whether it is one.
JOURNAL_PROBE_BYTES = 2**20


def flag(name: str) -> str:
    """``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def _label(labels: Mapping[str, str], name: str) -> str:
    return labels.get(name, flag(name))


def check_values(values: Mapping[str, Any], labels: Mapping[str, str] | None = None) -> None:
    """Range checks of the tune settings present in ``values`` (None values skipped):
    counts >= 1, gammas <= the engine's maximum, 0 <= seed <= ``MAX_SEED``, temperature >= 0,
    time_budget > 0, 0 < precision < 1, max_rounds >= the tuner's minimum, budgets below
    the context, not both resume and new_study, a known log level."""
    labels = labels or {}

    def value(name: str) -> Any:
        return values.get(name)

    def fail(name: str, rule: str) -> None:
        raise VegasError(f"{_label(labels, name)} must be {rule}, got {value(name)}")

    for name in POSITIVE_INTS:
        # batch_size may be a list of sizes (one tune across batch sizes).
        given = value(name)
        for item in given if isinstance(given, (list, tuple)) else [given]:
            if item is not None and item < 1:
                raise VegasError(f"{_label(labels, name)} must be >= 1, got {item}")
    for name in GAMMA_SETTINGS:
        if value(name) is not None and value(name) > MAX_GAMMA:
            fail(name, f"<= {MAX_GAMMA} (the most draft tokens the engine accepts)")
    if value("seed") is not None and not 0 <= value("seed") <= MAX_SEED:
        fail("seed", f"between 0 and {MAX_SEED}")
    for name in ("temperature", "time_budget", "precision"):
        if value(name) is not None and not math.isfinite(value(name)):
            fail(name, "a finite number")
    if value("spans") is not None and value("spans") < 0:
        fail("spans", ">= 0 (0: decode every new token from the prompt)")
    spans = value("spans") and value("max_new_tokens") is not None
    if spans:  # raises naming the options when the spans do not fit the generation
        SpanLayout(value("max_new_tokens"), value("spans"),
                   value("span_tokens") or DEFAULT_SPAN_TOKENS)
    # ctx may be a list of contexts (one tune across contexts): the budgets must leave
    # the shortest something sparse to search.
    budgets, contexts = value("budgets"), value("ctx")
    ctx = min(contexts) if isinstance(contexts, (list, tuple)) else contexts
    if budgets and ctx and spans and min(budgets) >= ctx + value("max_new_tokens"):
        raise VegasError(f"{_label(labels, 'budgets')} {','.join(map(str, budgets))}: every "
                         f"budget covers the whole generation of {_label(labels, 'ctx')} + "
                         f"{_label(labels, 'max_new_tokens')}; give budgets below it")
    if budgets and ctx and not spans and min(budgets) >= ctx:
        raise VegasError(f"{_label(labels, 'budgets')} {','.join(map(str, budgets))}: every "
                         f"budget covers the whole {ctx}-token prompt of {_label(labels, 'ctx')}; "
                         "give budgets below it")
    if value("temperature") is not None and value("temperature") < 0:
        fail("temperature", ">= 0 (0 = greedy)")
    if value("time_budget") is not None and value("time_budget") <= 0:
        fail("time_budget", "> 0 seconds (leave it unset for no limit)")
    if value("precision") is not None and not 0 < value("precision") < 1:
        fail("precision", "in (0, 1) (a share of the mean, e.g. 0.02)")
    if spans and value("probe_gamma") is not None:
        needed = min_new_tokens(value("probe_gamma"), SPAN_WARMUP_ITERATIONS)
        given = value("span_tokens") or DEFAULT_SPAN_TOKENS
        if given < needed:
            raise VegasError(
                f"{_label(labels, 'span_tokens')} {given} is too few to time a speculative "
                f"iteration at {_label(labels, 'probe_gamma')} {value('probe_gamma')}; use "
                f"at least {needed}")
    elif value("max_new_tokens") is not None and value("probe_gamma") is not None:
        needed = min_new_tokens(value("probe_gamma"))
        if value("max_new_tokens") < needed:
            raise VegasError(
                f"{_label(labels, 'max_new_tokens')} {value('max_new_tokens')} is too few to "
                f"time a speculative iteration at {_label(labels, 'probe_gamma')} "
                f"{value('probe_gamma')}; use at least {needed}")
    if value("max_rounds") is not None and value("max_rounds") < MIN_ROUNDS:
        fail("max_rounds", f">= {MIN_ROUNDS} (an interval from fewer rounds is too wide)")
    if value("resume") and value("new_study"):
        raise VegasError(f"{_label(labels, 'resume')} and {_label(labels, 'new_study')} "
                         "contradict each other: --resume continues the study's finished "
                         "trials, --new-study discards them; give one")
    level = value("log_level")
    if level is not None and str(level).upper() not in LOG_LEVELS:
        raise VegasError(f"{_label(labels, 'log_level')} '{level}': use one of "
                         f"{', '.join(LOG_LEVELS)}")


def named(label: str, error: VegasError) -> VegasError:
    """``error`` with ``label`` in front, unless its message names it already."""
    message = str(error)
    return error if label in message else VegasError(f"{label}: {message}")


def check_writable_folder(folder: Path, label: str, path: Path | str) -> None:
    """``folder`` exists and takes a new file, or can be created: its nearest existing
    ancestor is a folder that takes a new file. Nothing is left behind."""
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise VegasError(f"{label} {path}: {existing} is a file, not a folder; choose "
                         "another path")
    try:
        # The real test: permissions, read-only mounts and special filesystems (/sys)
        # all show up here, where os.access would pass them as root.
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise VegasError(f"{label} {path}: cannot write in {existing} "
                         f"({e.strerror or e}); choose a writable location") from None


def check_out(out: Path, label: str, what: str = "the profile's file name",
              example: str = "profile.yaml") -> None:
    """A file (and the files written beside it) can be written at ``out``; a folder is
    refused, asking for ``what`` (``example`` inside that folder)."""
    if out.is_dir():
        raise VegasError(f"{label} {out} is a folder; give {what}, e.g. {out / example}")
    check_writable_folder(out.parent, label, out)


def check_storage(url: str, label: str) -> None:
    """A journal file's folder can be created and written, and an existing journal
    appended to; a sqlite database's folder exists and is writable (sqlite creates
    the file, never the folder). Other database URLs are left to the tuner."""
    if "://" not in url:
        path = Path(url).expanduser()
        if path.is_dir():
            raise VegasError(f"{label} {url} is a folder; give a journal file, e.g. "
                             f"{path / ('study' + JOURNAL_SUFFIX)}")
        if path.exists():
            try:
                with open(path, "ab"):
                    pass
            except OSError as e:
                raise VegasError(f"{label} {url}: cannot append to it ({e.strerror or e}); "
                                 "choose another storage") from None
            check_journal(path, label, url)
            return
        check_writable_folder(path.parent, label, url)
        return
    if url.split("://", 1)[0].split("+", 1)[0] != SQLITE_SCHEME:
        return
    # Deferred (0.2 s to import): only database storages need it.
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        database = make_url(url).database
    except ArgumentError as e:
        raise VegasError(f"{label} '{url}' is not a valid database URL ({e})") from None
    if not database or database == SQLITE_IN_MEMORY:
        return
    path = Path(database).expanduser()
    if not path.parent.absolute().is_dir():
        raise VegasError(f"{label} '{url}': folder {path.parent.absolute()} does not exist; "
                         "create it or use another path (sqlite:////abs/path.db)")
    if path.is_dir():
        raise VegasError(f"{label} '{url}': {path} is a folder, not a database file")
    check_writable_folder(path.parent, label, f"'{url}'")


def check_journal(path: Path, label: str, url: str) -> None:
    """An existing file named as the storage is an optuna journal: empty, or JSON lines
    whose first is a journal entry. Anything else (a profile, a binary file) would fail
    deep inside optuna as a decoding error; appending to it would damage it."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(JOURNAL_PROBE_BYTES)
    except OSError as e:
        raise VegasError(f"{label} {url}: cannot read it ({e.strerror or e}); choose another "
                         "storage") from None
    if not head.strip():
        return  # a journal no study has written to yet
    try:
        entry = json.loads(head.split(b"\n", 1)[0].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        entry = None
    if not isinstance(entry, dict) or JOURNAL_ENTRY_KEY not in entry:
        raise VegasError(f"{label} {url} is not an optuna journal (its first line is not a "
                         "journal entry); give a journal file a tune wrote, or a new path")


def check_device(device: str, dtype: str, labels: Mapping[str, str] | None = None):
    """(torch.device, torch.dtype) the run will use, or a named error."""
    labels = labels or {}
    try:
        dev = resolve_device(device)
    except VegasError as e:
        raise named(_label(labels, "device"), e) from None
    try:
        return dev, resolve_dtype(dtype, dev)
    except VegasError as e:
        raise named(_label(labels, "dtype"), e) from None


def check_model_size(spec: str, device, dtype, *, ctx: int, max_new_tokens: int,
                     batch_size: int, extra_tokens: int = 0,
                     labels: Mapping[str, str] | None = None) -> None:
    """From ``spec``'s config, read without its weights (GGUF header, ``config.json``,
    dummy preset): prompt + generated tokens fit its positions, and its weights plus the
    KV cache of ``batch_size`` sequences fit the device's free memory; a batch that does
    not is refused naming the largest that does. A hub id's config may need a download:
    ``load_model`` checks the weights and the pipeline the positions after loading."""
    labels = labels or {}
    try:
        config = read_model_config(spec)
    except VegasError as e:
        raise named(_label(labels, "model"), e) from None
    if config is None:
        return
    limit = config.max_position_embeddings
    if ctx + max_new_tokens > limit:
        raise VegasError(f"{_label(labels, 'ctx')} {ctx} + {_label(labels, 'max_new_tokens')} "
                         f"{max_new_tokens} exceeds {spec}'s maximum of {limit} positions; "
                         f"lower {_label(labels, 'ctx')}")
    tokens = ctx + max_new_tokens + extra_tokens
    # Dummy weights are drawn in place; only weights read from a file are staged.
    staging = not spec.startswith(DUMMY_PREFIX)
    fits = largest_batch_that_fits(config, device, dtype, tokens, staging=staging)
    if fits is None or fits >= batch_size:
        return
    if fits < 1:
        # Not even one sequence: the weights are the problem (a smaller dtype, a smaller
        # model), which check_model_fits words.
        check_model_fits(config, device, dtype, staging=staging,
                         extra_bytes=kv_cache_bytes(config, dtype, tokens, 1),
                         extra_what="KV cache", extra_fix=f"a smaller {_label(labels, 'ctx')}")
        return
    cache = kv_cache_bytes(config, dtype, tokens, batch_size)
    where = "the CPU" if device.type == "cpu" else str(device)
    raise VegasError(
        f"{_label(labels, 'batch_size')}: batch {batch_size} does not fit: {spec} in "
        f"{str(dtype).removeprefix('torch.')} needs about "
        f"{gib(weight_bytes(config, dtype) + cache)} (weights "
        f"{gib(weight_bytes(config, dtype))}, KV cache {gib(cache)} for {batch_size} "
        f"sequences of {tokens} tokens), but only {free_memory_words(device)} is free on "
        f"{where}; the largest batch that fits is {fits}: lower "
        f"{_label(labels, 'batch_size')} or {_label(labels, 'ctx')}")


def check_tune(settings, labels: Mapping[str, str] | None = None) -> None:
    """Everything about a ``TuneSettings`` that can be known before loading the model:
    device and dtype, dataset, the model's positions and memory at the largest batch
    size and the longest context (its config read without the weights), the profile's
    and the storage's paths. Run after ``check_values``; the dataset's contents are checked by
    ``pipeline.prepare_workload``."""
    labels = labels or {}
    device, dtype = check_device(settings.device, settings.dtype, labels)
    try:
        check_dataset(settings.dataset)
    except VegasError as e:
        raise named(_label(labels, "dataset"), e) from None
    # The verify pass writes gamma + 1 slots past the generated tokens. The largest size
    # at the longest context (settings.ctx) is checked: the estimate (weights and KV
    # cache) is what any (context, size) needs at least.
    check_model_size(settings.model, device, dtype, ctx=settings.ctx,
                     max_new_tokens=settings.max_new_tokens,
                     batch_size=max(settings.batch_sizes),
                     extra_tokens=MAX_GAMMA + 1, labels=labels)
    if settings.out is not None:
        check_out(Path(settings.out).expanduser(), _label(labels, "out"))
    else:
        # The hardware only names the file; the folder is the same on any machine.
        check_out(default_out(settings, {}), f"{_label(labels, 'out')} (default)")
    if settings.storage:
        check_storage(settings.storage, _label(labels, "storage"))
    # Without --storage the journal lies beside the profile: checked with it.
