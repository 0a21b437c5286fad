"""A wall-time estimate printed before a long command starts (issue 49 item 2: the README tour
took ~53 min at the machine's load, and nothing said so beforehand).

The simulator's cost is its micro-batches: CPU = a fixed start (~1.6 s: interpreter, imports,
workload file) + ~30 us a micro-batch (gLLM on the main setup, 4 x L20 / Qwen2.5-32B: 60,469
micro-batches in 3.7 s of CPU at 0.8 req/s, 237,077 in 8.9 s at 0.25, 22,892 in 2.3 s at 1.5, 32,028
in 2.1 s for 300 requests at 0.25; 2026-11-27, load 18-28). A run makes ~25 micro-batches a
simulated second of arrivals (24-30 on that setup between 0.25 and 0.8 req/s), and its arrivals
last num_requests / rate seconds. Wall time is that CPU stretched by the machine's load: with
`load` (1-minute average) on `cores` cores, `workers` processes each took LOAD_SHARE x (load +
workers) / cores seconds of wall time a CPU second (fitted on four commands at load 10-36 on the
2-core machine, 2026-11-27: ratios 0.63-0.76 of the plain (load + 1) / cores; README step 2 then
took 5.2 min and 30 s of CPU where the estimate said 6.5 min and 30 s). Another model or GPU changes the micro-batch rate: the
estimate is a prior, and the progress bar's time left (from the points done) takes over.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

START_CPU_S = 1.6  # a process's fixed start
POINT_CPU_S = 0.3  # a point's own fixed cost in a sweep process (config, workload, its folder)
MLFLOW_POINT_CPU_S = 0.4  # logging one point run (params, metrics, artifacts)
MB_CPU_S = 30e-6  # one simulated micro-batch
MB_PER_SIM_S = 25.0  # micro-batches a simulated second of arrivals
LOAD_SHARE = 0.7  # see the module docstring
OFFLINE_SIM_S_PER_REQUEST = 0.5  # arrivals all at once: ~what 2,000 online requests take per request at 1-2 req/s


def simulated_s(spec: Any) -> float:
    """How long the run's arrivals last in simulated seconds (its requests over its rate)."""
    wl = spec.workload
    n = getattr(wl, "num_requests", None) or 2000
    rate = getattr(wl, "rate", None)
    if getattr(wl, "arrival", "poisson") == "offline" or not rate:
        return n * OFFLINE_SIM_S_PER_REQUEST
    return n / float(rate)


def point_cpu_s(spec: Any) -> float:
    mlflow = MLFLOW_POINT_CPU_S if spec.output.mlflow else 0.0
    return POINT_CPU_S + mlflow + MB_CPU_S * MB_PER_SIM_S * simulated_s(spec)


def stretch(workers: int = 1) -> tuple[float, float]:
    """(wall seconds per CPU second for each of `workers` processes, the 1-minute load)."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return max(1.0, LOAD_SHARE * (load + workers) / cores), load


def estimate_s(specs: Sequence[Any], workers: int = 1) -> tuple[float, float]:
    """(wall seconds, load) for simulating every spec in `workers` processes."""
    per_cpu, load = stretch(workers)
    cpu = START_CPU_S + sum(point_cpu_s(s) for s in specs)
    return cpu * per_cpu / max(1, min(workers, len(specs) or 1)), load


def estimate_line(specs: Sequence[Any], workers: int = 1, what: str = "run(s)") -> str:
    """`estimate: ~4.2 min of wall time for 8 run(s) at load 3.1 on 2 cores (~30 s of CPU)`."""
    wall, load = estimate_s(specs, workers)
    cpu = START_CPU_S + sum(point_cpu_s(s) for s in specs)
    return (f"estimate: ~{minutes(wall)} of wall time for {len(specs)} {what} at load {load:.1f} on "
            f"{os.cpu_count()} cores (~{minutes(cpu)} of CPU; the main setup's pace, testbed/sweep/estimate.py)")


def minutes(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


__all__ = ["estimate_line", "estimate_s", "point_cpu_s", "stretch"]
