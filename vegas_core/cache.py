"""Static, preallocated KV cache.

One slot per token position (page size one): the K/V of the token at position p of
sequence b live in slot p. Writing at a position that was written before overwrites it,
so rolling back is only a matter of moving a sequence's length back.

A hybrid model's sliding layers (Gemma3, gpt-oss) read only the last ``window``
positions, so where the cache is longer than their window plus ``RING_HEADROOM`` they
keep a ring instead: position p lives in slot ``p % ring_slots``. Gemma3-270M at batch
128 and 32256 positions needs 70.9 GiB with every layer at full length and 17.7 GiB
with rings (``kv_cache_bytes``); batch 256 35.3 GiB, so it fits on one 80 GB GPU.

A cache kept across calls (``vegas_core.graphs.Workspace``) also remembers which prompt
tokens each row's leading slots hold (``PromptSlots``), so that a later prefill of the
same prompt in the same row computes nothing: decode and speculation only write past
the prompt. A ring's slots of the prompt are overwritten by what is decoded after it,
so the cache saves each prompt's last positions of the ring layers (its "tail") and
puts them back when the prompt is reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vegas_core.config import SlidingWindow

# Slots a ring keeps beyond its window. One forward writes at most this many positions
# of a sequence past the oldest slot one of its rows still reads: a prefill chunk (ring
# caches cap their chunks at this), a verify window, drafts ahead of the committed
# length. Large enough that prefill chunks keep full-rate GEMMs.
RING_HEADROOM = 2048
# Positions before a kept prompt's end from which it can be reused on a ring cache: a
# speculative prefill reuses all but its last window of rows (at most this many).
PROMPT_TAIL_SLACK = 128


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two id lists share (one C-level compare when all of the
    shorter one is shared, the usual case)."""
    n = min(len(a), len(b))
    if (a if len(a) == n else a[:n]) == (b if len(b) == n else b[:n]):
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def ring_slots(window: SlidingWindow | None, max_len: int) -> int | None:
    """The slots of each sliding layer's ring in a cache of ``max_len`` slots; None when
    they keep full length (no hybrid window, or a cache no longer than the ring)."""
    if window is None or window.layers is None:
        return None
    slots = window.size + RING_HEADROOM
    return slots if slots < max_len else None


def layer_slots(num_layers: int, window: SlidingWindow | None, max_len: int) -> int:
    """The slots, summed over layers, that a cache of ``max_len`` positions keeps for
    each sequence: rings and their saved prompt tails included."""
    ring = ring_slots(window, max_len)
    if ring is None:
        return num_layers * max_len
    rings = len(window.layers)
    return (num_layers - rings) * max_len + rings * (ring + window.size + PROMPT_TAIL_SLACK)


@dataclass
class PromptCopy:
    """A row's K/V of a prompt's positions [0, end), as a ``PrefixCache`` keeps them:
    ``k``, ``v`` [L_full, H_kv, end, D] of the layers at full length, and where the cache
    has rings their saved tail ``tail_k``, ``tail_v`` [L_ring, H_kv, n, D] (positions
    [end - n, end)), else None."""

    k: torch.Tensor
    v: torch.Tensor
    tail_k: torch.Tensor | None
    tail_v: torch.Tensor | None
    end: int

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.tail_k, self.tail_v) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def map(self, fn) -> "PromptCopy":
        """The same copy with ``fn`` applied to each tensor (a clone, a move to the host)."""
        tail = (None, None) if self.tail_k is None else (fn(self.tail_k), fn(self.tail_v))
        return PromptCopy(fn(self.k), fn(self.v), *tail, self.end)


@dataclass
class PromptSlots:
    """Slots [0, len(ids)) of a row hold the K/V a prefill of ``ids`` computes;
    ``last_hidden`` [hidden] is the final hidden state of ids[-1] (None if unknown)."""

    ids: list[int]
    last_hidden: torch.Tensor | None = None


