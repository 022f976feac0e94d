"""What the decoders of one batch share: its KV cache, its random generator, each
sequence's committed length and pending token.

A batch decoded under a schedule switches decoder (vanilla, or one speculative
configuration or another) as sequences finish and contexts grow; each decoder reads and
writes this one state, so a switch needs no prefill and keeps the sampling stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vegas_core.attention import kernels_serve_model
from vegas_core.cache import KVCache
from vegas_core.graphs import Workspace, workspace
from vegas_core.loading import LoadedModel


def decode_capacity(prompt_ids: list[list[int]], max_new_tokens: int, gamma: int) -> int:
    """Cache slots a batch needs: the longest prompt and its new tokens, and with drafts
    of ``gamma`` tokens (0: vanilla) room for a full iteration past the last token and
    one more (a finished sequence keeps its length, but the batch's steps still write
    its slots)."""
    extra = 2 * (gamma + 1) if gamma else 0
    return max(len(p) for p in prompt_ids) + max_new_tokens + extra


@dataclass
class DecodeState:
    """The batch's cache (``space``: the workspace it belongs to, whose static buffers
    and graphs its steps run on; None: eager steps), the generator every token of the
    batch is drawn with, ``host_lengths`` (the slots each sequence has committed to the
    cache: ``cache.lengths`` on the host) and ``pending`` ([B]: each sequence's next
    token, chosen but not yet in the cache; None until the prefill chose it)."""

    cache: KVCache
    space: Workspace | None
    generator: torch.Generator
    host_lengths: list[int]
    pending: torch.Tensor | None = None
    _active_key: tuple[bool, ...] | None = field(default=None, repr=False)
    _active: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def for_batch(cls, model: LoadedModel, prompt_ids: list[list[int]], capacity: int,
                  rows: int, seed: int) -> DecodeState:
        """A state for ``prompt_ids``, not yet prefilled, with ``capacity`` slots; on
        the model's workspace when the kernels serve forwards of up to ``rows`` rows
        (what static steps need), else on a cache of its own."""
        net, dev = model.net, model.device
        space = (workspace(net, len(prompt_ids), capacity, dev)
                 if kernels_serve_model(model.config, dev, rows) else None)
        cache = space.cache if space is not None else net.new_cache(len(prompt_ids), capacity)
        return cls(cache, space, torch.Generator(device=dev).manual_seed(seed),
                   [len(p) for p in prompt_ids])

    @property
    def prefilled(self) -> bool:
        return self.pending is not None

    def active_mask(self, active) -> tuple[torch.Tensor, list[bool]]:
        """``active`` [B] bools (a list or a tensor) -> (device [B] bool, host list); the
        device copy is made only when the mask changes: a host-to-device copy from
        pageable memory would otherwise wait for the device at every step."""
        host = [bool(a) for a in (active.tolist() if torch.is_tensor(active) else active)]
        if tuple(host) != self._active_key:
            self._active_key = tuple(host)
            self._active = torch.tensor(host, device=self.cache.lengths.device)
        return self._active, host
