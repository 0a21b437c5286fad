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
the lowest window capacity, confirmed (testbed/capacity/cover.py), the binding window, the median and
range of the windows', the confirmation probes), `probes.csv` (every probe), `capacity.json`,
`capacity.png` (the criterion against the rate per window, capacity marked), `ranking.csv` /
`ranking.md` when hardware, P, TP or the model is an axis, and `runs/<point>/<window>/<probe>/`
(each probe's summary). The last line printed is the directory.
"""
from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.base.errors import ConfigError
from testbed import signals
from testbed.sweep import jobs as sweep
import testbed.capacity.results as results
import testbed.capacity.estimate as estimate
import testbed.capacity.windows as cw
from testbed.capacity.early import EarlyStop
from testbed.capacity.forecast import Refresh
from testbed.capacity.planning import Plan, PointSpec, plan, start_rate, window_unit
from testbed.capacity.search import RateSearch
from testbed.capacity.settings import MAX_PROBE_REQUESTS
from testbed.capacity.cover import Check, PointSearch
from testbed.capacity.steady import is_steady
from testbed.run.outputs import axis_name
from testbed.tracking.views import CAPACITY

# --- the searches as a sweep feed -----------------------------------------------------------------

INFO_PRECISION = 0.25  # a window that cannot bind stops at this precision (its capacity is information; 0.1 before: one probe more per such window)
HOST_BOUND = "host-bound"  # a live probe that measured its starved host, not the server (live.py)


class CapacityFeed(sweep.Feed):
    """One RateSearch per window and one PointSearch per grid point (testbed/capacity/cover.py);
    a finished probe is judged here (in the parent, from the verdict its worker computed) and
    queues the window's next probe, or, once every window of the point is done, the point's
    confirmation probes. Probe rows are collected per window for the table."""

    unit = "probes"

    def __init__(self, p: Plan, parent: sweep.ParentRun) -> None:
        super().__init__()
        self.p = p
        self.parent = parent
        self.searches: dict[int, RateSearch] = {pt.index: RateSearch(p.settings, start_rate(pt.run, p.settings))
                                                for pt in p.points}
        self.points = {g.group: PointSearch(p.settings, [pt.index for pt in p.windows_of(g.group)], self.searches,
                                            lambda b, tried, g=g.group: self._holdout(g, b, tried)) for g in p.groups}
        self.errors: dict[int, str] = {}  # window -> why its search stopped (a probe's run failed)
        self.owner: dict[int, int] = {}  # job index -> window
        self.checks: dict[int, Check] = {}  # job index -> the confirmation it runs
        self.busy: set[int] = set()  # windows with a probe running
        self.probe_rows: dict[int, list[dict]] = {pt.index: [] for pt in p.points}
        self.estimate_s: float | None = None  # the time estimate printed at the start (wall seconds)
        self.estimate_cpu_s: float | None = None  # ... and in CPU seconds (a simulated search)
        self.cpu0 = estimate.cpu_used()
        self.measured_estimate_s: float | None = None  # ... and the one from the first probe's wall time
        self.refresh: Refresh | None = None  # the CPU left, re-priced as probes finish (the progress line)
        self.estimate_inputs: dict | None = None  # how the start estimate came about (capacity.json)

    def cpu_spent(self) -> float:
        """CPU seconds of the search so far, its finished workers included."""
        return estimate.cpu_used() - self.cpu0

    def _holdout(self, group: int, binding: int, tried: list[int]) -> int | None:
        """A held-out unit of `group` near window `binding`: a trace stretch no window or earlier
        hold-out started at, or the next unused seed."""
        bound = self.p.points[binding]
        spec = replace(bound, dirname=bound.dirname.rsplit("/", 1)[0])  # the point's folder, not the window's
        layout = self.p.layouts.get(group)
        if layout is None:
            seed = spec.run.workload.seed - spec.window + len(self.p.windows_of(group)) + len(tried)
            unit = window_unit(spec, self.p.settings, len(self.p.points), len(tried) + 1, seed=seed, holdout=True)
        else:
            used = [pt.first_request for pt in self.p.points if pt.group == group]
            rows = len(layout[0]) - layout[1]
            start = cw.holdout_start(spec.first_request, layout[2], rows, used)
            if start is None:
                return None
            unit = window_unit(spec, self.p.settings, len(self.p.points), len(tried) + 1, layout=layout, start=start,
                               holdout=True)
        self.p.points.append(unit)
        self.searches[unit.index] = RateSearch(self.p.settings, self.points[group].answer or 1.0)
        self.probe_rows[unit.index] = []
        return unit.index

    def initial(self) -> list[sweep.Job]:
        for pt in self.p.points:
            if pt.pruned:
                self.errors[pt.index] = pt.pruned
        for point in self.points.values():
            if any(u in self.errors for u in point.windows):  # a pruned point is answered before any probe
                point.status = "stopped"
        return [job for pt in list(self.p.points) if not pt.pruned and self.points[pt.group].status is None
                and (job := self._next(pt)) is not None]

    def _next(self, pt: PointSpec) -> sweep.Job | None:
        """The window's next search probe; none, and the point unconfirmed, when narrowing after a
        failed confirmation has no room left for it and the confirmation after it."""
        self._coarsen(pt)
        rate = self.searches[pt.index].next_rate()
        point = self.points.get(pt.group)
        if rate is not None and point is not None and not point.affords(1 + sum(u in self.busy for u in point.units())):
            point.give_up("narrow_probes")
            return None
        return None if rate is None else self._job(pt, rate)

    def _coarsen(self, pt: PointSpec) -> None:
        """A window that passed at or above another window's failure cannot bind: its own
        capacity is information (the median and range), searched to INFO_PRECISION only."""
        point, search = self.points.get(pt.group), self.searches[pt.index]
        if point is None or pt.index not in point.windows:
            return
        fails = [h for u in point.windows if u != pt.index and (h := self.searches[u].bracket()[1]) is not None]
        lo = search.bracket()[0]
        coarse = bool(fails) and lo is not None and lo >= min(fails)
        want = max(search.s.precision, INFO_PRECISION) if coarse else self.p.settings.precision
        if want != search.s.precision:
            search.s = replace(search.s, precision=want)

    def _job(self, pt: PointSpec, rate: float, check: Check | None = None) -> sweep.Job:
        k = sum(1 for u in self.owner.values() if u == pt.index)  # the window's probe number
        job = probe_job(self.p, pt, rate, k, len(self.owner), self.parent.run_id, check.kind if check else None)
        self.owner[job.index] = pt.index
        self.busy.add(pt.index)
        if check is not None:
            self.checks[job.index] = check
        return job

    def follow(self, row: dict) -> list[sweep.Job]:
        pt = self.p.points[self.owner[row["point"]]]
        check = self.checks.get(row["point"])
        self.busy.discard(pt.index)
        rate = row["workload.rate"]
        if row.get("status") != "finished" or row.get("host_flag"):
            self.errors[pt.index] = (f"{HOST_BOUND} at {rate:g} req/s: {row['host_flag']}" if row.get("host_flag")
                                     else str(row.get("error") or "the probe failed"))
            self.probe_rows[pt.index].append(row)
            return self._after(pt)
        search = self.searches[pt.index]
        metrics = row.get("judged") or results.judged(row, pt.run.settings.slo, self.p.settings.warmup_s, rate)
        value = metrics[self.p.settings.metric]
        steady = is_steady(metrics["backlog_growth"])
        passed = self.p.settings.passes(value, pt.target, metrics) and steady
        row["window_s"] = (row.get("num_requests", math.nan) - 1) / rate  # how long the arrivals lasted
        probe = search.record(rate, value, passed, phase=check.kind if check else None, **metrics, steady=steady,
                              run_id=row.get("run_id"), run_dir=row.get("run_dir"))
        if check is not None:
            self.points[pt.group].record(check, passed, value)
        row.update({"capacity.value": value, "capacity.passed": passed, "capacity.phase": probe.phase,
                    "capacity.steady": steady, "capacity.metrics": metrics})
        self.probe_rows[pt.index].append(row)
        if row.get("run_id"):
            self.parent.log({"capacity.value": value, "capacity.passed": float(passed)},
                            {"capacity.phase": probe.phase}, run_id=row["run_id"])
        if check is None and (job := self._next(pt)) is not None:
            return [job]
        return self._after(pt)

    def _after(self, pt: PointSpec) -> list[sweep.Job]:
        """A window's search (or a check) ended: the point's confirmation, or its searches again."""
        point = self.points[pt.group]
        if point.status is not None:
            return []
        if point.checks:  # confirming the answer: settle once every check has its verdict
            if pt.index in self.errors:
                point.status = "stopped"
                return []
            return [] if any(c.passed is None for c in point.checks) else self._settle(point)
        units = [self.p.points[u] for u in point.windows]
        if any(u.index in self.busy for u in units):
            return []
        if any(u.index in self.errors for u in units):
            point.status = "stopped"
            return []
        jobs = [job for u in units if (job := self._next(u)) is not None]
        return jobs or self._confirm(point)

    def _confirm(self, point: PointSearch) -> list[sweep.Job]:
        if point.status is not None:  # ended while its searches were asked for their next probe
            return []
        jobs = []
        for check in point.confirm():
            ran = next((p for p in self.searches[check.unit].probes if p.rate == check.rate), None)
            if ran is not None:  # already probed there (the bracket's failure above the answer, say)
                point.record(check, ran.passed, ran.value)
            else:
                jobs.append(self._job(self.p.points[check.unit], check.rate, check))
        if not jobs and point.checks and point.status is None:
            return self._settle(point)
        return jobs

    def _settle(self, point: PointSearch) -> list[sweep.Job]:
        if point.settle():
            return []
        point.checks = []
        units = [self.p.points[u] for u in point.windows]
        jobs = [job for u in units if (job := self._next(u)) is not None]
        return jobs or self._confirm(point)

    def planned(self) -> int:
        """Probes done plus those to come: each window's search, and per point its checks (the
        other windows, the upper and the hold-out probe) until they ran."""
        total = 0
        for g, point in self.points.items():
            units = point.windows
            low = self._likely_binding(units)
            total += sum(len(self.searches[u].probes) if u in self.errors else self._window_plan(u, u != low)
                         for u in units)
            total += sum(len(self.searches[u].probes) for u in point.tried if u not in units)
            if point.status is None and not point.checks and not any(u in self.errors for u in units):
                total += len(units) + 1  # verify the others, the upper probe, the hold-out
        return total

    def _likely_binding(self, units: list[int]) -> int:
        """The window that looks lowest so far (lowest failure, then lowest pass; the first before any probe)."""
        def key(u: int) -> tuple[float, float]:
            lo, hi = self.searches[u].bracket()
            return (hi if hi is not None else math.inf, lo if lo is not None else math.inf)
        return min(units, key=lambda u: (key(u), units.index(u)))

    def _window_plan(self, unit: int, coarse: bool) -> int:
        """A window's planned probes; one that will not bind (all but the lowest, when the point
        has several windows) plans for INFO_PRECISION, as `_coarsen` will search it. Planning every
        window at full precision said 46 probes where the default gLLM search ran 36."""
        search = self.searches[unit]
        if not coarse or search.s.precision >= INFO_PRECISION:
            return search.planned()
        probe = copy.copy(search)
        probe.s = replace(search.s, precision=INFO_PRECISION)
        return probe.planned()

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
        value = f"{row['capacity.value']:.4g}"
        if (stopped := row["capacity.metrics"].get("stopped_at")) is not None:  # decided early (capacity/early.py)
            value, queue = f"< {pt.target:g}", f" (stopped after {stopped:,} of {row.get('num_requests', 0):,.0f} requests)"
        left = f" [dim]~{estimate.text(self.refresh.left_s(self.searches))} of CPU left[/dim]" if self.refresh else ""
        return (f"point {pt.group:>3} probe {job.tags['capacity.probe']:>2} rate {rate:<8g} {verdict} "
                f"{self.p.settings.metric} {value} ({row['capacity.phase']}){queue}{self._narrowing(pt, row)} {where}{left}")

    def _narrowing(self, pt: PointSpec, row: dict) -> str:
        """On a failed confirmation probe: the answer narrows, or (a bound reached) the point has none."""
        if row["capacity.phase"] not in ("verify", "holdout") or row["capacity.passed"]:
            return ""
        point = self.points[pt.group]
        return (" [yellow]confirmation failed: no capacity[/yellow]" if point.status == "unconfirmed"
                else " [yellow]confirmation failed: narrowing[/yellow]")


def probe_requests(p: Plan, pt: PointSpec, rate: float) -> int:
    """Requests of one probe: a trace window's, else those arriving over warm-up + duration at
    `rate` (as many as the trace holds from the window's offset; probes.csv's `window_s` says how
    long they lasted)."""
    if pt.window_requests:
        return pt.window_requests
    n = max(2, math.ceil(rate * (p.settings.warmup_s + pt.duration_s)))
    if n > MAX_PROBE_REQUESTS:
        raise ConfigError(f"a probe of {rate:g} req/s x {p.settings.warmup_s + pt.duration_s:g} s is {n:,} requests, "
                          f"over {MAX_PROBE_REQUESTS:,}; lower capacity.duration_s or capacity.max_rate")
    return min(n, pt.max_requests) if pt.max_requests else n


def probe_job(p: Plan, pt: PointSpec, rate: float, k: int, index: int, parent_run_id: str | None,
              kind: str | None = None) -> sweep.Job:
    """Probe k of a window: its config with `workload.rate` and the request count set (a plain
    `testbed run` of the same overrides replays exactly these requests). Its worker judges it
    (`judge`), so that the probe keeps only its summary."""
    from functools import partial

    spec = pt.run.with_values({"workload.rate": rate, "workload.num_requests": probe_requests(p, pt, rate)})
    name = pt.window_label.split(" ")[0]
    slo = pt.run.settings.slo
    watch = (EarlyStop(slo.ttft_s, slo.tpot_s, pt.target, p.settings.warmup_s)
             if kind is None and p.settings.early_stop and p.settings.criterion == "attainment" else None)
    where = f"{pt.label} · {name}"
    return sweep.Job(index=index, spec=spec, label=f"{where} @ {rate:g} req/s", axes=(*p.axes, "window", "workload.rate"),
                     axis_values={**pt.axis_values, "window": name, "workload.rate": rate}, experiment=p.name,
                     parent_run_id=parent_run_id, judge=partial(results.judge, slo, p.settings.warmup_s, rate), watch=watch,
                     run_dir=str(p.out_dir / "runs" / pt.dirname / (f"{k:02d}_rate={rate:g}" + (f"_{kind}" if kind else ""))),
                     tags={"testbed.kind": "probe", "capacity.point": pt.group, "capacity.window": name,
                           "capacity.start_s": getattr(pt.run.workload, "start_s", ""),
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
        parent.end("FINISHED")
    except KeyboardInterrupt as exc:
        parent.end("KILLED")
        if console is not None:
            console.print(f"{signals.interrupted_message(exc)}: the probes done so far are in {p.out_dir}",
                          highlight=False, markup=False)
        raise
    except sweep.ServiceLost as exc:  # the tracking store stayed away: the run's end is journaled (cluster/unwritten.py)
        parent.owe(exc)
        raise
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



def _print_start(console: Any, p: Plan, feed: CapacityFeed) -> None:
    s = p.settings
    sizes = {k: len({str(v) for pt in p.points for kk, v in pt.axis_values.items() if kk == k}) for k in p.axes}
    over = ", ".join(f"{k} ({n})" for k, n in sizes.items()) or "no axis"
    targets = sorted({pt.target for pt in p.points})
    what = f"{s.criterion}: {', '.join(s.describe(t) for t in targets)}"
    counts = sorted({len(p.windows_of(g.group)) for g in p.groups})
    kind = "trace windows" if hasattr(p.run0.workload, "start_s") else "seeds"
    spread = f" x {'-'.join(map(str, counts))} {kind}" if counts[-1] > 1 else ""
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
    else:
        feed.estimate_cpu_s, feed.estimate_s, fc = estimate.simulated(p, probe_requests, start_rate, CapacityFeed)
        feed.refresh, feed.estimate_inputs = Refresh(fc), fc.inputs
        console.print(f"capacity: the answer is the lowest window's, confirmed before it is printed; about "
                      f"{estimate.text(feed.estimate_cpu_s)} of CPU ({fc.probes} probes, each priced at its rate), "
                      f"{estimate.text(feed.estimate_s)} at this "
                      f"machine's present speed ({s.resolved_workers} worker(s))", highlight=False)



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
