"""`testbed compare`: run a grid of experiments and compare them in one table and a few figures.

    testbed compare policy=sarathi,vllm workload=azure workload.rate=2,4,8
    testbed compare policy=sarathi,vllm parallel.pp=2,4 compare.workers=2 compare.experiment=pp-sweep
    testbed compare policy=tdpipe parallel.num_microbatches=4,6,8

Any override whose value is a comma list (Hydra's sweep syntax, also `range(2,10,2)` and
`choice(a,b)`) is an axis; the grid is their product, in the order given. Every grid point is
composed and validated before anything runs, so a typo fails at once (exit 2). A point that
cannot be built (e.g. the model does not fit at that depth) or whose run fails becomes a row with
status `failed` and its reason; the rest of the grid still runs.

Every point is one MLflow run in experiment `compare.experiment` (default
`compare-<UTC time>-<6 hex>`, unique across hosts), beside one summary run (tag
`testbed.kind=compare`; the points link to it with the tag `testbed.parent_run`, not by nesting,
so MLflow's run list and charts show every point without a click) that gets the table
(`table.csv`, `table.md`) and the figures as artifacts; each run carries its axis values as tags
`axis.<key>` and the axis list as `testbed.axes`, which is how `testbed report` rebuilds the same
table later, from any machine sharing the store. The points run through `testbed/sweep/jobs.py`.

Output: `<output.dir>/compare/<experiment>/` with `table.csv`, `table.md`, figures
(`<metric>_vs_<x>.png`, `overview.png`: x = the numeric axis, one line per value of the other
axes, titled with the setup and what varies) and `runs/<point>/` (each point's run directory).
The table is printed at full width; the last line is the directory. `compare.workers=N` runs N
points at once in separate processes (spawn). Ctrl-C or SIGTERM stops launching points at once,
writes the table of the points done so far, ends the MLflow runs KILLED and exits 130 / 143.
"""
from __future__ import annotations

import itertools
import json
import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from engine.base.errors import ConfigError
from testbed import signals
from testbed.sweep import jobs as sweep
from testbed.cluster.ray_backend import split_backend
from testbed.cluster.reconnect import ServiceLost
from testbed.sweep.ray_points import ray_pool
from testbed.config.spec import compose_spec
from testbed.config.overrides import MAX_WORKERS, as_int, check_keys, explicit_keys, split_list, split_prefixed
from testbed.config.spec import RunSpec
from testbed.sweep.report import FIGURE_METRICS, print_table, sort_rows, write_comparison
from testbed.config.objectives import SCALAR_KEYS, resolve_metric
from testbed.config.naming import point_name

COMPARE_KEYS = ("workers", "experiment", "x", "metrics")
# grids larger than this need --yes: composing alone takes ~4 ms a point (200,000 points: 12 minutes
# of silence before the first run), and each point is a run and an MLflow run
CONFIRM_POINTS = 1000


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
        kw["workers"] = as_int("compare.workers", raw["workers"], 1, MAX_WORKERS)
    if "experiment" in raw:
        name = raw["experiment"].strip()
        if not name or "/" in name or name.startswith("."):
            raise ConfigError(f"invalid compare.experiment={raw['experiment']!r}: a name without '/'")
        kw["experiment"] = name
    if "x" in raw:
        kw["x"] = raw["x"].strip()
    if "metrics" in raw:
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
        """What the console and MLflow call the point, in the one style: `gllm · rate=0.25`."""
        return point_name(dict(self.axes))

    @property
    def dirname(self) -> str:
        given = ",".join(f"{k}={v}" for k, v in self.axes) or "base"  # the folder keeps the full keys
        return f"{self.index:03d}_" + re.sub(r"[^A-Za-z0-9_.=+-]+", "_", given)[:120]


