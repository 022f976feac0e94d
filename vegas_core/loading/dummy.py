"""``dummy:<preset>``: random weights of a real model's shape, for timing only."""

from __future__ import annotations

import torch

from vegas_core.config import preset_config
from vegas_core.loading.weights import build_random
from vegas_core.tokenizer import ByteTokenizer


def load_dummy(preset: str, *, device: torch.device, dtype: torch.dtype):
    config = preset_config(preset)
    net = build_random(config, device=device, dtype=dtype)
    return config, net, ByteTokenizer(config.vocab_size)
