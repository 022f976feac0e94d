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
    }


def speculative_json(tuned: Tuned | None) -> str:
    """The ``--speculative-config`` JSON for ``tuned``; ``null`` when there is none."""
    speculative = vllm_speculative_config(tuned) if tuned is not None else None
    return json.dumps(speculative, indent=JSON_INDENT)
