"""Workload prompts of an exact token length, for tuning and benchmarks.

``load_prompts`` is the entry point: it takes an embedded dataset name, a local
``.jsonl``/``.json``/``.parquet``/``.csv`` file, or a Hugging Face dataset id.

Embedded workloads: long prompts built from text every Python installation carries.

- ``code``: Python standard-library sources (the first ``ctx`` tokens of each module,
  continuing into the next module when one is short).
- ``prose``: the ``pydoc_data.topics`` help texts, joined from a starting topic on.
- ``mixed``: code and prose prompts alternating (the default).
- ``retrieval``: synthetic long-range retrieval: a table of key/value lines at the
  start, filler prose, then the table's first lines again, so that continuing means
  copying lines from far back in the context.
- ``writing``: short requests for long outputs, for long generations (``--ctx 256
  --max-new-tokens 6000``): code and prose alternating, each a request to continue a
  text to great length ("continue this module to its end", "continue this manual with
  many more sections") followed by the text's start, in the model's chat template
  where it has one. The text's start fills the prompt to exactly ``ctx`` tokens.

Code and prose prompts come in rounds, one prompt per module (starting topic); each
round after the first starts ``ROUND_SKIP_TOKENS`` further into its first text, so that a
workload of hundreds of prompts holds no copies.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import itertools
import random
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vegas_core.errors import VegasError

CODE_MODULES = ("argparse", "typing", "http.client", "ast", "email._header_value_parser",
                "inspect", "subprocess", "tarfile", "logging", "difflib", "pathlib",
                "threading", "dataclasses", "collections", "json.decoder", "statistics")
PROSE_START_TOPICS = (5, 25, 60, 15, 40, 70, 10, 50)
EMBEDDED_DATASETS = ("mixed", "code", "prose", "retrieval", "writing")
# The writing dataset's requests, by kind of text continued; they ask for length, so that a
# model's answer runs to thousands of tokens (as the long reasoning outputs of AIME25 and
# CodeElo in the Vegas paper do).
WRITING_REQUESTS = {
    "code": "Below is the start of a Python module. Continue it to its end: write every "
            "remaining class and function in full, with docstrings, comments and tests.\n\n",
    "prose": "Below is the start of a long technical manual. Continue it with many more "
             "sections, each explaining one topic in depth, with examples.\n\n",
}
# Where the text's start goes in the rendered chat template.
WRITING_PLACEHOLDER = "\x00EXCERPT\x00"
# The fewest tokens of text a writing prompt carries after its request.
MIN_EXCERPT_TOKENS = 16
# Share of a retrieval prompt taken by the key/value table.
RETRIEVAL_TABLE_SHARE = 0.3
RETRIEVAL_REPEATED_LINES = 4
# Below this a prompt is too short to say anything about long-context drafting.
MIN_CTX_TOKENS = 16
# How much further into its first text each round of code (prose) prompts starts, in
# tokens; prime, so that offsets taken modulo a text's length stay distinct.
ROUND_SKIP_TOKENS = 997


@dataclass
class Prompt:
    name: str
    ids: list[int]


def _module_source(name: str) -> str:
    module = importlib.import_module(name)
    return Path(inspect.getsourcefile(module)).read_text(encoding="utf-8")


def _prose_from(start: int) -> str:
    from pydoc_data.topics import topics  # deferred: 760 kB of text, for the prose prompts

    keys = list(topics)
    order = keys[start % len(keys):] + keys[: start % len(keys)]
    return "\n\n".join(topics[k] for k in order)


def _fill(encode, texts: list[str], ctx: int, skip: int = 0) -> list[int]:
    """The first ``ctx`` tokens of ``texts`` one after another, starting ``skip`` tokens
    into the first (modulo what it can give up: all of it when more texts follow, else
    all but ``ctx``)."""
    ids: list[int] = []
    for n, text in enumerate(texts):
        encoded = encode(text)
        if n == 0 and skip:
            room = len(encoded) if len(texts) > 1 else len(encoded) - ctx + 1
            encoded = encoded[skip % max(room, 1):]
        ids.extend(encoded)
        if len(ids) >= ctx:
            return ids[:ctx]
    raise VegasError(f"the embedded text is shorter than ctx {ctx} tokens; use a smaller --ctx")


def code_prompt(encode, i: int, ctx: int) -> Prompt:
    first = CODE_MODULES[i % len(CODE_MODULES)]
    rest = [m for m in CODE_MODULES if m != first]
    round_ = i // len(CODE_MODULES)
    ids = _fill(encode, [_module_source(m) for m in [first, *rest]], ctx,
                skip=round_ * ROUND_SKIP_TOKENS)
    return Prompt(f"code:{first}" + (f"+{round_}" if round_ else ""), ids)


def prose_prompt(encode, i: int, ctx: int) -> Prompt:
    start = PROSE_START_TOPICS[i % len(PROSE_START_TOPICS)]
    round_ = i // len(PROSE_START_TOPICS)
    ids = _fill(encode, [_prose_from(start)], ctx, skip=round_ * ROUND_SKIP_TOKENS)
    return Prompt(f"prose:topic{start}" + (f"+{round_}" if round_ else ""), ids)


def retrieval_prompt(encode, i: int, ctx: int, seed: int = 0) -> Prompt:
    rng = random.Random(seed * 1000 + i)
    words = ("amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor",
             "indigo", "juniper", "kelvin", "lumen", "magma", "nectar", "onyx", "prism")
    table: list[int] = []
    lines: list[str] = []
    while len(table) < RETRIEVAL_TABLE_SHARE * ctx:
        line = f"key-{rng.randrange(10000, 99999)}: {rng.choice(words)}-{rng.randrange(1000, 9999)}\n"
        lines.append(line)
        table.extend(encode(line))
    tail = encode("\n\nThe same table again, from the top:\n"
                  + "".join(lines[:RETRIEVAL_REPEATED_LINES]))
    head = encode("A table of keys and their values:\n") + table
    room = ctx - len(head) - len(tail)
    if room < 0:
        raise VegasError(f"ctx {ctx} is too small for a retrieval prompt; use --ctx 512 or more")
    filler = _fill(encode, [_prose_from(i + 3)], room) if room else []
    return Prompt(f"retrieval:{i}", head + filler + tail)


def _without_bos(tokenizer, ids: list[int]) -> list[int]:
    """``ids`` less a leading BOS token: for pieces encoded apart and joined after the first."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids[1:] if bos is not None and ids[:1] == [bos] else ids


