"""What a capacity search will run, settled before any probe: the grid's points composed (a GPU
budget's layouts among them, testbed/capacity/budget.py), each point's lone requests served
(testbed/capacity/steady.py: the probe length, pruning), and each point laid out over its trace
windows or seeds (testbed/capacity/windows.py), hold-outs made on demand from the same layout.
Every mistake in the overrides surfaces here, before any probe (exit 2). The search itself:
testbed/capacity/command.py."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from engine.base.errors import ConfigError
from testbed.sweep import jobs as sweep
import testbed.capacity.budget as budget
import testbed.capacity.windows as cw
from testbed.capacity.settings import CapacitySettings, check_prices, parse
from testbed.capacity.steady import Unloaded, probe_duration, unloaded, unloaded_miss
from testbed.sweep.compare import Point, axis_value, grid
from testbed.config.spec import compose_spec
from testbed.config.spec import RunSpec
from testbed.config.overrides import explicit_keys, merge, split_prefixed


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
    window: int = 0  # trace window / seed index (hold-outs: numbered after the windows)
    duration_s: float = 0.0  # seconds of arrivals per probe after the warm-up
    max_requests: int | None = None  # requests the trace holds from this window's offset
    window_requests: int | None = None  # a trace window: its requests (testbed/capacity/windows.py)
    first_request: int | None = None  # a trace window: the index of its first request from workload.start_s
    holdout: bool = False  # a held-out stretch (confirmation), not one of the windows the search probes
    pruned: str | None = None  # why no probe runs (does not fit, misses the SLO unloaded)
    unloaded: Unloaded | None = None

    @property
    def window_label(self) -> str:
        """`w<k>` / `h<k>` (a hold-out) and, for a trace, where it starts: `w2 @1480s`."""
        name = f"h{self.window}" if self.holdout else f"w{self.window}"
        start = getattr(self.run.workload, "start_s", None) if self.first_request is not None else None
        return name + (f" @{start:.0f}s" if start is not None else "")


@dataclass(frozen=True)
class Plan:
    name: str
    settings: CapacitySettings
    axes: list[str]
    points: list[PointSpec]  # one per search: grid point x window
    out_dir: Path
    overrides: list[str]
    live: Any = None  # testbed.capacity.live.LiveOptions with --base-url
    layouts: dict = field(default_factory=dict)  # group -> (trace arrivals, first request index) of a trace
    dropped: int = 0  # grid points over the GPU budget
    refused: tuple[str, ...] = ()  # combinations of a budget search that the simulator refuses, and why

    @property
    def run0(self) -> RunSpec:
        return self.points[0].run

    def probe_text(self) -> str:
        return self.settings.probe_text([pt.duration_s for pt in self.points],
                                        next((pt.window_requests for pt in self.points if pt.window_requests), None))

    @property
    def groups(self) -> list[PointSpec]:
        """The grid points (their first window's search)."""
        return [pt for pt in self.points if pt.window == 0 and not pt.holdout]

    def windows_of(self, group: int) -> list[PointSpec]:
        return [pt for pt in self.points if pt.group == group and not pt.holdout]


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
    layouts: dict = {}
    units = windows([settle(s, settings, live) for s in specs], settings, user, layouts)
    _warn_warmup(settings, units)
    return Plan(name, settings, axes, units, out_dir, list(rest), live, layouts, dropped, tuple(refused))


def settle(spec: PointSpec, settings: CapacitySettings, live: Any = None) -> PointSpec:
    """Before any probe: one request alone on the point (simulated, or served by the live
    server), which sets the probe length and prunes a point that does not fit or cannot meet the
    SLO at any rate."""
    u = unloaded(spec.run) if live is None else live.unloaded(spec.run, settings.retries)
    pruned = u.error or unloaded_miss(settings, spec.target, spec.run.settings.slo, u)
    return replace(spec, unloaded=u, pruned=pruned, duration_s=probe_duration(settings, u))


def windows(specs: Sequence[PointSpec], settings: CapacitySettings, user: set[str] = frozenset(),
            layouts: dict | None = None) -> list[PointSpec]:
    """Each point once per window (testbed/capacity/windows.py): trace windows of
    `capacity.window_requests` requests covering the trace from `workload.start_s` (or the stretch
    the user names: `capacity.windows=1`, `workload.num_requests` when set), or seeds of a
    generated workload. `layouts` collects each point's trace layout (its hold-outs need it)."""
    layouts = {} if layouts is None else layouts
    units: list[PointSpec] = []
    cache: dict[str, Any] = {}
    for spec in specs:
        key = repr(replace(spec.run.workload, rate=None)) if hasattr(spec.run.workload, "start_s") else None
        layout = cache[key] if key in cache else cache.setdefault(key, cw.trace_layout(spec.run, None))
        if layout is None:
            count = settings.windows or cw.DEFAULT_SEEDS
            for w in range(count):
                units.append(window_unit(spec, settings, len(units), w, seed=spec.run.workload.seed + w))
            continue
        arrivals, first = layout
        rows = len(arrivals) - first
        length = min(spec.run.workload.num_requests if "workload.num_requests" in user and
                     spec.run.workload.num_requests else settings.window_requests, rows)
        layouts[spec.index] = (arrivals, first, length)
        for w, start in enumerate(cw.cover_starts(rows, length, settings.windows)):
            units.append(window_unit(spec, settings, len(units), w, layout=layouts[spec.index], start=start))
    return units


def window_unit(spec: PointSpec, settings: CapacitySettings, index: int, window: int, *, seed: int | None = None,
                layout: tuple | None = None, start: int = 0, holdout: bool = False) -> PointSpec:
    """One window (or hold-out) of a point: a seed, or a trace stretch from request `start` on."""
    if layout is None:
        values: dict[str, Any] = {"workload.seed": seed}
        extra: dict[str, Any] = {}
    else:
        arrivals, first, length = layout
        values = {"workload.start_s": spec.run.workload.start_s if start == 0 else
                  cw.start_offsets(arrivals, first, [start])[0]}
        if not settings.duration_s:
            values["workload.num_requests"] = length
        extra = {"max_requests": len(arrivals) - first - start, "first_request": start,
                 "window_requests": None if settings.duration_s else length}
    run = spec.run.with_values(values)
    overrides = tuple(merge(spec.overrides, [f"{k}={v}" for k, v in values.items()]))
    tag = f"h{window}" if holdout else f"w{window}"
    return replace(spec, index=index, group=spec.group, window=window, run=run, overrides=overrides,
                   dirname=f"{spec.dirname}/{tag}", holdout=holdout, **extra)


def _warn_warmup(settings: CapacitySettings, units: Sequence[PointSpec]) -> None:
    """A warm-up as long as a trace window at the first probed rate leaves nothing to judge."""
    for pt in units:
        rate = start_rate(pt.run, settings)
        if pt.window_requests and settings.warmup_s and settings.warmup_s * rate >= pt.window_requests / 2:
            print(f"warning: capacity.warmup_s={settings.warmup_s:g} is half or more of a {pt.window_requests}-request "
                  f"window at {rate:g} req/s: most of each probe is not judged", file=sys.stderr)
            return


def _point_spec(pt: Point, settings: CapacitySettings, user: set[str]) -> PointSpec:
    # a probe keeps its summary, config and run info only (its worker judges it from the result in
    # memory: results.judge); per-request tables, traces and plots when the user asks for them.
    # With both tables every probe kept, one default search of the main setting wrote 348 MB.
    ovs = list(pt.overrides) + sweep.point_budget(user)
    run = compose_spec(ovs)
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


def start_rate(run: RunSpec, settings: CapacitySettings) -> float:
    return settings.start or getattr(run.workload, "rate", None) or 1.0


def plan_for_jobs(jobs: Sequence[sweep.Job], axes: list[str], settings: CapacitySettings, name: str,
                  out_dir: Path) -> Plan:
    """A search plan over points composed elsewhere (`testbed reproduce`'s capacity studies):
    each job is a point; its probes never draw per-run plots."""
    points = []
    for job in jobs:
        run = job.spec.with_values({"output.plots": False})
        points.append(settle(PointSpec(job.index, job.label, Path(job.run_dir).name, run, (), dict(job.axis_values),
                                       settings.resolved_target(run.settings.slo), group=job.index), settings))
    layouts: dict = {}
    units = windows(points, settings, set(), layouts)
    return Plan(name, settings, list(axes), units, out_dir, [], layouts=layouts)
