"""`testbed compare`: run a grid of experiments and compare them in one table and a few figures.

    testbed compare policy=sarathi,vllm workload=azure workload.rate=2,4,8
    testbed compare policy=sarathi,vllm parallel.pp=2,4 compare.workers=2 compare.experiment=pp-sweep

Any override whose value is a comma list (Hydra's sweep syntax, also `range(2,10,2)` and
`choice(a,b)`) is an axis; the grid is their product, in the order given. Every grid point is
composed and validated before anything runs, so a typo fails at once (exit 2). A point that
cannot be built (e.g. the model does not fit at that depth) or whose run fails becomes a row with
status `failed` and its reason; the rest of the grid still runs.

Every point is one MLflow run in experiment `compare.experiment` (default `compare-<UTC time>`),
nested under one parent run (tag `testbed.kind=compare`) that also gets the table and figures;
each run carries its axis values as tags `axis.<key>` and the axis list as `testbed.axes`, which is
how `testbed report` rebuilds the same table later, from any machine sharing the store.

Output: `<output.dir>/compare/<experiment>/` with `table.csv`, `table.md`, figures
(`<metric>_vs_<x>.png`, `overview.png`: x = the numeric axis, one line per value of the other
axes) and `runs/<point>/` (each point's run directory). The table is printed; the last line is
the directory. `compare.workers=N` runs N points at once in separate processes (spawn).
"""
from __future__ import annotations

import itertools
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from engine.errors import ConfigError, TestbedError
from testbed.overrides import as_int, check_keys, get_path, split_list, split_prefixed
from testbed.report import FIGURE_METRICS, print_table, sort_rows, write_comparison

COMPARE_KEYS = ("workers", "experiment", "x", "metrics")


@dataclass(frozen=True)
class CompareSettings:
    workers: int = 1
    experiment: str | None = None
    x: str | None = None  # x axis of the figures (default: the numeric axis, workload.rate first)
    metrics: tuple[str, ...] | None = None  # figure metrics (default FIGURE_METRICS)


def parse_settings(raw: Mapping[str, str]) -> CompareSettings:
    check_keys(raw, COMPARE_KEYS, "compare")
    kw: dict[str, Any] = {}
    if "workers" in raw:
        kw["workers"] = as_int("compare.workers", raw["workers"], 1)
    if "experiment" in raw:
        name = raw["experiment"].strip()
        if not name or "/" in name or name.startswith("."):
            raise ConfigError(f"invalid compare.experiment={raw['experiment']!r}: a name without '/'")
        kw["experiment"] = name
    if "x" in raw:
        kw["x"] = raw["x"].strip()
    if "metrics" in raw:
        from testbed.tune import SCALAR_KEYS, resolve_metric

        kw["metrics"] = tuple(resolve_metric(m, "metric") for m in split_list(raw["metrics"]))
        assert all(m in SCALAR_KEYS for m in kw["metrics"])
    return CompareSettings(**kw)


@dataclass(frozen=True)
class Point:
    index: int
    overrides: tuple[str, ...]  # the full override list of this point
    axes: tuple[tuple[str, str], ...]  # (key, value as given)

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.axes) or "base"

    @property
    def dirname(self) -> str:
        return f"{self.index:03d}_" + re.sub(r"[^A-Za-z0-9_.=+-]+", "_", self.label)[:120]


def grid(overrides: Sequence[str]) -> tuple[list[str], list[Point]]:
    """Split sweep overrides (axes) from fixed ones and expand the grid. Returns (axis keys, points)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not key=value (e.g. policy=sarathi,vllm, workload.rate=2,4)")
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise ConfigError(f"cannot parse overrides: {str(exc).splitlines()[0]}") from None
    fixed: list[str] = []
    axes: list[tuple[str, list[str]]] = []
    for ov, text in zip(parsed, overrides):
        key = text.partition("=")[0]
        if ov.is_sweep_override():
            values = list(ov.sweep_string_iterator())
            if any(k == key for k, _ in axes):
                raise ConfigError(f"axis {key} is given twice")
            if len(set(values)) != len(values):
                raise ConfigError(f"axis {key} lists a value twice: {text}")
            axes.append((key, values))
        else:
            fixed.append(text)
    points = []
    for i, combo in enumerate(itertools.product(*[v for _, v in axes])):
        pairs = tuple((k.lstrip("+~"), v) for (k, _), v in zip(axes, combo))
        point_ovs = fixed + [f"{k}={v}" for (k, _), v in zip(axes, combo)]
        points.append(Point(i, tuple(point_ovs), pairs))
    return [k.lstrip("+~") for k, _ in axes], points


def _axis_value(cfg: Mapping[str, Any], key: str, given: str) -> Any:
    """The typed value of an axis at a point: the config's value, or the choice for a group."""
    try:
        value = get_path(cfg, key)
    except (KeyError, TypeError):
        return given
    if isinstance(value, Mapping):
        return given
    return list(value) if isinstance(value, tuple) else value


