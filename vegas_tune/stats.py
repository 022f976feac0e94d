"""Repeated measurements as a mean with a confidence interval."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95
# Two-sided 95% quantiles of Student's t, t(0.975, df) for df = 1..30; beyond 30 degrees
# of freedom the normal quantile is within 2% of them.
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
          2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
          2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z_975 = 1.960


def t_quantile(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom, got {df}")
    return _T_975[df - 1] if df <= len(_T_975) else _Z_975


@dataclass(frozen=True)
class Estimate:
    """The (geometric) mean of ``n`` samples and its 95% confidence interval [low, high]."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def relative_half_width(self) -> float:
        """Half the interval's width over the mean: 0.02 means about "mean ± 2%"."""
        return (self.high - self.low) / 2 / abs(self.mean) if self.mean else math.inf

    def overlaps(self, other: Estimate) -> bool:
        """Whether the two intervals share a point: the data cannot order the two means."""
        return self.low <= other.high and other.low <= self.high

    def below(self, other: Estimate) -> bool:
        """Whether this interval lies wholly below ``other``'s."""
        return self.high < other.low

    def attrs(self, name: str) -> dict[str, float]:
        """``{name: mean, name_low: low, name_high: high}``, as trials store them."""
        return {name: self.mean, f"{name}_low": self.low, f"{name}_high": self.high}

    def words(self, unit: str = "x", digits: int = 2) -> str:
        """``1.42x [1.38, 1.46]``."""
        return f"{self.mean:.{digits}f}{unit} [{self.low:.{digits}f}, {self.high:.{digits}f}]"

    @classmethod
    def from_attrs(cls, attrs: dict, name: str) -> Estimate | None:
        """The estimate a trial stored with ``attrs(name)``; None when it has none."""
        keys = (name, f"{name}_low", f"{name}_high")
        if not all(isinstance(attrs.get(k), (int, float)) for k in keys):
            return None
        return cls(attrs[name], attrs[f"{name}_low"], attrs[f"{name}_high"],
                   int(attrs.get("rounds") or 0))


def estimate(samples: Sequence[float]) -> Estimate:
    """Geometric mean and its t interval, of at least two positive samples.

    Throughputs and their ratios vary by factors (a busy machine slows a run by some
    share), so the interval is a t interval of the logarithms, mapped back: it is never
    negative, one slow outlier moves it less than it would an arithmetic mean, and the
    geometric mean of per-round ratios is exactly the ratio of the geometric means.
    """
    n = len(samples)
    if n < 2:
        raise ValueError(f"an interval needs at least 2 samples, got {n}")
    if min(samples) <= 0:
        raise ValueError(f"samples must be positive, got {min(samples)}")
    logs = [math.log(x) for x in samples]
    centre = statistics.fmean(logs)
    half = t_quantile(n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return Estimate(math.exp(centre), math.exp(centre - half), math.exp(centre + half), n)