def grid(overrides: Sequence[str], confirmed: bool = True) -> tuple[list[str], list[Point]]:
    """Split sweep overrides (axes) from fixed ones and expand the grid. Returns (axis keys, points).
    Unless `confirmed`, a grid of more than CONFIRM_POINTS points is refused before it is built."""
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
        if not ov.is_sweep_override():
            fixed.append(text)
            continue
        values = list(ov.sweep_string_iterator())
        if any(k == key for k, _ in axes):
            raise ConfigError(f"axis {key} is given twice")
        if len(set(values)) != len(values):
            raise ConfigError(f"axis {key} lists a value twice: {text}")
        axes.append((key, values))
    size = math.prod(len(v) for _, v in axes)
    if size > CONFIRM_POINTS and not confirmed:
        shape = " x ".join(f"{k} ({len(v):,})" for k, v in axes)
        raise ConfigError(f"the grid has {size:,} points ({shape}), each a run and an MLflow run; "
                          f"add --yes to run them all, or shorten an axis (up to {CONFIRM_POINTS:,} run without --yes)")
    points = []
    for i, combo in enumerate(itertools.product(*[v for _, v in axes])):
        pairs = tuple((k.lstrip("+~"), v) for (k, _), v in zip(axes, combo))
        point_ovs = fixed + [f"{k}={v}" for (k, _), v in zip(axes, combo)]
        points.append(Point(i, tuple(point_ovs), pairs))
    return [k.lstrip("+~") for k, _ in axes], points


def axis_value(spec: RunSpec, key: str, given: str) -> Any:
    """The typed value of an axis at a point: the config's value, or the choice for a group."""
    try:
        value = spec.value_at(key)
    except KeyError:
        return given
    if isinstance(value, Mapping):
        return given
    return list(value) if isinstance(value, tuple) else value


def setup_title(spec: RunSpec, axes: Sequence[str]) -> str:
    """The figure title: what every point shares (model, hardware, P, workload) and what varies."""
    varied = {a.split(".", 1)[0] if a in ("model", "hardware", "workload", "policy") else a for a in axes}
    rc, wl = spec.settings, spec.workload
    parts = []
    if "policy" not in varied:
        parts.append(spec.policy_name)
    for key, what in (("model", rc.model), ("hardware", rc.hardware)):
        if key not in varied:
            parts.append(str(getattr(what, "name", "?")))
    if "parallel.pp" not in varied:
        parts.append(f"P={rc.parallel.pp}")
    if "workload" not in varied:
        rate = getattr(wl, "rate", None)
        rate = "" if "workload.rate" in varied or getattr(wl, "arrival", None) == "offline" or rate is None \
            else f" @ {rate:g} req/s"
        n = "" if "workload.num_requests" in varied else f", {wl.num_requests} requests"
        parts.append(f"{spec.workload_name}{rate}{n}")
    return " · ".join(parts) + (f" — varying {', '.join(axes)}" if axes else "")


# --- the command -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    name: str
    settings: CompareSettings
    axes: list[str]
    points: list[Point]
    specs: list[RunSpec]
    out_dir: Path
    overrides: list[str]
    backend: Any = None  # sweep.backend / ray.* (testbed/cluster/ray_backend.py)


def plan(overrides: Sequence[str], confirmed: bool = True, console: Any = None) -> Plan:
    """Parse the settings and compose every grid point (every typo surfaces here, exit 2)."""
    raw, rest = split_prefixed(overrides, "compare")
    settings = parse_settings(raw)
    backend, rest = split_backend(rest)
    axes, points = grid(rest, confirmed)
    if console is not None and len(points) > CONFIRM_POINTS:
        console.print(f"composing and checking {len(points):,} grid points first ...", highlight=False)
    budget = sweep.point_budget(explicit_keys(rest))  # run folders of ~10 kB: jobs.POINT_BUDGET
    specs = [compose_spec([*p.overrides, *budget]) for p in points]
    if settings.x is not None and settings.x not in axes:
        raise ConfigError(f"compare.x={settings.x!r} is not an axis; axes: {', '.join(axes) or '(none)'}")
    name = settings.experiment or default_name()
    out_dir = Path(specs[0].output.dir) / "compare" / name
    if (out_dir / "table.csv").exists():
        raise ConfigError(f"comparison {name!r} already exists at {out_dir}; choose another compare.experiment=")
    return Plan(name, settings, axes, points, specs, out_dir, list(rest), backend)


