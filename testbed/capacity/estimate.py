"""How long a simulated capacity search will take, said before its first probe.

The probes are simulations whose cost is close to linear in their requests, so the estimate is
planned probes x requests per probe x the CPU seconds one request costs, plus a fixed cost per
probe (its MLflow run and folder) and per worker (its imports). The CPU per request is measured,
not assumed: a short simulation of the first window's first `SAMPLE_REQUESTS` requests at the start
rate, in this process, less one of a tenth of them (what a run costs whatever its length). CPU
seconds carry over between machines and loads; the wall time is that over the workers at the
speed the sample ran (on the shared 2-core machine at load ~24 a process got 5-20% of a core, so
the wall estimate is only as good as the load stays). Before, only a live search printed one.
"""
from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

SAMPLE_REQUESTS = 300  # requests of the timing sample (~0.4 s of CPU for the main setting)
PROBE_OVERHEAD_CPU_S = 0.5  # CPU seconds per probe outside its simulation (run folder, MLflow run, queue)
WORKER_START_CPU_S = 4.0  # a spawned worker's imports


def sample(p: Any, probe_requests: Callable, start_rate: Callable) -> tuple[float, float]:
    """(CPU, wall) seconds of simulation per request of the first unpruned window, timed here.
    `probe_requests` and `start_rate` are the command's own (passed in: this module sits below it)."""
    from testbed.run.runner import run_experiment

    pt = next((pt for pt in p.points if not pt.pruned), None)
    if pt is None:
        return 0.0, 0.0
    rate = start_rate(pt.run, p.settings)
    n = min(SAMPLE_REQUESTS, probe_requests(p, pt, rate))
    small = max(2, n // 10)
    took = []
    for k in (small, n):
        spec = pt.run.with_values({"workload.rate": rate, "workload.num_requests": k, "output.mlflow": False,
                                   "output.progress": False, "output.trace": "off"})
        c0, t0 = time.process_time(), time.perf_counter()
        run_experiment(spec)
        took.append((time.process_time() - c0, time.perf_counter() - t0))
    if n <= small:
        return took[1][0] / n, took[1][1] / n
    return (max(took[1][0] - took[0][0], 0.0) / (n - small), max(took[1][1] - took[0][1], 0.0) / (n - small))


def simulated(p: Any, planned: int, probe_requests: Callable, start_rate: Callable) -> tuple[float, float]:
    """(CPU seconds, wall seconds) for `planned` probes of the plan's points."""
    live = [pt for pt in p.points if not pt.pruned]
    if not live or not planned:
        return 0.0, 0.0
    cpu_req, wall_req = sample(p, probe_requests, start_rate)
    mean_requests = sum(probe_requests(p, pt, start_rate(pt.run, p.settings)) for pt in live) / len(live)
    workers = max(1, min(p.settings.resolved_workers, len(live)))
    cpu = planned * (mean_requests * cpu_req + PROBE_OVERHEAD_CPU_S) + (WORKER_START_CPU_S * workers if workers > 1 else 0)
    slowdown = wall_req / cpu_req if cpu_req > 0 else 1.0
    INPUTS.update(planned=planned, cpu_per_request_s=cpu_req, wall_per_request_s=wall_req, requests=mean_requests)
    return cpu, cpu * max(slowdown, 1.0) / workers


INPUTS: dict = {}  # the last estimate's inputs (capacity.json: how the printed estimate came about)


def cpu_used() -> float:
    """CPU seconds of this process and its finished children (the workers) so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def text(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.0f} s"
