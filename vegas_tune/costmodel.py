"""Predict decode throughput for every (gamma, sparsity) at one batch size from step 1's
acceptance and a few measurements at that size: a vanilla run and up to three probe runs
(see ``ProbeRun``):

- ``main``: the probe gamma at step 1's sparsity s0;
- ``short``: gamma 1 at s0, so the iteration time is a line in gamma;
- ``sparse``: the probe gamma at another step-1 ratio, so the cost of a draft step is a
  line in the K/V share it reads, and acceptance is known at this size at two ratios.

Tokens per iteration per sequence: E(gamma, s) = 1 + sum_{i <= gamma} a_i(s), where a_i(s)
is the rate at which draft position i is accepted at sparsity s. It does not depend on
how many positions are drafted after position i. Step 1 measures a_i(s) once, at the
smallest batch size. In exact arithmetic it would not depend on the batch size either,
but in bf16 on a GPU the batch size changes rounding, so long greedy continuations
diverge and acceptance differs by up to ~15% on a few prompts. So each size rescales
step 1's rates, position by position, by what its probes accepted (``batch_acceptance``).

Time per iteration, for the whole batch:

    T(gamma, s) = fixed + per_gamma * gamma + gamma * per_share * (share(s) - share(s0))

- ``fixed`` and ``per_gamma``: the line through the main and short probes' whole steady
  iterations. Every part of an iteration is paid either once (the verify's one-row cost,
  selection, acceptance, bookkeeping) or once per drafted token (a draft forward, a
  verify row, the launches between them). So the line also holds what the timed phases
  leave out, e.g. the host work between draft steps.
- ``per_share``: what one draft step costs per unit of K/V share. It comes from the main
  and sparse probes' iterations. Without a sparse probe it falls back to the line from
  the main probe's draft step to a vanilla decode step (share 1). That underestimates
  it where gathering scattered K/V costs more per byte than a contiguous read.

At each probe point the prediction reproduces that probe's measured iteration time, by
construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from vegas_core.spec_config import draft_budget


@dataclass(frozen=True)
class ProbeRun:
    """One speculative probe run at one batch size (seconds, for the whole batch)."""

    gamma: int
    sparsity: float
    share: float  # the draft budget as a share of the mean prefix
    iteration_seconds: float  # one whole steady-state iteration
    draft_step_seconds: float  # one sparse draft forward
    acceptance_by_position: tuple[float, ...] = ()  # what this run accepted, per position


@dataclass(frozen=True)
class StepCosts:
    """Step times measured at one batch size: vanilla's decode step and the probes
    (``main`` required; ``short`` at gamma 1 and ``sparse`` at another sparsity
    optional)."""

    decode_step_seconds: float  # one vanilla decode forward
    main: ProbeRun
    short: ProbeRun | None = None
    sparse: ProbeRun | None = None

    def __post_init__(self) -> None:
        if self.short is not None and (self.short.gamma == self.main.gamma
                                       or self.short.share != self.main.share):
            raise ValueError("the short probe needs the main probe's share and another gamma")
        if self.sparse is not None and (self.sparse.gamma != self.main.gamma
                                        or self.sparse.share == self.main.share):
            raise ValueError("the sparse probe needs the main probe's gamma and another share")

    @property
    def probes(self) -> tuple[ProbeRun, ...]:
        return tuple(p for p in (self.main, self.short, self.sparse) if p is not None)

    def line(self) -> tuple[float, float]:
        """(fixed, per_gamma): the iteration time at the main probe's share, a line in
        gamma; flat at the main probe's time without a short probe."""
        if self.short is None:
            return self.main.iteration_seconds, 0.0
        low, high = sorted((self.short, self.main), key=lambda p: p.gamma)
        per_gamma = (high.iteration_seconds - low.iteration_seconds) / (high.gamma - low.gamma)
        return low.iteration_seconds - per_gamma * low.gamma, per_gamma

    def per_share_seconds(self) -> float:
        """One draft step's cost per unit of K/V share (never negative)."""
        main = self.main
        if self.sparse is not None:
            slope = ((main.iteration_seconds - self.sparse.iteration_seconds)
                     / (main.gamma * (main.share - self.sparse.share)))
        elif main.share < 1.0:
            slope = (self.decode_step_seconds - main.draft_step_seconds) / (1.0 - main.share)
        else:
            slope = 0.0
        return max(0.0, slope)


