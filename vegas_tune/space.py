"""The tuner's search space: which draft rules a deployment target can run, budgets in KV
slots, and the configurations they make.

A configuration is a ``Point``: a ``Selection`` (drafter, score, window, rule: how a draft
picks its K/V), a budget (KV slots per layer and sequence) and gamma. The budget is searched as
a number of slots, never as a ratio (ratios of one context collapse onto the same
``min_tokens`` floor); ``Point.spec`` writes it as the engine's pair: ``min_tokens`` =
the budget, and a ratio small enough that the budget is exactly that many slots at every
prefix of the tuned workload, which grows in proportion at longer contexts when served.

Targets (``TuneOptions.target``):

- ``vllm``, the authors' vLLM fork: ``sparse_attn_algorithm: vegas`` (softmax-weight
  scores of the first and last verify rows, one top-k per layer, no sink/recent share)
  or ``streamingllm``, both measured under the fork's own rule (``rule: fork``: its
  candidates, budget clamp, first selection and block-wise streaming window, see
  docs/drafters.md); gamma, ratio and min_tokens are its only other settings.
- ``vegas``, this engine: the vegas drafter with logit or weight scores and every window
  share, the same with ``spread`` and no window, and the streaming drafter, under this
  engine's rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vegas_core.spec_config import MAX_GAMMA, MAX_WINDOW, SpecConfig

# The fork's fixed choices for its vegas algorithm (vllm/v1/spec_decode/sparse_attn:
# SCORE_MODE = "weight", Collect-2-Query, one top-k per layer, no window, and its own
# candidates, budget and first selection: rule "fork").
FORK_VEGAS = {"score": "weight", "collect": "two", "granularity": "layer", "window": 0.0,
              "rule": "fork", "spread": 0}
# Its streamingllm: whole blocks, the recent tokens within the budget (rule "fork").
FORK_STREAMING = {"rule": "fork"}
# Drafters the fork runs, and its name for each.
FORK_ALGORITHMS = {"vegas": "vegas", "streaming": "streamingllm"}
# What the fork fixes for each of them.
FORK_SETTINGS = {"vegas": FORK_VEGAS, "streaming": FORK_STREAMING}
# Windows the vegas target searches: the paper's rule (0) up to the engine's maximum.
WINDOWS = (0.0, 0.25, 0.5, MAX_WINDOW)
SCORES = ("logit", "weight")
# The spread the vegas target searches beside the paper's 0 (each slot ranks with the best
# of the 8 before it), with no window. On Gemma3-270M (H100, 9521991,
# docs/results/acceptance.md) it accepted the most on retrieval at 8k and 32k and on long
# generations (8.88 tokens per iteration against the plain rule's 5.50), less on code at
# 16k and on prose: a choice by workload, which is the tuner's. With a window of 0.5 it
# accepted less over the nine groups (7.30 against 7.45), so windows are not crossed with it.
SPREAD = 8
# The smallest budget searched: 16 sink tokens and a recent window need room.
MIN_BUDGET = 32
# Significant digits of the ratio written beside a budget: readable, and rounded down so
# that the ratio never lifts the budget above its slot count inside the workload.
RATIO_DIGITS = 3


@dataclass(frozen=True, order=True)
class Selection:
    """How a draft chooses its K/V, apart from budget and gamma."""

    drafter: str
    score: str = "logit"
    window: float = 0.0
    rule: str = "engine"
    spread: int = 0

    def words(self) -> str:
        rule = " (fork rule)" if self.rule == "fork" else ""
        if self.drafter != "vegas":
            return self.drafter + rule
        window = f", window {self.window:g}" if self.window else ""
        spread = f", spread {self.spread}" if self.spread else ""
        return f"vegas {self.score}{window}{spread}{rule}"

    @classmethod
    def of(cls, spec: SpecConfig) -> Selection:
        if spec.drafter != "vegas":
            return cls(spec.drafter, rule=spec.rule)
        return cls("vegas", spec.score, spec.window, spec.rule, spec.spread)


STREAMING = Selection("streaming")
FORK_STREAMING_SELECTION = Selection("streaming", rule=FORK_STREAMING["rule"])


def selections(target: str) -> list[Selection]:
    """The draft rules ``target`` can serve, vegas's first."""
    if target == "vllm":
        return [Selection("vegas", FORK_VEGAS["score"], FORK_VEGAS["window"],
                          FORK_VEGAS["rule"]), FORK_STREAMING_SELECTION]
    return ([Selection("vegas", score, window) for score in SCORES for window in WINDOWS]
            + [Selection("vegas", score, spread=SPREAD) for score in SCORES] + [STREAMING])


