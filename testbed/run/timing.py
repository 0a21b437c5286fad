"""One time per run, named by what it measures (issue 49 item 6).

A torch run once printed three: `wall time (s) 243.25` (building + workers + serving),
`torch run 163.47 s` and `end to end 257.02 s`, while the process took 283 s. Now:
- `simulation_s` (executor=sim) or `engine_s` (any real engine): serving the requests, from the
  first arrival's start to the last completion, workers and policy preparation excluded. The one
  to quote for the run's speed;
- `end_to_end_s`: the command, from its process's start (interpreter and imports included) to the
  moment its results were saved and handed to MLflow; `start-up`, `building`, `workers` and
  `saving` are its parts beside the serving time.
The same names in `run_info.json` (with `time_parts_s`; summary.json stays deterministic, so no times
there), in MLflow (`time.simulation_s` or `time.engine_s`, `time.end_to_end_s`) and on the console.
"""
from __future__ import annotations

import os
import time
from typing import Mapping


def serving_name(executor: str) -> str:
    """`simulation` for the simulator, `engine` for a real engine."""
    return "simulation" if executor == "sim" else "engine"


def serving_s(info: Mapping) -> float:
    """The run's serving time (see the module docstring), 0 when it has none."""
    return float(info.get(f"{serving_name(info.get('executor', 'sim'))}_s", 0.0))


def process_age_s(fallback_start: float) -> float:
    """Seconds since this process started (Linux: /proc), else since `fallback_start` (perf_counter)."""
    try:
        with open("/proc/self/stat") as fh:
            started_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - fallback_start


def breakdown(info: Mapping, end_to_end: float, saving: float) -> dict[str, float]:
    """The command's time in parts that add up to `end_to_end`: start-up (interpreter, imports,
    config), building (workload, policy, executor), workers (start-up of the engine's workers and
    the policy's preparation), serving, saving (files, figures, MLflow hand-off)."""
    build, workers, serve = (float(info.get(k, 0.0)) for k in ("build_s", "start_s", f"{serving_name(info.get('executor', 'sim'))}_s"))
    startup = max(0.0, end_to_end - build - workers - serve - saving)
    return {"start-up": startup, "building": build, "workers": workers, serving_name(info.get("executor", "sim")): serve,
            "saving": saving}


__all__ = ["breakdown", "process_age_s", "serving_name", "serving_s"]
