"""Predict decode throughput for every (gamma, sparsity) at one batch size from three
measurements there: a vanilla run and two speculative probe runs at one sparsity and two
gammas (the probe gamma and gamma 1).

Tokens per iteration per sequence: E(gamma, s) = 1 + sum_{i <= gamma} a_i(s), where a_i(s)
is the measured rate at which draft position i is accepted at sparsity s (it does not
depend on how many positions are drafted after it, nor, for greedy decoding, on the batch
size: step 1 measures it once for every size).

Time per iteration, for the whole batch:

    T(gamma, s) = fixed + per_gamma * gamma + gamma * (draft(s) - draft(s_probe))

- ``fixed`` and ``per_gamma`` come from the two probes' whole steady iterations: a line
  through (gamma 1, T_1) and (probe gamma, T_probe). Every part of an iteration is either
  paid once (the verify's one-row cost, selection, acceptance, bookkeeping) or once per
  drafted token (a draft forward, a verify row, the launches between them), so the line
  holds what the timed phases leave out, e.g. the host work between draft steps.
- draft(s): a sparse draft forward reads every weight and the budget's share of the K/V;
  it is interpolated linearly in that share between the probes' draft step and a vanilla
  decode step (share 1: all K/V).

With one probe (probe gamma 1) there is no line to draw: its iteration time is used for
gamma 1, the only gamma predicted. At each probe point the prediction reproduces the
probe's measured iteration time, by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeRun:
    """One speculative probe run's timings (seconds, for the whole batch)."""

    gamma: int
    iteration_seconds: float  # one whole steady-state iteration
    draft_step_seconds: float  # one sparse draft forward, at the probe's budget share


@dataclass(frozen=True)
class StepCosts:
    """Step times measured at one batch size: vanilla's decode step, and one or two probe
    runs at different gammas and the same budget share ``probe_share``."""

    decode_step_seconds: float  # one vanilla decode forward
    probes: tuple[ProbeRun, ...]
    probe_share: float  # the probes' draft budget as a share of the prefix

    def __post_init__(self) -> None:
        gammas = [p.gamma for p in self.probes]
        if not 1 <= len(gammas) <= 2 or len(set(gammas)) != len(gammas):
            raise ValueError(f"expected one or two probes of different gammas, got {gammas}")

    @property
    def draft_step_seconds(self) -> float:
        return sum(p.draft_step_seconds for p in self.probes) / len(self.probes)

    def line(self) -> tuple[float, float]:
        """(fixed, per_gamma): the iteration time at the probes' share as a line in gamma."""
        if len(self.probes) == 1:
            (probe,) = self.probes
            return probe.iteration_seconds, 0.0
        low, high = sorted(self.probes, key=lambda p: p.gamma)
        per_gamma = (high.iteration_seconds - low.iteration_seconds) / (high.gamma - low.gamma)
        return low.iteration_seconds - per_gamma * low.gamma, per_gamma


def budget_share(sparsity: float, min_tokens: int, prefix_len: int) -> float:
    """The share of a ``prefix_len`` prefix a draft reads: the engine's budget
    ``max(min_tokens, ceil(sparsity * prefix_len))``, at most the prefix."""
    budget = max(min_tokens, math.ceil(sparsity * prefix_len))
    return min(budget, prefix_len) / prefix_len


def expected_tokens(acceptance_by_position: list[float], gamma: int) -> float:
    """Tokens per iteration per sequence at ``gamma``: the bonus token plus each draft
    position's acceptance rate."""
    if gamma > len(acceptance_by_position):
        raise ValueError(f"acceptance known for {len(acceptance_by_position)} positions, "
                         f"asked for gamma {gamma}")
    return 1.0 + sum(acceptance_by_position[:gamma])


def draft_seconds(costs: StepCosts, share: float) -> float:
    """One draft forward reading ``share`` of the K/V."""
    if costs.probe_share >= 1.0:
        return costs.draft_step_seconds
    per_share = ((costs.decode_step_seconds - costs.draft_step_seconds)
                 / (1.0 - costs.probe_share))
    return max(0.0, costs.draft_step_seconds + per_share * (share - costs.probe_share))


def iteration_seconds(costs: StepCosts, gamma: int, share: float | None = None) -> float:
    """One iteration of ``batch`` sequences at ``gamma``, drafting ``share`` of the K/V
    (default: the probes')."""
    share = costs.probe_share if share is None else share
    fixed, per_gamma = costs.line()
    sparser = gamma * (draft_seconds(costs, share) - costs.draft_step_seconds)
    # Never below one draft-free verify: a line fitted to noisy probes must not predict
    # a free iteration.
    return max(fixed + per_gamma * gamma + sparser, costs.decode_step_seconds)


def predict_tokens_per_second(acceptance_by_position: list[float], costs: StepCosts,
                              gamma: int, batch_size: int, share: float | None = None) -> float:
    """Decode tokens/s of ``batch_size`` sequences at ``gamma`` drafting ``share`` of the
    K/V (default: the probes'), with ``acceptance_by_position`` measured at that share."""
    return (batch_size * expected_tokens(acceptance_by_position, gamma)
            / iteration_seconds(costs, gamma, share))
