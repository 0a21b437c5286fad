"""How much CPU a simulated capacity search will take: the search's own plan, priced, before its
first probe and again as its probes finish.

The first estimate (a 300-request sample at the start rate x the planned probes) said 135 s of CPU
for the default gLLM search, which took 247 s (+83%): half its probes run 4.5x below the start rate,
where each request decodes in a small batch and costs ~3x the CPU (13-17 s a 4,000-request probe at
0.18 req/s against 4.4-4.8 s at 0.8). So the forecast prices each probe at its own rate:

1. Pilots: each window's first `PILOT_REQUESTS` requests (at most a quarter of a probe) at the
   start rate and at start / growth^2 (the bracket's second step down), and while all pass at
   x growth^2 above (`MAX_CLIMBS`), simulated here: the CPU per request and the criterion's value
   at each rate.
2. The CPU per request against the rate: `a + b / rate` through the two pilots (the iterations a
   request shares fall with the batch, which grows with the rate), held below the low pilot (a
   request alone costs what it costs).
3. Each window's capacity guessed from its pilots: where the criterion crosses the target between
   the last pass and the first failure (log-rate interpolation); above the top pilot by
   sqrt(growth) when all pass, below the low one by sqrt(growth) when all fail.
4. The search's own state machine (testbed/capacity/command.py's CapacityFeed: windows, bracket,
   bisection, windows that cannot bind at INFO_PRECISION, the confirmations) run against those
   guesses on `workers` simulated slots, each probe priced requests x cost per request x the share
   an early stop leaves (`stop_share`). No probe is simulated.

The guesses are only guesses (nothing before the first probe knows where a window's capacity
lies; gLLM's binding window fails at the low rate by a TPOT floor), so the progress line re-prices
what is left as the brackets close (`Refresh`). Measured figures: docs/measurements/capacity-2026-11-27.md.
"""
from __future__ import annotations

import heapq
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

PILOT_REQUESTS = 300  # requests of each pilot run (~0.3 s of CPU at 0.8 req/s, ~1 s at 0.2 for the main setting)
PILOT_SHARE = 4  # ... and at most a quarter of a probe (short test searches stay short)
WARM_REQUESTS = 30  # a first, discarded run: the trace parse and caches a process pays once
MAX_CLIMBS = 2  # pilots above the start (x growth^2 each) while every pilot passed
MAX_PILOT_UNITS = 24  # beyond this many windows, later points reuse the first point's pilots window by window
PROBE_OVERHEAD_CPU_S = 0.5  # CPU seconds per probe outside its simulation (run folder, MLflow run, queue)
PROBE_OVERHEAD_BARE_CPU_S = 0.05  # ... without MLflow (a 12-probe search of 150-request windows: 2 s of CPU in all)
WORKER_START_CPU_S = 4.0  # a spawned worker's imports
STOP_POWER = 1.0  # early stop: a probe x times over its capacity runs (1 - T) + T / x of its requests (fit below)


