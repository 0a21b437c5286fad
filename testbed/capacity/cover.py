"""A grid point's capacity over its windows, and its confirmation, as a pure state machine (no
runs, no I/O): the feed (testbed/capacity/command.py) runs what it asks for.

Definition: the capacity of a trace (or of the stretch the user names) is the highest rate at which
every window meets the criterion. Each window runs its own search (testbed/capacity/search.py);
the point's answer is the lowest of their capacities, and the window that gave it *binds*. The
median and the range of the windows' capacities stay beside it as information. Before, the
answer was the median over three windows that spanned 0.67-1.47 req/s: a rate two of them could
not sustain.

Confirmation, before an answer is reported:
- every other window is run at the answer (each search probed its own rates; a window is not
  assumed to pass at a rate it did not run);
- the binding window at answer x (1 + precision) must fail (else the point is marked non-monotone:
  the answer stays the conservative one);
- a held-out stretch (testbed/capacity/windows.py), which no probe replayed, at the answer must pass.
A failed confirmation narrows the answer: a window that failed at it reopens its search; a failed
hold-out becomes a window of its own (its search steps down from the answer to the highest rate
that passes there too), and the new, lower answer is confirmed again, on a fresh hold-out. This
repeats until a confirmation passes, within two bounds: `capacity.holdouts` held-out stretches
and `capacity.narrow_probes` probes after the first failed confirmation (a narrowing step is only
started when its confirmation still fits). A point that reaches a bound, or runs out of held-out
stretches, ends `unconfirmed`: no capacity is printed, only what passed and what failed (`ended`).
Before, the last hold-out's failure ended the search without narrowing: the docs' live example
(seeds as hold-outs, two allowed) ended unconfirmed at 3.126 req/s, where one more step confirms
2.701 on a third seed.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from testbed.capacity.search import RateSearch, round_rate
from testbed.capacity.settings import CapacitySettings

KINDS = ("verify", "upper", "holdout")  # the confirmation probes' phases


@dataclass
class Check:
    """One confirmation probe of the current answer."""

    unit: int
    rate: float
    kind: str  # verify | upper | holdout
    passed: bool | None = None
    value: float = math.nan


@dataclass
class PointSearch:
    """The searches of one grid point (`windows`: unit ids, each with a RateSearch in `searches`)
    and the confirmation of their lowest capacity. `holdout(binding_unit, tried_units)` makes a
    held-out unit near the binding window (with its RateSearch), or returns None when none fits."""

    settings: CapacitySettings
    windows: list[int]
    searches: dict[int, RateSearch]
    holdout: Callable[[int, list[int]], int | None]
    tried: list[int] = field(default_factory=list)  # hold-out units used, in order
    checks: list[Check] = field(default_factory=list)  # of the current answer
    answer: float | None = None
    binding: int | None = None
    status: str | None = None  # None while running; confirmed | unconfirmed | no capacity | stopped
    narrowed_from: int | None = None  # the point's probe count when a confirmation first failed
    ended: str | None = None  # why an unconfirmed point stopped: holdouts | narrow_probes | no holdout
    failed: Check | None = None  # the last confirmation probe that failed (what the point ends on)

    # --- the answer -----------------------------------------------------------------------------------
    def capacities(self) -> dict[int, float | None]:
        return {w: self.searches[w].outcome().capacity for w in self.windows}

    def lowest(self) -> tuple[float | None, int | None]:
        """(the lowest window capacity, its window); (None, the first window without one)."""
        caps = self.capacities()
        missing = [w for w, c in caps.items() if c is None]
        if missing:
            return None, missing[0]
        binding = min(self.windows, key=lambda w: (caps[w], self.windows.index(w)))
        return caps[binding], binding

    # --- what to run next -------------------------------------------------------------------------------
    def checks_for(self, answer: float, binding: int) -> list[Check]:
        """The confirmation probes of `answer` not yet answered by a probe that ran."""
        s = self.settings
        out = [Check(w, answer, "verify") for w in self.windows if w != binding and not self._ran(w, answer)]
        if answer < s.max_rate:
            out.append(Check(binding, round_rate(min(answer * (1 + s.precision), s.max_rate)), "upper"))
        unit = self._holdout(binding)
        if unit is not None:
            out.append(Check(unit, answer, "holdout"))
        return out

    def _ran(self, unit: int, rate: float) -> bool:
        return any(p.rate == rate and p.passed for p in self.searches[unit].probes)

    def _holdout(self, binding: int) -> int | None:
        current = self.tried[-1] if self.tried and self.tried[-1] not in self.windows else None
        if current is None:
            current = self.holdout(binding, list(self.tried))
            if current is not None:
                self.tried.append(current)
        return current

    # --- narrowing within its bounds ----------------------------------------------------------------
    def units(self) -> list[int]:
        """The windows and every hold-out tried (those that failed are windows too)."""
        return self.windows + [u for u in self.tried if u not in self.windows]

    def probes_run(self) -> int:
        return sum(len(self.searches[u].probes) for u in self.units())

    def extra_probes(self) -> int:
        """Probes run since a confirmation first failed (0 before)."""
        return 0 if self.narrowed_from is None else self.probes_run() - self.narrowed_from

    def affords(self, probes: int, confirm_after: bool = True) -> bool:
        """Whether `probes` more (those in flight included) stay within `capacity.narrow_probes`,
        with room left for the confirmation that follows (`confirm_after`: the other windows, the
        upper probe and a hold-out); always before a confirmation failed."""
        if self.narrowed_from is None:
            return True
        reserve = len(self.windows) + 1 if confirm_after else 0
        return self.extra_probes() + probes + reserve <= self.settings.narrow_probes

    def give_up(self, ended: str) -> None:
        """End the point `unconfirmed`: a bound reached (`holdouts`, `narrow_probes`) or no
        held-out stretch left (`no holdout`)."""
        self.status, self.ended = "unconfirmed", ended

    def confirm(self) -> list[Check]:
        """Called when no window search has a probe left: the answer and its checks (empty when
        the point ends here: no capacity, or no hold-out left)."""
        answer, binding = self.lowest()
        self.answer, self.binding = answer, binding
        if answer is None:
            self.status = "no capacity"
            return []
        if not self.affords(len(self.windows) + 1, confirm_after=False):
            self.give_up("narrow_probes")
            return []
        self.checks = self.checks_for(answer, binding)
        if not any(c.kind == "holdout" for c in self.checks):
            self.give_up("no holdout")
            return []
        return list(self.checks)

    def record(self, check: Check, passed: bool, value: float) -> None:
        check.passed, check.value = passed, value

    def settle(self) -> bool:
        """After every check answered: True when the point is done; else the searches go on
        (a window failed at the answer, or the hold-out did and became a window)."""
        failed_windows = [c for c in self.checks if c.kind == "verify" and not c.passed]
        hold = next(c for c in self.checks if c.kind == "holdout")
        if not failed_windows and hold.passed:
            self.status = "confirmed"
            return True
        self.failed = hold if not hold.passed else failed_windows[0]
        if self.narrowed_from is None:
            self.narrowed_from = self.probes_run()
        if not hold.passed:
            self.windows.append(hold.unit)  # its search continues below the answer
            search = self.searches[hold.unit]
            # narrowing: the capacity is near the answer, so step down by the precision x 4, not x growth
            search.s = replace(search.s, growth=min(search.s.growth, (1 + self.settings.precision) ** 4))
            if len([u for u in self.tried if u in self.windows]) >= self.settings.holdouts:
                self.give_up("holdouts")
                return True
        return False

    def holdout_check(self) -> Check | None:
        return next((c for c in self.checks if c.kind == "holdout"), None)

    def upper_check(self) -> Check | None:
        return next((c for c in self.checks if c.kind == "upper"), None)
