"""Hugging Face checkpoints: a local directory or a hub id resolved through the cache."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from vegas_core.config import ModelConfig
from vegas_core.errors import VegasError
from vegas_core.loading.weights import build_with_weights
from vegas_core.tokenizer import TransformersTokenizer

_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def resolve_hub_id(repo_id: str) -> Path:
    """A local snapshot of ``repo_id``: from the cache when offline, downloaded otherwise."""
    from huggingface_hub import snapshot_download  # deferred (0.3 s): hub ids only

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


def read_hf_config(path: Path) -> ModelConfig:
    """The model config of the Hugging Face folder ``path`` (its ``config.json``)."""
    try:
        hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VegasError(f"{path / 'config.json'} is not valid JSON ({e}); fix or re-download it") from e
    return ModelConfig.from_hf(hf_config, name=path.name)


def load_hf_dir(path: Path, *, device: torch.device, dtype: torch.dtype):
    config = read_hf_config(path)
    if not any(path.glob("*.safetensors")):
        raise VegasError(
            f"{path} has a config.json but no *.safetensors weights; convert the "
            f"checkpoint to safetensors or download them"
        )
    tensors = _hf_tensors(path)
    if config.family == "gemma3":
        tensors = _unit_offset_norms(tensors)
    elif config.family == "gpt_oss":
        tensors = _per_expert(tensors)
    net = build_with_weights(config, tensors, device=device, dtype=dtype, source=str(path))
    return config, net, hf_tokenizer(path, config)


def _unit_offset_norms(tensors: Iterator[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma checkpoints store each RMSNorm weight as w for a scale of 1 + w; the model's
    RMSNorm multiplies by its weight, so it is given 1 + w (GGUF files store it so)."""
    for name, tensor in tensors:
        yield name, (tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)


_GPT_OSS_FUSED = re.compile(r"(layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias)?")


def _per_expert(tensors: Iterator[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss checkpoints hold each layer's experts in fused tensors, input dimension
    first, with gate and up interleaved column by column: gate_up_proj [E, D, 2F] and
    its bias [E, 2F], down_proj [E, F, D] and its bias [E, D]. Split them into the
    per-expert Linear weights other MoE checkpoints store; the router is ``gate``."""
    for name, t in tensors:
        if ".mlp.router." in name:
            yield name.replace(".mlp.router.", ".mlp.gate."), t
            continue
        m = _GPT_OSS_FUSED.fullmatch(name)
        if m is None:
            if name.endswith(("_blocks", "_scales")):
                raise VegasError(f"'{name}': MXFP4-quantized experts are not supported; use "
                                 "a checkpoint with bf16 or fp32 experts")
            yield name, t
            continue
        mlp, which, bias = m.group(1), m.group(2), m.group(3) or ""
        suffix = "bias" if bias else "weight"
        for e in range(t.shape[0]):
            if which == "down_proj":
                yield f"{mlp}.experts.{e}.down_proj.{suffix}", t[e] if bias else t[e].T
                continue
            gate, up = (t[e, 0::2], t[e, 1::2]) if bias else (t[e][:, 0::2].T, t[e][:, 1::2].T)
            yield f"{mlp}.experts.{e}.gate_proj.{suffix}", gate
            yield f"{mlp}.experts.{e}.up_proj.{suffix}", up


def hf_tokenizer(path: Path, config: ModelConfig):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer  # deferred (0.7 s to import)

    return TransformersTokenizer(AutoTokenizer.from_pretrained(str(path)), config.eos_token_ids)
