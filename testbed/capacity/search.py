"""The search for one point's capacity, as a pure state machine (no runs, no I/O), so that it can
be driven by simulator runs, by a live endpoint, or by a synthetic function in the tests.

1. Bracket: probe `start`; while it passes multiply by `growth` (up to `max_rate`), while it fails
   divide (down to `min_rate`), until one rate passes and a higher one fails.
2. Bisect the bracket at its geometric midpoint until (hi - lo) / lo <= `precision`.
3. Confirm: `confirm` probe(s) between `hi` and the next failed rate above it (or hi x (1 + 4 x
   precision)). A pass there means the criterion is not monotone in the rate at this point.

Attainment falls with the rate only in expectation (bursts, preemption cascades), so the reported
capacity is conservative: the highest probed rate that passed while every probed rate below it
passed too (`lo`); the lowest failed rate above it is `hi`. Both were run. A pass above a failure
is reported as non-monotone, with every probe, never smoothed over and never interpolated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from testbed.capacity.settings import CapacitySettings

RATE_DIGITS = 4  # probed rates are rounded to 4 significant digits (readable labels; far below any precision)


def round_rate(rate: float) -> float:
    return float(f"{rate:.{RATE_DIGITS}g}")


@dataclass
class Probe:
    rate: float
    passed: bool
    value: float  # the criterion's metric at this rate
    phase: str  # bracket | bisect | confirm
    metrics: dict = field(default_factory=dict)  # anything else worth reporting (run id, SLO metrics)


@dataclass
class Outcome:
    capacity: float | None  # a probed rate that passed (None: none did)
    lo: float | None
    hi: float | None  # the lowest failed rate above `capacity` (None: none failed)
    status: str  # converged | non-monotone | fails at min_rate | passes at max_rate | probe limit
    monotone: bool
    violations: list[str]
    max_passed: float | None  # the highest rate that passed anywhere (differs when non-monotone)


class RateSearch:
    def __init__(self, settings: CapacitySettings, start: float) -> None:
        self.s = settings
        self.start = round_rate(min(max(start, settings.min_rate), settings.max_rate))
        self.probes: list[Probe] = []
        self.confirmed = 0

    # --- what has been seen ---------------------------------------------------------------------
    def _rates(self, passed: bool) -> list[float]:
        return sorted(p.rate for p in self.probes if p.passed is passed)

    def bracket(self) -> tuple[float | None, float | None]:
        """(lo, hi): hi = the lowest failed rate; lo = the highest pass below it, if every probe
        below lo passed too (else the highest pass below the lowest failure)."""
        failed = self._rates(False)
        hi = failed[0] if failed else None
        below = [r for r in self._rates(True) if hi is None or r < hi]
        return (below[-1] if below else None), hi

    def converged(self) -> bool:
        lo, hi = self.bracket()
        return lo is not None and hi is not None and (hi - lo) / lo <= self.s.precision + 1e-12

    # --- what to probe next -----------------------------------------------------------------------
    def next_rate(self) -> float | None:
        """The next rate to probe, or None when the search is over."""
        if len(self.probes) >= self.s.max_probes:
            return None
        if not self.probes:
            return self.start
        lo, hi = self.bracket()
        if lo is None:  # nothing passed yet below the lowest failure: go down
            return self._fresh(max(hi / self.s.growth, self.s.min_rate)) if hi > self.s.min_rate else None
        if hi is None:  # nothing failed yet: go up
            return self._fresh(min(lo * self.s.growth, self.s.max_rate)) if lo < self.s.max_rate else None
        if not self.converged():
            return self._fresh(math.sqrt(lo * hi))
        if self.confirmed < self.s.confirm:
            return self._confirm_rate(hi)
        return None

    def _fresh(self, rate: float) -> float | None:
        rate = round_rate(rate)
        return None if any(p.rate == rate for p in self.probes) else rate

    def _confirm_rate(self, hi: float) -> float | None:
        above = [r for r in self._rates(False) if r > hi]
        top = above[0] if above else hi * (1 + 4 * self.s.precision)
        untried = [p.rate for p in self.probes if p.rate > hi]
        rate = round_rate(math.sqrt(hi * min([top] + untried)))
        return rate if rate > hi and all(p.rate != rate for p in self.probes) else None

    def phase(self) -> str:
        lo, hi = self.bracket()
        if lo is None or hi is None:
            return "bracket"
        return "confirm" if self.converged() else "bisect"

    def record(self, rate: float, value: float, passed: bool, phase: str | None = None, **metrics) -> Probe:
        """`phase`: a probe the search did not ask for (a confirmation of the point's answer)."""
        probe = Probe(rate, passed, value, phase or self.phase(), metrics)
        if probe.phase == "confirm":
            self.confirmed += 1
        self.probes.append(probe)
        return probe

    # --- the answer ---------------------------------------------------------------------------
    def planned(self) -> int:
        """Probes done plus those still to come (the progress bar and a live search's time
        estimate). Before any probe, the bracket takes two probes (the start, then the first rate
        above or below it that closes the bracket; the count once said one, so the plan printed at
        the start was a probe short: 6 planned, 7 run in docs/capacity.md's live search). Exact
        when the capacity lies within one `growth` factor of the start and the criterion is
        monotone; otherwise a lower bound (each further factor of `growth` adds a bracketing probe)."""
        if self.next_rate() is None:
            return len(self.probes)
        lo, hi = self.bracket()
        width = math.log(hi / lo) if lo and hi else math.log(self.s.growth)
        steps = max(0, math.ceil(math.log2(max(width / math.log1p(self.s.precision), 1.0))))
        if lo is not None and hi is not None and self.converged():
            steps = 0
        bracketing = 0 if lo is not None and hi is not None else (1 if self.probes else 2)
        left = steps + (self.s.confirm - self.confirmed) + bracketing
        return min(len(self.probes) + max(left, 1), self.s.max_probes)

    def outcome(self) -> Outcome:
        lo, hi = self.bracket()
        passed = self._rates(True)
        violations = [f"passed at {p:g} above a failure at {f:g}" for p in passed for f in self._rates(False)
                      if p > f]
        violations = [v for i, v in enumerate(violations) if v not in violations[:i]]
        if violations:
            status = "non-monotone"
        elif not self.probes:
            status = "not run"
        elif lo is None and hi <= self.s.min_rate:
            status = f"fails at min_rate {hi:g}"
        elif hi is None and lo >= self.s.max_rate:
            status = f"passes at max_rate {lo:g}"
        elif lo is not None and hi is not None and self.converged():
            status = "converged"
        else:
            status = "probe limit"
        return Outcome(lo, lo, hi, status, not violations, violations, passed[-1] if passed else None)
