"""``load_model``: one entry point for every way a model can be named."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vegas_core.config import DUMMY_PREFIX, ModelConfig
from vegas_core.errors import VegasError
from vegas_core.loading.dummy import load_dummy
from vegas_core.loading.embedded import DEFAULT_MODEL
from vegas_core.loading.gguf import load_gguf
from vegas_core.loading.header import locate_model, single_gguf
from vegas_core.loading.hf import is_hf_dir, load_hf_dir
from vegas_core.model import Transformer

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    """A ready model: the transformer, its config and tokenizer, and where it came from."""

    config: ModelConfig
    net: Transformer
    tokenizer: Any  # vegas_core.tokenizer.Tokenizer, or None for weights-only checkpoints
    spec: str
    path: Path | None
    is_dummy: bool

    @property
    def device(self) -> torch.device:
        return self.net.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.embed_tokens.weight.dtype

    @property
    def label(self) -> str:
        """How the model is named in output; dummy models say so."""
        return f"{self.spec} (DUMMY: random weights, timing only)" if self.is_dummy else self.spec


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise VegasError(f"unknown device '{device}'; use cpu, cuda, cuda:N or auto") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise VegasError(f"device '{device}' requested but no CUDA GPU is visible; use --device cpu")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise VegasError(f"unknown dtype '{dtype}'; use one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    device: str | torch.device | None = "auto",
    dtype: str | torch.dtype | None = "auto",
) -> LoadedModel:
    """Load a model by name.

    ``spec`` is one of: an embedded model name (``"smollm2-135m"``, the default), a
    ``.gguf`` file, a directory holding a Hugging Face checkpoint (config.json +
    safetensors) or a single GGUF file, a Hugging Face hub id (from the local cache,
    downloaded when online), or ``"dummy:<preset>"`` (random weights of a real shape).
    ``dtype="auto"`` means bfloat16 on a GPU and float32 on the CPU.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if spec.startswith(DUMMY_PREFIX):
        config, net, tok = load_dummy(spec[len(DUMMY_PREFIX):], device=dev, dtype=dt)
        return LoadedModel(config, net, tok, spec, None, True)
    path = locate_model(spec, download=True)
    if path.is_dir() and is_hf_dir(path):
        config, net, tok = load_hf_dir(path, device=dev, dtype=dt)
    else:
        config, net, tok = load_gguf(single_gguf(path), device=dev, dtype=dt)
    return LoadedModel(config, net, tok, spec, path, False)