def default_name() -> str:
    """`compare-<UTC time>-<6 hex>`: the time alone collided when two hosts started a grid in the
    same second, and `report` then listed both grids as one (issue 24 item 7)."""
    import secrets

    return f"compare-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def make_jobs(p: Plan, parent_run_id: str | None) -> list[sweep.Job]:
    return [sweep.Job(index=pt.index, spec=spec, label=pt.label, axes=tuple(p.axes),
                      axis_values={k: axis_value(spec, k, v) for k, v in pt.axes}, experiment=p.name,
                      parent_run_id=parent_run_id, run_dir=str(p.out_dir / "runs" / pt.dirname))
            for pt, spec in zip(p.points, p.specs)]


def run_compare(overrides: Sequence[str], console: Any = None, confirmed: bool = True) -> tuple[Path, Any]:
    """Validate the whole grid, run it, write and log the comparison. Returns (dir, table).
    Interrupted (KeyboardInterrupt, signals.Terminated): the table so far is written, the runs
    end KILLED, and the interrupt propagates."""
    p = plan(overrides, confirmed, console)
    parent = sweep.ParentRun(p.specs[0].output, p.name, p.name, {
        "testbed.kind": "compare", "testbed.axes": json.dumps(p.axes),
        "compare.overrides": " ".join(p.overrides)[:5000], "compare.points": str(len(p.points))})
    try:
        return _run_grid(p, parent, console)
    except ServiceLost as exc:  # the tracking store stayed away: what was done is written, the run's end journaled
        parent.owe(exc)
        raise


def _run_grid(p: Plan, parent: sweep.ParentRun, console: Any) -> tuple[Path, pd.DataFrame]:
    jobs = make_jobs(p, parent.run_id)
    p.out_dir.mkdir(parents=True, exist_ok=True)
    (p.out_dir / "compare.json").write_text(json.dumps(_summary(p, [], 0.0), indent=2) + "\n")
    parent.check_store(p.out_dir / "compare.json")  # an unwritable artifact store: fails here, nothing run
    if console is not None:
        _print_start(console, p)
        parent.print_link(console)
    out = p.specs[0].output
    rows: list[dict] = []
    t0 = time.perf_counter()
    try:
        sweep.run_jobs(jobs, p.settings.workers, console, out.progress, rows, pool=ray_pool(p.backend))
    except KeyboardInterrupt as exc:
        _write(p, rows, time.perf_counter() - t0, parent, plots=False, interrupted=signals.interrupted_message(exc))
        parent.end_interrupted(exc, console, f"the table of the {len(rows)} point(s) done", p.out_dir)
        raise
    except ServiceLost as exc:  # e.g. the Ray head gone: the points done are kept, the runs ended
        _write_kept(p, rows, time.perf_counter() - t0, parent, exc)
        parent.end_failed(exc)
        raise
    except Exception as exc:  # e.g. sweep.backend=ray whose cluster cannot be reached
        parent.end_failed(exc)
        raise
    wall = time.perf_counter() - t0
    df = _write(p, rows, wall, parent, plots=True)
    parent.end("FINISHED")
    if console is not None:
        print_table(console, df, p.axes, f"{p.name} ({len(df)} runs, {wall:.1f} s)")
        warn_overloaded(console, df, p.axes)
        parent.print_figure(console, p.out_dir / "overview.png")
    return p.out_dir, df


def warn_overloaded(console: Any, df: pd.DataFrame, axes: Sequence[str]) -> list[int]:
    """One yellow line naming the points whose queue kept growing over the arrival window, as
    `testbed run` warns for its run (testbed/run/overload.py): there TTFT and SLO attainment measure
    a backlog that grows with the run's length, not the policy. Returns those points."""
    from testbed.run.overload import GROWTH_LIMIT

    if "queue_growth" not in df.columns:
        return []
    over = df[df["queue_growth"].fillna(0.0) > GROWTH_LIMIT]
    if over.empty:
        return []
    names = ", ".join(f"{int(r['point'])} ({point_name(dict((a, r[a]) for a in axes))})" for r in over.to_dict("records"))
    console.print(f"[yellow]warning: overloaded: in {len(over)} of {len(df)} points the queue waiting for a first "
                  f"token kept growing over the arrivals, so TTFT measures the backlog: points {names}; `testbed capacity` "
                  f"finds each setup's highest sustainable rate[/yellow]", soft_wrap=True)
    return [int(pt) for pt in over["point"]]


