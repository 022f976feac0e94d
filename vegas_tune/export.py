"""Deployment exports of a tuned profile: vLLM serve settings and this engine's own.

vLLM: the Vegas authors' vLLM fork adds a ``sparse_attn`` speculative method. Its
speculative config carries gamma, the sparsity ratio and the minimum budget; the fork has
no setting for ``collect``, ``score``, ``granularity`` or ``window`` (it ranks tokens by
softmax weights), so those stay with this engine. Stock vLLM rejects the fork's keys.

vegas: the keyword arguments of ``vegas_core.SpecConfig`` for the same settings.

A profile with ``recommended: false`` measured no reliable gain over vanilla decoding, so
``render_export`` exports vanilla decoding unless told to ``force`` the tuned settings:

- vllm, yaml: the serve config without its ``speculative-config`` key (a ``# `` comment
  says why); vllm, json: ``null``, which ``--speculative-config`` reads as "no
  speculative decoding";
- vegas, yaml or json: ``null``, standing for ``spec=None``, which is how
  ``vegas_core.generate`` decodes plainly (``SpecConfig(**settings)`` on it fails loudly
  rather than speculating with defaults).

``recommendation_note`` gives the one line the CLI prints on stderr in that case.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from vegas_core.errors import VegasError
from vegas_tune.profile import Exports, Profile, Tuned, VllmExport

VLLM_TARGET = "vllm-sparse-attn-fork"
VLLM_NOTE = (
    "These keys are for the Vegas authors' vLLM fork (speculative method 'sparse_attn'); "
    "stock vLLM (e.g. 0.33) rejects unknown speculative keys (its config forbids extra "
    "fields). Only gamma, sparsity ratio and min_tokens carry over: the fork has no setting "
    "for collect, score, granularity or window, and ranks tokens by softmax weights."
)

VLLM_METHOD = "sparse_attn"
VLLM_ALGORITHM = "vegas"
# The key `vllm serve --config file.yaml` reads the speculative settings from.
VLLM_SPECULATIVE_KEY = "speculative-config"
# Indentation of the JSON that `--speculative-config` takes: readable when pasted.
JSON_INDENT = 2

EXPORT_TARGETS = ("vllm", "vegas")
EXPORT_FORMATS = ("yaml", "json")

# What a not-recommended profile exports by default: no speculative settings at all.
VANILLA_NOTE = ("Not recommended: the tuned settings did not beat vanilla decoding reliably, "
                "so this config has no speculative decoding.")
VANILLA_TEXT = "null\n"


def vllm_speculative_config(tuned: Tuned) -> dict[str, Any]:
    """The fork's speculative config for ``tuned`` (what ``--speculative-config`` takes)."""
    return {
        "method": VLLM_METHOD,
        "num_speculative_tokens": tuned.gamma,
        "sparse_attn_algorithm": VLLM_ALGORITHM,
        "sparse_attn_ratio": tuned.sparsity_ratio,
        "sparse_attn_min_tokens": tuned.min_tokens,
    }


def vllm_serve_config(model_id: str, tuned: Tuned) -> dict[str, Any]:
    """The mapping ``vllm serve --config file.yaml`` takes: the model and its speculative
    config, nested under ``speculative-config``."""
    return {"model": model_id, VLLM_SPECULATIVE_KEY: vllm_speculative_config(tuned)}


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
    }


def build_exports(model_id: str, tuned: Tuned) -> Exports:
    """The ``exports`` section of a profile for ``tuned`` served as ``model_id``."""
    speculative = vllm_speculative_config(tuned)
    return Exports(
        vllm=VllmExport(
            target=VLLM_TARGET,
            note=VLLM_NOTE,
            serve_config=vllm_serve_config(model_id, tuned),
            speculative_config_json=json.dumps(speculative, indent=JSON_INDENT),
        ),
        vegas=engine_settings(tuned),
    )


def _yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)


def _json(data: Any) -> str:
    return json.dumps(data, indent=JSON_INDENT) + "\n"


def _comment(text: str) -> str:
    """``text`` as YAML comment lines, so the rendered file still parses to the config."""
    return "".join(f"# {line}\n" for line in text.splitlines())


def render_export(profile: Profile, target: str, fmt: str, force: bool = False) -> str:
    """Render one of the profile's stored exports as text.

    target ``vllm``: fmt ``yaml`` gives the serve config for ``vllm serve --config``,
    preceded by the note as a ``# `` comment; fmt ``json`` gives the speculative config
    JSON that ``--speculative-config`` takes on the command line.
    target ``vegas``: this engine's settings as YAML or JSON.
    A profile that is not recommended renders vanilla decoding instead (see the module
    docstring) unless ``force`` is true.
    An unknown target or format raises ``VegasError`` naming the allowed values.
    """
    if target not in EXPORT_TARGETS:
        raise VegasError(f"unknown export target '{target}'; choose one of: "
                         f"{', '.join(EXPORT_TARGETS)}")
    if fmt not in EXPORT_FORMATS:
        raise VegasError(f"unknown export format '{fmt}'; choose one of: "
                         f"{', '.join(EXPORT_FORMATS)}")
    if not profile.recommended and not force:
        return _render_vanilla(profile, target, fmt)
    if target == "vllm":
        vllm = profile.exports.vllm
        if fmt == "yaml":
            return _comment(vllm.note) + _yaml(vllm.serve_config)
        return vllm.speculative_config_json.rstrip("\n") + "\n"
    settings = profile.exports.vegas
    return _yaml(settings) if fmt == "yaml" else _json(settings)


def _render_vanilla(profile: Profile, target: str, fmt: str) -> str:
    if target == "vllm" and fmt == "yaml":
        serve = {key: value for key, value in profile.exports.vllm.serve_config.items()
                 if key != VLLM_SPECULATIVE_KEY}
        return _comment(VANILLA_NOTE) + _yaml(serve)
    if fmt == "yaml":
        return _comment(VANILLA_NOTE) + VANILLA_TEXT
    return VANILLA_TEXT


def recommendation_note(profile: Profile, source: str, force: bool) -> str | None:
    """The one stderr line ``export`` prints for a profile that is not recommended (what
    was exported, and why); None for a recommended profile."""
    if profile.recommended:
        return None
    r = profile.results
    low, high = r.speedup_interval
    why = (f"{source} is not recommended (speedup {r.speedup:.2f}x, interval "
           f"[{low:.2f}, {high:.2f}])")
    if force:
        return f"note: {why}: exporting the tuned settings anyway, as --force asks"
    return (f"warning: {why}: exporting vanilla decoding; pass --force to export the "
            "tuned settings")
