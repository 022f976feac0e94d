"""Selection scores accumulated across iterations (the vegas option ``accumulate``).

The paper's rule ranks the prefix by the last verify pass alone, whose few rows may
attend elsewhere than the next drafts will. ``ScoreHistory`` keeps an exponentially
decayed average per slot instead: a slot ranked at the previous selection keeps
``decay * earlier + (1 - decay) * new``; a slot ranked for the first time (the previous
tail) starts at its new score, so that it is neither favoured nor penalised by having
no history, whatever the sign of the scores (logits may be negative).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ScoreHistory:
    """Decayed scores of one session's selections; ``decay`` in (0, 1)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.scores: torch.Tensor | None = None  # [L', B, H_kv, S] as ranked last time
        self.ranked: torch.Tensor | None = None  # [B] the candidates last time

    def update(self, scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """scores [L', B, H_kv, S] of the pass just verified, candidates [B] (slots
        [0, candidates) are ranked now) -> the accumulated scores, same shape. Slots past
        the candidates hold whatever ``scores`` held: callers never rank them."""
        if self.scores is None:
            mixed = scores.float().clone()
        else:
            span = scores.shape[-1]
            # The prefix only grows: earlier scores are padded (never cut) to this span,
            # padding that only slots ranked for the first time read, and they ignore it.
            earlier = F.pad(self.scores, (0, max(span - self.scores.shape[-1], 0)))
            earlier = earlier[..., :span]
            slots = torch.arange(span, device=scores.device)
            seen = (slots[None] < self.ranked[:, None])[None, :, None, :]  # [1, B, 1, S]
            blended = self.decay * earlier + (1.0 - self.decay) * scores.float()
            mixed = torch.where(seen, blended, scores.float())
        self.scores, self.ranked = mixed, candidates.clone()
        return mixed
