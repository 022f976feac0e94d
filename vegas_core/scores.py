"""Selection scores: what a verify pass computes anyway, kept for the next draft.

A drafter that selects from the verify pass (Vegas, and the SnapKV and SpecExtend peers)
ranks the prefix slots of each KV head by the attention of a few window rows:

    scores[layer, b, kvh, s] = sum over the group's query heads h and window rows t of
                               rows[b, t] * x(layer, b, t, h, s),  for visible slots s

with ``x = q.k / sqrt(D)`` (``logit``) or the softmax probability (``weight``);
invisible slots count 0. A ``ScoreCollector`` rides along the verify forward and
``finish(rows)`` hands the drafter that [L', B, H_kv, S] tensor, one row per collected
layer in ascending order, whichever of four paths filled it:

- **fused** (``fusable``): the rows are known before the pass (Collect-2-Query or all
  rows, logit scores), so the verify kernel sums them on the fly;
- **edges** (``keeps_edges``): Collect-2-Query probabilities, which need each row's
  final log-sum-exp: the verify kernel keeps the first and last rows' logits (float16)
  and, once the layer's attention is merged, ``vegas_kernels.collect_scores.
  edge_weight_scores`` turns them into the summed probabilities, without reading K
  again;
- **deferred** (``deferrable``): the rows are known only after acceptance (the last
  accepted row), or all rows' probabilities count: the kernel keeps each layer's
  queries and log-sum-exp, and ``finish`` runs ``vegas_kernels.collect_scores``, reading K
  once more;
- **reference**: PyTorch attention hands over per-row scores (``add``) and ``finish``
  sums the rows.

The attention side talks to a collector through ``collects``, ``fused_rows``,
``home``, ``keep_fused``, ``keep_edges``, ``defer`` and ``add``; drafters see only
``finish``'s tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vegas_core.spec_config import SCORES
from vegas_kernels.collect_scores import collect_scores, edge_weight_scores

RowsFn = Callable[[], torch.Tensor]


class ScoreCollector:
    """Scores of one verify pass. ``mode``: "logit" or "weight"; ``layers``: the layers
    whose scores are kept (None: every layer; the kernels run the others as plain verify
    attention); ``fused_rows`` [B, T]: the row weights when they are known before the
    pass (in ``weight`` mode they must be 0 outside the first and last row);
    ``deferrable``: whether the kernels may keep queries for a pass afterwards;
    ``scores_out`` [L', B, H_kv, S_max]: an optional preallocated home for the kernels'
    summed scores, one row per collected layer (slots past each sequence's last position
    are left unwritten)."""

    def __init__(self, mode: str, layers: set[int] | None = None,
                 fused_rows: torch.Tensor | None = None, *, deferrable: bool = False,
                 scores_out: torch.Tensor | None = None) -> None:
        if mode not in SCORES:
            raise ValueError(f"score mode must be one of {SCORES}, got {mode!r}")
        self.mode = mode
        self.layers = layers
        self.fused_rows = fused_rows
        self.deferrable = deferrable
        self.scores_out = scores_out
        self._home_rows = None if layers is None else {n: i for i, n in enumerate(sorted(layers))}
        self._summed: dict[int, torch.Tensor] = {}  # layer -> [B, H_kv, S], rows summed
        self._per_row: dict[int, torch.Tensor] = {}  # layer -> [B, H_kv, T, S] (reference)
        # layer -> (q [B, T, H, D], k [B, H_kv, S, D], positions [B, T], lse [B, T, H], kv_len)
        self._deferred: dict[int, tuple] = {}
        self._run_deferred: Callable[[torch.Tensor], None] = self.reduce_deferred

    # --- what the attention kernels and the reference ask and hand over ---------------

    @property
    def fusable(self) -> bool:
        """Whether the verify kernel can sum the scores on the fly."""
        return self.mode == "logit" and self.fused_rows is not None

    @property
    def keeps_edges(self) -> bool:
        """Whether the verify kernel keeps the edge rows' logits for ``keep_edges``."""
        return self.mode == "weight" and self.fused_rows is not None

    @property
    def summed_in_pass(self) -> bool:
        """Whether the verify pass itself leaves the summed scores (fused or edges)."""
        return self.fusable or self.keeps_edges

    def collects(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def home(self, layer: int) -> torch.Tensor | None:
        """Where the kernels (fused, edges or deferred) write ``layer``'s summed scores: its row
        of ``scores_out`` [B, H_kv, S_max], or None (the kernel allocates)."""
        if self.scores_out is None:
            return None
        return self.scores_out[layer if self._home_rows is None else self._home_rows[layer]]

    def keep_fused(self, layer: int, scores: torch.Tensor) -> None:
        """scores [B, H_kv, S]: ``layer``'s rows summed by the verify kernel."""
        self._summed[layer] = scores

    def keep_edges(self, layer: int, edges: torch.Tensor, lse: torch.Tensor,
                   positions: torch.Tensor, kv_len: int) -> None:
        """edges [B, H_kv, E * G, S] (float16) and lse [B, T, H] of ``layer``'s verify
        attention: summed into its probabilities now (a few bytes per slot, not K)."""
        self._summed[layer] = edge_weight_scores(edges, lse, positions, self.fused_rows, kv_len,
                                                 out=self.home(layer))

    def defer(self, layer: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
              lse: torch.Tensor, kv_len: int) -> None:
        """Keep what the score pass after acceptance needs: q [B, T, H, D], the layer's
        K [B, H_kv, S, D], positions [B, T], lse [B, T, H] and the slot bound."""
        self._deferred[layer] = (q, k, positions, lse, kv_len)

    def add(self, layer: int, scores: torch.Tensor, probs: torch.Tensor,
            mask: torch.Tensor) -> None:
        """The reference path: scores (float32, masked slots -inf), probs and mask
        [B, H_kv, group, T, S]."""
        if not self.collects(layer):
            return
        if self.mode == "logit":
            self._per_row[layer] = scores.masked_fill(~mask, 0.0).sum(dim=2)
        else:
            self._per_row[layer] = probs.sum(dim=2)

    # --- the deferred pass ------------------------------------------------------------

    def reduce_deferred(self, rows: torch.Tensor) -> None:
        """The score kernel over the deferred layers, for rows [B, T]."""
        for layer, (q, k, positions, lse, kv_len) in self._deferred.items():
            self._summed[layer] = collect_scores(
                q, k, positions, rows, kv_len, lse if self.mode == "weight" else None,
                out=self.home(layer))

    def run_deferred_with(self, run: Callable[[torch.Tensor], None]) -> None:
        """Run the deferred pass through ``run(rows)`` (a captured graph of
        ``reduce_deferred``) rather than eagerly."""
        self._run_deferred = run

    # --- what drafters get ------------------------------------------------------------

    def finish(self, rows: RowsFn) -> torch.Tensor:
        """The scores of the rows ``rows()`` ([B, T] weights, called only where they are
        not already summed) -> [L', B, H_kv, S], one row per collected layer, ascending.
        S may run past the prefix: callers mask the slots they do not rank."""
        if self._deferred:
            self._run_deferred(rows())
        layers = sorted(self._summed or self._per_row)
        if self._summed:
            if self.scores_out is not None and len(layers) == self.scores_out.shape[0]:
                return self.scores_out  # the kernels wrote every layer here: no copy
            width = min(self._summed[i].shape[-1] for i in layers)
            return torch.stack([self._summed[i][..., :width] for i in layers])
        if not self._per_row:
            raise RuntimeError("no scores were collected: the verify pass ran without "
                               "this collector")
        weights = rows()
        per_row = torch.stack([self._per_row[i] for i in layers])  # [L', B, H_kv, T, S]
        return torch.einsum("lbkts,bt->lbks", per_row, weights.to(per_row.dtype))