# --- one grid point (in this process or a spawned worker) ------------------------------------------

_TRACKERS: dict[tuple[str, str], Any] = {}


def run_point(job: dict) -> dict:
    """Run one grid point as `testbed run` would, logged under the comparison's parent run.
    Never raises for a user-level failure: that becomes the row's error."""
    from testbed.outputs import write_run_dir
    from testbed.runner import prepare_experiment

    cfg = job["cfg"]
    t0 = time.perf_counter()
    row: dict[str, Any] = {"point": job["index"], **job["axis_values"], "status": "failed", "error": None,
                           "run_id": None, "run_dir": None}
    tracker = None
    out = cfg.get("output") or {}
    if out.get("mlflow", True):
        from testbed.tracking import Tracker, tracking_uri

        key = (tracking_uri(cfg), job["experiment"])
        if key not in _TRACKERS:
            _TRACKERS[key] = Tracker(cfg, job["experiment"])
        tracker = _TRACKERS[key]
        tags = {"testbed.kind": "point", "testbed.compare": job["experiment"], "testbed.axes": json.dumps(job["axes"]),
                "compare.point": str(job["index"]),
                **{f"axis.{k}": str(v) for k, v in job["axis_values"].items()}}
        row["run_id"] = tracker.start(cfg, job["label"], parent_run_id=job["parent_run_id"], tags=tags)
    try:
        prepared = prepare_experiment(cfg)
        result = prepared.run()
    except TestbedError as exc:
        row["error"] = str(exc)
    except Exception as exc:  # a policy bug at this point: one failed row, not a dead grid
        row["error"] = f"{type(exc).__name__}: {exc}"
    else:
        run_dir = Path(job["run_dir"])
        write_run_dir(result, run_dir, plots=bool(out.get("plots", True)))
        row["run_dir"] = str(run_dir)
        if tracker is not None:
            tracker.finish(row["run_id"], result, run_dir)
        row["error"] = result.error
        row["status"] = "failed" if result.error else "finished"
        for k, v in result.summary.items():
            if isinstance(v, list):
                row.update({f"{k}.stage{i}": float(x) for i, x in enumerate(v)})
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                row[k] = float(v)
    if row["error"] and tracker is not None and row["status"] == "failed" and row["run_dir"] is None:
        tracker.fail(row["run_id"], row["error"])
    row["wall_s"] = time.perf_counter() - t0
    return row


# --- the command -------------------------------------------------------------------------------------

