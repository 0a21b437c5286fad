"""How long a simulated capacity search will take, said before its first probe.

The CPU comes from testbed/capacity/forecast.py (the search's own plan, each probe priced at its
rate from two timed pilot runs per window). CPU seconds carry over between machines and loads;
the wall time is the plan's makespan at the speed the pilots ran (on the shared 2-core machine at
load ~24 a process got 5-20% of a core, so the wall estimate is only as good as the load stays).
"""
from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any


def simulated(p: Any, probe_requests: Callable, start_rate: Callable, feed_type: type) -> tuple[float, float, Any]:
    """(CPU seconds, wall seconds, the Forecast) of the plan's search (testbed/capacity/forecast.py:
    its own plan priced from timed pilot runs of each window). The wall time is the plan's
    makespan on the workers at the speed the pilots ran."""
    from testbed.capacity.forecast import forecast

    t0, c0 = time.perf_counter(), time.process_time()
    fc = forecast(p, probe_requests, start_rate, feed_type)
    took_cpu, took_wall = time.process_time() - c0, time.perf_counter() - t0
    slowdown = took_wall / took_cpu if took_cpu > 0 else 1.0
    pilots = {f"{p.points[u].label} {p.points[u].window_label}": {
        "rates": pl.rates, "cpu_per_request_s": pl.cpu, "values": pl.values,
        "capacity_guess": pl.guess(p.settings.growth)} for u, pl in fc.pilots.items()}
    fc.inputs = dict(planned=fc.probes, pilot_cpu_s=fc.pilot_cpu_s, makespan_cpu_s=fc.makespan_s, pilots=pilots)
    return fc.cpu_s, fc.makespan_s * max(slowdown, 1.0), fc



def cpu_used() -> float:
    """CPU seconds of this process and its finished children (the workers) so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def text(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.0f} s"
