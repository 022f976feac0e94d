"""Build a Transformer on a device and fill it from named tensors or at random."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vegas_core.config import ModelConfig
from vegas_core.errors import VegasError
from vegas_core.loading.memory import check_model_fits
from vegas_core.model import Transformer, packed_projections

# Matches the initializer range of the public configs; only dummy models use it.
DUMMY_INIT_STD = 0.02


def _empty_transformer(config: ModelConfig, device: torch.device, dtype: torch.dtype, *,
                       staging: bool) -> Transformer:
    # Refused before anything is allocated: a model bigger than the free memory would be
    # killed by the kernel without a message. ``staging``: weights come from a file.
    check_model_fits(config, device, dtype, staging=staging)
    # Built on the meta device and allocated once in the target dtype, so an 8B dummy on
    # a GPU never exists as a float32 copy on the host.
    with torch.device("meta"):
        net = Transformer(config)
    net = net.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    for name, table in net.rope_tables().items():
        setattr(net, name, table.to(device))
    return net


def build_with_weights(
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    device: torch.device,
    dtype: torch.dtype,
    source: str,
) -> Transformer:
    """Allocate the model and copy each (name, tensor) into the parameter of that name.

    Names follow the Hugging Face layout without the ``model.`` prefix. Every parameter
    must be filled exactly; a tied ``lm_head`` may be absent.
    """
    net = _empty_transformer(config, device, dtype, staging=True)
    params = dict(net.named_parameters(remove_duplicate=False))
    # Expected names: the model's own, with packed parameters split back into the
    # checkpoint's pieces, each a block of its packed parameter.
    targets: dict[str, tuple[str, tuple]] = {}
    wholes: set[str] = set()
    for i in range(config.num_layers):
        for piece, (whole, index) in packed_projections(config, i).items():
            if f"layers.{i}.{whole}" in params:  # bare tensors (experts): weight, bias
                pairs = [(f"{piece}.weight", whole), (f"{piece}.bias", f"{whole}_bias")]
            else:  # a packed Linear: its weight and bias, where it has one
                pairs = [(f"{piece}.{s}", f"{whole}.{s}") for s in ("weight", "bias")]
            for name, pname in pairs:
                pname = f"layers.{i}.{pname}"
                if pname in params:
                    targets[f"layers.{i}.{name}"] = (pname, index)
                    wholes.add(pname)
    for pname in params:
        if pname not in wholes:
            targets[pname] = (pname, (slice(None),))
    filled: set[str] = set()
    for name, tensor in tensors:
        if name not in targets:
            raise VegasError(
                f"{source}: unexpected weight '{name}'; this checkpoint's architecture "
                f"variant is not supported"
            )
        pname, index = targets[name]
        target = params[pname][index]
        if tuple(target.shape) != tuple(tensor.shape):
            raise VegasError(
                f"{source}: weight '{name}' has shape {tuple(tensor.shape)}, the config "
                f"implies {tuple(target.shape)}; the checkpoint does not match its config"
            )
        with torch.no_grad():
            target.copy_(tensor)
        filled.add(name)
    if config.tie_word_embeddings:
        filled.add("lm_head.weight")
    missing = sorted(set(targets) - filled)
    if missing:
        raise VegasError(
            f"{source}: {len(missing)} weights missing (first: '{missing[0]}'); the "
            f"checkpoint is incomplete"
        )
    return net.eval().requires_grad_(False)


def build_random(config: ModelConfig, *, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> Transformer:
    """Random weights of the config's exact shape (norm weights one), for timing."""
    net = _empty_transformer(config, device, dtype, staging=False)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, DUMMY_INIT_STD, generator=gen)
    return net.eval().requires_grad_(False)
