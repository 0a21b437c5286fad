"""Where a capacity search's windows lie: stretches of a trace, or seeds of a generated workload.

A trace window is `capacity.window_requests` (4,000) contiguous requests of the trace, replayed
with their own arrival gaps rescaled to the probed rate: exactly a plain `testbed run
workload.start_s=<s> workload.num_requests=4000 workload.rate=<r>`, so any probe can be rerun as
one. Before, a probe replayed a window's first 500 requests in cycles: 90-130 s of trace time
whose prompts were 20% shorter than the stretches around them (935 against 1,177-1,183 tokens) and
which held none of the trace's minute-scale drift (500-request blocks run at 0.76-1.23x their
stretch's mean rate), so its answer did not hold on the trace (gLLM: 1.06 req/s, where 4,000-request
runs got 0.39-0.60 attainment). 4,000 requests are 590-815 s of the Azure conversation trace:
several of its 5-minute swings in rate and prompt length.

By default (`capacity.windows` unset) the windows tile the trace from `workload.start_s` to its
end: starts at 0, L, 2L, ... requests, the last one ending at the trace's last request (the
conversation trace's 19,366 requests: five windows). `capacity.windows=k` spreads k windows evenly
over it; `capacity.windows=1` is the one stretch the workload names (`workload.start_s`, and
`workload.num_requests` when given). A held-out stretch for the confirmation starts half a window
from the binding one (a quarter, three quarters when those are taken): a stretch no probe replayed.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.base.errors import ConfigError

DEFAULT_SEEDS = 3  # a generated workload's windows (seeds) when capacity.windows is unset
HOLDOUT_SHIFTS = (0.5, -0.5, 0.25, -0.25, 0.75, -0.75)  # a held-out stretch's start, in windows from the binding one


def cover_starts(rows: int, length: int, count: int | None) -> list[int]:
    """First-request indices of the windows: tiling `rows` requests (count None) or `count` of
    them spread evenly, each `length` long (fewer rows than that: one window of all of them)."""
    if rows <= length:
        return [0]
    last = rows - length
    if count is None:
        starts = list(range(0, last + 1, length))
        return starts + ([last] if starts[-1] != last else [])
    if count == 1:
        return [0]
    return sorted({round(i * last / (count - 1)) for i in range(count)})


def holdout_start(binding: int, length: int, rows: int, used: Sequence[int]) -> int | None:
    """A stretch no window or earlier hold-out started at, near the binding window; None if none fits."""
    for shift in HOLDOUT_SHIFTS:
        start = binding + round(shift * length)
        if 0 <= start <= rows - length and all(abs(start - u) >= length // 8 for u in used):
            return start
    return None


def start_offsets(arrivals: Sequence[float], first: int, indices: Sequence[int]) -> list[float]:
    """`workload.start_s` of each window: halfway between its first request's arrival and the one
    before (`arrivals`: the whole trace's, in seconds from its first row; `first`: the index of the
    workload's own first request)."""
    out = []
    for i in indices:
        g = first + i
        out.append(0.0 if g == 0 else round((arrivals[g - 1] + arrivals[g]) / 2, 6))
    return out


def trace_layout(run, length: int | None) -> tuple[list[float], int] | None:
    """(the whole trace's arrival offsets, the index of the workload's first request), or None
    for a workload without `start_s` (generated: its windows are seeds)."""
    if not hasattr(run.workload, "start_s"):
        return None
    from workloads.base import build_workload

    whole = run.with_values({"workload.num_requests": None, "workload.rate": None, "workload.start_s": 0})
    try:
        arrivals = [r.arrival_s for r in build_workload(whole.workload, whole.data_dir)]
        own = len(build_workload(run.with_values({"workload.num_requests": None}).workload, run.data_dir))
    except ConfigError as exc:
        raise ConfigError(f"trace window at {run.workload.start_s:g} s: {exc}") from None
    return arrivals, len(arrivals) - own