@dataclass(frozen=True)
class Pilot:
    """One window's timed pilot runs, by rising rate: CPU seconds per request and the criterion's
    value at each."""

    rates: tuple[float, ...]
    cpu: tuple[float, ...]
    values: tuple[float, ...]
    passed: tuple[bool, ...]
    target: float  # the criterion's target at this window

    def cpu_per_request(self, rate: float) -> float:
        """`a + b / rate` through the two pilots around `rate` (the top two above them), held at
        the lowest pilot's below it: there a request decodes nearly alone (the default gLLM
        search's binding window cost 3.8 / 4.0 / 2.8 ms a request at 0.1 / 0.14 / 0.2 req/s, where
        1 / rate said 6.5 ms at 0.1)."""
        rates, cpu = self.rates, self.cpu
        if len(rates) < 2 or rate <= rates[0]:
            return cpu[0]
        k = next((i for i in range(1, len(rates)) if rate <= rates[i]), len(rates) - 1)
        (lo, hi), (c_lo, c_hi) = rates[k - 1:k + 1], cpu[k - 1:k + 1]
        if hi <= lo:
            return c_hi
        b = max((c_lo - c_hi) / (1 / lo - 1 / hi), 0.0)
        return max(c_hi - b / hi + b / rate, min(cpu) / 2)

    def guess(self, growth: float) -> float:
        """The window's capacity as the pilots suggest it (see the module docstring, step 3)."""
        rates, values, passed = self.rates, self.values, self.passed
        for i in range(len(rates) - 1):
            if passed[i] and not passed[i + 1]:
                (v_lo, v_hi), (lo, hi) = values[i:i + 2], rates[i:i + 2]
                share = 0.5 if not (math.isfinite(v_lo) and math.isfinite(v_hi)) or v_lo == v_hi else \
                    min(max(abs(v_lo - self.target) / abs(v_lo - v_hi), 0.0), 1.0)
                return lo * (hi / lo) ** share
        return rates[-1] * math.sqrt(growth) if passed[-1] else rates[0] / math.sqrt(growth)


def stop_share(rate: float, capacity: float, target: float) -> float:
    """The share of its requests an early-stopped probe runs: all of them at its capacity,
    (1 - target) of them far above it (the certain misses must exceed (1 - target) x N).
    Measured on the default gLLM search: 19-34% at 2-4.5x over, 95-99% just over."""
    if rate <= capacity:
        return 1.0
    return (1 - target) + target / (rate / capacity) ** STOP_POWER


# --- pilots ---------------------------------------------------------------------------------------

def run_pilots(p: Any, probe_requests: Callable, start_rate: Callable) -> tuple[dict[int, Pilot], float]:
    """Every unpruned window's pilots (up to MAX_PILOT_UNITS windows), and the CPU they took."""
    from testbed.run.runner import run_experiment

    live = [pt for pt in p.points if not pt.pruned]
    c0 = time.process_time()
    pilots: dict[int, Pilot] = {}
    if not live:
        return pilots, 0.0
    run_experiment(_spec(live[0], start_rate(live[0].run, p.settings), WARM_REQUESTS))
    for pt in live[:MAX_PILOT_UNITS]:
        start, s = start_rate(pt.run, p.settings), p.settings
        rates, runs = [max(start / s.growth ** 2, s.min_rate), start], []
        while rates:
            rate = rates.pop(0)
            runs.append((rate, *_pilot(p, pt, rate, probe_requests)))
            if not rates and runs[-1][3] and len(runs) < 2 + MAX_CLIMBS and rate < s.max_rate:
                rates.append(min(rate * s.growth ** 2, s.max_rate))  # all passed: climb
        pilots[pt.index] = Pilot(*(tuple(col) for col in zip(*runs)), target=pt.target)
    return pilots, time.process_time() - c0


