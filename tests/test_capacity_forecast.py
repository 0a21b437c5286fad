"""The CPU forecast of a simulated capacity search (testbed/capacity/forecast.py): it prices the
search's own plan, so under known window capacities and a fake cost per probe it must plan exactly
the probes the search runs and sum exactly their cost; its pilots, capacity guesses and early-stop
share follow the rules its docstring states. No timing is asserted."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from types import SimpleNamespace

import pytest

from testbed.capacity import forecast as fc
from testbed.capacity.forecast import Pilot, dry_run, stop_share

AZURE = ["policy=gllm", "workload=azure", "output.progress=false", "output.mlflow=false",
         "capacity.window_requests=150", "capacity.precision=0.1", "capacity.workers=1", "capacity.windows=3"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """A plan of three 150-request trace windows, start 0.8 req/s (`plan` settles each point)."""
    from testbed.capacity.planning import plan

    return plan([*AZURE, "capacity.start=0.8", f"output.dir={tmp_path_factory.mktemp('fc')}"])


NO_PARENT = SimpleNamespace(run_id=None, log=lambda *a, **k: None)


def searched(p, knees: dict[int, float]) -> list[tuple[int, float, str | None]]:
    """The probes the real CapacityFeed asks for (its own jobs, composed as the command composes
    them) when window u passes exactly up to knees[u] (hold-outs: their window's knee), one at a time."""
    from testbed.capacity.command import CapacityFeed

    return drive(CapacityFeed(replace(p, points=list(p.points)), NO_PARENT), knees)


def drive(feed, knees: dict[int, float]) -> list[tuple[int, float, str | None]]:
    ran, queue = [], deque(feed.initial())
    while queue:
        job = queue.popleft()
        unit = feed.owner[job.index]
        rate = job.spec.workload.rate
        passed = rate <= knee_of(feed.p, knees, unit)
        kind = feed.checks[job.index].kind if job.index in feed.checks else None
        ran.append((unit, rate, kind))
        queue.extend(feed.follow({"point": job.index, "workload.rate": rate, "status": "finished",
                                  "judged": {"slo_attainment": 1.0 if passed else 0.0, "backlog_growth": 0.0}}))
    return ran


def knee_of(p, knees: dict[int, float], unit: int) -> float:
    return knees.get(unit, min(knees.values()) * 1.001)  # a hold-out passes at the answer


@pytest.mark.parametrize("knees", [{0: 0.31, 1: 0.9, 2: 2.5}, {0: 5.0, 1: 0.05, 2: 0.05}, {0: 0.8, 1: 0.8, 2: 0.8}])
def test_the_priced_plan_is_the_search_it_prices(trace, knees):
    """Known capacities, one worker: the dry run plans the same probes, in the same order, as the
    search itself (bracket, bisection, coarse windows, verifications, upper, hold-out), and sums the
    fake cost of exactly those; on two workers the makespan lies between half the sum and the sum."""
    p = trace
    ran = searched(p, knees)
    cost = lambda plan, u, r, ok, k: 1.0 / r + (3.0 if k else 0.0)  # noqa: E731 - a fake cost per probe
    planned, makespan = dry_run(p, lambda plan, u: knee_of(plan, knees, u), cost, workers=1, feed_type=_feed())
    assert [(pr.unit, pr.rate, pr.kind) for pr in planned] == ran
    assert any(k == "holdout" for _, _, k in ran) and len(ran) > 10
    total = sum(1.0 / r + (3.0 if k else 0.0) for _, r, k in ran)
    assert sum(pr.cpu_s for pr in planned) == pytest.approx(total) and makespan == pytest.approx(total)
    two, makespan2 = dry_run(p, lambda plan, u: knee_of(plan, knees, u), cost, workers=2, feed_type=_feed())
    assert sorted((pr.unit, pr.rate, pr.kind) for pr in two) == sorted(ran)  # the same plan, other order
    assert total / 2 <= makespan2 < total
    assert len(p.points) == 3  # the dry run added its hold-out to a copy of the plan, not to the plan


def test_a_probe_is_priced_at_its_own_rate_and_early_stops_shorten_failures_only(trace):
    """CPU per request through both pilots as a + b / rate, held at the low pilot's below it; a failing search probe at x times its capacity runs (1 - T) + T / x of its requests,
    a passing one and a confirmation all of them."""
    pilot = Pilot((0.2, 0.8), (3e-3, 1e-3), (0.79, 0.5), (False, False), 0.8)
    b = (3e-3 - 1e-3) / (5 - 1.25)
    assert pilot.cpu_per_request(0.4) == pytest.approx(1e-3 - b / 0.8 + b / 0.4)
    assert pilot.cpu_per_request(0.01) == pilot.cpu_per_request(0.2) == pytest.approx(3e-3)
    assert stop_share(0.8, 0.2, 0.8) == pytest.approx(0.2 + 0.8 / 4) and stop_share(0.2, 0.2, 0.8) == 1.0
    p = trace
    f = fc.Forecast(p, {0: pilot}, 0.0, lambda plan, pt, rate: 1000, 1)
    full = 1000 * pilot.cpu_per_request(0.8) + fc.PROBE_OVERHEAD_BARE_CPU_S  # the plan has output.mlflow=false
    assert f.cost(p, 0, 0.8, True, None, 0.2) == pytest.approx(full)
    assert f.cost(p, 0, 0.8, False, "verify", 0.2) == pytest.approx(full)
    assert f.cost(p, 0, 0.8, False, None, 0.2) == pytest.approx(full * 0.4 + fc.PROBE_OVERHEAD_BARE_CPU_S * 0.6)


@pytest.mark.parametrize("values, passed, expected", [
    ((0.95, 0.90), (True, True), 0.8 * math.sqrt(2)),  # both pass: above the start
    ((0.79, 0.50), (False, False), 0.2 / math.sqrt(2)),  # both fail: below the low pilot
    ((0.90, 0.70), (True, False), 0.2 * 4 ** 0.5),  # crossing half way: the geometric middle
    ((0.85, 0.65), (True, False), 0.2 * 4 ** 0.25),
    ((0.95, 0.9, 0.9, 0.6), (True, True, True, False), 3.2 * 4 ** (1 / 3)),  # climbed twice: between 3.2 and 12.8
    ((0.95, 0.9, 0.9), (True, True, True), 3.2 * math.sqrt(2))])
def test_a_window_capacity_is_guessed_where_its_pilots_cross_the_target(values, passed, expected):
    rates = (0.2, 0.8, 3.2, 12.8)[:len(values)]
    assert Pilot(rates, (1e-3,) * len(values), values, passed, 0.8).guess(2.0) == pytest.approx(expected)


def test_above_the_start_a_probe_is_priced_between_the_pilots_around_it():
    pilot = Pilot((0.2, 0.8, 3.2), (3e-3, 1e-3, 4e-4), (0.9, 0.9, 0.5), (True, True, False), 0.8)
    b = (1e-3 - 4e-4) / (1 / 0.8 - 1 / 3.2)
    assert pilot.cpu_per_request(1.6) == pytest.approx(4e-4 - b / 3.2 + b / 1.6)
    assert pilot.cpu_per_request(3.2) == pytest.approx(4e-4) and pilot.cpu_per_request(0.8) == pytest.approx(1e-3)
    assert 2e-4 <= pilot.cpu_per_request(100.0) < 4e-4  # beyond the top pilot: the top segment's, floored


def test_the_forecast_times_two_pilots_per_window_and_refresh_prices_only_what_is_left(trace, monkeypatch):
    """Real pilots on 150-request windows: one pair per window at start / growth^2 and the start
    (more above only while all pass); before any probe the CPU left is the whole plan's, after the
    search it is nothing, though the search appended its hold-out to the plan."""
    from testbed.capacity.command import CapacityFeed, probe_requests
    from testbed.capacity.planning import start_rate

    monkeypatch.setattr(fc, "PILOT_REQUESTS", 40)  # short pilots: what is asserted is which runs, not their length
    plan = replace(trace, points=list(trace.points))
    f = fc.forecast(plan, probe_requests, start_rate, CapacityFeed)
    assert sorted(f.pilots) == [0, 1, 2] and all(pl.rates[:2] == (0.2, 0.8) for pl in f.pilots.values())
    for pl in f.pilots.values():  # above the start only while every pilot passed, x growth^2 a step
        assert pl.rates[2:] == (3.2, 12.8)[:len(pl.rates) - 2] and all(pl.passed[1:len(pl.rates) - 1])
    assert all(c > 0 for pl in f.pilots.values() for c in pl.cpu) and f.pilot_cpu_s > 0 and f.probes > 3
    refresh = fc.Refresh(f)
    feed = CapacityFeed(plan, NO_PARENT)
    probes, _ = f.price(f.guesses())
    assert refresh.left_s(feed.searches) == pytest.approx(sum(pr.cpu_s for pr in probes))
    ran = drive(feed, f.guesses())
    assert len(plan.points) == 4 and any(k == "holdout" for _, _, k in ran)
    assert refresh.left_s(feed.searches) == 0


def _feed() -> type:
    """The search's own feed, which the dry run drives (handed down by the command)."""
    from testbed.capacity.command import CapacityFeed

    return CapacityFeed
