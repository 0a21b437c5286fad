"""`testbed capacity`: per grid point, the highest request rate that meets an SLO criterion.

    testbed capacity policy=gllm,vllm,sarathi workload=azure
    testbed capacity hardware=a100-80g,h100-80g parallel.pp=2,4 model=llama2-70b capacity.price.a100-80g=1.8
    testbed capacity capacity.gpus=4 model=llama2-70b hardware=h100-80g,l20-48g
    testbed capacity --base-url http://127.0.0.1:8000 workload=azure capacity.duration_s=60

The grid is `testbed compare`'s (comma lists are axes, `compare.grid`; under `capacity.gpus` a
configuration search, testbed/capacity/budget.py). Before any probe each point serves one request
alone (testbed/capacity/steady.py: the probe length, pruning), then runs its own search
(testbed/capacity/search.py) in each of `capacity.windows` trace windows or seeds, whose probes
are ordinary runs at `workload.rate=<r>`, through
the shared sweep runner (testbed/sweep/jobs.py): `capacity.workers` processes, one MLflow run per probe
(tags `capacity.point`, `capacity.probe`) beside one summary run (tag `testbed.kind=capacity`),
Ctrl-C / SIGTERM ending the runs KILLED with the results so far written (exit 130 / 143). The
searches of different points run side by side; one point's probes run one after another, since
each depends on the last. With `--base-url` the probe is `testbed bench serve` against that server
(testbed/capacity/live.py), one probe at a time.

Output: `<output.dir>/capacity/<experiment>/` with `table.csv` / `table.md` (one row per point:
the median capacity over its windows and their range), `probes.csv` (every probe), `capacity.json`, `capacity.png` (the criterion against the rate per
point, capacity marked), `ranking.csv` / `ranking.md` when hardware, P, TP or the model is an axis,
and `runs/<point>/<probe>/` (each probe's run directory). The last line printed is the directory.
"""
from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from engine.base.errors import ConfigError
from testbed import signals
from testbed.sweep import jobs as sweep
import testbed.capacity.budget as budget
import testbed.capacity.results as results
from testbed.capacity.search import RateSearch
from testbed.capacity.settings import CapacitySettings, check_prices, parse
from testbed.capacity.steady import Unloaded, cycled, cycles, is_steady, probe_duration, unloaded, unloaded_miss
from testbed.sweep.compare import Point, axis_value, grid
from testbed.config.spec import compose_spec
from testbed.config.spec import RunSpec
from testbed.run.outputs import axis_name
from testbed.config.overrides import explicit_keys, merge, split_prefixed
from testbed.tracking.views import CAPACITY


@dataclass(frozen=True)
class PointSpec:
    """One search: a grid point (`group`) in one trace window or seed (`window`), its composed
    config, the columns it keeps, and what was settled before any probe."""

    index: int
    label: str
    dirname: str
    run: RunSpec
    overrides: tuple[str, ...]
    axis_values: dict
    target: float
    group: int = 0  # the grid point (the table's row)
    window: int = 0  # trace window / seed index
    duration_s: float = 0.0  # seconds of arrivals per probe after the warm-up
    max_requests: int | None = None  # requests the trace holds from this window's offset
    pattern: int | None = None  # a trace window at the steady-state length: requests of one cycle (steady.cycled)
    pruned: str | None = None  # why no probe runs (does not fit, misses the SLO unloaded)
    unloaded: Unloaded | None = None


@dataclass(frozen=True)
class Plan:
    name: str
    settings: CapacitySettings
    axes: list[str]
    points: list[PointSpec]  # one per search: grid point x window
    out_dir: Path
    overrides: list[str]
    live: Any = None  # testbed.capacity.live.LiveOptions with --base-url
    dropped: int = 0  # grid points over the GPU budget
    refused: tuple[str, ...] = ()  # combinations of a budget search that the simulator refuses, and why

    @property
    def run0(self) -> RunSpec:
        return self.points[0].run

    def probe_text(self) -> str:
        return self.settings.probe_text([pt.duration_s for pt in self.points], any(pt.pattern for pt in self.points))

    @property
    def groups(self) -> list[PointSpec]:
        """The grid points (their first window's search)."""
        return [pt for pt in self.points if pt.window == 0]


