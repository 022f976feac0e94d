"""Static, preallocated KV cache.

One slot per token position (page size one): the K/V of the token at position p of
sequence b live in slot p. Writing at a position that was written before overwrites it,
so rolling back is only a matter of moving a sequence's length back.

A cache kept across calls (``vegas_core.graphs.Workspace``) also remembers which prompt
tokens each row's leading slots hold (``PromptSlots``), so that a later prefill of the
same prompt in the same row computes nothing: decode and speculation only write past
the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two id lists share (one C-level compare when all of the
    shorter one is shared, the usual case)."""
    n = min(len(a), len(b))
    if (a if len(a) == n else a[:n]) == (b if len(b) == n else b[:n]):
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


@dataclass
class PromptSlots:
    """Slots [0, len(ids)) of a row hold the K/V a prefill of ``ids`` computes;
    ``last_hidden`` [hidden] is the final hidden state of ids[-1] (None if unknown)."""

    ids: list[int]
    last_hidden: torch.Tensor | None = None


class KVCache:
    """K and V for every layer, shape ``[L, B, H_kv, S_max, D]``.

    ``lengths[b]`` (on the cache's device) counts the valid slots of sequence b: slots
    ``[0, lengths[b])`` hold real tokens, anything beyond is stale and never attended.
    Shapes never change after construction, so a decode step can be captured in a CUDA
    graph.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._batch_index = torch.arange(batch_size, device=device)[:, None]  # [B, 1]
        # What each row's leading slots hold (None: unknown); kept by ``prefill`` and
        # cut back by anything that rewrites prompt slots (``forget_from``).
        self.prompts: list[PromptSlots | None] = [None] * batch_size

    def rows(self, start: int, end: int) -> "KVCache":
        """A view of sequences [start, end): writes through it land in this cache."""
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, start:end], self.v[:, start:end]
        view.lengths = self.lengths[start:end]
        view._batch_index = self._batch_index[: end - start]
        view.prompts = [None] * (end - start)  # bookkeeping stays with the whole cache
        return view

    def forget_from(self, row: int, slot: int) -> None:
        """Slots from ``slot`` on of ``row`` are about to be rewritten by something other
        than a prefill of the remembered prompt."""
        kept = self.prompts[row]
        if kept is not None and slot < len(kept.ids):
            self.prompts[row] = PromptSlots(kept.ids[:slot]) if slot > 0 else None

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of new tokens at their positions.

        positions: [B, T]; k, v: [B, T, H_kv, D]
        """
        # Advanced indices around a slice put their dims first: the target is [B, T, H_kv, D].
        self.k[layer][self._batch_index, :, positions] = k
        self.v[layer][self._batch_index, :, positions] = v

    def layer(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one layer over slots [0, kv_len): each [B, H_kv, kv_len, D]."""
        return self.k[layer, :, :, :kv_len], self.v[layer, :, :, :kv_len]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
