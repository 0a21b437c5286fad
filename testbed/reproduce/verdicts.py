"""Judging a measured number against a published claim: the verdict rules (in `verdict`'s
docstring and in every report) and the reducers claims aggregate with."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_TOLERANCE = 0.25  # size: within +-25% of the claimed effect (ratio - baseline)
DEFAULT_ABS_TOL = 0.02  # ... but never tighter than +-0.02 (2 points of a ratio or a fraction)
DEFAULT_MIN_EFFECT = 0.01  # direction: the effect must be at least 1% of the baseline

VERDICT_TEXT = {
    "size": "reproduced in direction and size",
    "direction": "reproduced in direction only",
    "none": "not reproduced",
    "info": "no published number (shown for information)",
    "n/a": "not assessed",
}
# a "direction" verdict on a claim published without a number: direction was all there was to reproduce
UNSIZED_TEXT = "reproduced in direction (no size published)"


@dataclass(frozen=True)
class Verdict:
    category: str  # size | direction | none | info | n/a
    text: str  # one line: why
    sized: bool = True  # False: the claim states a direction but no number

    @property
    def label(self) -> str:
        if self.category == "direction" and not self.sized:
            return UNSIZED_TEXT
        return VERDICT_TEXT[self.category]


def verdict(measured: float | None, claimed: float | tuple[float, float] | None = None, *, baseline: float = 1.0,
            direction: str | None = None, at_most: float | None = None, tolerance: float = DEFAULT_TOLERANCE,
            abs_tol: float = DEFAULT_ABS_TOL, min_effect: float = DEFAULT_MIN_EFFECT, fmt=None) -> Verdict:
    """Judge a measured number against a published claim.

    - The effect is `measured - baseline` (baseline: 1 for a ratio, 2 for "super-linear 2->4
      GPU scaling", the reference system's value for a value claim).
    - Direction: the effect has the claimed sign (the sign of claimed - baseline, or `direction`
      when no number is claimed) and is at least `min_effect` x |baseline| (1%), so a tie is no
      reproduction.
    - Size: the measured value lies in the claimed value or range, widened on each side by
      `tolerance` (25%) of the claimed effect at that end, and by at least `abs_tol` (0.02).
      E.g. "1.91x": effect 0.91, band 1.68x-2.14x; "+3-6%": band 1.01x-1.08x.
    - Verdict: direction and size -> "reproduced in direction and size"; direction only ->
      "reproduced in direction only"; otherwise "not reproduced".
    - A bound claim (`at_most`, e.g. "within 2%"): |measured| <= bound x (1 + tolerance) is
      reproduced (direction and size), else not reproduced.
    - No number and no direction: "no published number" (informational row).
    """
    fmt = fmt or num
    if measured is None or (isinstance(measured, float) and math.isnan(measured)):
        return Verdict("n/a", "no measurement")
    if at_most is not None:
        limit = abs(at_most) * (1 + tolerance)
        ok = abs(measured) <= limit
        return Verdict("size" if ok else "none",
                       f"{pct(measured)} {'<=' if ok else '>'} {pct(limit)} "
                       f"(bound {pct(at_most)} + {tolerance:.0%})")
    if claimed is None and direction is None:
        return Verdict("info", "")
    lo = hi = None
    if claimed is not None:
        lo, hi = (claimed, claimed) if isinstance(claimed, (int, float)) else claimed
        mid = (lo + hi) / 2
        direction = direction or ("higher" if mid > baseline else "lower")
    effect = measured - baseline
    floor = min_effect * abs(baseline) if baseline else min_effect
    dir_ok = (effect > 0 if direction == "higher" else effect < 0) and abs(effect) >= floor
    sign = "above" if direction == "higher" else "below"
    dir_text = f"{'is' if dir_ok else 'is not'} {sign} {fmt(baseline)} by >= {min_effect:.0%}"
    if lo is None:
        return Verdict("direction" if dir_ok else "none", f"{dir_text}; no size published", sized=False)
    band_lo = lo - max(tolerance * abs(lo - baseline), abs_tol)
    band_hi = hi + max(tolerance * abs(hi - baseline), abs_tol)
    size_ok = band_lo <= measured <= band_hi
    size_text = f"{'inside' if size_ok else 'outside'} the size band {fmt(band_lo)} to {fmt(band_hi)}"
    if dir_ok and size_ok:
        return Verdict("size", f"{dir_text}, {size_text}")
    if dir_ok:
        return Verdict("direction", f"{dir_text}, {size_text}")
    return Verdict("none", f"{dir_text}")


def num(v: float) -> str:
    return f"{v:.3g}"


def pct(v: float) -> str:
    return f"{v * 100:.1f}%"


def geomean(values: Sequence[float]) -> float:
    if all(v > 0 for v in values):
        return math.exp(sum(math.log(v) for v in values) / len(values))
    return sum(values) / len(values)


REDUCERS = {"only": None, "max": max, "min": min, "mean": lambda v: sum(v) / len(v), "geomean": geomean}


