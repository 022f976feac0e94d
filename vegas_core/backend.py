"""What serves a model's forwards on a device, in words: for profiles' provenance, the
benchmarks' reports and ``vegas-tune doctor``. Above ``attention`` (the kernel switch) and
``graphs`` (CUDA graphs), which both decide a part of it."""

from __future__ import annotations

import torch

from vegas_core.attention import kernels_enabled, prefill_kernels_enabled
from vegas_core.graphs import graphs_enabled


def attention_backend(device: torch.device | str) -> str:
    """What serves attention on ``device``: for profiles' provenance and ``doctor``."""
    probe = torch.empty(0, device=torch.device(device))
    prefill = " + sdpa (prefill)" if prefill_kernels_enabled() else ""
    if not kernels_enabled(probe):
        return "pytorch-reference" + (f" (decode, verify, drafts){prefill}" if prefill else "")
    graphs = " + CUDA graphs" if graphs_enabled(probe.device) else ""
    return ("triton (decode, verify with fused, edge-logit or deferred vegas scores, "
            "index-list drafts)"
            f"{graphs}{prefill} + pytorch-reference (query-dependent drafts"
            + ("" if prefill else ", prefill") + ")")