def _pilot(p: Any, pt: Any, rate: float, probe_requests: Callable) -> tuple[float, float, bool]:
    """One pilot run: (CPU seconds per request, the criterion's value, passed)."""
    from testbed.capacity.results import judge
    from testbed.run.runner import run_experiment

    n = max(2, min(PILOT_REQUESTS, probe_requests(p, pt, rate) // PILOT_SHARE))
    t0 = time.process_time()
    result = run_experiment(_spec(pt, rate, n))
    cpu = (time.process_time() - t0) / n
    metrics = judge(pt.run.settings.slo, p.settings.warmup_s, rate, result)
    value = float(metrics.get(p.settings.metric, math.nan))
    return cpu, value, p.settings.passes(value, pt.target, metrics)


def _spec(pt: Any, rate: float, n: int) -> Any:
    return pt.run.with_values({"workload.rate": rate, "workload.num_requests": n, "output.mlflow": False,
                               "output.progress": False, "output.trace": "off"})


def pilot_of(p: Any, pilots: dict[int, Pilot], unit: int) -> Pilot | None:
    """A unit's pilot; a hold-out or an unpiloted window borrows that of the nearest piloted window
    (of its own point first, by trace position, else the same window number)."""
    if unit in pilots:
        return pilots[unit]
    pt = p.points[unit]
    same = [u for u in pilots if p.points[u].group == pt.group]
    if same:
        return pilots[min(same, key=lambda u: abs((p.points[u].first_request or 0) - (pt.first_request or 0)))]
    alike = [u for u in pilots if p.points[u].window == pt.window] or list(pilots)
    return pilots[alike[0]] if alike else None


# --- the plan, priced ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedProbe:
    unit: int
    rate: float
    kind: str | None  # None: a search probe; verify | upper | holdout
    passed: bool
    cpu_s: float


def dry_run(p: Any, capacity: Callable[[Any, int], float], cost: Callable[[Any, int, float, bool, str | None], float],
            workers: int, feed_type: type) -> tuple[list[PlannedProbe], float]:
    """The search the command would run if window `u`'s capacity were `capacity(plan, u)`: its
    probes in the order they finish on `workers` slots (each taking `cost(plan, unit, rate, passed,
    kind)` CPU seconds; `plan` holds the hold-outs the search adds), and the makespan in CPU seconds
    of one worker. Runs the search's own feed (`feed_type`: command.py's CapacityFeed, handed down
    so that this module stays below the command)."""
    _, done, clock = dry_feed(p, capacity, cost, workers, feed_type)
    return done, clock


def dry_feed(p: Any, capacity: Callable[[Any, int], float], cost: Callable[[Any, int, float, bool, str | None], float],
             workers: int, feed_type: type) -> tuple[Any, list[PlannedProbe], float]:
    """`dry_run`, and the feed it drove (its points' outcomes: the tests drive the search with it)."""

    class DryFeed(feed_type):
        def _job(self, pt: Any, rate: float, check: Any = None) -> Any:
            index = len(self.owner)
            self.owner[index] = pt.index
            self.busy.add(pt.index)
            if check is not None:
                self.checks[index] = check
            return index, pt.index, rate, (check.kind if check else None)

    feed = DryFeed(replace(p, points=list(p.points)), None)
    ready, running, done, clock = deque(feed.initial()), [], [], 0.0
    higher = p.settings.higher_is_better
    while ready or running:
        while ready and len(running) < max(workers, 1):
            index, unit, rate, kind = ready.popleft()
            passed = rate <= capacity(feed.p, unit) * (1 + 1e-9)
            took = cost(feed.p, unit, rate, passed, kind)
            heapq.heappush(running, (clock + took, index, unit, rate, kind, passed, took))
        clock, index, unit, rate, kind, passed, took = heapq.heappop(running)
        done.append(PlannedProbe(unit, rate, kind, passed, took))
        good = 1.0 if higher else 0.0
        value = good if passed else (0.0 if higher else math.inf)
        ready.extend(feed.follow({"point": index, "workload.rate": rate, "status": "finished",
                                  "judged": {p.settings.metric: value, "backlog_growth": 0.0,
                                             "sched_delay_p50_s": 0.0}}))
    return feed, done, clock


@dataclass
class Forecast:
    """The priced plan of one search: what the start line prints, and what `Refresh` re-prices."""

    p: Any
    pilots: dict[int, Pilot]
    pilot_cpu_s: float
    probe_requests: Callable
    workers: int
    cpu_s: float = 0.0
    makespan_s: float = 0.0
    probes: int = 0
    units: int = 0  # the plan's windows before the search adds its hold-outs (the dry runs start from these)
    feed_type: Any = None  # the search's feed class, which the dry runs drive (command.py's CapacityFeed)
    inputs: dict | None = None  # how the printed estimate came about (capacity.json `estimate_inputs`)

    def __post_init__(self) -> None:
        self.units = self.units or len(self.p.points)

    def cost(self, plan: Any, unit: int, rate: float, passed: bool, kind: str | None, capacity: float) -> float:
        """CPU seconds of one probe: its requests x the CPU per request at its rate x the share an
        early stop leaves a failing search probe, and its overhead."""
        pt, pilot = plan.points[unit], pilot_of(plan, self.pilots, unit)
        per = pilot.cpu_per_request(rate) if pilot else 0.0
        share = 1.0
        if kind is None and not passed and plan.settings.early_stop and plan.settings.criterion == "attainment":
            share = stop_share(rate, capacity, pt.target)
        overhead = PROBE_OVERHEAD_CPU_S if pt.run.output.mlflow else PROBE_OVERHEAD_BARE_CPU_S
        return self.probe_requests(plan, pt, rate) * per * share + overhead

    def guesses(self) -> dict[int, float]:
        return {u: pl.guess(self.p.settings.growth) for u, pl in self.pilots.items()}

    def price(self, guesses: dict[int, float]) -> tuple[list[PlannedProbe], float]:
        """The plan under these capacity guesses (units without one borrow their pilot's)."""
        def capacity(plan: Any, u: int) -> float:
            if u in guesses:
                return guesses[u]
            pilot = pilot_of(plan, self.pilots, u)
            return pilot.guess(plan.settings.growth) if pilot else math.inf

        plan = replace(self.p, points=self.p.points[:self.units])  # the real search appends its hold-outs to p
        return dry_run(plan, capacity,
                       lambda plan, u, r, ok, k: self.cost(plan, u, r, ok, k, capacity(plan, u)), self.workers,
                       self.feed_type)

    def run(self) -> Forecast:
        probes, self.makespan_s = self.price(self.guesses())
        workers = max(1, min(self.workers, len([pt for pt in self.p.points if not pt.pruned])))
        self.probes = len(probes)
        self.cpu_s = (sum(pr.cpu_s for pr in probes) + self.pilot_cpu_s
                      + (WORKER_START_CPU_S * workers if workers > 1 else 0))
        return self


def forecast(p: Any, probe_requests: Callable, start_rate: Callable, feed_type: type) -> Forecast:
    pilots, took = run_pilots(p, probe_requests, start_rate)
    return Forecast(p, pilots, took, probe_requests, p.settings.resolved_workers, feed_type=feed_type).run()


# --- as the probes finish ---------------------------------------------------------------------------

class Refresh:
    """The CPU left, re-priced after each probe: every window's guess moved into its bracket as it
    stands (the geometric middle once both ends are known), the plan priced again from the start,
    and the probes it plans that have not run yet summed."""

    def __init__(self, fc: Forecast) -> None:
        self.fc = fc

    def left_s(self, searches: dict) -> float:
        guesses = self.fc.guesses()
        for unit, search in searches.items():
            lo, hi = search.bracket()
            g = guesses.get(unit, math.inf)
            if lo is not None and hi is not None:
                g = math.sqrt(lo * hi)
            elif hi is not None:
                g = min(g, hi / math.sqrt(self.fc.p.settings.growth))
            elif lo is not None:
                g = max(g, lo * math.sqrt(self.fc.p.settings.growth))
            guesses[unit] = g
        probes, _ = self.fc.price(guesses)
        ran = Counter((u, pr.rate) for u, s in searches.items() for pr in s.probes)
        # a window whose own search ended plans no more search probes, whatever rates the dry run
        # (in another order, coarsened otherwise) gave it: counting those put "~3.9 min left"
        # after "~2.9 min" in the default gLLM search
        ended = {u for u, s in searches.items() if s.probes and s.next_rate() is None}
        left = 0.0
        for pr in probes:
            if ran[(pr.unit, pr.rate)] > 0:
                ran[(pr.unit, pr.rate)] -= 1
            elif not (pr.kind is None and pr.unit in ended):
                left += pr.cpu_s
        return left
