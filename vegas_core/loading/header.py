"""A model's config and tokenizer, read without its weights.

Checks of a run's input (the context against the model's positions, the memory the
weights and KV cache need, prompts of the requested length) need only these; reading
them takes a fraction of a second where loading the weights takes seconds to minutes. A
GGUF file's header holds both (its metadata, parsed by ``gguf_header``), a Hugging Face
folder its ``config.json`` and tokenizer files, and a dummy preset its shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vegas_core.config import DUMMY_PREFIX, ModelConfig, preset_config
from vegas_core.errors import VegasError
from vegas_core.loading.embedded import EMBEDDED, embedded_path
from vegas_core.loading.gguf import GGUFFile, gguf_config, gguf_tokenizer
from vegas_core.loading.hf import hf_tokenizer, is_hf_dir, read_hf_config, resolve_hub_id
from vegas_core.tokenizer import ByteTokenizer


@dataclass
class ModelHeader:
    """What a model spec names, short of its weights: the config and the tokenizer (None
    for a checkpoint that ships none)."""

    spec: str
    config: ModelConfig
    tokenizer: Any


def locate_model(spec: str, *, download: bool) -> Path | None:
    """The file or folder that ``spec`` (an embedded name, a path or a hub id) names; a
    hub id is resolved through the local cache, and downloaded when ``download``
    (else None for a hub id). ``VegasError`` for a path that does not exist."""
    if spec in EMBEDDED:
        return embedded_path(spec)
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if looks_like_hub_id(spec):
        return resolve_hub_id(spec) if download else None
    raise VegasError(
        f"model '{spec}' not found: no such file or directory, and not an "
        f"embedded model ({', '.join(EMBEDDED)}) or a hub id (owner/name)")


def looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))


def single_gguf(path: Path) -> Path:
    """``path`` itself, or the one ``.gguf`` file in the folder ``path``."""
    if path.is_file():
        return path
    found = sorted(path.glob("*.gguf"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise VegasError(
            f"{path} holds no model: expected config.json with *.safetensors, or a .gguf file"
        )
    raise VegasError(f"{path} holds {len(found)} .gguf files; pass the one to load")


def read_model_config(spec: str) -> ModelConfig | None:
    """``spec``'s config without its weights or tokenizer; None for a hub id (resolving
    it may download: ``load_model`` does that). Raises ``VegasError`` where
    ``load_model`` would refuse the spec for what the header says (not found, no model
    in a folder, not GGUF, truncated, unsupported architecture)."""
    found = _read(spec, with_tokenizer=False)
    return None if found is None else found.config


def read_model_header(spec: str) -> ModelHeader | None:
    """``spec``'s config and tokenizer without its weights (see ``read_model_config``)."""
    return _read(spec, with_tokenizer=True)


def _read(spec: str, *, with_tokenizer: bool) -> ModelHeader | None:
    if spec.startswith(DUMMY_PREFIX):
        config = preset_config(spec[len(DUMMY_PREFIX):])
        return ModelHeader(spec, config, ByteTokenizer(config.vocab_size))
    path = locate_model(spec, download=False)
    if path is None:
        return None
    if path.is_dir() and is_hf_dir(path):
        config = read_hf_config(path)
        return ModelHeader(spec, config, hf_tokenizer(path, config) if with_tokenizer else None)
    gguf = GGUFFile(single_gguf(path))
    config = gguf_config(gguf)
    return ModelHeader(spec, config, gguf_tokenizer(gguf) if with_tokenizer else None)