def _print_start(console: Any, p: Plan) -> None:
    sizes = {k: len({v for pt in p.points for kk, v in pt.axes if kk == k}) for k in p.axes}
    over = ", ".join(f"{k} ({n})" for k, n in sizes.items()) or "no axis"
    console.print(f"comparison [bold]{p.name}[/bold]: {len(p.points)} run(s) over {over}, "
                  f"{'Ray tasks' if p.backend is not None and p.backend.remote else f'{p.settings.workers} worker(s)'}", highlight=False)
    if p.backend is None or not p.backend.remote:
        from testbed.sweep.estimate import estimate_line

        console.print(estimate_line(p.specs, p.settings.workers), highlight=False, markup=False)


def _write(p: Plan, rows: list[dict], wall: float, parent: sweep.ParentRun, plots: bool,
           interrupted: str | None = None) -> pd.DataFrame:
    """table.csv, table.md, figures and compare.json; the files are logged on the parent run."""
    df = sort_rows(pd.DataFrame(rows).sort_values("point"), ["point"]) if rows else \
        pd.DataFrame(columns=["point", *p.axes, "status"])
    write_comparison(df, p.axes, p.out_dir, x=p.settings.x, figure_metrics=p.settings.metrics or FIGURE_METRICS,
                     plots=plots, title=setup_title(p.specs[0], p.axes))
    summary = _summary(p, rows, wall)
    failed = summary["failed"]
    if interrupted:
        summary.update(interrupted=interrupted, done=len(rows))
    (p.out_dir / "compare.json").write_text(json.dumps(summary, indent=2) + "\n")
    parent.log({}, tags={"compare.runs": len(df), "compare.failed": failed, "compare.wall_s": f"{wall:.1f}"})
    parent.log_files(p.out_dir)
    return df


def _write_kept(p: Plan, rows: list[dict], wall: float, parent: sweep.ParentRun, exc: ServiceLost) -> None:
    """The table of the points done before a service was lost (a tracking store that is the one
    lost fails the logging after the files are written: journaled by the caller)."""
    try:
        _write(p, rows, wall, parent, plots=False, interrupted=f"stopped: {str(exc)[:300]}")
    except ServiceLost:
        pass
    print(f"note: the table of the {len(rows)} point(s) done is in {p.out_dir}", file=sys.stderr, flush=True)


def _summary(p: Plan, rows: list[dict], wall: float) -> dict:
    """compare.json: what ran and how it went (written once before the grid, as the artifact
    store's check, and again at the end)."""
    return {"experiment": p.name, "axes": p.axes, "overrides": p.overrides, "points": len(p.points),
            "workers": p.settings.workers, "wall_s": wall,
            "failed": sum(1 for r in rows if r.get("status") != "finished")}


def failed_points(df: pd.DataFrame) -> str | None:
    """One line naming the failed points and the first one's reason, or None if none failed."""
    if df.empty or "status" not in df:
        return None
    failed = df[df["status"] != "finished"]
    if failed.empty:
        return None
    first = failed.iloc[0]
    reason = str(first.get("error") or "?").splitlines()[0][:300]
    return (f"{len(failed)} of {len(df)} point(s) failed (the table's `error` column says why); "
            f"point {first['point']}: {reason}")


def cli_compare(overrides: Sequence[str], console: Any, yes: bool = False) -> int:
    """`testbed compare`: 0; 1 when a point failed (the table is written) or the artifact store
    cannot be written (nothing runs); 130 (Ctrl-C) / 143 (SIGTERM) with the partial table written;
    a grid over CONFIRM_POINTS points needs `yes` (--yes)."""
    with signals.sigterm_as_interrupt():
        try:
            out_dir, table = run_compare(overrides, console, confirmed=yes)
        except KeyboardInterrupt as exc:
            print(signals.interrupted_message(exc), file=sys.stderr)
            return signals.exit_code(exc)
    print(out_dir.resolve())
    failed = failed_points(table)
    if failed:  # a failed point is a failed command: scripts and CI see it (was: exit 0, issue 38 item 4)
        print(f"error: {failed}", file=sys.stderr)
        return 1
    return 0
