"""Does a capacity hold on the workload it names? Plain long runs at the reported capacity.

    python scripts/capacity_long_check.py runs/capacity/<experiment> [--winner] [--starts 0,600,1800]

For every point of a finished search (or the ranking's winner), plain `testbed run`s of
`--requests` (4,000) requests of the trace from each of `--starts` (trace seconds 0, 600 and 1,800)
at the capacity must each reach `--floor` (0.78) attainment, and runs at `--over` (1.15) x the
capacity from the first start and from the binding window's start must not reach the target (0.8). This is the check that the
capacities of the cycled probes failed (gLLM 1.06 req/s: 0.39 / 0.43 / 0.60 attainment). A
generated workload's runs move the seed instead of the start.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.base.errors import ConfigError

SET_HERE = ("workload.start_s", "workload.num_requests", "workload.rate", "workload.seed")


@dataclass(frozen=True)
class LongRun:
    label: str
    start: float
    rate: float
    over: bool  # the run above the capacity (must miss the target)
    attainment: float
    holds: bool


def points(folder: Path, winner: bool = False) -> list[dict]:
    """The searched points with a capacity (the ranking's first one with `winner`)."""
    path = folder / "capacity.json"
    if not path.is_file():
        raise ConfigError(f"{folder} holds no capacity.json: give the folder a `testbed capacity` printed last")
    data = json.loads(path.read_text())
    found = [pt for pt in data.get("answers", []) if pt.get("capacity_req_s") is not None]
    if winner:
        ranking = folder / "ranking.csv"
        if not ranking.is_file():
            raise ConfigError(f"{folder} has no ranking.csv (no deployment axis): drop --winner")
        import pandas as pd

        first = int(pd.read_csv(ranking)["point"].iloc[0])
        found = [pt for pt in found if pt["point"] == first]
    return found


def _attainment(overrides: list[str]) -> float:
    from testbed.config.spec import compose_spec
    from testbed.run.runner import run_experiment

    return float(run_experiment(compose_spec(overrides)).summary["slo_attainment"])


def run_point(point: dict, starts: Sequence[float], requests: int, over: float, floor: float,
              workers: int = 1) -> list[LongRun]:
    """The point's long runs, `workers` at a time (spawned processes)."""
    quiet = ["output.mlflow=false", "output.progress=false", "output.trace=off", "output.plots=false"]
    mine = {ov.partition("=")[0] for ov in quiet}
    base = [ov for ov in point["overrides"] if ov.partition("=")[0] not in (*SET_HERE, *mine)] + quiet
    cap, target = point["capacity_req_s"], point["target"]
    trace = point.get("trace", True)
    out = []
    above = sorted({starts[0], *([point["binding_start_s"]] if point.get("binding_start_s") is not None else [])})
    plan = [(s, cap, False) for s in starts] + [(s, round(cap * over, 4), True) for s in above]
    specs = [[*base, f"workload.start_s={start!r}" if trace else f"workload.seed={int(start)}",
              f"workload.num_requests={requests}", f"workload.rate={rate:g}"] for start, rate, _ in plan]
    if workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(min(workers, len(specs))) as pool:
            values = pool.map(_attainment, specs)
    else:
        values = [_attainment(ovs) for ovs in specs]
    for (start, rate, above), att in zip(plan, values):
        out.append(LongRun(point["label"], start, rate, above, att, att < target if above else att >= floor))
    return out


def report(runs: Sequence[LongRun], floor: float, target: float) -> str:
    lines = [f"{'point':<24} {'start':>7} {'rate':>8} {'attainment':>10}  verdict"]
    for r in runs:
        need = f"< {target:g}" if r.over else f">= {floor:g}"
        lines.append(f"{r.label:<24} {r.start:>7g} {r.rate:>8g} {r.attainment:>10.3f}  "
                     f"{'holds' if r.holds else 'FAILS'} ({'above capacity, ' if r.over else ''}needs {need})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--winner", action="store_true", help="only the deployment ranking's first point")
    ap.add_argument("--starts", default="0,600,1800", help="trace seconds (or seeds) the runs start at")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--over", type=float, default=1.15)
    ap.add_argument("--floor", type=float, default=0.78)
    ap.add_argument("--workers", type=int, default=1, help="runs at a time (spawned processes)")
    a = ap.parse_args(argv)
    try:
        starts = [float(x) for x in a.starts.split(",")]
        found = points(a.folder, a.winner)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    runs: list[Any] = []
    for point in found:
        runs += run_point(point, starts, a.requests, a.over, a.floor, a.workers)
    target = found[0]["target"] if found else 0.8
    print(report(runs, a.floor, target))
    return 0 if runs and all(r.holds for r in runs) else 1
