"""Capacity answers that hold on the workload they name (issue 45): trace windows are long
contiguous stretches of the trace replayed as plain runs (no cycles of a small sample), they cover
the trace, the answer is the lowest window's and is confirmed (every window at it, the binding
window above it, a held-out stretch) before it is printed, and the printed figure is what a
plain run of the stretch gives. Small settings only: 150-300-request windows."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from testbed.capacity import windows as cw
from testbed.capacity.cover import PointSearch
from testbed.capacity.search import RateSearch
from testbed.capacity.settings import CapacitySettings
from testbed.cli import main

AZURE = ["policy=gllm", "workload=azure", "output.progress=false", "output.mlflow=false",
         "capacity.window_requests=150", "capacity.precision=0.1", "capacity.workers=1"]


@pytest.mark.parametrize("rows, length, count", [(19366, 4000, None), (1000, 300, None), (1000, 300, 3),
                                                 (200, 300, None), (900, 300, None)])
def test_windows_tile_the_trace_and_a_holdout_is_no_window(rows, length, count):
    starts = cw.cover_starts(rows, length, count)
    length = min(length, rows)
    if count is None:  # every request of the trace is in some window
        covered = set().union(*(range(s, s + length) for s in starts))
        assert covered == set(range(rows))
    else:
        assert len(starts) == count and starts[0] == 0 and starts[-1] == rows - length
    assert all(0 <= s <= rows - length for s in starts)
    for b in starts:
        h = cw.holdout_start(b, length, rows, starts)
        assert h is None or (h not in starts and 0 <= h <= rows - length)


def point_search(knees: dict[int, float], holdout_knees: list[float], s: CapacitySettings) -> PointSearch:
    """Windows whose criterion passes up to their knee; hold-outs made on demand with their own knees."""
    searches = {w: RateSearch(s, 1.0) for w in knees}
    made = iter(holdout_knees)

    def holdout(binding, tried):
        knee = next(made, None)
        if knee is None:
            return None
        unit = 100 + len(tried)
        knees[unit] = knee
        searches[unit] = RateSearch(s, 1.0)
        return unit

    return PointSearch(s, list(knees), searches, holdout)


def drive(point: PointSearch, knees: dict[int, float]) -> PointSearch:
    """What the feed does, without runs: every window's search (while narrowing affords its next
    probe), then the checks, until settled."""
    for _ in range(50):
        for w in list(point.windows):
            search = point.searches[w]
            while (rate := search.next_rate()) is not None:
                if not point.affords(1):
                    point.give_up("narrow_probes")
                    return point
                search.record(rate, float(rate <= knees[w]), rate <= knees[w])
        checks = point.confirm()
        if not checks:
            return point
        for c in checks:
            ok = c.rate <= knees[c.unit]
            point.searches[c.unit].record(c.rate, float(ok), ok, phase=c.kind)
            point.record(c, ok, float(ok))
        if point.settle():
            return point
    raise AssertionError("the search did not end")


def test_the_answer_is_the_lowest_window_and_every_check_ran():
    s = CapacitySettings(precision=0.05)
    knees = {0: 3.0, 1: 1.3, 2: 2.2}
    point = drive(point_search(knees, [1.5], s), knees)
    assert point.status == "confirmed" and point.binding == 1
    assert point.answer <= 1.3 < point.answer * (1 + s.precision) + 1e-9
    kinds = {c.kind: c for c in point.checks}
    assert kinds["holdout"].passed and not kinds["upper"].passed  # held-out passes, above the answer fails
    for w in point.windows:  # every window ran at the answer and passed
        assert any(p.rate == point.answer and p.passed for p in point.searches[w].probes)


def test_a_failed_holdout_becomes_a_window_and_the_answer_narrows():
    s = CapacitySettings(precision=0.05, holdouts=2)
    knees = {0: 3.0, 1: 2.0}
    point = drive(point_search(knees, [1.6, 1.9], s), knees)  # the first hold-out is harder than every window
    assert point.status == "confirmed" and 100 in point.windows and point.binding == 100
    assert point.answer <= 1.6 and point.holdout_check().unit == 101 and point.holdout_check().passed


def test_an_answer_no_holdout_confirms_is_never_reported():
    s = CapacitySettings(precision=0.05, holdouts=1)
    knees = {0: 3.0, 1: 2.0}
    point = drive(point_search(knees, [1.0], s), knees)
    assert point.status == "unconfirmed" and point.ended == "holdouts" and point.failed.kind == "holdout"
    none_left = drive(point_search({0: 3.0}, [], s), {0: 3.0})
    assert none_left.status == "unconfirmed" and none_left.ended == "no holdout"


def test_each_failed_confirmation_narrows_until_a_fresh_holdout_confirms():
    """Three held-out stretches each harder than the answer before them: the answer steps down
    to each one's capacity and the fourth confirms it (two hold-outs ended this unconfirmed)."""
    s = CapacitySettings(precision=0.05, narrow_probes=60)
    knees = {0: 3.0}
    point = drive(point_search(knees, [2.0, 1.6, 1.3, 2.5], s), knees)
    assert point.status == "confirmed" and point.windows == [0, 100, 101, 102] and point.binding == 102
    assert point.answer <= 1.3 < point.answer * (1 + s.precision) + 1e-9
    assert point.holdout_check().unit == 103 and point.holdout_check().passed
    for w in point.windows:  # the narrowed answer ran and passed on every stretch searched
        assert any(p.rate == point.answer and p.passed for p in point.searches[w].probes)