def plan(overrides: Sequence[str], live: Any = None) -> Plan:
    """Parse the settings, compose every point and settle what needs no probe (every mistake
    surfaces here, exit 2)."""
    raw, rest = split_prefixed(overrides, "capacity")
    settings = parse(raw)
    if live is not None:
        live.check(rest, settings)
        settings = replace(settings, workers=1)  # one server: its probes run one at a time
    rest = budget.with_layout_axes(rest, settings)
    axes, points = grid(rest)
    if "workload.rate" in axes:
        raise ConfigError("workload.rate is what `testbed capacity` searches: give one start with capacity.start=, "
                          "not a list")
    user = explicit_keys(rest)
    composed, refused = budget.compose_points(points, settings, lambda pt: _point_spec(pt, settings, user))
    specs, dropped = budget.within(composed, settings)
    if not specs:
        raise ConfigError(f"no configuration of the grid fits capacity.gpus={settings.gpus}; "
                          f"lower parallel.pp / parallel.tp or raise the budget")
    check_prices(settings, sorted({s.run.settings.hardware.name for s in specs}))
    specs = [_priced(s, settings, user) for s in specs]
    name = settings.experiment or f"capacity-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
    out_dir = Path(specs[0].run.output.dir) / "capacity" / name
    if (out_dir / "table.csv").exists():
        raise ConfigError(f"capacity search {name!r} already exists at {out_dir}; choose another capacity.experiment=")
    if live is not None:
        live.reach()
    units = windows([settle(s, settings, live) for s in specs], settings)
    return Plan(name, settings, axes, units, out_dir, list(rest), live, dropped, tuple(refused))


def settle(spec: PointSpec, settings: CapacitySettings, live: Any = None) -> PointSpec:
    """Before any probe: one request alone on the point (simulated, or served by the live
    server), which sets the probe length and prunes a point that does not fit or cannot meet the
    SLO at any rate."""
    u = unloaded(spec.run) if live is None else live.unloaded(spec.run)
    pruned = u.error or unloaded_miss(settings, spec.target, spec.run.settings.slo, u)
    return replace(spec, unloaded=u, pruned=pruned, duration_s=probe_duration(settings, u))


def windows(specs: Sequence[PointSpec], settings: CapacitySettings) -> list[PointSpec]:
    """Each point once per window: `workload.start_s` moved by `window_step_s` for a trace, the
    workload's seed moved by one otherwise. Window 0 is the workload as configured."""
    units: list[PointSpec] = []
    for spec in specs:
        wl = spec.run.workload
        for w in range(settings.windows):
            if hasattr(wl, "start_s"):
                values: dict[str, Any] = {"workload.start_s": wl.start_s + w * settings.window_step_s}
            else:
                values = {"workload.seed": wl.seed + w}
            run = spec.run.with_values(values) if w else spec.run
            key, value = next(iter(values.items()))
            unit = replace(spec, index=len(units), group=spec.index, window=w, run=run,
                           overrides=tuple(merge(spec.overrides, [f"{key}={value:g}"])) if w else spec.overrides,
                           dirname=spec.dirname + (f"/w{w}" if settings.windows > 1 else ""))
            rows = trace_rows(run)
            pattern = None if rows is None or settings.duration_s else min(settings.cycle_requests, rows)
            units.append(replace(unit, max_requests=rows, pattern=pattern))
    return units


def trace_rows(run: RunSpec) -> int | None:
    """Requests a trace workload holds from its offset (None: a generated workload, no limit)."""
    if not hasattr(run.workload, "start_s"):
        return None
    from workloads.base import build_workload

    try:
        return len(build_workload(run.with_values({"workload.num_requests": None}).workload, run.data_dir))
    except ConfigError as exc:
        raise ConfigError(f"trace window {run.workload.start_s:g} s: {exc}; lower capacity.windows or "
                          f"capacity.window_step_s") from None


