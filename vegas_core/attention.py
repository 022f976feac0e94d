"""Attention metadata and the attention implementations it dispatches to.

Full, verify and draft forwards run the same model code; they differ only in the
``AttentionMeta`` they are given:

- ``full``: causal attention over the whole cache (prefill chunks, vanilla decode). A
  prefill chunk (``AttentionMeta.prefill``) also says where its block starts, so that
  it can run on the fused prefill kernels (``vegas_kernels.prefill_attention``).
- ``verify``: the same, for the γ+1 rows of a speculative verify window.
- ``draft``: sparse attention over per-layer index lists of prefix slots, plus every slot
  from ``tail_start`` up to the query's own position (tokens written since the selection).

The PyTorch reference below is the ground truth; faster kernels plug in behind
``attend`` with the same contract.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vegas_core.cache import KVCache
from vegas_core.config import SlidingWindow
from vegas_core.scores import ScoreCollector
from vegas_kernels.prefill_attention import prefill_attention
from vegas_kernels.sparse_attention import sparse_attention
from vegas_kernels.verify_attention import verify_attention

MODES = ("full", "verify", "draft")
# Kernels serve decode and verify windows; longer blocks (prefill chunks) use the reference.
MAX_KERNEL_ROWS = 16
MIN_KERNEL_HEAD_DIM = 16  # tl.dot needs a reduction of at least 16
# VEGAS_ATTENTION: "auto" (Triton kernels on CUDA when Triton imports), "reference", or
# "triton" (also on the CPU through TRITON_INTERPRET=1, for tests).
ATTENTION_ENV = "VEGAS_ATTENTION"


class DraftSelection(Protocol):
    """The prefix slots a draft forward attends to, beside the recent tail.

    Fixed index lists (``SparseSelection``) or selections that depend on the draft's own
    query (Quest, the oracle) both answer ``prefix_mask``.
    """

    tail_start: torch.Tensor  # [B]: slots from here to the query's position are always attended

    def prefix_mask(self, layer: int, kv_len: int, q: torch.Tensor, k: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
        """Boolean [B, G, kv_len] (G = 1 or H_kv) for q [B, T, H, D], k [B, H_kv, S, D]
        and the query positions [B, T]."""
        ...


@dataclass
class SparseSelection:
    """Prefix slots a draft attends to, per layer and sequence, as index lists.

    indices: [L', B, G, K] slot ids; G = 1 (one set per layer, shared by all heads) or
        G = H_kv (one set per KV head). Entries past ``counts`` are padding.
    counts: [L', B] number of valid entries per (layer, sequence).
    tail_start: [B] slots in [tail_start, own position] are always attended.
    layers: the model layers of the L' rows, in order; None: every layer (L' = L).
        A hybrid model's sliding layers have no row: their drafts read their window.
    """

    indices: torch.Tensor
    counts: torch.Tensor
    tail_start: torch.Tensor
    # A host-side lower bound of tail_start (0 is always safe), so that the key bound
    # below needs no read from the device.
    tail_floor: int = 0
    layers: tuple[int, ...] | None = None

    def row(self, layer: int) -> int:
        """The row of ``indices`` and ``counts`` that holds ``layer``'s selection."""
        return layer if self.layers is None else self.layers.index(layer)

    def max_keys(self, kv_len: int) -> int:
        """A static bound on any sequence's key count (selected + tail): it only caps
        the kernel's split count; each program sizes its work from the device values."""
        return self.indices.shape[-1] + kv_len - self.tail_floor

    def prefix_mask(self, layer: int, kv_len: int, q: torch.Tensor | None = None,
                    k: torch.Tensor | None = None, positions: torch.Tensor | None = None
                    ) -> torch.Tensor:
        """Boolean [B, G, kv_len]: True where a prefix slot is selected."""
        row = self.row(layer)
        idx = self.indices[row]  # [B, G, K]
        k = idx.shape[-1]
        counts = self.counts[row][:, None, None]
        valid = (torch.arange(k, device=idx.device) < counts).expand_as(idx)
        hits = torch.zeros(*idx.shape[:2], kv_len, dtype=torch.int32, device=idx.device)
        # scatter_add, not scatter: a padding entry may repeat a valid slot.
        hits.scatter_add_(-1, idx.clamp(0, kv_len - 1), valid.to(torch.int32))
        return hits > 0


@dataclass
class AttentionMeta:
    """What one forward's attention may see.

    positions: [B, T] position of each query row; its K/V are written to that slot.
    kv_len: static bound on the slots read, [0, kv_len).
    block_start: set for prefill chunks: every sequence's rows sit at positions
        block_start .. kv_len - 1.
    """

    mode: str
    positions: torch.Tensor
    kv_len: int
    sliding_window: SlidingWindow | None = None
    sparse: DraftSelection | None = None
    collector: ScoreCollector | None = None
    block_start: int | None = None
    _causal: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"attention mode must be one of {MODES}, got {self.mode!r}")
        if (self.mode == "draft") != (self.sparse is not None):
            raise ValueError("draft attention needs a SparseSelection, other modes none")

    @classmethod
    def full(cls, positions: torch.Tensor, kv_len: int,
             sliding_window: SlidingWindow | None = None):
        return cls("full", positions, kv_len, sliding_window)

    @classmethod
    def prefill(cls, batch: int, start: int, end: int, device: torch.device,
                sliding_window: SlidingWindow | None = None):
        """A prefill chunk: positions start..end-1 in each of ``batch`` sequences, over
        slots [0, end)."""
        positions = torch.arange(start, end, device=device).expand(batch, -1)  # [B, T]
        return cls("full", positions, end, sliding_window, block_start=start)

    @classmethod
    def verify(cls, positions: torch.Tensor, kv_len: int,
               sliding_window: SlidingWindow | None = None,
               collector: ScoreCollector | None = None):
        """Full causal attention for a multi-row verify window; ``collector`` keeps the
        selection scores."""
        return cls("verify", positions, kv_len, sliding_window, collector=collector)

    @classmethod
    def draft(cls, positions: torch.Tensor, kv_len: int, sparse: DraftSelection,
              sliding_window: SlidingWindow | None = None):
        return cls("draft", positions, kv_len, sliding_window, sparse)

    def window_of(self, layer: int) -> int | None:
        """The sliding window that limits ``layer``, or None."""
        w = self.sliding_window
        return w.size if w is not None and w.applies(layer) else None

    def drafts_whole_window(self, layer: int) -> bool:
        """Whether a draft reads ``layer``'s whole window rather than a selection: the
        sliding layers of a hybrid model (Gemma3, gpt-oss), whose windows are shorter
        than a budget worth selecting. Where every layer slides (Mistral), the window
        is the context, and drafts select within it."""
        w = self.sliding_window
        return w is not None and w.layers is not None and w.applies(layer)

    def causal_mask(self, layer: int = 0) -> torch.Tensor:
        """Boolean [B, T, S]: slot s is at or before the query's position (and inside
        the sliding window, where it limits ``layer``). Built once per forward and kind
        of layer."""
        window = self.window_of(layer)
        if window not in self._causal:
            slots = torch.arange(self.kv_len, device=self.positions.device)
            pos = self.positions[:, :, None]
            mask = slots <= pos
            if window is not None:
                mask &= slots > pos - window
            self._causal[window] = mask
        return self._causal[window]

    def mask(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Boolean [B, G, 1, T, S] for ``layer``; G is 1 or H_kv."""
        causal = self.causal_mask(layer)[:, None]  # [B, 1, T, S]
        if self.sparse is None or self.drafts_whole_window(layer):
            return causal[:, :, None]
        selected = self.sparse.prefix_mask(layer, self.kv_len, q, k, self.positions)
        selected = selected[:, :, None, :]  # [B, G, 1, S]
        slots = torch.arange(self.kv_len, device=self.positions.device)
        recent = slots >= self.sparse.tail_start[:, None, None, None]  # [B, 1, 1, S]
        return ((selected | recent) & causal)[:, :, None]


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
    on_scores: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked GQA attention in plain PyTorch, softmax in float32 (or float64).

    q: [B, T, H, D]; k, v: [B, H_kv, S, D]; mask: [B, G, 1, T, S] with G in {1, H_kv}.
    Returns [B, T, H, D]. ``on_scores(scores, probs, mask)`` receives the float32 scores
    and probabilities, [B, H_kv, group, T, S]. ``sinks`` [H]: a logit per head that joins
    each row's softmax as one more slot with no value (gpt-oss); the probabilities
    handed on exclude it.
    """
    b, t, h, d = q.shape
    h_kv = k.shape[1]
    q = q.view(b, t, h_kv, h // h_kv, d).permute(0, 2, 3, 1, 4)  # [B, H_kv, group, T, D]
    # float32 at least (float64 stays float64, for references of references)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bkgtd,bksd->bkgts", q, k).to(acc) * (1.0 / math.sqrt(d))
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(acc).view(1, h_kv, h // h_kv, 1, 1)  # [1, H_kv, group, 1, 1]
        total = torch.logaddexp(scores.logsumexp(dim=-1, keepdim=True), sink)
        probs = torch.exp(scores - total)
    if on_scores is not None:
        on_scores(scores, probs, mask)
    out = torch.einsum("bkgts,bksd->bkgtd", probs.to(v.dtype), v)  # [B, H_kv, group, T, D]
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, h, d)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernels_enabled(q: torch.Tensor) -> bool:
    """Whether the Triton kernels serve tensors like ``q`` (see VEGAS_ATTENTION)."""
    choice = os.environ.get(ATTENTION_ENV, "auto")
    if choice == "reference":
        return False
    if choice == "auto" and not q.is_cuda:
        return False
    return _triton_installed()


def prefill_kernels_enabled() -> bool:
    """Prefill chunks run on PyTorch's fused attention (``vegas_kernels.prefill_attention``) on
    every device, unless VEGAS_ATTENTION=reference."""
    return os.environ.get(ATTENTION_ENV, "auto") != "reference"


def supported_head_dim(head_dim: int) -> bool:
    """Head dims the kernels handle: a power of two of at least 16."""
    return head_dim >= MIN_KERNEL_HEAD_DIM and head_dim & (head_dim - 1) == 0


def kernels_serve(q: torch.Tensor, rows: int, sliding_window: SlidingWindow | None) -> bool:
    """Whether the Triton kernels can serve forwards of ``rows`` query rows of this
    shape and device (the condition for capturing decode steps in CUDA graphs).
    Hybrid models' sliding layers are served; a window over every layer (Mistral) is
    not: its drafts select within the window, which the index-list kernel does not
    bound."""
    if rows > MAX_KERNEL_ROWS or not kernels_enabled(q):
        return False
    if sliding_window is not None and sliding_window.layers is None:
        return False
    return supported_head_dim(q.shape[-1])


def kernels_serve_model(config, device: torch.device, rows: int) -> bool:
    """``kernels_serve`` for forwards of ``rows`` rows of a model with this config (the
    condition for static, graph-captured steps)."""
    probe = torch.empty(0, config.num_heads, config.head_dim, device=device)
    return kernels_serve(probe, rows, config.window)


def _kernel_attention(q, k, v, layer: int, meta: AttentionMeta,
                      sinks: torch.Tensor | None, ring: int | None) -> torch.Tensor | None:
    """The Triton path where it covers the request, else None. ``ring``: the slots of
    the layer's ring (``KVCache.ring_of``), whose k and v are the whole ring."""
    if not kernels_serve(q, q.shape[1], meta.sliding_window):
        return None
    collector = meta.collector
    if collector is not None and not collector.collects(layer):
        collector = None
    # A hybrid model's sliding layer drafts over its whole window, as a decode row does.
    dense = meta.mode in ("full", "verify") or meta.drafts_whole_window(layer)
    window = meta.window_of(layer)
    edges = collector is not None and collector.keeps_edges and window is None
    if dense and (collector is None or collector.fusable or edges or collector.deferrable):
        fuse = collector is not None and collector.fusable
        weights = collector.fused_rows if fuse else None
        into = collector.home(layer) if fuse else None
        out, lse, scores = verify_attention(q, k, v, meta.positions, meta.kv_len, weights,
                                            scores_out=into, edge_logits=edges, window=window,
                                            sinks=sinks, ring=ring)
        if fuse:
            collector.keep_fused(layer, scores)
        elif edges:
            collector.keep_edges(layer, scores, lse, meta.positions, meta.kv_len)
        elif collector is not None:
            collector.defer(layer, q, k, meta.positions, lse, meta.kv_len)
        return out
    if (meta.mode == "draft" and isinstance(meta.sparse, SparseSelection) and q.shape[1] == 1
            and ring is None):
        sel = meta.sparse
        row = sel.row(layer)
        return sparse_attention(q, k, v, meta.positions, sel.indices[row], sel.counts[row],
                                sel.tail_start, sel.max_keys(meta.kv_len), sinks=sinks)
    return None


def attend(q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMeta,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q ([B, T, H, D]) over ``layer``'s cache as ``meta`` allows: fused
    SDPA for prefill chunks; the Triton kernels for decode and verify rows (selection
    scores fused, from edge logits or deferred, see ``ScoreCollector``; sliding windows
    and attention ``sinks`` [H]) and index-list drafts when enabled; else the reference
    (query-dependent selections, collectors of the peer drafters)."""
    k, v = cache.layer(layer, meta.kv_len)
    ring = cache.ring_of(layer)
    if ring is not None and meta.window_of(layer) is None:
        raise ValueError(f"layer {layer} keeps a ring of its last {ring} positions; attending "
                         "to it needs the model's sliding window in the attention metadata")
    if meta.block_start is not None and meta.collector is None and prefill_kernels_enabled():
        # Every prefill chunk, short ones too: no Triton kernel compiled per chunk shape.
        return prefill_attention(q, k, v, meta.block_start, meta.window_of(layer), sinks,
                                 ring=ring)
    out = _kernel_attention(q, k, v, layer, meta, sinks, ring)
    if out is not None:
        return out
    if ring is not None:
        k, v = cache.unrolled(layer, meta.kv_len)
    return _reference(q, k, v, layer, meta, sinks)


def _reference(q, k, v, layer: int, meta: AttentionMeta, sinks=None) -> torch.Tensor:
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        # The reference would run over the whole static cache on every replay.
        raise RuntimeError(f"{meta.mode} attention at layer {layer} is not served by the "
                           "kernels and cannot be captured in a CUDA graph")
    collector = meta.collector
    on_scores = None
    if collector is not None:
        on_scores = lambda scores, probs, mask: collector.add(layer, scores, probs, mask)  # noqa: E731
    return reference_attention(q, k, v, meta.mask(layer, q, k), on_scores, sinks)
