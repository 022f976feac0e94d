"""Embedded workloads: long prompts built from text every Python installation carries.

- ``code``: Python standard-library sources (the first ``ctx`` tokens of each module,
  continuing into the next module when one is short).
- ``prose``: the ``pydoc_data.topics`` help texts, joined from a starting topic on.
- ``mixed``: code and prose prompts alternating (the default).
- ``retrieval``: synthetic long-range retrieval: a table of key/value lines at the
  start, filler prose, then the table's first lines again, so that continuing means
  copying lines from far back in the context.
"""

from __future__ import annotations

import inspect
import importlib
import random
from dataclasses import dataclass
from pathlib import Path

from vegas_core.errors import VegasError

CODE_MODULES = ("argparse", "typing", "http.client", "ast", "email._header_value_parser",
                "inspect", "subprocess", "tarfile", "logging", "difflib", "pathlib",
                "threading", "dataclasses", "collections", "json.decoder", "statistics")
PROSE_START_TOPICS = (5, 25, 60, 15, 40, 70, 10, 50)
EMBEDDED_DATASETS = ("mixed", "code", "prose", "retrieval")
# Share of a retrieval prompt taken by the key/value table.
RETRIEVAL_TABLE_SHARE = 0.3
RETRIEVAL_REPEATED_LINES = 4


@dataclass
class Prompt:
    name: str
    ids: list[int]


def _module_source(name: str) -> str:
    module = importlib.import_module(name)
    return Path(inspect.getsourcefile(module)).read_text(encoding="utf-8")


def _prose_from(start: int) -> str:
    from pydoc_data.topics import topics

    keys = list(topics)
    order = keys[start % len(keys):] + keys[: start % len(keys)]
    return "\n\n".join(topics[k] for k in order)


def _fill(tokenizer, texts: list[str], ctx: int) -> list[int]:
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text))
        if len(ids) >= ctx:
            return ids[:ctx]
    raise VegasError(f"the embedded text is shorter than ctx {ctx} tokens; use a smaller --ctx")


def code_prompt(tokenizer, i: int, ctx: int) -> Prompt:
    first = CODE_MODULES[i % len(CODE_MODULES)]
    rest = [m for m in CODE_MODULES if m != first]
    return Prompt(f"code:{first}", _fill(tokenizer, (_module_source(m) for m in [first, *rest]), ctx))


def prose_prompt(tokenizer, i: int, ctx: int) -> Prompt:
    start = PROSE_START_TOPICS[i % len(PROSE_START_TOPICS)] + 7 * (i // len(PROSE_START_TOPICS))
    return Prompt(f"prose:topic{start}", _fill(tokenizer, [_prose_from(start)], ctx))


def retrieval_prompt(tokenizer, i: int, ctx: int, seed: int = 0) -> Prompt:
    rng = random.Random(seed * 1000 + i)
    words = ("amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor",
             "indigo", "juniper", "kelvin", "lumen", "magma", "nectar", "onyx", "prism")
    table: list[int] = []
    lines: list[str] = []
    while len(table) < RETRIEVAL_TABLE_SHARE * ctx:
        line = f"key-{rng.randrange(10000, 99999)}: {rng.choice(words)}-{rng.randrange(1000, 9999)}\n"
        lines.append(line)
        table.extend(tokenizer.encode(line))
    tail = tokenizer.encode("\n\nThe same table again, from the top:\n"
                            + "".join(lines[:RETRIEVAL_REPEATED_LINES]))
    head = tokenizer.encode("A table of keys and their values:\n") + table
    room = ctx - len(head) - len(tail)
    if room < 0:
        raise VegasError(f"ctx {ctx} is too small for a retrieval prompt; use --ctx 512 or more")
    filler = _fill(tokenizer, [_prose_from(i + 3)], room) if room else []
    return Prompt(f"retrieval:{i}", head + filler + tail)


def embedded_prompts(tokenizer, dataset: str, ctx: int, count: int, seed: int = 0) -> list[Prompt]:
    """``count`` prompts of exactly ``ctx`` tokens from an embedded dataset."""
    if dataset not in EMBEDDED_DATASETS:
        raise VegasError(f"unknown dataset '{dataset}'; embedded: {', '.join(EMBEDDED_DATASETS)}")
    if ctx < 16:
        raise VegasError(f"ctx must be at least 16 tokens, got {ctx}")
    prompts = []
    for i in range(count):
        if dataset == "code" or (dataset == "mixed" and i % 2 == 0):
            prompts.append(code_prompt(tokenizer, i // (2 if dataset == "mixed" else 1), ctx))
        elif dataset == "prose" or dataset == "mixed":
            prompts.append(prose_prompt(tokenizer, i // (2 if dataset == "mixed" else 1), ctx))
        else:
            prompts.append(retrieval_prompt(tokenizer, i, ctx, seed))
    return prompts