def writing_prompt(tokenizer, encode, i: int, ctx: int) -> Prompt:
    """A request to continue a text at length (code for even ``i``, prose for odd), then
    the text's start: exactly ``ctx`` tokens, in the chat template where there is one."""
    kind = ("code", "prose")[i % 2]
    source = code_prompt if kind == "code" else prose_prompt
    message = WRITING_REQUESTS[kind] + WRITING_PLACEHOLDER
    # A tokenizer without templates (or a model without one) gets the request as it is.
    template = getattr(tokenizer, "apply_chat_template", None)
    rendered = template([{"role": "user", "content": message}]) if template else message
    head_text, tail_text = rendered.split(WRITING_PLACEHOLDER)
    head = encode(head_text)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and head[:2] == [bos, bos]:  # a template that writes BOS itself
        head = head[1:]
    tail = _without_bos(tokenizer, encode(tail_text)) if tail_text else []
    room = ctx - len(head) - len(tail)
    if room < MIN_EXCERPT_TOKENS:
        need = len(head) + len(tail) + MIN_EXCERPT_TOKENS
        raise VegasError(f"ctx {ctx} is too small for a writing prompt (its request takes "
                         f"{len(head) + len(tail)} tokens); use --ctx {need} or more")
    text = source(lambda t: _without_bos(tokenizer, encode(t)), i // 2, room)
    return Prompt(f"writing:{text.name}", head + text.ids + tail)


def embedded_prompts(tokenizer, dataset: str, ctx: int, count: int, seed: int = 0) -> list[Prompt]:
    """``count`` prompts of exactly ``ctx`` tokens from an embedded dataset."""
    if dataset not in EMBEDDED_DATASETS:
        raise VegasError(f"unknown dataset '{dataset}'; embedded: {', '.join(EMBEDDED_DATASETS)}")
    if ctx < MIN_CTX_TOKENS:
        raise VegasError(f"ctx must be at least {MIN_CTX_TOKENS} tokens, got {ctx}")
    # Each source text is encoded once per call, however many prompts start in it.
    encode = functools.lru_cache(maxsize=None)(tokenizer.encode)
    prompts = []
    for i in range(count):
        if dataset == "code" or (dataset == "mixed" and i % 2 == 0):
            prompts.append(code_prompt(encode, i // (2 if dataset == "mixed" else 1), ctx))
        elif dataset == "prose" or dataset == "mixed":
            prompts.append(prose_prompt(encode, i // (2 if dataset == "mixed" else 1), ctx))
        elif dataset == "writing":
            prompts.append(writing_prompt(tokenizer, encode, i, ctx))
        else:
            prompts.append(retrieval_prompt(encode, i, ctx, seed))
    return prompts


# --- Prompts from files and Hugging Face datasets ------------------------------------

# Column names that hold the prompt text, in order of preference.
TEXT_COLUMNS = ("text", "prompt")
# Short records are joined with a blank line, as paragraphs of one document.
RECORD_SEPARATOR = "\n\n"
FILE_READERS = (".jsonl", ".json", ".parquet", ".csv")
# Suffixes that mark a name as meant to be a file, so a typo reads "file not found"
# instead of being looked up on the Hugging Face Hub.
FILE_LIKE_SUFFIXES = (*FILE_READERS, ".tsv", ".txt", ".gz", ".zst", ".arrow", ".xz", ".bz2")
DEFAULT_HF_SPLIT = "train"
# The package that reads Hugging Face datasets (optional).
HUB_CLIENT = "datasets"
# "name", "owner/name", "owner/name:split" (the Hub's own character set for ids).
HF_ID_PATTERN = re.compile(r"^(?P<id>[\w.-]+(?:/[\w.-]+)?)(?::(?P<split>[\w.-]+))?$")
# Token ids are hashed as little-endian 64-bit integers so the fingerprint does not
# depend on the machine's byte order or on how Python stores the ints.
FINGERPRINT_DTYPE = "<i8"


def load_prompts(tokenizer, dataset: str, ctx: int, count: int, seed: int = 0) -> list[Prompt]:
    """``count`` prompts of exactly ``ctx`` tokens from ``dataset``.

    ``dataset`` is one of ``EMBEDDED_DATASETS``; a path to a ``.jsonl``/``.json``
    (JSON lines), ``.parquet`` or ``.csv`` file with a ``text`` (or ``prompt``) column;
    or a Hugging Face dataset id ``owner/name[:split]`` (split defaults to ``train``;
    needs the ``datasets`` package). Records are used in order: a record of ``ctx``
    tokens or more gives one prompt (truncated); shorter ones are joined with a blank
    line until ``ctx`` tokens are reached. ``seed`` only affects the embedded
    ``retrieval`` dataset. ``tokenizer`` needs ``encode(text) -> list[int]``.
    """
    if ctx < MIN_CTX_TOKENS:
        raise VegasError(f"ctx must be at least {MIN_CTX_TOKENS} tokens, got {ctx}; "
                         "use a larger --ctx")
    if count < 1:
        raise VegasError(f"the number of prompts must be at least 1, got {count}; "
                         "use --num-prompts 1 or more")
    kind, where = _locate(dataset)
    if kind == "embedded":
        return embedded_prompts(tokenizer, dataset, ctx, count, seed)
    if kind == "file":
        texts = _file_texts(where)
        return _pack(tokenizer, texts, ctx, count, label=f"dataset file {where.name}",
                     name_prefix=f"file:{where.name}")
    try:
        import datasets as hf_datasets  # optional: not a dependency of this package
    except ImportError:
        raise VegasError(_needs_datasets_package(dataset)) from None
    hf_id, split = where
    texts = _hub_texts(hf_datasets, hf_id, split)
    return _pack(tokenizer, texts, ctx, count, label=f"Hugging Face dataset {hf_id} ({split})",
                 name_prefix=f"hf:{hf_id}:{split}")


def check_dataset(dataset: str) -> None:
    """Raise ``VegasError`` for a ``dataset`` that ``load_prompts`` would refuse before
    reading a record: not an embedded name, a missing or empty file, a directory, an
    unsupported file type, a malformed Hub id, no ``datasets`` package for a Hub id.
    Needs no tokenizer, so a command can check ``--dataset`` before loading a model."""
    _locate(dataset)


def _locate(dataset: str) -> tuple[str, object]:
    """("embedded", name), ("file", path) or ("hub", (id, split)), after the checks
    that need no reading beyond the file's size."""
    if dataset in EMBEDDED_DATASETS:
        return "embedded", dataset
    path = Path(dataset).expanduser()
    if path.is_dir():
        raise VegasError(f"dataset path {dataset} is a directory; "
                         f"pass a {'/'.join(FILE_READERS)} file")
    if path.is_file():
        _check_file_type(path)
        if path.stat().st_size == 0:
            raise VegasError(_no_records(path))
        return "file", path
    if _looks_like_path(dataset):
        raise VegasError(f"dataset file not found: {dataset}; check the path")
    match = HF_ID_PATTERN.match(dataset)
    if match is None:
        raise VegasError(f"dataset '{dataset}' is not a file, an embedded dataset "
                         f"({', '.join(EMBEDDED_DATASETS)}) or a Hugging Face id "
                         "(owner/name[:split]); check the name")
    if not _hub_client_installed():
        raise VegasError(_needs_datasets_package(dataset))
    return "hub", (match["id"], match["split"] or DEFAULT_HF_SPLIT)


def _hub_client_installed() -> bool:
    """Whether ``import datasets`` can work, without importing it (slow)."""
    if HUB_CLIENT in sys.modules:
        return sys.modules[HUB_CLIENT] is not None  # None: an import that failed before
    return importlib.util.find_spec(HUB_CLIENT) is not None


def _needs_datasets_package(dataset: str) -> str:
    return (f"dataset '{dataset}' is not a file or an embedded dataset "
            f"({', '.join(EMBEDDED_DATASETS)}); Hugging Face dataset ids need "
            f"`pip install {HUB_CLIENT}`")


def _no_records(path: Path) -> str:
    return (f"dataset file {path} has no records; add records with a "
            f"{' or '.join(repr(c) for c in TEXT_COLUMNS)} field, or use another --dataset")


def dataset_fingerprint(prompts: list[Prompt]) -> str:
    """SHA-256 hex digest of the prompts' token ids, in order (names are not hashed).

    Each prompt's length is hashed before its ids, so moving a token from one prompt
    to the next changes the digest.
    """
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(np.asarray([len(prompt.ids)], dtype=FINGERPRINT_DTYPE).tobytes())
        digest.update(np.asarray(prompt.ids, dtype=FINGERPRINT_DTYPE).tobytes())
    return digest.hexdigest()


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` was meant as a file path rather than a dataset id."""
    if Path(name).suffix.lower() in FILE_LIKE_SUFFIXES:
        return True
    # A Hub id has at most one "/" and never starts like a relative or absolute path.
    return name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1


def _check_file_type(path: Path) -> None:
    suffix = path.suffix.lower()
    if suffix not in FILE_READERS:
        raise VegasError(f"unsupported dataset file type '{suffix}' ({path.name}); "
                         f"use a {'/'.join(FILE_READERS)} file")


def _read_table(path: Path):
    import pandas as pd  # deferred (0.3 s to import): only table files need it

    _check_file_type(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            return pd.read_parquet(path)
        if suffix == ".csv":
            # keep_default_na=False: a record that reads "NA" is text, not a missing value.
            return pd.read_csv(path, dtype=str, keep_default_na=False)
        # dtype=False: no type or date conversion; the text must come back as written.
        return pd.read_json(path, lines=True, dtype=False)
    except Exception as exc:  # pandas/pyarrow raise many types for malformed files
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise VegasError(f"cannot read dataset file {path}: {reason}; "
                         f"check that it is valid {suffix[1:]}") from None


def _text_column(columns: Iterable[str], source: str) -> str:
    columns = list(columns)
    for name in TEXT_COLUMNS:
        if name in columns:
            return name
    raise VegasError(f"{source} has no {' or '.join(repr(c) for c in TEXT_COLUMNS)} column "
                     f"(columns: {', '.join(map(str, columns)) or 'none'}); "
                     "rename the column that holds the prompts to 'text'")


def _clean(value) -> str | None:
    """The record's text, or None for a missing or blank record (dropped)."""
    if value is None or (isinstance(value, float) and value != value):  # NaN
        return None
    text = value if isinstance(value, str) else str(value)
    return text if text.strip() else None


def _file_texts(path: Path) -> Iterator[str]:
    table = _read_table(path)
    if len(table) == 0:
        # Checked before the column: a file without records has no columns either, and
        # "no text column" would send the user looking for a misnamed field.
        raise VegasError(_no_records(path))
    column = _text_column(table.columns, f"dataset file {path.name}")
    return (text for text in map(_clean, table[column]) if text is not None)


def _hub_texts(hf_datasets, hf_id: str, split: str) -> Iterator[str]:
    try:
        records = iter(hf_datasets.load_dataset(hf_id, split=split, streaming=True))
        first = next(records, None)
    except Exception as exc:  # the Hub client raises many types (not found, gated, offline)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise VegasError(f"cannot load Hugging Face dataset '{hf_id}' split '{split}': {reason}; "
                         "check the id, the split and your network access") from None
    if first is None:
        return iter(())
    column = _text_column(first.keys(), f"Hugging Face dataset {hf_id}")
    # Records stream in; the first was read above to find the column.
    cleaned = (_clean(record.get(column)) for record in itertools.chain([first], records))
    return (text for text in cleaned if text is not None)


def _pack(tokenizer, texts: Iterable[str], ctx: int, count: int, *, label: str,
          name_prefix: str) -> list[Prompt]:
    """Cut ``count`` prompts of ``ctx`` tokens from ``texts``, read lazily in order."""
    prompts: list[Prompt] = []
    pending: list[str] = []          # records waiting to be joined into the next prompt
    pending_tokens = 0               # estimate: sum of their separate token counts
    separator_tokens = len(tokenizer.encode(RECORD_SEPARATOR))
    total_tokens = records = 0
    for text in texts:
        ids = tokenizer.encode(text)
        records += 1
        total_tokens += len(ids)
        pending_tokens += len(ids) + (separator_tokens if pending else 0)
        pending.append(text)
        if pending_tokens < ctx:
            continue
        # Encode the joined text once, so merges across the separator and a tokenizer's
        # BOS come out as they would for one document.
        joined = ids if len(pending) == 1 else tokenizer.encode(RECORD_SEPARATOR.join(pending))
        if len(joined) < ctx:
            pending_tokens = len(joined)
            continue
        prompts.append(Prompt(f"{name_prefix}:{len(prompts)}", joined[:ctx]))
        pending, pending_tokens = [], 0
        if len(prompts) == count:
            return prompts
    if records == 0:
        raise VegasError(f"{label} has no records with text (every one is missing or blank); "
                         "use another --dataset")
    raise VegasError(
        f"{label} makes only {len(prompts)} of {count} prompts of {ctx} tokens: it holds "
        f"{total_tokens} tokens in {records} records, and {count * ctx} are needed at least; "
        "use a smaller --ctx or --num-prompts")
