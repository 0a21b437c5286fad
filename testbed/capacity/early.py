"""Ending a capacity probe once its verdict is certain: the attainment can no longer reach the target.

A probe fails the attainment criterion when fewer than target x N of its N judged requests meet
the SLO. A request's miss is certain before the probe ends: it finished or failed outside the SLO,
or it is still waiting for its first token more than `slo.ttft_s` after it arrived, or it decodes
so slowly that, even finishing now, its TPOT would exceed `slo.tpot_s`. Once the certain misses
exceed (1 - target) x N, no remaining request can lift the attainment back to the target and the
probe fails whatever the rest does (a failed attainment fails the probe whatever the queue does).
So the search's verdicts, and with them its probes and its answer, are those of the full run
(tests/test_capacity_early.py runs a search both ways). What changes is the failed probe's
reported value: the attainment with its undecided requests counted as misses (a lower bound),
and `stopped_at` (requests done when it stopped) in probes.csv.

"Now" is the last completion's time, a lower bound of the simulator's clock (reading the
executor's clock can move a replay's), so a miss counted here is a miss in the full run. Only
search probes stop early: a confirmation probe (the other windows, the upper and the held-out
probe) runs to its end, so the table's printed values are full runs. The check runs every
`EVERY` completions (a scan of the probe's 4,000 sequences: ~1 ms).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.base.errors import RunFailedError

EVERY = 50  # completions between two checks
MARK = "capacity probe stopped early"


class ProbeDecided(RunFailedError):
    """Raised from the controller's progress callback: the probe's verdict is a failure already."""


@dataclass(frozen=True)
class EarlyStop:
    """What decides a probe early (picklable: it travels with the sweep job to its worker)."""

    ttft_s: float
    tpot_s: float
    target: float  # attainment target, a fraction
    warmup_s: float = 0.0  # requests arriving earlier are not judged

    def progress(self, ctrl: Any) -> Callable[[int, int], None]:
        """The controller's `progress(done, total)` callback for this probe."""
        judged = [s for s in ctrl.sequences.values() if s.request.arrival_s >= self.warmup_s]
        allowed = len(judged) - self.target * len(judged)  # misses above this: attainment < target
        last = [0]

        def check(done: int, total: int) -> None:  # called after every micro-batch
            if done - last[0] < EVERY or done >= total:
                return
            last[0] = done
            now = ctrl.last_complete_s
            if now is not None and self.misses(judged, now) > allowed:
                raise ProbeDecided(f"{MARK} at {done} of {total} requests: the SLO attainment cannot reach "
                                   f"{self.target:g}")
        return check

    def misses(self, seqs: list, now: float) -> int:
        """Judged requests whose SLO miss is certain at time `now`."""
        n = 0
        for s in seqs:
            r = s.request
            first = s.first_token_s
            if s.status.value == "failed":
                n += 1
            elif first is None:
                n += now - r.arrival_s > self.ttft_s
            elif first - r.arrival_s > self.ttft_s:
                n += 1
            elif r.output_len > 1:
                end = s.finish_s if s.finish_s is not None else now
                n += (end - first) / (r.output_len - 1) > self.tpot_s
        return n

    @staticmethod
    def settle(result: Any) -> Any:
        """A probe stopped by this check is a finished run that failed its criterion, not a failed
        run: its error becomes `info["stopped_at"]` (requests done when it stopped)."""
        if not (result.error or "").startswith(MARK):
            return result
        done = int(result.error.split(" at ", 1)[1].split(" ", 1)[0])
        return dataclasses.replace(result, error=None, info={**result.info, "stopped_at": done})
