"""SpecConfig: what a speculative run drafts with, and how it selects the draft's KV."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TypeVar

import torch

from vegas_core.errors import VegasError

DRAFTERS = ("vegas", "streaming", "quest", "snapkv", "specextend", "oracle", "dense")
COLLECT = ("two", "all", "last")
SCORES = ("logit", "weight")
GRANULARITIES = ("layer", "kv_head")
# At least a quarter of a vegas budget stays verification-guided.
MAX_WINDOW = 0.75
# Most draft tokens per iteration the engine accepts (the verify pass has gamma + 1 rows);
# profiles are checked against it too.
MAX_GAMMA = 64


_Length = TypeVar("_Length", int, torch.Tensor)


def draft_budget(prefix_len: _Length, sparsity: float, min_tokens: int) -> _Length:
    """The draft budget, the one rule every drafter, bound and cost estimate uses:
    ``max(min_tokens, ceil(sparsity * prefix_len))``, at most ``prefix_len``. Takes a
    host int (static sizes, the cost model) or a tensor of per-sequence lengths."""
    if torch.is_tensor(prefix_len):
        ratio = torch.ceil(prefix_len.double() * sparsity).long()
        return torch.minimum(torch.clamp(ratio, min=min_tokens), prefix_len)
    return min(max(min_tokens, math.ceil(sparsity * prefix_len)), prefix_len)


@dataclass(frozen=True)
class SpecConfig:
    """Self-speculative decoding settings.

    drafter: which KV subset the draft passes attend to (see docs/drafters.md):
        ``vegas`` (verification-guided top-k, the method), ``streaming``, ``quest``,
        ``snapkv``, ``specextend``, ``oracle`` (upper bound), ``dense`` (no sparsity).
    gamma: draft tokens per iteration; the verify pass has gamma + 1 rows.
    sparsity, min_tokens: the draft budget per layer and sequence is
        ``max(min_tokens, ceil(sparsity * prefix_len))``, at most ``prefix_len``.
    collect: verify rows whose scores select the next set: ``two`` (first and last,
        Collect-2-Query), ``all`` (every row), ``last`` (the last accepted token's row).
    score: ``logit`` (pre-softmax q.k/sqrt(d)) or ``weight`` (softmax probabilities),
        summed over the collected rows and the query heads.
    granularity: ``layer`` (one set per layer, shared by all heads) or ``kv_head``
        (one set per KV head, summing over its query group).
    window: ``vegas`` only: the share of the budget (0 to 0.75) reserved for 16 sink
        tokens and the most recent prefix tokens; the rest is the verification-guided
        top-k. 0 is the paper's rule.
    """

    drafter: str = "vegas"
    gamma: int = 6
    sparsity: float = 0.05
    min_tokens: int = 256
    collect: str = "two"
    score: str = "logit"
    granularity: str = "layer"
    window: float = 0.0

    def __post_init__(self) -> None:
        for name, allowed in (("drafter", DRAFTERS), ("collect", COLLECT),
                              ("score", SCORES), ("granularity", GRANULARITIES)):
            value = getattr(self, name)
            if value not in allowed:
                raise VegasError(f"unknown {name} '{value}'; choose one of: {', '.join(allowed)}")
        if not 1 <= self.gamma <= MAX_GAMMA:
            raise VegasError(f"gamma must be between 1 and {MAX_GAMMA}, got {self.gamma}")
        if not 0.0 < self.sparsity <= 1.0:
            raise VegasError(f"sparsity must be in (0, 1], got {self.sparsity}")
        if not 0.0 <= self.window <= MAX_WINDOW:
            raise VegasError(f"window must be between 0 and {MAX_WINDOW}, got {self.window}")
        if self.min_tokens < 1:
            raise VegasError(f"min_tokens must be >= 1, got {self.min_tokens}")

    def to_dict(self) -> dict:
        return asdict(self)