@pytest.mark.parametrize("bound", [0, 5, 12])
def test_narrowing_stays_within_its_probe_bound_and_then_reports_no_capacity(bound):
    s = CapacitySettings(precision=0.05, narrow_probes=bound)
    knees = {0: 3.0}
    point = drive(point_search(knees, [2.0, 1.6, 1.3, 2.5], s), knees)
    assert point.status == "unconfirmed" and point.ended == "narrow_probes"
    assert point.narrowed_from is not None and point.extra_probes() <= bound
    assert point.failed.kind == "holdout" and not point.failed.passed


def trace_plan(tmp_path, *args):
    from testbed.capacity.planning import plan

    return plan([*(args or AZURE), f"output.dir={tmp_path}"])


def test_a_trace_probe_is_a_plain_run_of_contiguous_requests_covering_the_trace(tmp_path):
    """The probe of a window at rate r is `testbed run workload.start_s=<s> workload.num_requests=L
    workload.rate=r`: L distinct contiguous requests of the trace (the cycled probe repeated a
    window's first 500), and the windows together hold every request of the trace."""
    from testbed.capacity.command import probe_job
    from workloads.base import build_workload

    p = trace_plan(tmp_path, *[a for a in AZURE if "window_requests" not in a])  # the default: 4,000
    whole = build_workload(p.run0.with_values({"workload.num_requests": None, "workload.rate": None}).workload,
                           p.run0.data_dir)
    key = [(r.prompt_len, r.output_len) for r in whole]
    seen: set[int] = set()
    for pt in p.points:
        job = probe_job(p, pt, 0.7, 0, 0, None)
        assert job.requests is None  # nothing shipped: the spec alone is the probe
        reqs = build_workload(job.spec.workload, job.spec.data_dir)
        first = pt.first_request
        assert len(reqs) == 4000 and [(r.prompt_len, r.output_len) for r in reqs] == key[first:first + 4000]
        assert (len(reqs) - 1) / reqs[-1].arrival_s == pytest.approx(0.7)
        seen.update(range(first, first + 4000))
    assert seen == set(range(len(whole))) and len(p.points) == 5


