"""Long generations (a short prompt, thousands of new tokens) measured over sampled spans.

A long generation costs more per token as it goes: every decode, draft and verify
forward reads the K/V of a context that grows by a slot per token, and what a drafter
selects changes with the context. Its first 128 tokens say little about its 6000th, and
decoding all of it in every trial costs more than a tuner can pay. So a trial decodes
``K`` spans of ``N`` tokens at depths spread over the generation:

1. **Reference, once per workload** (``reference_continuations``): each prompt is decoded
   plainly, greedy or sampled at the workload's temperature, to the deepest span's start.
   A context at depth ``d`` is the prompt and the first ``d`` tokens of that output: what
   decoding the whole generation puts in the cache before that point (greedy: exactly
   what speculative decoding puts there too, since it is lossless).
2. **Layout** (``SpanLayout``): the ``G`` new tokens are cut into ``K`` equal strata;
   span ``j`` decodes the ``N`` tokens centred on stratum ``j``'s midpoint. Its first
   ``SPAN_WARMUP_ITERATIONS`` iterations are decoded but neither timed nor counted for
   acceptance: the first selection of a decode comes from the prefill, not from a verify
   pass at that depth.
3. **Rows** (``span_rows``): each sequence of a batch is one (prompt, span) pair, and a
   batch of ``K`` rows or more holds every depth equally, as a serving batch of long
   generations holds them at every stage (continuous batching refills a finished slot
   with a new request). The deepest rows come first, so the first batch sizes the cache
   for the rest.
4. **Trial**: ``generate`` on the rows with ``max_new_tokens = N``,
   ``warmup_iterations`` and ``stop_after_steady``: timed from the end of the warm-up
   until the first row has its N tokens. Its steady tokens/s is the rate of a batch
   whose sequences sit at the K depths; acceptance is over the same iterations.

Why the figure is what the whole generation costs: a span's cache holds the prompt, the
``d`` reference tokens and its own output, all real tokens, so every forward reads as
much K/V as it would at that point of the generation, and the drafter selects from
those real slots. Per-token cost is close to linear in the context (K/V reads grow by a
slot per token, weight reads are constant), and the mean of a linear cost over a
stratum is its value at the stratum's midpoint, so midpoint spans estimate the
generation's total time with no error from that part (the midpoint rule: for a cost
``t(p)`` with curvature, ``(G/K)^2 / 24 · max|t''|`` per token). What is not linear in
depth (acceptance depends on the text, kernels change split counts at steps) is sampled
at ``K`` depths per prompt: a sampling error, which the tuner's interval over rounds does
not show (every round measures the same spans). ``bench/acceptance.py --full`` decodes
every token beside the spans and reports the gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vegas_core import generate
from vegas_core.errors import VegasError
from vegas_tune.datasets import Prompt

# Iterations each span decodes before it is timed and counted: the first drafts with a
# selection made from the prefill, the second with one from a verify pass at that depth.
# Counted in iterations, not tokens: rows that accept at different rates would otherwise
# finish their warm-ups so far apart that the fastest ends its span before the slowest
# begins (no steady iteration left).
SPAN_WARMUP_ITERATIONS = 2
# Defaults of the span options: four depths of 256 timed tokens each.
DEFAULT_SPANS = 4
DEFAULT_SPAN_TOKENS = 256


@dataclass(frozen=True)
class SpanLayout:
    """Where ``spans`` spans of ``span_tokens`` lie in a generation of
    ``generation_tokens`` new tokens; each is timed after ``warmup_iterations``."""

    generation_tokens: int
    spans: int
    span_tokens: int
    warmup_iterations: int = SPAN_WARMUP_ITERATIONS

    def __post_init__(self) -> None:
        if self.spans < 1:
            raise VegasError(f"--spans must be >= 1, got {self.spans}")
        if self.span_tokens < 1:
            raise VegasError(f"--span-tokens must be >= 1, got {self.span_tokens}")
        if self.warmup_iterations < 0:
            raise VegasError(f"span warm-up iterations must be >= 0, got "
                             f"{self.warmup_iterations}")
        stratum = self.generation_tokens // self.spans
        if self.span_tokens > stratum:
            raise VegasError(
                f"--spans {self.spans} of {self.span_tokens} tokens do not fit apart in "
                f"--max-new-tokens {self.generation_tokens} ({stratum} tokens per span); "
                f"use fewer spans, shorter spans or more new tokens")

    @property
    def max_new_tokens(self) -> int:
        """New tokens a span decodes."""
        return self.span_tokens

    def starts(self) -> list[int]:
        """Each span's depth, ascending: the generated tokens already in its context.
        A span's tokens ``[start, start + N)`` are centred on its stratum's midpoint."""
        stratum = self.generation_tokens / self.spans
        return [round((j + 0.5) * stratum - self.span_tokens / 2) for j in range(self.spans)]

    @property
    def reference_tokens(self) -> int:
        """How far each prompt's reference output must run: the deepest span's start."""
        return self.starts()[-1]

    def words(self) -> str:
        return (f"{self.spans} spans of {self.span_tokens} tokens (timed after "
                f"{self.warmup_iterations} iterations) at depths "
                f"{', '.join(map(str, self.starts()))} of {self.generation_tokens} new tokens")


def prompts_for_rows(rows: int, layout: SpanLayout) -> int:
    """Distinct prompts that give at least ``rows`` sequences, each prompt at every span."""
    return math.ceil(rows / layout.spans)


def reference_continuations(model, prompts: list[list[int]], tokens: int, *,
                            batch_size: int, temperature: float = 0.0,
                            seed: int = 0) -> list[list[int]]:
    """Each prompt's first ``tokens`` new tokens, decoded plainly (EOS ignored, as every
    measurement does) in batches of ``batch_size``; batch ``i`` seeded ``seed + i``."""
    if tokens == 0:
        return [[] for _ in prompts]
    out: list[list[int]] = []
    for index, first in enumerate(range(0, len(prompts), batch_size)):
        chunk = prompts[first : first + batch_size]
        result = generate(model, chunk, tokens, temperature=temperature, seed=seed + index,
                          ignore_eos=True)
        out += result.tokens
    return out


def span_rows(prompts: list[Prompt], continuations: list[list[int]],
              layout: SpanLayout) -> list[Prompt]:
    """One context per (prompt, span): the prompt and its reference's first ``start``
    tokens. Row ``s`` is prompt ``s // K`` at span ``K - 1 - s % K``: the deepest first,
    and every ``K`` consecutive rows hold every span."""
    starts = layout.starts()
    rows = []
    for prompt, continuation in zip(prompts, continuations, strict=True):
        if len(continuation) < starts[-1]:
            raise VegasError(f"{prompt.name}: its reference output has {len(continuation)} "
                             f"tokens, the deepest span starts at {starts[-1]}")
        for start in reversed(starts):
            rows.append(Prompt(f"{prompt.name}@{start}", prompt.ids + continuation[:start]))
    return rows