def run_compare(overrides: Sequence[str], console: Any = None) -> tuple[Path, Any]:
    """Validate the whole grid, run it, write and log the comparison. Returns (dir, table)."""
    import pandas as pd

    from testbed.config import compose, to_container

    raw, rest = split_prefixed(overrides, "compare")
    settings = parse_settings(raw)
    axes, points = grid(rest)
    cfgs = [to_container(compose(list(p.overrides))) for p in points]  # every typo surfaces here
    if settings.x is not None and settings.x not in axes:
        raise ConfigError(f"compare.x={settings.x!r} is not an axis; axes: {', '.join(axes) or '(none)'}")
    name = settings.experiment or f"compare-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
    out = cfgs[0].get("output") or {}
    out_dir = Path(out.get("dir") or "runs") / "compare" / name
    if (out_dir / "table.csv").exists():
        raise ConfigError(f"comparison {name!r} already exists at {out_dir}; choose another compare.experiment=")
    tracker = parent = None
    if out.get("mlflow", True):
        from testbed.tracking import Tracker

        tracker = Tracker(cfgs[0], name)  # creates the database and the experiment before any worker
        parent = tracker.client.create_run(tracker.experiment_id, run_name=name, tags={
            "testbed.kind": "compare", "testbed.axes": json.dumps(axes),
            "compare.overrides": " ".join(rest)[:5000], "compare.points": str(len(points))}).info.run_id
    jobs = []
    for p, cfg in zip(points, cfgs):
        axis_values = {k: _axis_value(cfg, k, v) for k, v in p.axes}
        jobs.append({"index": p.index, "cfg": cfg, "label": p.label, "axes": axes, "axis_values": axis_values,
                     "experiment": name, "parent_run_id": parent, "run_dir": str(out_dir / "runs" / p.dirname)})
    if console is not None:
        sizes = {k: len({v for p in points for kk, v in p.axes if kk == k}) for k in axes}
        over = ", ".join(f"{k} ({n})" for k, n in sizes.items()) or "no axis"
        console.print(f"comparison [bold]{name}[/bold]: {len(points)} run(s) over {over}, "
                      f"{settings.workers} worker(s)", highlight=False)
    t0 = time.perf_counter()
    try:
        rows = _run_jobs(jobs, settings.workers, console, bool(out.get("progress", True)))
    except BaseException:
        if tracker is not None:
            tracker.client.set_terminated(parent, "KILLED")
        raise
    wall = time.perf_counter() - t0
    df = sort_rows(pd.DataFrame(rows).sort_values("point"), ["point"])
    res = write_comparison(df, axes, out_dir, x=settings.x, figure_metrics=settings.metrics or FIGURE_METRICS,
                           plots=True)
    (out_dir / "compare.json").write_text(json.dumps({
        "experiment": name, "axes": axes, "overrides": list(rest), "points": len(points), "workers": settings.workers,
        "wall_s": wall, "failed": int((df["status"] != "finished").sum())}, indent=2) + "\n")
    if tracker is not None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        tracker.client.log_batch(parent, metrics=[Metric("compare.runs", float(len(df)), now, 0),
                                                  Metric("compare.failed", float((df["status"] != "finished").sum()),
                                                         now, 0),
                                                  Metric("compare.wall_s", wall, now, 0)])
        for path in sorted(out_dir.iterdir()):
            if path.is_file():
                tracker.client.log_artifact(parent, str(path))
        tracker.client.set_terminated(parent, "FINISHED")
    if console is not None:
        print_table(console, df, axes, f"{name} ({len(df)} runs, {wall:.1f} s)")
    return out_dir, df


def _run_jobs(jobs: list[dict], workers: int, console: Any, progress_on: bool) -> list[dict]:
    from contextlib import nullcontext

    progress = task = None
    if console is not None and progress_on:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("runs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console, transient=True)
        task = progress.add_task("grid", total=len(jobs))

    def done(row: dict) -> None:
        if progress is not None:
            state = "[green]done[/green]" if row["status"] == "finished" else "[red]failed[/red]"
            tput = row.get("throughput_tok_s")
            extra = f" throughput {tput:.4g} tok/s" if isinstance(tput, float) and not math.isnan(tput) else ""
            progress.console.print(f"point {row['point']:>3} {state} {jobs[row['point']]['label']}{extra}",
                                   highlight=False)
            progress.advance(task)

    rows: list[dict] = []
    with progress if progress is not None else nullcontext():
        if workers <= 1 or len(jobs) <= 1:
            for job in jobs:
                rows.append(run_point(job))
                done(rows[-1])
        else:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor, as_completed

            with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
                futures = {pool.submit(run_point, job): job for job in jobs}
                for fut in as_completed(futures):
                    job = futures[fut]
                    try:
                        row = fut.result()
                    except Exception as exc:  # the worker process itself died
                        row = {"point": job["index"], **job["axis_values"], "status": "failed",
                               "error": f"worker died: {type(exc).__name__}: {exc}", "run_id": None}
                    rows.append(row)
                    done(row)
    return rows
