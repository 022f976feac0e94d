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
# Whose selection rule a vegas or streaming draft follows: this engine's, or the one the
# Vegas authors' vLLM fork runs (docs/drafters.md, "The vLLM fork's rule").
RULES = ("engine", "fork")
FORK_RULE_DRAFTERS = ("vegas", "streaming")
# The KV block size the fork's streamingllm works in: vLLM's default on CUDA, which a
# serve config that sets no block-size gets (vllm/platforms/cuda.py).
FORK_BLOCK = 16
# At least a quarter of a vegas budget stays verification-guided.
MAX_WINDOW = 0.75
# The largest decay of scores accumulated across iterations (``accumulate``): at 1 the
# first verify pass's scores would never fade.
MAX_ACCUMULATE = 0.95
# At least a quarter of a vegas budget stays verification-guided when pages are
# chosen by their key bounds (``pages``).
MAX_PAGES = 0.75
# Most draft tokens per iteration the engine accepts (the verify pass has gamma + 1 rows);
# profiles are checked against it too.
MAX_GAMMA = 64
# The most slots after a high-scoring slot that ``spread`` lifts to its score: beyond a
# draft's reach (gamma up to MAX_GAMMA) a run of slots costs budget and earns nothing.
MAX_SPREAD = MAX_GAMMA


# Fields ``to_dict`` leaves out at their default (0: off).
OPTIONAL_FIELDS = ("accumulate", "pages", "spread")


_Length = TypeVar("_Length", int, torch.Tensor)


def draft_budget(prefix_len: _Length, sparsity: float, min_tokens: int) -> _Length:
    """The draft budget, the one rule every drafter, bound and cost estimate uses:
    ``max(min_tokens, ceil(sparsity * prefix_len))``, at most ``prefix_len``. Takes a
    host int (static sizes, the cost model) or a tensor of per-sequence lengths."""
    if torch.is_tensor(prefix_len):
        ratio = torch.ceil(prefix_len.double() * sparsity).long()
        return torch.minimum(torch.clamp(ratio, min=min_tokens), prefix_len)
    return min(max(min_tokens, math.ceil(sparsity * prefix_len)), prefix_len)


def _ceil_f32(lengths: torch.Tensor, ratio: float) -> torch.Tensor:
    """ceil(lengths * ratio) computed in float32, as the fork computes it on int32 lengths
    (``3000 * 0.07`` is 210 there, 210.00000000000003 in float64)."""
    return torch.ceil(lengths.to(torch.float32) * ratio).long()


def fork_budget(seq_len: _Length, ratio: float, min_tokens: int, max_model_len: int | None,
                valid_len: _Length) -> _Length:
    """The fork's vegas budget (``VegasAttnOverrider._verify_attention``):
    ``clamp(ceil(seq_len * ratio), min_tokens, max(ceil(max_model_len * ratio),
    min_tokens))``, at most ``valid_len`` (the slots it ranks). ``seq_len`` is the key
    count of the pass that scored (a verify window's last row sees them all); the upper
    bound never binds while ``seq_len <= max_model_len``; None: no upper bound."""
    lengths = seq_len if torch.is_tensor(seq_len) else torch.tensor(seq_len)
    budget = torch.clamp(_ceil_f32(lengths, ratio), min=min_tokens)
    if max_model_len is not None:
        budget = torch.clamp(budget, max=max(math.ceil(max_model_len * ratio), min_tokens))
    valid = valid_len if torch.is_tensor(valid_len) else torch.tensor(valid_len)
    budget = torch.minimum(budget, valid.to(budget.device))
    return budget if torch.is_tensor(seq_len) else int(budget)