class KVCache:
    """K and V of every layer: ``k``, ``v`` [L_full, B, H_kv, S_max, D] for the layers
    kept at full length (all of them unless the cache has rings) and ``ring_k``,
    ``ring_v`` [L_ring, B, H_kv, ring_slots, D] for a hybrid model's sliding layers
    where they keep rings (see ``ring_slots``); ``store`` maps a layer to its tensor.

    ``lengths[b]`` (on the cache's device) counts the valid positions of sequence b:
    positions ``[0, lengths[b])`` hold real tokens, anything beyond is stale and never
    attended. Shapes never change after construction, so a decode step can be captured
    in a CUDA graph.
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
        window: SlidingWindow | None = None,
    ) -> None:
        self.ring_slots = ring_slots(window, max_len)
        ring_layers = sorted(window.layers) if self.ring_slots is not None else []
        full_layers = [i for i in range(num_layers) if i not in ring_layers]
        # layer -> (kept in a ring, index in its tensor)
        self._home = {i: (False, n) for n, i in enumerate(full_layers)}
        self._home.update({i: (True, n) for n, i in enumerate(ring_layers)})
        self._max_len = max_len

        def zeros(layers: int, slots: int) -> torch.Tensor:
            return torch.zeros(layers, batch_size, num_kv_heads, slots, head_dim, dtype=dtype,
                               device=device)

        self.k, self.v = zeros(len(full_layers), max_len), zeros(len(full_layers), max_len)
        self.ring_k = self.ring_v = self.tail_k = self.tail_v = None
        if ring_layers:
            self.window = window.size
            self.ring_k = zeros(len(ring_layers), self.ring_slots)
            self.ring_v = zeros(len(ring_layers), self.ring_slots)
            # Each row's kept prompt tail: positions [end - tail, end) of the ring layers,
            # at slot p - (end - tail), end = tail_end[b] (0: nothing saved).
            tail = window.size + PROMPT_TAIL_SLACK
            self.tail_k, self.tail_v = zeros(len(ring_layers), tail), zeros(len(ring_layers), tail)
        self.tail_end = [0] * batch_size
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._batch_index = torch.arange(batch_size, device=device)[:, None]  # [B, 1]
        # What each row's leading slots hold (None: unknown); kept by ``prefill`` and
        # cut back by anything that rewrites prompt slots (``forget_from``).
        self.prompts: list[PromptSlots | None] = [None] * batch_size

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.ring_k, self.ring_v, self.tail_k, self.tail_v)
                if t is not None]

    def rows(self, start: int, end: int) -> "KVCache":
        """A view of sequences [start, end): writes through it land in this cache."""
        view = object.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        for name in ("k", "v", "ring_k", "ring_v", "tail_k", "tail_v"):
            t = getattr(self, name)
            setattr(view, name, None if t is None else t[:, start:end])
        view.lengths = self.lengths[start:end]
        view._batch_index = self._batch_index[: end - start]
        # bookkeeping stays with the whole cache
        view.prompts = [None] * (end - start)
        view.tail_end = [0] * (end - start)
        return view

    def forget_from(self, row: int, slot: int) -> None:
        """Slots from ``slot`` on of ``row`` are about to be rewritten by something other
        than a prefill of the remembered prompt."""
        kept = self.prompts[row]
        if kept is not None and slot < len(kept.ids):
            self.prompts[row] = PromptSlots(kept.ids[:slot]) if slot > 0 else None

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def forward_rows(self) -> int | None:
        """The most positions of a sequence one forward may write: what a ring holds
        beside the window before them (None: no limit, no rings)."""
        return None if self.ring_slots is None else self.ring_slots - self.window + 1

    def ring_of(self, layer: int) -> int | None:
        """The slots of ``layer``'s ring, or None where it keeps full length."""
        return self.ring_slots if self._home[layer][0] else None

    def store(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(K, V, index): ``layer`` lives at ``K[index]``, ``V[index]`` ([B, H_kv, S, D],
        S = max_len, or ring_slots for a ring)."""
        ring, index = self._home[layer]
        return (self.ring_k, self.ring_v, index) if ring else (self.k, self.v, index)

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of new tokens at their positions.

        positions: [B, T]; k, v: [B, T, H_kv, D]
        """
        ks, vs, index = self.store(layer)
        ring = self.ring_of(layer)
        slots = positions % ring if ring is not None else positions
        # Advanced indices around a slice put their dims first: the target is [B, T, H_kv, D].
        ks[index][self._batch_index, :, slots] = k
        vs[index][self._batch_index, :, slots] = v

    def layer(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one layer as stored: each [B, H_kv, kv_len, D] over slots [0, kv_len),
        or a ring's whole [B, H_kv, ring_slots, D] (see ``ring_of``, ``unrolled``)."""
        ks, vs, index = self.store(layer)
        if self.ring_of(layer) is not None:
            return ks[index], vs[index]
        return ks[index, :, :, :kv_len], vs[index, :, :, :kv_len]

    def unrolled(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one layer over positions [0, kv_len), [B, H_kv, kv_len, D]; a ring's
        position p read from its slot (a copy; only the last window of each row's
        positions is current, the rest is whatever the slot holds now)."""
        k, v = self.layer(layer, kv_len)
        ring = self.ring_of(layer)
        if ring is None:
            return k, v
        slots = torch.arange(kv_len, device=k.device) % ring
        return k.index_select(2, slots), v.index_select(2, slots)

    def save_prompt_tail(self, row: int, end: int) -> None:
        """Keep positions [end - window - PROMPT_TAIL_SLACK, end) of ``row``'s rings: the
        end of the prompt just prefilled there, which decoding overwrites."""
        if self.ring_k is None:
            return
        tail = self.tail_k.shape[3]
        lo = max(0, end - tail)
        slots = torch.arange(lo, end, device=self.ring_k.device) % self.ring_slots
        self.tail_k[:, row, :, : end - lo] = self.ring_k[:, row].index_select(2, slots)
        self.tail_v[:, row, :, : end - lo] = self.ring_v[:, row].index_select(2, slots)
        self.tail_end[row] = end

    def restore_prompt_tail(self, row: int, reused: int) -> bool:
        """Make ``row``'s rings hold what a prefill up to position ``reused`` (of the
        prompt last saved there) left in them: True when the saved tail covers the
        window before it (or there are no rings), False when the prompt must be
        computed from the start."""
        if self.ring_k is None or reused == 0:
            return True
        end = self.tail_end[row]
        if not end - PROMPT_TAIL_SLACK <= reused <= end:
            return False
        lo = max(0, end - self.tail_k.shape[3])
        slots = torch.arange(lo, reused, device=self.ring_k.device) % self.ring_slots
        self.ring_k[:, row].index_copy_(2, slots, self.tail_k[:, row, :, : reused - lo])
        self.ring_v[:, row].index_copy_(2, slots, self.tail_v[:, row, :, : reused - lo])
        return True

    def prompt_copy(self, row: int, end: int) -> PromptCopy:
        """Views of ``row``'s K/V of the prompt just prefilled there, positions [0, end)
        (with rings: its saved tail, so ``save_prompt_tail`` must have kept that end)."""
        tail = (None, None)
        if self.ring_k is not None:
            if self.tail_end[row] != end:
                raise ValueError(f"row {row}'s saved tail ends at {self.tail_end[row]}, "
                                 f"not at the prompt's end {end}")
            n = min(end, self.tail_k.shape[3])
            tail = (self.tail_k[:, row, :, :n], self.tail_v[:, row, :, :n])
        return PromptCopy(self.k[:, row, :, :end], self.v[:, row, :, :end], *tail, end)

    def take_prompt(self, row: int, copy: PromptCopy, start: int, reused: int) -> bool:
        """Fill ``row``'s positions [start, reused) from ``copy`` (a ``PrefixCache``
        entry whose first ``reused`` tokens the row's prompt shares): True when done,
        False when the copy cannot serve this cache (another layout: rings or not) or,
        with rings, its tail does not cover the window before ``reused``."""
        if copy.k.shape[0] != self.k.shape[0] or (copy.tail_k is None) != (self.ring_k is None):
            return False
        if self.ring_k is not None:
            if not copy.end - PROMPT_TAIL_SLACK <= reused <= copy.end:
                return False
            n = copy.tail_k.shape[2]
            self.tail_k[:, row, :, :n] = copy.tail_k
            self.tail_v[:, row, :, :n] = copy.tail_v
            self.tail_end[row] = copy.end
            self.restore_prompt_tail(row, reused)
        self.k[:, row, :, start:reused] = copy.k[:, :, start:reused]
        self.v[:, row, :, start:reused] = copy.v[:, :, start:reused]
        return True

    def fill_(self, fill) -> None:
        """Apply ``fill`` (an in-place function) to every K/V tensor: benches' random
        contents."""
        for t in self._tensors():
            fill(t)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())