def test_the_printed_capacity_holds_on_a_plain_run_of_each_window_and_the_holdout(tmp_path, capsys):
    """End to end on the trace (150-request windows, two spread over it): the capacity printed is
    the lowest window's; a plain run of every window and of the held-out stretch at it passes, of
    the binding window at capacity x (1 + precision) fails; the probes kept no request tables."""
    from testbed.config.spec import compose_spec
    from testbed.run.runner import run_experiment

    code = main(["capacity", *AZURE, "capacity.windows=2", f"output.dir={tmp_path}", "capacity.experiment=hold"])
    assert code == 0, capsys.readouterr().err[-2000:]
    out = tmp_path / "capacity" / "hold"
    row = pd.read_csv(out / "table.csv").iloc[0]
    probes = pd.read_csv(out / "probes.csv")
    assert row["status"] == "finished" and row["search"].startswith("confirmed")
    cap = row["capacity_req_s"]
    assert cap == row["capacity_min_req_s"] <= row["capacity_median_req_s"] <= row["capacity_max_req_s"]
    assert not any((out / "runs").rglob("requests.csv")) and not any((out / "runs").rglob("microbatches.csv"))
    answer = json.loads((out / "capacity.json").read_text())["answers"][0]
    base = [ov for ov in answer["overrides"] if not ov.startswith(("workload.start_s", "workload.num_requests"))]

    def attainment(start_s: float, rate: float) -> float:
        spec = compose_spec([*base, f"workload.start_s={start_s}", "workload.num_requests=150", f"workload.rate={rate}"])
        return run_experiment(spec).summary["slo_attainment"]

    for window, start in probes.groupby("window")["start_s"].first().items():
        assert attainment(start, cap) >= 0.8, window  # held-out h1 included
    binding = probes[probes["window"] == row["binding"].split(" ")[0]]["start_s"].iloc[0]
    assert attainment(binding, row["upper_req_s"]) < 0.8 and not math.isnan(row["holdout_value"])


def test_probe_lengths_and_warm_ups_are_bounded(tmp_path, capsys):
    for args, message in ((["capacity.duration_s=1e12"], "invalid capacity.duration_s=1000000000000.0"),
                          (["capacity.duration_s=10", "capacity.warmup_s=10"], "warm-up must be shorter"),
                          (["capacity.workers=1000000"], "invalid capacity.workers=1000000: must be an integer in [1, 64]"),
                          (["capacity.gpus=100000"], "invalid capacity.gpus=100000: must be an integer in [1, 1024]")):
        keys = {a.partition("=")[0] for a in args}
        code = main(["capacity", *[a for a in AZURE if a.partition("=")[0] not in keys], f"output.dir={tmp_path}", *args])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("error: ") and "\n" not in err and message in err, err


# --- narrowing end to end: hold-outs made harder than the window (longer prompts) ----------------------

SYNTH = ["policy=sarathi", "model=llama2-13b", "hardware=rtx4090", "parallel.pp=2", "workload=synthetic",
         "capacity.duration_s=30", "capacity.start=2", "capacity.precision=0.05", "capacity.windows=1",
         "output.progress=false", "output.mlflow=false", "capacity.workers=1"]


def harder_holdouts(monkeypatch, prompts: list[int]) -> None:
    """The k-th held-out seed sends prompts of prompts[k-1] tokens (the window's are 512; later
    hold-outs 512 again): stretches harder than every window the search probed."""
    from dataclasses import replace

    import testbed.capacity.command as command
    from testbed.config.overrides import merge

    made = command.window_unit

    def unit(spec, settings, index, window, **kw):
        out = made(spec, settings, index, window, **kw)
        if not kw.get("holdout"):
            return out
        n = prompts[window - 1] if window <= len(prompts) else 512
        return replace(out, run=out.run.with_values({"workload.input_mean": n}),
                       overrides=tuple(merge(out.overrides, [f"workload.input_mean={n}"])))

    monkeypatch.setattr(command, "window_unit", unit)


def test_a_search_narrows_past_two_harder_holdouts_and_confirms_on_a_third(tmp_path, capsys, monkeypatch):
    """Hold-outs h1 (1,024-token prompts) and h2 (2,048) each fail at the answer before them: the
    answer narrows to h2's capacity and h3 confirms it. (Two hold-outs ended this `unconfirmed`.)"""
    harder_holdouts(monkeypatch, [1024, 2048])
    assert main(["capacity", *SYNTH, f"output.dir={tmp_path}", "capacity.experiment=narrow"]) == 0
    out = tmp_path / "capacity" / "narrow"
    row = pd.read_csv(out / "table.csv").iloc[0]
    probes = pd.read_csv(out / "probes.csv")
    cap = row["capacity_req_s"]
    assert row["search"] == "confirmed" and row["binding"] == "h2" and row["confirm_holdout"].startswith("h3")
    assert cap == row["capacity_min_req_s"] < row["capacity_max_req_s"]
    for window in ("w0", "h1", "h2", "h3"):  # the answer ran and passed on every stretch
        at = probes[(probes["window"] == window) & (probes["workload.rate"] == cap)]
        assert at["capacity.passed"].all() and len(at), window
    assert f"{cap:g}" in capsys.readouterr().err  # the table (the console writes to stderr)


