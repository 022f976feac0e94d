"""Predict decode throughput for every gamma from one measurement at a probe gamma.

Tokens per iteration per sequence: E(gamma) = 1 + sum_{i <= gamma} a_i, where a_i is the
measured rate at which draft position i is accepted (it does not depend on how many
positions are drafted after it). Time per iteration:

    T(gamma) = gamma * draft_step + verify(gamma) + selection_step

with verify(gamma) interpolated linearly in its rows between a one-row vanilla decode
step (gamma = 0) and the verify measured at the probe gamma.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepCosts:
    draft_step_seconds: float  # one sparse draft forward (batch)
    verify_step_seconds: float  # one verify forward at the probe gamma
    selection_step_seconds: float  # selection per iteration
    decode_step_seconds: float  # one vanilla decode forward (batch)
    probe_gamma: int


def expected_tokens(acceptance_by_position: list[float], gamma: int) -> float:
    if gamma > len(acceptance_by_position):
        raise ValueError(f"acceptance known for {len(acceptance_by_position)} positions, "
                         f"not {gamma}")
    return 1.0 + sum(acceptance_by_position[:gamma])


def verify_seconds(costs: StepCosts, gamma: int) -> float:
    per_row = (costs.verify_step_seconds - costs.decode_step_seconds) / costs.probe_gamma
    return costs.decode_step_seconds + per_row * gamma


def predict_tokens_per_second(acceptance_by_position: list[float], costs: StepCosts,
                              gamma: int, batch_size: int) -> float:
    seconds = (gamma * costs.draft_step_seconds + verify_seconds(costs, gamma)
               + costs.selection_step_seconds)
    return batch_size * expected_tokens(acceptance_by_position, gamma) / seconds