def fork_stream_window_start(position: torch.Tensor, ratio: float, min_tokens: int,
                             max_model_len: int | None, block: int = FORK_BLOCK
                             ) -> torch.Tensor:
    """[B] first slot of the fork's streamingllm window for draft queries at ``position``
    [B] (``StreamingLLMAttnOverrider._may_update_attn_metadata``): the last
    ``ceil(max(seq_len * ratio, min_tokens) / block)`` whole blocks up to the query's own
    block, at most ``ceil(max(ceil(max_model_len * ratio), min_tokens) / block) - 1``
    of them, never block 0 (the sink block, kept besides). ``seq_len = position + 1``
    counts the query itself: the window holds the tokens since the last verification."""
    tokens = torch.clamp((position + 1).to(torch.float32) * ratio, min=min_tokens)
    blocks = torch.ceil(tokens / block).long()
    if max_model_len is not None:
        most = max(math.ceil(max_model_len * ratio), min_tokens)
        blocks = torch.clamp(blocks, max=-(-most // block) - 1)
    last = torch.div(position, block, rounding_mode="floor")
    return torch.clamp(last - blocks + 1, min=1) * block


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
    accumulate: ``vegas`` only: the decay d (0 to 0.95) of scores accumulated across
        iterations: a slot ranked before keeps ``d * earlier + (1 - d) * new``, a slot
        ranked for the first time its new score. 0 (the paper's rule): the last verify
        pass alone.
    pages: ``vegas`` only: the share of the budget (0 to 0.75) given to whole 16-slot
        pages chosen at every draft step and layer by Quest's key bounds with the
        draft's own query; the rest is the verification-guided top-k (and its window).
        Query-dependent: served by the PyTorch reference path, like ``quest``.
    spread: ``vegas`` only: each prefix slot ranks by the highest score of itself and
        the ``spread`` slots before it (0 to 64; 0, the paper's rule: its own). Copying
        heads attend at the source slot of the token they copy; the next drafts need
        the slots after it, which the verify rows had no reason to attend.
    rule: ``engine`` (this engine's rule) or ``fork`` (what the authors' vLLM fork runs;
        ``vegas`` and ``streaming`` only). ``vegas``: the first selection ranks every
        prompt slot by the prompt's last row; later ones rank the prefix and the
        verified window's first slot, with the budget ``fork_budget`` of the verify
        pass's key count. ``streaming``: a sink block and whole blocks up to each draft
        query, the recent tokens within the budget (``fork_stream_window_start``).
    """

    drafter: str = "vegas"
    gamma: int = 6
    sparsity: float = 0.05
    min_tokens: int = 256
    collect: str = "two"
    score: str = "logit"
    granularity: str = "layer"
    window: float = 0.0
    rule: str = "engine"
    accumulate: float = 0.0
    pages: float = 0.0
    spread: int = 0

    def __post_init__(self) -> None:
        for name, allowed in (("drafter", DRAFTERS), ("collect", COLLECT),
                              ("score", SCORES), ("granularity", GRANULARITIES),
                              ("rule", RULES)):
            value = getattr(self, name)
            if value not in allowed:
                raise VegasError(f"unknown {name} '{value}'; choose one of: {', '.join(allowed)}")
        if not 1 <= self.gamma <= MAX_GAMMA:
            raise VegasError(f"gamma must be between 1 and {MAX_GAMMA}, got {self.gamma}")
        if not 0.0 < self.sparsity <= 1.0:
            raise VegasError(f"sparsity must be in (0, 1], got {self.sparsity}")
        if not 0.0 <= self.window <= MAX_WINDOW:
            raise VegasError(f"window must be between 0 and {MAX_WINDOW}, got {self.window}")
        if not 0.0 <= self.accumulate <= MAX_ACCUMULATE:
            raise VegasError(f"accumulate must be between 0 and {MAX_ACCUMULATE}, "
                             f"got {self.accumulate}")
        if not 0.0 <= self.pages <= MAX_PAGES:
            raise VegasError(f"pages must be between 0 and {MAX_PAGES}, got {self.pages}")
        if not 0 <= self.spread <= MAX_SPREAD:
            raise VegasError(f"spread must be between 0 and {MAX_SPREAD}, got {self.spread}")
        if (self.accumulate or self.pages or self.spread) and self.drafter != "vegas":
            raise VegasError(f"accumulate, pages and spread are vegas options; set them to 0 "
                             f"for drafter '{self.drafter}'")
        if self.min_tokens < 1:
            raise VegasError(f"min_tokens must be >= 1, got {self.min_tokens}")
        if self.rule == "fork" and self.drafter not in FORK_RULE_DRAFTERS:
            raise VegasError(f"rule 'fork' is the vLLM fork's rule for "
                             f"{' and '.join(FORK_RULE_DRAFTERS)}, not for '{self.drafter}'")

    def to_dict(self) -> dict:
        """The fields; issue 41's options only where set, so that the tuner's claim keys
        and records of configurations without them are what they were before them (a
        study resumes without measuring its configurations again)."""
        out = asdict(self)
        for name in OPTIONAL_FIELDS:
            if out[name] == 0:
                del out[name]
        return out

    def options_set(self) -> dict:
        """Issue 41's options that are not 0, by name: what a record of this configuration
        holds beside the fields every configuration has (``to_dict``'s rule)."""
        return {name: getattr(self, name) for name in OPTIONAL_FIELDS if getattr(self, name)}
