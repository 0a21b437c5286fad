"""How long a simulated capacity search will take, said before its first probe.

The probes are simulations whose cost is close to linear in their requests, so the estimate is
planned probes x requests per probe x the seconds one request costs here and now, spread over
the workers (the windows of a point search side by side), plus a fixed cost per probe (its
MLflow run and folder). The seconds per request are measured, not assumed: a short simulation
of the first window's first `SAMPLE_REQUESTS` requests at the start rate, in this process, less one
of a tenth of them (what a run costs whatever its length: building it, the first imports), so
the machine's present load is in the figure. Before, only a live search printed an estimate.
"""
from __future__ import annotations

import time
from typing import Any

SAMPLE_REQUESTS = 300  # requests of the timing sample (~0.4 s on an idle core for the main setting)
PROBE_OVERHEAD_S = 0.4  # wall seconds per probe outside its simulation (run folder, MLflow run, queue)
WORKER_START_S = 3.0  # a spawned worker's imports


def seconds_per_request(p: Any) -> float:
    """Seconds of simulation per request of the first unpruned window, timed here."""
    from testbed.run.runner import run_experiment
    from testbed.capacity.command import probe_requests, start_rate

    pt = next((pt for pt in p.points if not pt.pruned), None)
    if pt is None:
        return 0.0
    rate = start_rate(pt.run, p.settings)
    n = min(SAMPLE_REQUESTS, probe_requests(p, pt, rate))
    took = []
    for k in (max(2, n // 10), n):
        spec = pt.run.with_values({"workload.rate": rate, "workload.num_requests": k, "output.mlflow": False,
                                   "output.progress": False, "output.trace": "off"})
        t0 = time.perf_counter()
        run_experiment(spec)
        took.append(time.perf_counter() - t0)
    return max(took[1] - took[0], 0.0) / (n - max(2, n // 10)) if n > max(2, n // 10) else took[1] / n


def simulated_s(p: Any, planned: int) -> float:
    """Wall seconds for `planned` probes of the plan's points."""
    from testbed.capacity.command import probe_requests, start_rate

    live = [pt for pt in p.points if not pt.pruned]
    if not live or not planned:
        return 0.0
    per_request = seconds_per_request(p)
    mean_requests = sum(probe_requests(p, pt, start_rate(pt.run, p.settings)) for pt in live) / len(live)
    workers = max(1, min(p.settings.resolved_workers, len(live)))
    return (planned * (mean_requests * per_request + PROBE_OVERHEAD_S)) / workers + (WORKER_START_S if workers > 1 else 0)


def text(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.0f} s"
