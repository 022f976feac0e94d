"""What serving a tuned configuration takes: the Vegas authors' vLLM fork's speculative
config, serve config and note, and this engine's ``SpecConfig`` settings, each derived
from a profile's ``Tuned``. ``vegas_tune.profile`` builds a profile's exports from these
and checks them against its ``tuned``; ``vegas_tune.export`` renders them (see its
docstring for the fork's rules)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from vegas_tune.space import FORK_ALGORITHMS, FORK_SETTINGS

if TYPE_CHECKING:  # for annotations only: profile imports this module
    from vegas_tune.profile import Tuned

VLLM_TARGET = "vllm-sparse-attn-fork"
VLLM_NOTE = (
    "These keys are for the Vegas authors' vLLM fork (speculative method 'sparse_attn'); "
    "stock vLLM rejects unknown speculative keys (its config forbids extra fields). Only "
    "gamma, the algorithm (vegas or streamingllm), sparsity ratio and min_tokens carry over: "
    "the fork's score mode is a code constant (softmax weights), and it fixes collection "
    "(first and last verify rows), granularity (one top-k per layer), window (none) and "
    "its selection rule (this engine's rule 'fork': its candidates, budget clamp and "
    "block-wise streaming window)."
)
# Said of a profile tuned for the fork: the configuration exported is the one measured.
VLLM_MEASURED = (
    " Tuned with --target vllm: every configuration searched was one the fork runs, and "
    "this is the one measured fastest.")

VLLM_METHOD = "sparse_attn"
# The key `vllm serve --config file.yaml` reads the speculative settings from.
VLLM_SPECULATIVE_KEY = "speculative-config"
# Indentation of the JSON that `--speculative-config` takes: readable when pasted.
JSON_INDENT = 2
# vLLM's dynamic speculative decoding (pull request 32374): a list of inclusive
# [batch_lo, batch_hi, K] ranges; K = 0 turns speculation off for that range.
VLLM_BATCH_TABLE_KEY = "num_speculative_tokens_per_batch_size"
# The context form of that table, proposed in vLLM's RFC 48627 (pull request 48944, read
# by no release): the same key, each entry [batch_lo, batch_hi, ctx_lo, ctx_hi, K], K
# chosen by the live batch size and the context (tokens) of its sequences.
VLLM_CONTEXT_FORM = "RFC 48627"
CONTEXT_ENTRY_LENGTH = 5
# The selection and budget of a configuration: what one fork speculative config fixes
# for every batch size (only gamma varies through the table). The drafter's options
# count only between two configurations of one drafter.
BUDGET_FIELDS = ("sparsity_ratio", "min_tokens")
SELECTION_FIELDS = ("collect", "score", "granularity", "window", "rule", "spread")


def vllm_batch_table(ranges: list[tuple[int, int, Tuned | None]], served: Tuned
                     ) -> tuple[list[list[int]], list[str]]:
    """vLLM's per-batch-size table for a schedule served with ``served``'s selection and
    budget: ``ranges`` are (batch_min, batch_max, configuration or None for vanilla), in
    order. Returns the table, one ``[batch_min, batch_max, K]`` per range (K = 0 where the
    schedule runs vanilla, else the range's gamma), and a line for each range whose
    measured selection or budget differs from ``served`` (vLLM would run ``served``'s
    there at that gamma: a configuration not measured)."""
    table, unmeasured = [], []
    for low, high, tuned in ranges:
        table.append([low, high, 0 if tuned is None else tuned.gamma])
        if tuned is None:
            continue
        fields = (("drafter",) if tuned.drafter != served.drafter
                  else SELECTION_FIELDS) + BUDGET_FIELDS
        differs = [f"{name} {getattr(tuned, name)!r}" for name in fields
                   if getattr(tuned, name) != getattr(served, name)]
        if differs:
            unmeasured.append(f"batch {low}-{high}: measured with {', '.join(differs)}")
    return table, unmeasured


def check_vllm_batch_table(table: object) -> None:
    """Raise ``ValueError`` unless ``table`` follows vLLM's rules for
    ``num_speculative_tokens_per_batch_size``: a non-empty list of [start, end, K]
    integer triples, 0 < start <= end, K >= 0, sorted and non-overlapping, the first
    starting at 1 (so that every batch size has a K)."""
    if not isinstance(table, list) or not table:
        raise ValueError("the table must be a non-empty list of [start, end, K] entries")
    previous_end = 0
    for entry in table:
        if (not isinstance(entry, list) or len(entry) != 3
                or not all(type(x) is int for x in entry)):
            raise ValueError(f"{entry!r}: each entry must be three integers [start, end, K]")
        start, end, k = entry
        if not 0 < start <= end:
            raise ValueError(f"{entry!r}: a range needs 0 < start <= end")
        if k < 0:
            raise ValueError(f"{entry!r}: K must be >= 0")
        if start <= previous_end:
            raise ValueError(f"{entry!r}: ranges must be sorted and must not overlap")
        previous_end = end
    if table[0][0] != 1:
        raise ValueError("the first range must start at batch size 1")


def vllm_context_table(bands: list[tuple[int, int, list[tuple[int, int, Tuned | None]]]],
                       served: Tuned) -> tuple[list[list[int]], list[str]]:
    """The context form of vLLM's per-batch-size table (``VLLM_CONTEXT_FORM``): ``bands``
    are (ctx_min, ctx_max, that band's ranges as ``vllm_batch_table`` takes them), shortest
    first. Returns one ``[batch_min, batch_max, ctx_min, ctx_max, K]`` per range, band by
    band, and the lines naming ranges measured with another selection or budget than
    ``served`` (as ``vllm_batch_table``, each with its band)."""
    table, unmeasured = [], []
    for ctx_min, ctx_max, ranges in bands:
        batch_table, band_unmeasured = vllm_batch_table(ranges, served)
        table += [[low, high, ctx_min, ctx_max, k] for low, high, k in batch_table]
        unmeasured += [f"ctx {ctx_min}-{ctx_max}, {line}" for line in band_unmeasured]
    return table, unmeasured


def check_vllm_context_table(table: object) -> None:
    """Raise ``ValueError`` unless ``table`` follows the rules of the context form
    (``VLLM_CONTEXT_FORM``): a non-empty list of [batch_start, batch_end, ctx_start,
    ctx_end, K] integer entries, K >= 0, inclusive ranges with 0 < start <= end; entries
    grouped by context band, the bands sorted and following each other from context 1
    (the RFC says nothing of a context between bands, so none is left out); within a
    band, the batch ranges as ``check_vllm_batch_table`` wants them."""
    if not isinstance(table, list) or not table:
        raise ValueError("the table must be a non-empty list of [batch_start, batch_end, "
                         "ctx_start, ctx_end, K] entries")
    bands: list[tuple[int, int, list[list[int]]]] = []
    for entry in table:
        if (not isinstance(entry, list) or len(entry) != CONTEXT_ENTRY_LENGTH
                or not all(type(x) is int for x in entry)):
            raise ValueError(f"{entry!r}: each entry must be five integers [batch_start, "
                             "batch_end, ctx_start, ctx_end, K]")
        batch_start, batch_end, ctx_start, ctx_end, k = entry
        if not 0 < ctx_start <= ctx_end:
            raise ValueError(f"{entry!r}: a context range needs 0 < ctx_start <= ctx_end")
        if bands and (ctx_start, ctx_end) == bands[-1][:2]:
            bands[-1][2].append([batch_start, batch_end, k])
            continue
        expected = bands[-1][1] + 1 if bands else 1
        if ctx_start != expected:
            raise ValueError(f"{entry!r}: context bands must be sorted, start at 1 and follow "
                             f"each other without gaps or overlaps; expected ctx_start "
                             f"{expected}")
        bands.append((ctx_start, ctx_end, [[batch_start, batch_end, k]]))
    for ctx_start, ctx_end, batch_table in bands:
        try:
            check_vllm_batch_table(batch_table)
        except ValueError as error:
            raise ValueError(f"context band {ctx_start}-{ctx_end}: {error}") from None


def vllm_speculative_config(tuned: Tuned) -> dict[str, Any] | None:
    """The fork's speculative config for ``tuned`` (what ``--speculative-config`` takes);
    None for a sparsity ratio of 1, which the fork refuses (it needs 0 < ratio < 1), or a
    drafter the fork does not run."""
    if not tuned.sparsity_ratio < 1.0 or tuned.drafter not in FORK_ALGORITHMS:
        return None
    return {
        "method": VLLM_METHOD,
        "num_speculative_tokens": tuned.gamma,
        "sparse_attn_algorithm": FORK_ALGORITHMS[tuned.drafter],
        "sparse_attn_ratio": tuned.sparsity_ratio,
        "sparse_attn_min_tokens": tuned.min_tokens,
    }


def vllm_serve_config(model_id: str, tuned: Tuned | None, max_num_seqs: int,
                      max_model_len: int) -> dict[str, Any]:
    """The mapping ``vllm serve --config file.yaml`` takes: the model, the concurrency and
    context the fork sizes its buffers for, and the speculative config nested under
    ``speculative-config`` (absent for ``tuned`` None or a config the fork refuses)."""
    serve: dict[str, Any] = {"model": model_id, "max-num-seqs": max_num_seqs,
                             "max-model-len": max_model_len}
    speculative = vllm_speculative_config(tuned) if tuned is not None else None
    if speculative is not None:
        serve[VLLM_SPECULATIVE_KEY] = speculative
    return serve


def vllm_note(tuned: Tuned, target: str) -> str:
    """``VLLM_NOTE``, plus whether ``tuned`` (tuned for ``target``) is what the fork runs."""
    if tuned.drafter not in FORK_ALGORITHMS:
        return (f"{VLLM_NOTE} This configuration drafts with {tuned.drafter!r}, which the "
                "fork does not run, so there is no speculative config.")
    if vllm_speculative_config(tuned) is None:
        return (f"{VLLM_NOTE} This configuration drafts densely (sparsity ratio "
                f"{tuned.sparsity_ratio:g}); the fork needs 0 < ratio < 1, so there is no "
                "speculative config.")
    differs = [f"{name} {getattr(tuned, name)!r} (fork: {fixed!r})"
               for name, fixed in FORK_SETTINGS[tuned.drafter].items()
               if getattr(tuned, name) != fixed]
    if differs:
        return (f"{VLLM_NOTE} Tuned for this engine with {', '.join(differs)}: the fork's "
                "acceptance and selection cost may differ from this profile's figures.")
    measured = VLLM_MEASURED if target == "vllm" else ""
    return VLLM_NOTE + measured


def engine_settings(tuned: Tuned) -> dict[str, Any]:
    """This engine's ``SpecConfig`` keyword arguments for ``tuned``."""
    return {
        "drafter": tuned.drafter,
        "gamma": tuned.gamma,
        "sparsity": tuned.sparsity_ratio,
        "min_tokens": tuned.min_tokens,
        "collect": tuned.collect,
        "score": tuned.score,
        "granularity": tuned.granularity,
        "window": tuned.window,
        "rule": tuned.rule,
        # Only where set: the settings of a configuration without it read as before.
        **({"spread": tuned.spread} if tuned.spread else {}),
    }


def speculative_json(tuned: Tuned | None) -> str:
    """The ``--speculative-config`` JSON for ``tuned``; ``null`` when there is none."""
    speculative = vllm_speculative_config(tuned) if tuned is not None else None
    return json.dumps(speculative, indent=JSON_INDENT)
