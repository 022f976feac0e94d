"""Predict decode throughput for every (gamma, sparsity) from two measurements at one
batch size: a vanilla run and a speculative run at a probe gamma and sparsity.

Tokens per iteration per sequence: E(gamma, s) = 1 + sum_{i <= gamma} a_i(s), where a_i(s)
is the measured rate at which draft position i is accepted at sparsity s (it does not
depend on how many positions are drafted after it, nor, for greedy decoding, on the batch
size: step 1 measures it once for every size). Time per iteration:

    T(gamma, s) = gamma * draft(s) + verify(gamma) + selection + overhead

- draft(s): a sparse draft forward reads every weight and the budget's share of the K/V;
  it is interpolated linearly in that share between the probe's draft step and a
  vanilla decode step (share 1: all K/V).
- verify(gamma): linear in its rows between a one-row vanilla decode step (gamma = 0) and
  the verify measured at the probe gamma.
- overhead: what the probe's whole iteration took beyond its timed phases (acceptance,
  bookkeeping, launches between phases); without it the model predicts too high at
  small batch sizes, where that time is a large part of an iteration.

At the probe point the prediction is the probe's measured throughput, by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class StepCosts:
    """Step times measured at one batch size (seconds, for the whole batch)."""

    draft_step_seconds: float  # one sparse draft forward, at the probe's budget share
    verify_step_seconds: float  # one verify forward at the probe gamma
    selection_step_seconds: float  # selection per iteration
    decode_step_seconds: float  # one vanilla decode forward
    iteration_seconds: float  # one whole speculative iteration of the probe
    probe_gamma: int
    probe_share: float  # the probe's draft budget as a share of the prefix

    @property
    def overhead_seconds(self) -> float:
        """Iteration time outside the timed phases (never negative)."""
        timed = (self.probe_gamma * self.draft_step_seconds + self.verify_step_seconds
                 + self.selection_step_seconds)
        return max(0.0, self.iteration_seconds - timed)


def budget_share(sparsity: float, min_tokens: int, prefix_len: int) -> float:
    """The share of a ``prefix_len`` prefix a draft reads: the engine's budget
    ``max(min_tokens, ceil(sparsity * prefix_len))``, at most the prefix."""
    budget = max(min_tokens, math.ceil(sparsity * prefix_len))
    return min(budget, prefix_len) / prefix_len


def expected_tokens(acceptance_by_position: list[float], gamma: int) -> float:
    if gamma > len(acceptance_by_position):
        raise ValueError(f"acceptance known for {len(acceptance_by_position)} positions, "
                         f"not {gamma}")
    return 1.0 + sum(acceptance_by_position[:gamma])


def draft_seconds(costs: StepCosts, share: float) -> float:
    """One draft forward reading ``share`` of the K/V."""
    if costs.probe_share >= 1.0:
        return costs.draft_step_seconds
    per_share = (costs.decode_step_seconds - costs.draft_step_seconds) / (1.0 - costs.probe_share)
    return max(0.0, costs.draft_step_seconds + per_share * (share - costs.probe_share))


def verify_seconds(costs: StepCosts, gamma: int) -> float:
    per_row = (costs.verify_step_seconds - costs.decode_step_seconds) / costs.probe_gamma
    return costs.decode_step_seconds + per_row * gamma


def iteration_seconds(costs: StepCosts, gamma: int, share: float) -> float:
    return (gamma * draft_seconds(costs, share) + verify_seconds(costs, gamma)
            + costs.selection_step_seconds + costs.overhead_seconds)


def predict_tokens_per_second(acceptance_by_position: list[float], costs: StepCosts,
                              gamma: int, batch_size: int, share: float | None = None) -> float:
    """Decode tokens/s of ``batch_size`` sequences at ``gamma`` drafting ``share`` of the
    K/V (default: the probe's), with ``acceptance_by_position`` measured at that share."""
    share = costs.probe_share if share is None else share
    return (batch_size * expected_tokens(acceptance_by_position, gamma)
            / iteration_seconds(costs, gamma, share))