def budget_share(sparsity: float, min_tokens: int, prefix_len: int) -> float:
    """The share of a ``prefix_len`` prefix a draft reads: the engine's budget
    (``draft_budget``) over the prefix."""
    return draft_budget(prefix_len, sparsity, min_tokens) / prefix_len


def draft_read_share(sparsity: float, min_tokens: int, prefix_len: int,
                     windows: list[int | None]) -> float:
    """The share of a vanilla step's K/V reads that a draft step makes, for a model whose
    layer i attends within ``windows[i]`` (None: the whole prefix). Budgets count in
    full-attention layers only: a sliding layer reads its whole window in a draft as in
    vanilla decoding (``AttentionMeta.drafts_whole_window``). A model with no sliding
    layer, or only sliding ones (Mistral, whose drafts select within the window), reads
    the budget's share of the prefix."""
    hybrid = any(w is None for w in windows) and any(w is not None for w in windows)
    if not hybrid:
        return budget_share(sparsity, min_tokens, prefix_len)
    full = [prefix_len for w in windows if w is None]
    local = sum(min(w, prefix_len) for w in windows if w is not None)
    budget = budget_share(sparsity, min_tokens, prefix_len) * prefix_len
    return (len(full) * budget + local) / (sum(full) + local)


def expected_tokens(acceptance_by_position: list[float], gamma: int) -> float:
    """Tokens per iteration per sequence at ``gamma``: the bonus token plus each draft
    position's acceptance rate."""
    if gamma > len(acceptance_by_position):
        raise ValueError(f"acceptance known for {len(acceptance_by_position)} positions, "
                         f"asked for gamma {gamma}")
    return 1.0 + sum(acceptance_by_position[:gamma])


def batch_acceptance(step1: dict[float, list[float]],
                     probes: tuple[ProbeRun, ...]) -> dict[float, list[float]]:
    """Step 1's acceptance by sparsity, rescaled to one batch size by its probes.

    Each probe at a step-1 ratio gives per-position factors: what it accepted divided
    by what step 1 accepted at the same ratio. The probe with the most positions at a
    ratio is used. A ratio between two probes' ratios gets factors interpolated
    linearly in sparsity; one outside them takes the nearer probe's. Rates stay at most
    1, and positions beyond the probes' are left as step 1 measured them. With no probe
    at a step-1 ratio, step 1's rates are returned unchanged.
    """
    anchors: dict[float, list[float]] = {}
    for probe in probes:
        base = step1.get(probe.sparsity)
        measured = list(probe.acceptance_by_position)
        if base is None or not measured or len(measured) <= len(anchors.get(probe.sparsity, [])):
            continue
        anchors[probe.sparsity] = [m / b if b > 0 else 1.0 for m, b in zip(measured, base)]
    if not anchors:
        return {s: list(a) for s, a in step1.items()}
    ratios = sorted(anchors)

    def factors(sparsity: float) -> list[float]:
        if sparsity <= ratios[0]:
            return anchors[ratios[0]]
        if sparsity >= ratios[-1]:
            return anchors[ratios[-1]]
        above = next(r for r in ratios if r >= sparsity)
        below = max(r for r in ratios if r <= sparsity)
        if above == below:
            return anchors[above]
        w = (sparsity - below) / (above - below)
        return [(1 - w) * lo + w * hi for lo, hi in zip(anchors[below], anchors[above])]

    out = {}
    for sparsity, rates in step1.items():
        f = factors(sparsity)
        out[sparsity] = [min(1.0, rate * (f[i] if i < len(f) else 1.0))
                         for i, rate in enumerate(rates)]
    return out


def iteration_seconds(costs: StepCosts, gamma: int, share: float | None = None) -> float:
    """One iteration of the batch at ``gamma``, drafting ``share`` of the K/V (default:
    the main probe's)."""
    share = costs.main.share if share is None else share
    fixed, per_gamma = costs.line()
    sparser = gamma * costs.per_share_seconds() * (share - costs.main.share)
    # Never below one draft-free verify: a line fitted to noisy probes must not predict
    # a free iteration.
    return max(fixed + per_gamma * gamma + sparser, costs.decode_step_seconds)


def predict_tokens_per_second(acceptance_by_position: list[float], costs: StepCosts,
                              gamma: int, batch_size: int, share: float | None = None) -> float:
    """Decode tokens/s of ``batch_size`` sequences at ``gamma`` drafting ``share`` of the
    K/V (default: the main probe's), with ``acceptance_by_position`` at that share and
    batch size (``batch_acceptance``)."""
    return (batch_size * expected_tokens(acceptance_by_position, gamma)
            / iteration_seconds(costs, gamma, share))
