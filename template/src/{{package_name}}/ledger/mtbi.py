"""The MTBI measured from the interruption history, with a 95 % interval.

From n interruptions (a Poisson process) over T seconds of exposure: T / n, and
M_low = 2T / χ²(1 - α/2; 2n + 2), M_high = 2T / χ²(α/2; 2n) (n >= 1); docs/GOODPUT.md,
"The measured MTBI". The degrees of freedom are even, where the χ² distribution function
has a closed form, so the quantiles come by bisection, without SciPy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA = 0.05        # a 95 % interval
MIN_COUNT = 3       # fewer interruptions than this are too few to plan with


def chi2_cdf_even(x: float, dof: int) -> float:
    """P(X <= x) = 1 - exp(-x/2)·Σ_{i<dof/2} (x/2)^i / i! for X ~ χ²(dof), dof even."""
    if dof <= 0 or dof % 2:
        raise ValueError(f"degrees of freedom must be even and positive (got {dof})")
    if x <= 0:
        return 0.0
    half = x / 2.0
    term, total = 1.0, 1.0
    for i in range(1, dof // 2):
        term *= half / i
        total += term
    # exp(-half) * total, computed in logs so that large x does not overflow
    return 1.0 - math.exp(-half + math.log(total))


def chi2_quantile_even(p: float, dof: int) -> float:
    """The p-quantile of χ² with ``dof`` (even) degrees of freedom, by bisection."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1) (got {p})")
    low, high = 0.0, max(1.0, 2.0 * dof)
    while chi2_cdf_even(high, dof) < p:
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if chi2_cdf_even(middle, dof) < p:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * max(1.0, high):
            break
    return (low + high) / 2.0


@dataclass(frozen=True)
class MTBI:
    estimate_s: float | None   # T / n; None without an interruption
    low_s: float | None        # the 95 % interval
    high_s: float | None       # None with n = 0 (no upper bound)
    count: int                 # n
    exposure_s: float          # T

    @property
    def enough(self) -> bool:
        return self.count >= MIN_COUNT

    def excludes(self, mtbi_s: float) -> bool:
        """Whether ``mtbi_s`` lies outside the interval (always False with too few)."""
        return (self.enough and self.low_s is not None
                and (mtbi_s < self.low_s or (self.high_s is not None and mtbi_s > self.high_s)))


def measure_mtbi(count: int, exposure_s: float, alpha: float = ALPHA) -> MTBI:
    if count < 0 or exposure_s < 0:
        raise ValueError("count and exposure must be >= 0")
    if exposure_s == 0:
        return MTBI(None, None, None, count, 0.0)
    low = 2.0 * exposure_s / chi2_quantile_even(1.0 - alpha / 2.0, 2 * count + 2)
    if count == 0:
        return MTBI(None, low, None, 0, exposure_s)
    high = 2.0 * exposure_s / chi2_quantile_even(alpha / 2.0, 2 * count)
    return MTBI(exposure_s / count, low, high, count, exposure_s)


@dataclass(frozen=True)
class Share:
    estimate: float | None   # count / interruptions; None without an interruption
    count: int


def share(count: int, of: int) -> Share:
    return Share(count / of if of else None, count)


def duration(seconds: float | None) -> str:
    """Seconds, minutes or hours, whichever reads best."""
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def describe(mtbi: MTBI) -> str:
    """One line: "measured 1.89 h [0.995 h, 4.13 h] from 9 interruptions over 17 h"."""
    if mtbi.count == 0:
        return (f"no interruption in {duration(mtbi.exposure_s)} of training (the MTBI is at "
                f"least {duration(mtbi.low_s)}, 95 %)")
    return (f"measured MTBI {duration(mtbi.estimate_s)} [{duration(mtbi.low_s)}, "
            f"{duration(mtbi.high_s)}] from {mtbi.count} interruption"
            f"{'s' if mtbi.count != 1 else ''} over {duration(mtbi.exposure_s)}")