def _point_spec(pt: Point, settings: CapacitySettings, user: set[str]) -> PointSpec:
    # per-probe traces and plots (~1 s each) only when asked; requests.csv always: every probe's
    # steady-state check and scheduling delay are read from it (testbed/capacity/results.judged)
    ovs = list(pt.overrides) + sweep.point_budget(user, ("output.requests",))
    run = compose_spec(ovs)
    if not run.output.requests:
        raise ConfigError("invalid output.requests=false for testbed capacity: each probe's steady-state check "
                          "reads its requests.csv; leave output.requests unset")
    if getattr(run.workload, "arrival", None) == "offline":
        raise ConfigError(f"workload.arrival=offline has no request rate to search (point {pt.label}); "
                          f"valid choices: poisson, gamma")
    return PointSpec(pt.index, pt.label, pt.dirname, run, tuple(ovs),
                     {k: axis_value(run, k, v) for k, v in pt.axes}, settings.resolved_target(run.settings.slo),
                     group=pt.index)


def _priced(spec: PointSpec, settings: CapacitySettings, user: set[str]) -> PointSpec:
    """`capacity.price.<hw>=` sets that hardware entry's `cost_per_gpu_hour` at its points."""
    price = dict(settings.prices).get(spec.run.settings.hardware.name)
    if price is None:
        return spec
    ovs = merge(spec.overrides, [f"hardware.cost_per_gpu_hour={price}"])
    return replace(spec, run=compose_spec(ovs), overrides=tuple(ovs))


# --- the searches as a sweep feed -----------------------------------------------------------------

HOST_BOUND = "host-bound"  # a live probe that measured its starved host, not the server (live.py)

def start_rate(run: RunSpec, settings: CapacitySettings) -> float:
    return settings.start or getattr(run.workload, "rate", None) or 1.0


class CapacityFeed(sweep.Feed):
    """One RateSearch per point; a finished probe is judged here (in the parent) and queues the
    point's next probe. Probe rows are collected per point for the table."""

    unit = "probes"

    def __init__(self, p: Plan, parent: sweep.ParentRun) -> None:
        super().__init__()
        self.p = p
        self.parent = parent
        self.searches = [RateSearch(p.settings, start_rate(pt.run, p.settings)) for pt in p.points]
        self.errors: dict[int, str] = {}  # point -> why its search stopped (a probe's run failed)
        self.owner: dict[int, int] = {}  # job index -> point
        self.probe_rows: dict[int, list[dict]] = {pt.index: [] for pt in p.points}
        self.estimate_s: float | None = None  # a live search's time estimate (wall seconds)
        self.measured_estimate_s: float | None = None  # ... and the one from its first probe's wall time

    def initial(self) -> list[sweep.Job]:
        for pt in self.p.points:
            if pt.pruned:
                self.errors[pt.index] = pt.pruned
        return [job for pt in self.p.points if not pt.pruned and (job := self._next(pt)) is not None]

    def _next(self, pt: PointSpec) -> sweep.Job | None:
        rate = self.searches[pt.index].next_rate()
        if rate is None:
            return None
        job = probe_job(self.p, pt, rate, len(self.searches[pt.index].probes), len(self.owner),
                        self.parent.run_id)
        self.owner[job.index] = pt.index
        return job

    def follow(self, row: dict) -> list[sweep.Job]:
        pt = self.p.points[self.owner[row["point"]]]
        rate = row["workload.rate"]
        if row.get("status") != "finished" or row.get("host_flag"):
            self.errors[pt.index] = (f"{HOST_BOUND} at {rate:g} req/s: {row['host_flag']}" if row.get("host_flag")
                                     else str(row.get("error") or "the probe failed"))
            self.probe_rows[pt.index].append(row)
            return []
        search = self.searches[pt.index]
        metrics = results.judged(row, pt.run.settings.slo, self.p.settings.warmup_s, rate)
        value = metrics[self.p.settings.metric]
        steady = is_steady(metrics["backlog_growth"])
        passed = self.p.settings.passes(value, pt.target, metrics) and steady
        row["window_s"] = (row.get("num_requests", math.nan) - 1) / rate  # how long the arrivals lasted
        search.record(rate, value, passed, **metrics, steady=steady, run_id=row.get("run_id"),
                      run_dir=row.get("run_dir"))
        row.update({"capacity.value": value, "capacity.passed": passed, "capacity.phase": search.probes[-1].phase,
                    "capacity.steady": steady, "capacity.metrics": metrics})
        self.probe_rows[pt.index].append(row)
        if row.get("run_id"):
            # capacity/passed_rate: grouped by point and aggregated by max in the printed link's view, the capacity
            self.parent.log({"capacity.value": value, "capacity.passed": float(passed),
                             **({"capacity/passed_rate": rate} if passed else {})},
                            {"capacity.phase": search.probes[-1].phase}, run_id=row["run_id"])
        job = self._next(pt)
        return [job] if job is not None else []

    def planned(self) -> int:
        return sum(len(s.probes) if pt.index in self.errors else s.planned()
                   for pt, s in zip(self.p.points, self.searches))

    def describe(self, row: dict, job: sweep.Job) -> str:
        pt = self.p.points[self.owner[row["point"]]]
        where = job.label.rsplit(" @ ", 1)[0]
        rate = row.get("workload.rate")
        if row.get("host_flag"):
            return f"point {pt.group:>3} [yellow]{HOST_BOUND}[/yellow] {job.label}: {row['host_flag']}"
        if row.get("status") != "finished":
            return f"point {pt.group:>3} [red]failed[/red] {job.label}: {str(row.get('error'))[:100]}"
        verdict = "[green]pass[/green]" if row["capacity.passed"] else "[red]fail[/red]"
        growth = row["capacity.metrics"]["backlog_growth"]
        queue = "" if row["capacity.steady"] else f" [yellow]queue still growing ({growth:+.0%} of the rate)[/yellow]"
        return (f"point {pt.group:>3} probe {job.tags['capacity.probe']:>2} rate {rate:<8g} {verdict} "
                f"{self.p.settings.metric} {row['capacity.value']:.4g} ({row['capacity.phase']}){queue} {where}")


