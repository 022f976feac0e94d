"""Hugging Face checkpoints: a local directory or a hub id resolved through the cache."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from vegas_core.config import ModelConfig
from vegas_core.errors import VegasError
from vegas_core.loading.weights import build_with_weights
from vegas_core.tokenizer import TransformersTokenizer

_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def resolve_hub_id(repo_id: str) -> Path:
    """A local snapshot of ``repo_id``: from the cache when offline, downloaded otherwise."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except Exception as e:
        raise VegasError(
            f"model '{repo_id}' is neither a local path nor a Hugging Face model in the cache, "
            f"and downloading it failed ({type(e).__name__}); check the name or pass a local "
            f"directory"
        ) from e


def _hf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    name = key.removeprefix("model.")
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    yield name, f.get_tensor(key)
        except VegasError:
            raise
        except Exception as e:
            raise VegasError(f"{file} is truncated or corrupt ({e}); download it again") from e


def load_hf_dir(path: Path, *, device: torch.device, dtype: torch.dtype):
    try:
        hf_config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise VegasError(f"{path / 'config.json'} is not valid JSON ({e}); fix or re-download it") from e
    config = ModelConfig.from_hf(hf_config, name=path.name)
    if not any(path.glob("*.safetensors")):
        raise VegasError(
            f"{path} has a config.json but no *.safetensors weights; convert the "
            f"checkpoint to safetensors or download them"
        )
    tensors = _hf_tensors(path)
    if config.family == "gemma3":
        tensors = _unit_offset_norms(tensors)
    net = build_with_weights(config, tensors, device=device, dtype=dtype, source=str(path))
    return config, net, _hf_tokenizer(path, config)


def _unit_offset_norms(tensors: Iterator[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma checkpoints store each RMSNorm weight as w for a scale of 1 + w; the model's
    RMSNorm multiplies by its weight, so it is given 1 + w (GGUF files store it so)."""
    for name, tensor in tensors:
        yield name, (tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)


def _hf_tokenizer(path: Path, config: ModelConfig):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return TransformersTokenizer(AutoTokenizer.from_pretrained(str(path)), config.eos_token_ids)
