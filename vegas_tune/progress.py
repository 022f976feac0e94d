"""Progress of a tuning run: what the tuner reports, and how the CLI shows it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ProgressEvent:
    """One update from the tuner.

    step: ``sparsity``, ``gamma``, ``refine``, ``baselines`` (or ``baseline vanilla``);
    done / total: finished trials of that step (earlier runs' included on resume);
    best: the step's best so far in words, e.g. ``gamma 3: 1.42x [1.38, 1.46]``, or None.
    """

    step: str
    done: int
    total: int
    best: str | None = None


ProgressCallback = Callable[[ProgressEvent], None]