def probe_requests(p: Plan, pt: PointSpec, rate: float) -> int:
    """Requests of one probe: whole cycles of a trace window's pattern, else those arriving over
    warm-up + duration at `rate` (as many as the trace holds from the window's offset; probes.csv's
    `window_s` says how long they lasted)."""
    if pt.pattern:
        return pt.pattern * cycles(p.settings, pt.pattern, rate, pt.duration_s)
    n = max(2, math.ceil(rate * (p.settings.warmup_s + pt.duration_s)))
    return min(n, pt.max_requests) if pt.max_requests else n


def probe_job(p: Plan, pt: PointSpec, rate: float, k: int, index: int, parent_run_id: str | None) -> sweep.Job:
    """Probe k of a point: its config with `workload.rate` and the request count set."""
    values: dict[str, Any] = {"workload.rate": rate, "workload.num_requests": pt.pattern or probe_requests(p, pt, rate)}
    spec = pt.run.with_values(values)
    requests = None
    if pt.pattern:  # the window's pattern at this rate, replayed (config.yaml's num_requests is one cycle)
        from workloads.base import build_workload

        requests = cycled(build_workload(spec.workload, spec.data_dir), rate, probe_requests(p, pt, rate) // pt.pattern)
    where = f"{pt.label} · w{pt.window}" if p.settings.windows > 1 else pt.label
    return sweep.Job(index=index, spec=spec, requests=requests, label=f"{where} @ {rate:g} req/s", axes=(*p.axes, "workload.rate"),
                     axis_values={**pt.axis_values, "workload.rate": rate}, experiment=p.name,
                     parent_run_id=parent_run_id,
                     run_dir=str(p.out_dir / "runs" / pt.dirname / f"{k:02d}_rate={rate:g}"),
                     tags={"testbed.kind": "probe", "capacity.point": pt.group, "capacity.window": pt.window,
                           "capacity.probe": k, "capacity.label": axis_name(pt.axis_values)})


# --- the command ------------------------------------------------------------------------------------

def run_capacity(overrides: Sequence[str], console: Any = None, live: Any = None) -> tuple[Path, Any]:
    """Plan, search every point, write and log the results. Returns (dir, table). Interrupted:
    the results so far are written, the runs end KILLED, and the interrupt propagates."""
    p = plan(overrides, live)
    parent = sweep.ParentRun(p.run0.output, p.name, p.name, {
        "testbed.kind": "capacity", "testbed.axes": json.dumps(p.axes),
        "capacity.overrides": " ".join(p.overrides)[:5000],
        "capacity.points": str(len(p.points)), "capacity.criterion": p.settings.criterion,
        **({"capacity.base_url": live.base_url} if live is not None else {})}, view=CAPACITY)
    try:
        df, ranking, wall = run_searches(p, parent, console)
    except KeyboardInterrupt as exc:
        parent.end("KILLED")
        if console is not None:
            console.print(f"{signals.interrupted_message(exc)}: the probes done so far are in {p.out_dir}",
                          highlight=False, markup=False)
        raise
    parent.end("FINISHED")
    if console is not None:
        results.show(console, p, df, ranking, wall)
    return p.out_dir, df


def run_searches(p: Plan, parent: sweep.ParentRun, console: Any = None) -> tuple[Any, Any, float]:
    """Every point's search through the sweep runner; the results written (also when
    interrupted, then the interrupt propagates). Returns (table, ranking or None, wall seconds)."""
    feed = p.live.feed(p, parent) if p.live is not None else CapacityFeed(p, parent)
    if console is not None:
        _print_start(console, p, feed)
        parent.print_link(console)
    t0 = time.perf_counter()
    try:
        sweep.run_jobs([], p.settings.resolved_workers, console, p.run0.output.progress, [], feed=feed)
    except KeyboardInterrupt as exc:
        results.write(p, feed, time.perf_counter() - t0, parent, interrupted=signals.interrupted_message(exc))
        raise
    wall = time.perf_counter() - t0
    df, ranking = results.write(p, feed, wall, parent)
    return df, ranking, wall


def plan_for_jobs(jobs: Sequence[sweep.Job], axes: list[str], settings: CapacitySettings, name: str,
                  out_dir: Path) -> Plan:
    """A search plan over points composed elsewhere (`testbed reproduce`'s capacity studies):
    each job is a point; its probes never draw per-run plots."""
    points = []
    for job in jobs:
        run = job.spec.with_values({"output.plots": False})
        points.append(settle(PointSpec(job.index, job.label, Path(job.run_dir).name, run, (), dict(job.axis_values),
                                       settings.resolved_target(run.settings.slo), group=job.index), settings))
    return Plan(name, settings, list(axes), windows(points, settings), out_dir, [])


def _print_start(console: Any, p: Plan, feed: CapacityFeed) -> None:
    s = p.settings
    sizes = {k: len({str(v) for pt in p.points for kk, v in pt.axis_values.items() if kk == k}) for k in p.axes}
    over = ", ".join(f"{k} ({n})" for k, n in sizes.items()) or "no axis"
    targets = sorted({pt.target for pt in p.points})
    what = f"{s.criterion}: {', '.join(s.describe(t) for t in targets)}"
    spread = (f" x {s.windows} {'trace windows' if hasattr(p.run0.workload, 'start_s') else 'seeds'}"
              if s.windows > 1 else "")
    budget_text = (f"; GPU budget {s.gpus} ({p.dropped} over it dropped, {len(p.refused)} invalid skipped)"
                   if s.gpus else "")
    console.print(f"capacity [bold]{p.name}[/bold]: {len(p.groups)} point(s){spread} over {over}{budget_text}; "
                  f"{what}; precision {s.precision:.0%}; each probe {p.probe_text()}; "
                  f"~{feed.planned()} probes planned; {s.resolved_workers} worker(s)", highlight=False)
    for why in p.refused[:3]:
        console.print(f"[yellow]skipped[/yellow] {why}", highlight=False)
    for pt in p.groups:
        if pt.pruned:
            console.print(f"[yellow]pruned[/yellow] point {pt.group} {pt.label}: {pt.pruned}", highlight=False)
    if p.live is not None:
        p.live.print_estimate(console, p, feed)



def cli_capacity(overrides: Sequence[str], console: Any, live: Any = None) -> int:
    """`testbed capacity`: 0, or 130 (Ctrl-C) / 143 (SIGTERM) with the results so far written."""
    with signals.sigterm_as_interrupt():
        try:
            out_dir, _ = run_capacity(overrides, console, live)
        except KeyboardInterrupt as exc:
            print(signals.interrupted_message(exc), file=sys.stderr)
            return signals.exit_code(exc)
    print(out_dir.resolve())
    return 0


