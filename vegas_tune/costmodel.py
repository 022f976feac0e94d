"""Predict decode throughput at every gamma from a few timed runs at one batch size.

The sweep (``vegas_tune.steps``) runs every (selection, budget) of the search once, at
the probe gamma G, at the batch size being tuned. Each run gives

- the rate a_i at which draft position i was accepted, for i = 1..G; it does not depend
  on how many positions are drafted after i, so tokens per iteration per sequence at any
  gamma g <= G are E(g) = 1 + sum_{i <= g} a_i;
- the tokens per sequence each steady iteration produced, which throughput counts. It
  falls short of E(G) (up to 10% at small budgets, SmolLM2 8k on an H100): the rates
  include the first, untimed iterations, and the new-token limit cuts the last steady
  one. So the rates are scaled by one factor, (steady tokens - 1) / (E(G) - 1),
  that makes E(G) what the steady window produced;
- the time of one steady iteration of the whole batch at G, T(G), and of one draft
  forward, d.

An iteration at gamma g drafts G - g tokens fewer, each a draft forward plus what a
drafted token costs beyond it (a verify row, launches, host work between steps): ``extra``,
measured per batch size and per drafter and score (a weight rule's verify does more per
row) from one configuration at two gammas (the sweep's short probes). So

    T(g) = T(G) - (G - g) * (d + extra)

where a configuration has runs at two gammas (the short probe, an extension of the gamma
axis, the focus step's run at its best predicted gamma), T is the line through them, and
E(g) comes from the rates of the nearest run that drafted at least g positions: Vegas's
rates shift with gamma, since its draft set comes from verify rows that gamma moves.
Predicted tokens/s: B * E(g) / T(g). Every run of a configuration is reproduced exactly
at its own gamma; what is predicted is the gammas between and below.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    """One timed run of one (selection, budget) at one gamma and batch size; seconds are
    for the whole batch."""

    gamma: int
    iteration_seconds: float  # one steady iteration
    draft_step_seconds: float  # one sparse draft forward
    acceptance_by_position: tuple[float, ...]
    # Tokens per sequence a steady iteration produced; None: 1 + sum of the rates.
    tokens_per_iteration: float | None = None

    @property
    def steady_acceptance(self) -> tuple[float, ...]:
        """The rates scaled so that 1 + their sum is what a steady iteration produced."""
        drafted = sum(self.acceptance_by_position)
        if self.tokens_per_iteration is None or drafted <= 0:
            return self.acceptance_by_position
        scale = max(0.0, self.tokens_per_iteration - 1.0) / drafted
        return tuple(min(1.0, a * scale) for a in self.acceptance_by_position)


def per_token_extra(long: Run, short: Run) -> float:
    """What each drafted token costs an iteration beyond its draft forward, from two runs
    of one configuration at two gammas. Noise may make it negative; ``Curve`` never lets
    a drafted token cost less than nothing."""
    if long.gamma == short.gamma:
        raise ValueError("the two runs need different gammas")
    slope = (long.iteration_seconds - short.iteration_seconds) / (long.gamma - short.gamma)
    return slope - (long.draft_step_seconds + short.draft_step_seconds) / 2


def expected_tokens(acceptance_by_position: tuple[float, ...] | list[float], gamma: int) -> float:
    """Tokens per iteration per sequence at ``gamma``: the bonus token plus each draft
    position's acceptance rate."""
    if gamma > len(acceptance_by_position):
        raise ValueError(f"acceptance known for {len(acceptance_by_position)} positions, "
                         f"asked for gamma {gamma}")
    return 1.0 + sum(acceptance_by_position[:gamma])


class Curve:
    """Throughput against gamma of one (selection, budget) at one batch size.

    ``runs``: its timed runs (one or more gammas); ``extra``: ``per_token_extra`` at this
    batch size; ``floor_seconds``: a vanilla decode step. No iteration at gamma g is
    predicted faster than that step plus g draft forwards: it holds a verify pass, which
    reads everything a decode step does, and its drafts."""

    def __init__(self, runs: list[Run], extra: float, floor_seconds: float = 0.0) -> None:
        if not runs:
            raise ValueError("a curve needs at least one run")
        self.runs = sorted(runs, key=lambda r: r.gamma)
        self.extra = extra
        self.floor_seconds = floor_seconds
        # The run that drafted furthest knows acceptance at the most positions.
        self.acceptance = max(self.runs, key=lambda r: len(r.acceptance_by_position)
                              ).steady_acceptance

    @property
    def top_gamma(self) -> int:
        """The largest gamma with known acceptance: the end of what can be predicted."""
        return len(self.acceptance)

    def acceptance_at(self, gamma: int) -> tuple[float, ...]:
        """The rates of the run that drafted the fewest positions at or beyond ``gamma``.
        Vegas's rates shift with gamma (its draft set comes from the verify pass's rows,
        which gamma moves): SmolLM2 8k at batch 64 accepted 8.08 tokens per iteration at
        gamma 9 with logit scores and 8.13 with weight scores, where their gamma-12 runs'
        first 9 rates say 7.87 and 8.22. The nearest run is the best estimate."""
        fits = [r for r in self.runs if len(r.acceptance_by_position) >= gamma]
        if not fits:
            return self.acceptance
        return min(fits, key=lambda r: len(r.acceptance_by_position)).steady_acceptance

    def per_token_seconds(self, run: Run) -> float:
        return max(0.0, run.draft_step_seconds + self.extra)

    def iteration_seconds(self, gamma: int) -> float:
        runs = self.runs
        below = [r for r in runs if r.gamma <= gamma]
        above = [r for r in runs if r.gamma >= gamma]
        if below and above:
            lo, hi = below[-1], above[0]
            if lo.gamma == hi.gamma:
                seconds = lo.iteration_seconds
            else:
                w = (gamma - lo.gamma) / (hi.gamma - lo.gamma)
                seconds = (1 - w) * lo.iteration_seconds + w * hi.iteration_seconds
        elif above:  # below every run: fewer drafted tokens than the shortest
            first = above[0]
            seconds = first.iteration_seconds - (first.gamma - gamma) * self.per_token_seconds(first)
        else:
            last = below[-1]
            seconds = last.iteration_seconds + (gamma - last.gamma) * self.per_token_seconds(last)
        draft = min(r.draft_step_seconds for r in runs)
        return max(seconds, self.floor_seconds + gamma * draft)

    def tokens_per_second(self, gamma: int, batch_size: int) -> float:
        return (batch_size * expected_tokens(self.acceptance_at(gamma), gamma)
                / self.iteration_seconds(gamma))

    def best_gamma(self, batch_size: int) -> int:
        """The gamma (1 .. top_gamma) predicted fastest; the smaller where two tie."""
        return max(range(1, self.top_gamma + 1),
                   key=lambda g: (self.tokens_per_second(g, batch_size), -g))