@pytest.mark.parametrize("keys, ended", [(["capacity.holdouts=2"], "capacity.holdouts=2 spent"),
                                         (["capacity.narrow_probes=4"], "capacity.narrow_probes=4 spent")])
def test_a_search_that_reaches_a_bound_prints_no_capacity_and_says_what_held(tmp_path, capsys, monkeypatch,
                                                                            keys, ended):
    harder_holdouts(monkeypatch, [1024, 2048])
    assert main(["capacity", *SYNTH, *keys, f"output.dir={tmp_path}", "capacity.experiment=bound"]) == 0
    out = tmp_path / "capacity" / "bound"
    row = pd.read_csv(out / "table.csv").iloc[0]
    printed = capsys.readouterr().err
    assert row["status"] == "unconfirmed" and math.isnan(row.get("capacity_req_s", math.nan))
    table = printed[printed.index("capacity per point"):printed.index("unconfirmed point 0")]
    rates = {f"{r:g}" for r in pd.read_csv(out / "probes.csv")["workload.rate"]}
    assert not any(rate in table for rate in rates if "." in rate), table  # no probed rate in the printed table
    line = next(ln for ln in printed.splitlines() if ln.startswith("unconfirmed point 0"))
    assert "no capacity: " in line and "held on w0" in line and "failed on held-out h" in line and ended in line
    if "narrow_probes" in ended:  # at most 4 probes after the first failed confirmation (h1 at w0's capacity)
        first = pd.read_csv(out / "probes.csv")
        assert len(first[first["window"] == "h1"]) <= 1 + 4


def live_feed():
    """The live search's feed (`--base-url`), its server never reached: the dry run answers its probes."""
    from testbed.capacity.live import LiveFeed, LiveOptions

    class Live(LiveFeed):
        def __init__(self, p, parent):
            super().__init__(p, parent, LiveOptions("http://127.0.0.1:9"))

    return Live


@pytest.mark.parametrize("live", [False, True])
def test_every_point_of_a_grid_narrows_on_its_own(tmp_path, live):
    """The feed of a two-point grid (a ranking, a configuration search) run dry against known
    capacities, simulated and live: the point whose hold-outs are harder narrows to them and is
    confirmed; the other is confirmed at once."""
    from testbed.capacity.command import CapacityFeed
    from testbed.capacity.planning import plan
    from testbed.capacity.forecast import dry_feed

    p = plan([*[a for a in SYNTH if not a.startswith("policy=")], "policy=sarathi,vllm", f"output.dir={tmp_path}"])
    harder = {1: 2.0, 2: 1.6}

    def capacity(plan, u):
        pt = plan.points[u]
        return harder.get(pt.window, 5.0) if pt.holdout and pt.group == 0 else 3.0

    feed, done, _ = dry_feed(p, capacity, lambda *a: 1.0, 2, live_feed() if live else CapacityFeed)
    first, second = feed.points[0], feed.points[1]
    assert first.status == "confirmed" and 1.6 / 1.05 <= first.answer <= 1.6 and len(first.tried) == 3
    assert second.status == "confirmed" and 3.0 / 1.05 <= second.answer <= 3.0 and len(second.tried) == 1


def test_a_points_probe_count_counts_its_hold_out_probes_as_probes_csv_lists_them():
    """A host-bound or failed probe is a row of probes.csv but never enters its unit's search: the
    table's probe count must follow probes.csv (the fresh-clone CI of 2026-11-29 printed 7 probes
    beside 8 rows, the host-bound one in a hold-out stretch)."""
    from types import SimpleNamespace

    from testbed.capacity.results import _holdout_probes

    searches = {0: SimpleNamespace(probes=[1, 2, 3]), 1: SimpleNamespace(probes=[1]), 2: SimpleNamespace(probes=[])}
    point = SimpleNamespace(windows=[0], tried=[0, 1, 2], searches=searches)
    rows = {0: [{}] * 3, 1: [{"status": "finished"}, {"status": "host-bound"}], 2: [{"status": "failed"}]}
    assert _holdout_probes(point, rows) == 3  # units 1 and 2: 2 + 1 rows, though their searches hold 1 + 0
    assert _holdout_probes(SimpleNamespace(windows=[0, 1, 2], tried=[0, 1, 2], searches=searches), rows) == 0