def fits_target(spec: SpecConfig, target: str) -> str | None:
    """Why ``spec`` cannot be served by ``target`` (one phrase), or None when it can."""
    if target == "vegas":
        return None
    if spec.drafter not in FORK_ALGORITHMS:
        return (f"drafter {spec.drafter!r}: the vLLM fork runs only "
                f"{' and '.join(FORK_ALGORITHMS)}")
    for name, fixed in FORK_SETTINGS[spec.drafter].items():
        if getattr(spec, name) != fixed:
            return f"{name} {getattr(spec, name)!r}: the vLLM fork fixes it at {fixed!r}"
    return None


def longest_prefix(ctx: int, max_new_tokens: int) -> int:
    """The longest prefix a draft of the workload can see: the prompt, every new token,
    and the most draft tokens the engine takes (``MAX_GAMMA``) with their bonus token."""
    return ctx + max_new_tokens + MAX_GAMMA + 1


def budget_ratio(budget: int, longest_prefix: int) -> float:
    """The sparsity ratio written beside a budget of ``budget`` slots: budget / the longest
    prefix a draft sees in the workload, rounded down to ``RATIO_DIGITS`` significant
    digits, so that ``max(budget, ceil(ratio * prefix))`` is the budget at every prefix
    up to ``longest_prefix``."""
    exact = budget / longest_prefix
    scale = 10 ** (RATIO_DIGITS - 1 - math.floor(math.log10(exact)))
    return math.floor(exact * scale) / scale


@dataclass(frozen=True, order=True)
class Point:
    """One configuration of the search: a selection, a budget in slots, a gamma."""

    selection: Selection
    budget: int
    gamma: int

    def spec(self, longest_prefix: int) -> SpecConfig:
        s = self.selection
        return SpecConfig(drafter=s.drafter, gamma=self.gamma,
                          sparsity=budget_ratio(self.budget, longest_prefix),
                          min_tokens=self.budget, score=s.score, window=s.window, rule=s.rule,
                          spread=s.spread)

    def with_gamma(self, gamma: int) -> Point:
        return Point(self.selection, self.budget, gamma)

    @property
    def curve(self) -> tuple[Selection, int]:
        """What the point shares with every gamma of it: (selection, budget)."""
        return self.selection, self.budget

    def words(self) -> str:
        return f"{self.selection.words()}, {self.budget} slots, gamma {self.gamma}"

    @classmethod
    def of(cls, spec: SpecConfig) -> Point:
        return cls(Selection.of(spec), spec.min_tokens, spec.gamma)


def tuned_words(tuned) -> str:
    """A profile's tuned mapping (or ``Tuned``) in words: ``vegas weight, 256 slots,
    gamma 8 (ratio 0.0305 beyond them)``."""
    get = tuned.get if isinstance(tuned, dict) else lambda name: getattr(tuned, name)
    selection = Selection.of(SpecConfig(drafter=get("drafter"), score=get("score"),
                                        window=get("window"), rule=get("rule"),
                                        spread=get("spread") or 0))
    point = Point(selection, get("min_tokens"), get("gamma"))
    return f"{point.words()} (ratio {get('sparsity_ratio'):g} at longer contexts)"
