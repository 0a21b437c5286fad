"""What a capacity search leaves: one row per point (capacity, the SLO metrics at capacity, the
bracket, every probed rate), the probes, the deployment ranking, capacity.json, the figure, and
the summary MLflow run's tags and files."""
from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from engine.core.metrics import SLO
from testbed.sweep import jobs as sweep
from testbed.capacity.search import RateSearch
from testbed.capacity.steady import backlog_growth
from testbed.run.outputs import axis_name
from testbed.sweep.report import print_table, print_wide, to_markdown, write_comparison

JUDGED = ("slo_attainment", "ttft_p99_s", "tpot_p99_s", "itl_p99_s", "sched_delay_p50_s")  # after the warm-up
TABLE_METRICS = ("capacity_req_s", "binding", "capacity_median_req_s", "capacity_min_req_s", "capacity_max_req_s",
                 "capacities", "confirm_holdout", "confirm_upper", "unconfirmed_req_s", "output_tok_s", *JUDGED,
                 "holdout_value", "upper_req_s", "upper_value", "verified_windows", "probes", "search", "window_s",
                 "bracket_lo", "bracket_hi", "max_passed_req_s", "gpus", "replicas", "idle_gpus", "capacity_per_gpu",
                 "capacity_total_req_s", "cost_per_gpu_hour", "req_per_dollar", "rates")
PRINT_METRICS = ("capacity_req_s", "binding", "capacity_median_req_s", "capacity_min_req_s", "capacity_max_req_s",
                 "slo_attainment", "confirm_holdout", "confirm_upper", "probes", "search")
RANK_AXES = ("hardware", "parallel.pp", "parallel.tp", "model")  # deployment axes: a ranking is written
RANK_COLUMNS = ("gpus", "replicas", "idle_gpus", "status", "search", "capacity_req_s", "capacity_min_req_s",
                "capacity_max_req_s", "capacity_per_gpu", "capacity_total_req_s", "cost_per_gpu_hour", "req_per_dollar")
REPLICAS_NOTE = "replicas x capacity: arithmetic, not simulated behind a dispatcher"


def judge(slo: SLO, warmup_s: float, rate: float, result: Any) -> dict:
    """A probe's verdict metrics from its RunResult in memory (run in the probe's worker, so the
    probe's folder need not keep requests.csv: testbed/sweep/jobs.Job.judge)."""
    if result.error or not result.requests:
        return {}
    out = judged_frame(pd.DataFrame(result.requests), result.summary, slo, warmup_s, rate)
    if "stopped_at" in result.info:  # decided before its end (testbed/capacity/early.py)
        out["stopped_at"] = result.info["stopped_at"]
    return out


def judged(row: Mapping[str, Any], slo: SLO, warmup_s: float, rate: float) -> dict:
    """The same from a probe's folder (a live probe: bench serve's requests.csv)."""
    return judged_frame(pd.read_csv(Path(row["run_dir"]) / "requests.csv"), row, slo, warmup_s, rate)


def judged_frame(req: pd.DataFrame, summary: Mapping[str, Any], slo: SLO, warmup_s: float, rate: float) -> dict:
    """The criterion metrics of a probe, over the requests arriving after the warm-up (the
    definitions of `testbed run`; the time between tokens over all of them), its median
    scheduling delay and how fast its queue still grew (testbed/capacity/steady.py)."""
    req = req.assign(**{c: pd.to_numeric(req[c], errors="coerce") for c in
                        ("arrival_s", "first_token_s", "first_scheduled_s", "ttft_s", "tpot_s") if c in req})
    growth = backlog_growth(req, rate, warmup_s)
    late = req[req["arrival_s"] >= warmup_s]
    fin = late[late["status"] == "finished"]
    delay = (fin["first_scheduled_s"] - fin["arrival_s"]).dropna().to_numpy(float)
    out = {"itl_p99_s": float(summary.get("itl_p99_s", math.nan)), "backlog_growth": growth,
           "sched_delay_p50_s": float(np.median(delay)) if delay.size else math.nan}
    if not warmup_s:
        return {**{k: float(summary.get(k, math.nan)) for k in JUDGED[:3]}, **out}
    ttft, tpot = fin["ttft_s"].to_numpy(float), fin["tpot_s"].dropna().to_numpy(float)
    ok = ((fin["ttft_s"] <= slo.ttft_s) & (fin["tpot_s"].isna() | (fin["tpot_s"] <= slo.tpot_s))).sum()
    return {"slo_attainment": float(ok / len(late)) if len(late) else 0.0,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft.size else math.nan,
            "tpot_p99_s": float(np.percentile(tpot, 99)) if tpot.size else math.nan, **out}


# --- rows ----------------------------------------------------------------------------------------------

def point_row(pt: Any, search: RateSearch, probe_rows: list[dict], error: str | None) -> dict:
    """One search's row (a grid point in one window). The capacity is a probed rate that passed
    (never interpolated); its SLO metrics and throughput are that probe's."""
    out = search.outcome()
    gpus = pt.run.num_gpus
    price = pt.run.settings.hardware.cost_per_gpu_hour
    row: dict[str, Any] = {"point": pt.group, **pt.axis_values, "window": pt.window, "unit": pt.index,
                           "window_label": pt.window_label, "status": "finished",
                           "error": error, "probes": len(probe_rows), "search": out.status, "target": pt.target,
                           "gpus": gpus, "cost_per_gpu_hour": price, "bracket_lo": out.lo, "bracket_hi": out.hi,
                           "max_passed_req_s": out.max_passed, "rates": rates_text(search),
                           "violations": "; ".join(out.violations) or None}
    if pt.pruned:
        row["status"] = ("does not fit" if "does not fit" in pt.pruned else "host-bound"
                         if pt.pruned.startswith("host-bound") else "misses the SLO unloaded")
        row["search"] = "pruned before any probe" if row["status"] != "host-bound" else pt.pruned
    elif error and error.startswith("host-bound"):
        row["status"], row["search"] = "host-bound", f"stopped: probe {len(probe_rows) - 1} {error}"
    elif error:
        row["status"] = "does not fit" if "does not fit" in error else "failed"
        row["search"] = f"stopped: probe {len(probe_rows) - 1} failed"
    elif out.capacity is None:
        row["status"] = out.status
    at = next((r for r in probe_rows if r.get("workload.rate") == out.capacity and r.get("capacity.passed")), None)
    if out.capacity is not None and at is not None:
        row.update(capacity_req_s=out.capacity, output_tok_s=at.get("output_throughput_tok_s"),
                   throughput_tok_s=at.get("throughput_tok_s"), run_id=at.get("run_id"), run_dir=at.get("run_dir"),
                   window_s=at.get("window_s"), **{k: at["capacity.metrics"][k] for k in at["capacity.metrics"]})
    return row


def group_row(rows: list[dict], point: Any, units: Mapping[int, Any], probe_rows: Mapping[int, list[dict]],
              gpu_budget: int | None, interrupted: bool = False) -> dict:
    """A grid point's row from its windows' rows (testbed/capacity/cover.py): the capacity is the
    lowest window capacity, printed only once confirmed; `binding` the window that gave it; the
    median and range of the windows' own capacities as information; the confirmation probes
    beside it (`confirm_holdout`: the held-out stretch at the capacity, must pass; `confirm_upper`:
    the binding window at capacity x (1 + precision), must fail). The SLO metrics are the binding
    window's at the capacity."""
    by_unit = {r["unit"]: r for r in rows}
    found = sorted((r for r in rows if r["status"] == "finished" and r.get("capacity_req_s") is not None),
                   key=lambda r: r["capacity_req_s"])
    lacking = [r for r in rows if r not in found]
    answer, binding = point.answer, point.binding
    base = by_unit.get(binding) if binding in by_unit else (lacking[0] if lacking else (found[0] if found else rows[0]))
    row = dict(base)
    caps = [r["capacity_req_s"] for r in found]
    row.update(windows=len(rows), probes=sum(r["probes"] for r in rows) + _holdout_probes(point, probe_rows),
               capacities=" ".join(f"{r['window_label']}:{r.get('capacity_req_s') or math.nan:.4g}" for r in rows),
               rates=" | ".join(f"{r['window_label'].split(' ')[0]} {r['rates']}" for r in rows))
    if caps:
        row.update(capacity_median_req_s=caps[(len(caps) - 1) // 2], capacity_min_req_s=caps[0],
                   capacity_max_req_s=caps[-1])
    for key in ("window", "unit", "window_label"):
        row.pop(key, None)
    row.pop("capacity_req_s", None)
    _confirmation(row, point, units)
    status = point.status  # None: the search was stopped before it ended
    if status in ("no capacity", "stopped") and lacking:
        row["status"] = lacking[0]["status"]
        row["search"] = "; ".join((f"{r['window_label'].split(' ')[0]} " if len(rows) > 1 else "") + str(r["search"])
                                  for r in lacking)
        return row
    if status != "confirmed":
        row["status"] = "interrupted" if status is None else status
        row["search"] = ("interrupted" if status is None else
                         f"unconfirmed: {unconfirmed_line(point, units)}" if status == "unconfirmed" else str(status))
        row["unconfirmed_req_s"] = answer
        if status == "unconfirmed":  # the footer's one line under the table
            row["error"] = unconfirmed_line(point, units)
        return row
    row["status"] = "finished"
    at = by_unit[binding]
    violations = _violations(point)
    row.update(capacity_req_s=answer, binding=at["window_label"],
               binding_start_s=getattr(units[binding].run.workload, "start_s", None),
               search="confirmed" + ("; non-monotone: " + "; ".join(violations) if violations else ""))
    _capacity_columns(row, gpu_budget)
    return row


def unconfirmed_line(point: Any, units: Mapping[int, Any]) -> str:
    """What an unconfirmed point did and did not confirm, with no figure given as its capacity:
    `no capacity: 3.126 req/s held on w0, h1, failed on held-out h2 (0.915); capacity.holdouts=2 spent`
    (short: the table's footer prints 120 characters of it)."""
    def names(rate: float) -> str:
        held = [units[u].window_label.split(" ")[0] for u in point.units()
                if any(p.rate == rate and p.passed for p in point.searches[u].probes)]
        return ", ".join(held) if len(held) <= 5 else f"{len(held)} stretches"

    s, failed = point.settings, point.failed
    text = "no capacity: "
    if failed is not None:
        where = units[failed.unit]
        text += (f"{failed.rate:g} req/s held on {names(failed.rate) or 'no window'}, failed on "
                 f"{'held-out ' if failed.kind == 'holdout' else ''}{where.window_label.split(' ')[0]} ({failed.value:.3g})")
    if point.ended == "holdouts":
        return text + f"; capacity.holdouts={s.holdouts} spent"
    if point.ended == "narrow_probes":
        return text + f"; capacity.narrow_probes={s.narrow_probes} spent"
    lead = "; " if failed is not None else ""
    return text + lead + (f"{point.answer:g} req/s held on {names(point.answer)}, no held-out stretch left"
                          if point.answer is not None else "no held-out stretch left")


def _violations(point: Any) -> list[str]:
    out = [v for u in point.windows for v in point.searches[u].outcome().violations]
    up = point.upper_check()
    if up is not None and up.passed:
        out.append(f"the binding window passed at {up.rate:g} above its failure")
    return out


def _holdout_probes(point: Any, probe_rows: Mapping[int, list[dict]]) -> int:
    """The point's probes outside its windows (hold-out stretches), counted as probes.csv lists them: a
    host-bound or failed probe is a row there but never enters its search (the fresh-clone CI of
    2026-11-29 caught a table saying 7 probes beside 8 rows, the host-bound one in a hold-out)."""
    return sum(len(probe_rows.get(u, ())) for u in point.tried if u not in point.windows)


def _confirmation(row: dict, point: Any, units: Mapping[int, Any]) -> None:
    """The confirmation probes of the point's last answer, as numbers and as printed text."""
    hold, up = point.holdout_check(), point.upper_check()
    verified = [c for c in point.checks if c.kind == "verify"]
    if hold is not None and hold.passed is not None:
        label = units[hold.unit].window_label
        row.update(holdout=label, holdout_value=hold.value,
                   confirm_holdout=f"{label} {hold.value:.3g} {'pass' if hold.passed else 'FAIL'}")
    if up is not None and up.passed is not None:
        row.update(upper_req_s=up.rate, upper_value=up.value,
                   confirm_upper=f"{up.rate:g}: {up.value:.3g} {'PASS (non-monotone)' if up.passed else 'fail'}")
    if point.answer is not None and point.checks:
        row["verified_windows"] = sum(1 for c in verified if c.passed) + 1 + sum(
            1 for u in point.windows if u != point.binding and not any(c.unit == u for c in verified))


def _capacity_columns(row: dict, gpu_budget: int | None) -> None:
    """Per GPU and per dollar: under a budget, replicas of the layout fill it and the GPUs they
    leave idle are charged too (P=4 under a budget of 6 runs one replica on 6 GPUs' bill)."""
    gpus, price, cap = row["gpus"], row["cost_per_gpu_hour"], row["capacity_req_s"]
    replicas = gpu_budget // gpus if gpu_budget else 1
    charged = gpu_budget if gpu_budget else gpus
    total = replicas * cap
    row.update(replicas=replicas, idle_gpus=charged - replicas * gpus, capacity_per_gpu=total / charged,
               capacity_total_req_s=total, req_per_dollar=total * 3600 / (charged * price) if price else None)


def rates_text(search: RateSearch) -> str:
    """Every probed rate in order, '+' passed, '-' failed: '1.5+ 3+ 6- 4.24- ...'."""
    return " ".join(f"{p.rate:g}{'+' if p.passed else '-'}" for p in search.probes)


def probe_table(feed: Any, axes: list[str]) -> pd.DataFrame:
    keep = ("status", "error", "capacity.phase", "capacity.passed", "capacity.value", "capacity.steady", *JUDGED,
            "backlog_growth", "stopped_at", "host_flag", "ttft_path_s", "attempts", "window_s", "num_requests", "output_throughput_tok_s", "throughput_tok_s",
            "num_finished", "num_failed", "cpu_s", "wall_s", "run_id", "run_dir")
    rows = []
    for unit, probes in feed.probe_rows.items():
        pt = feed.p.points[unit]
        for k, r in enumerate(probes):
            metrics = r.get("capacity.metrics") or {}
            rows.append({"point": pt.group, "window": pt.window_label.split(" ")[0],
                         "start_s": getattr(pt.run.workload, "start_s", None), "probe": k, **{a: r.get(a) for a in axes},
                         "workload.rate": r.get("workload.rate"), **{c: metrics.get(c, r.get(c)) for c in keep}})
    return pd.DataFrame(rows, columns=["point", "window", "start_s", "probe", *axes, "workload.rate", *keep])


def ranking(df: pd.DataFrame, axes: list[str]) -> pd.DataFrame | None:
    """Deployments by capacity per GPU (and by requests per dollar where priced); `ties` lists the
    ranks whose capacity range over the windows overlaps this one's (not distinguishable by this
    search); the points without a capacity (does not fit, missed the SLO unloaded) last, saying why."""
    if not any(a in RANK_AXES for a in axes) or df.empty:
        return None
    cols = ["point", *axes, *[c for c in RANK_COLUMNS if c in df.columns]]
    ranked = df[df["status"] == "finished"].sort_values("capacity_per_gpu", ascending=False)[cols].copy()
    ranked.insert(0, "rank", range(1, len(ranked) + 1))
    ranked["ties"] = _ties(ranked, "capacity_per_gpu", "rank")
    if "req_per_dollar" in ranked and ranked["req_per_dollar"].notna().any():
        ranked["rank_by_cost"] = ranked["req_per_dollar"].rank(ascending=False, method="min")
        ranked["ties_by_cost"] = _ties(ranked, "req_per_dollar", "rank_by_cost")
    rest = df[df["status"] != "finished"][cols + (["error"] if "error" in df.columns else [])]
    return pd.concat([ranked, rest], ignore_index=True)


def _ties(ranked: pd.DataFrame, key: str, rank: str) -> list[str]:
    """Per row, the `rank`s whose [min, max] capacity over the windows (scaled like `key`) overlaps its own."""
    if "capacity_min_req_s" not in ranked:
        return [""] * len(ranked)
    scale = ranked[key] / ranked["capacity_req_s"]
    lo, hi = ranked["capacity_min_req_s"] * scale, ranked["capacity_max_req_s"] * scale
    out = []
    for i in range(len(ranked)):
        same = [f"{ranked[rank].iloc[j]:g}" for j in range(len(ranked))
                if j != i and lo.iloc[i] <= hi.iloc[j] and lo.iloc[j] <= hi.iloc[i]]
        out.append(", ".join(same))
    return out


# --- writing and showing ----------------------------------------------------------------------------------

def collect(p: Any, feed: Any, interrupted: bool = False) -> pd.DataFrame:
    """One row per grid point, over its windows (those with a probe done, one in flight, or pruned
    before any). A point whose first probe was still running when a signal came gets its row too:
    the interrupted search is part of what was done (the fresh-clone CI caught such a row missing)."""
    rows = []
    units = {pt.index: pt for pt in p.points}
    for g in p.groups:
        point = feed.points[g.group]
        windows = [units[u] for u in point.windows]
        if not any(feed.probe_rows[pt.index] or pt.pruned or pt.index in feed.busy for pt in windows):
            continue
        per = [point_row(pt, feed.searches[pt.index], feed.probe_rows[pt.index], feed.errors.get(pt.index))
               for pt in windows]
        row = group_row(per, point, units, feed.probe_rows, p.settings.gpus, interrupted)
        # what the table's footer names a row without a capacity by ("host-bound None: None" before)
        row["run_name"] = f"point {g.group} ({g.label})"
        if row["status"] != "finished" and not row.get("error"):
            row["error"] = row.get("search")
        rows.append(row)
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=["point", *p.axes, "status"])


def write(p: Any, feed: Any, wall: float, parent: sweep.ParentRun,
          interrupted: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """table.csv/.md, probes.csv, ranking.csv/.md, capacity.json, capacity.png; logged on the summary run."""
    from testbed.capacity.figure import plot_search

    df = collect(p, feed, bool(interrupted))
    df.attrs["estimate_s"] = (feed.estimate_s, feed.measured_estimate_s)
    if getattr(feed, "estimate_cpu_s", None):
        df.attrs["cpu_s"] = (feed.estimate_cpu_s, feed.cpu_spent())
    write_comparison(df, p.axes, p.out_dir, metrics=TABLE_METRICS, plots=False)
    probe_table(feed, p.axes).to_csv(p.out_dir / "probes.csv", index=False)
    ranked = ranking(df, p.axes)
    if ranked is not None:
        ranked.to_csv(p.out_dir / "ranking.csv", index=False)
        (p.out_dir / "ranking.md").write_text(to_markdown(ranked))
    if not interrupted:
        plot_search(p, feed, p.out_dir / "capacity.png")
    summary = {"experiment": p.name, "axes": p.axes, "overrides": p.overrides, "settings": _settings(p),
               "answers": _answers(p, df), "points": [_point_json(pt, feed) for pt in p.points], "wall_s": wall,
               "base_url": p.live.base_url if p.live is not None else None, "estimate_s": feed.estimate_s,
               "measured_estimate_s": feed.measured_estimate_s, "estimate_cpu_s": getattr(feed, "estimate_cpu_s", None),
               "cpu_s": (df.attrs.get("cpu_s") or (None, None))[1],
               "estimate_inputs": dict(getattr(feed, "estimate_inputs", None) or {})}
    if interrupted:
        summary["interrupted"] = interrupted
    (p.out_dir / "capacity.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    found = df[df["status"] == "finished"] if "status" in df else df
    parent.log({f"capacity.point{int(r['point'])}": r["capacity_req_s"] for _, r in found.iterrows()},
               tags={"capacity.probes": sum(len(s.probes) for s in feed.searches.values()), "capacity.wall_s": f"{wall:.1f}",
                     "compare.runs": len(df), "compare.failed": int((df["status"] != "finished").sum())})
    log_points(parent, p, df)
    parent.log_files(p.out_dir)
    return df, ranked


def log_points(parent: sweep.ParentRun, p: Any, df: pd.DataFrame) -> None:
    """One MLflow run per grid point (tag `testbed.kind=capacity-point`, grouped with its probes by
    `capacity.label`) whose metric `capacity/req_s` is the capacity the command prints: the first
    chart of the printed link's view. (Before, the chart showed the highest passing probe of any
    window: gLLM 1.47 where the command printed 1.06.)"""
    if parent.tracker is None or df.empty:
        return
    from mlflow.entities import Metric

    client, now = parent.tracker.client, int(time.time() * 1000)
    for _, r in df.iterrows():
        g = next(pt for pt in p.groups if pt.group == int(r["point"]))
        label = axis_name(g.axis_values)
        tags = {"testbed.kind": "capacity-point", "capacity.label": label, "capacity.point": str(g.group),
                "capacity.status": str(r.get("status")), "capacity.search": str(r.get("search"))[:5000],
                "capacity.binding": str(r.get("binding") or ""), sweep.PARENT_TAG: parent.run_id,
                **{f"axis.{k}": str(v) for k, v in g.axis_values.items()}}
        # `capacity/req_s` alone under `capacity/`: MLflow puts every `capacity/*` metric in the view's
        # first section, alphabetically, which put the hold-out's attainment before the capacity
        metrics = {k: r.get(c) for k, c in (("capacity/req_s", "capacity_req_s"), ("capacity.median_req_s",
                   "capacity_median_req_s"), ("capacity.min_req_s", "capacity_min_req_s"), ("capacity.max_req_s",
                   "capacity_max_req_s"), ("capacity.holdout_value", "holdout_value"), ("capacity.upper_value",
                   "upper_value"), ("slo_attainment", "slo_attainment"))}
        run = client.create_run(parent.tracker.experiment_id, run_name=f"{label} · capacity", tags=tags)
        client.log_batch(run.info.run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()
                                                   if isinstance(v, (int, float)) and math.isfinite(v)])
        client.set_terminated(run.info.run_id, "FINISHED")


def _answers(p: Any, df: pd.DataFrame) -> list[dict]:
    """Per grid point: what was printed, and the overrides that rerun it (scripts/capacity_long_check.py)."""
    out = []
    for _, r in df.iterrows():
        g = next(pt for pt in p.groups if pt.group == int(r["point"]))
        cap = r.get("capacity_req_s")
        out.append({"point": g.group, "label": axis_name(g.axis_values), "overrides": list(g.overrides),
                    "target": g.target, "trace": g.first_request is not None, "status": r.get("status"),
                    "capacity_req_s": None if cap is None or cap != cap else float(cap),
                    "binding": r.get("binding"), "binding_start_s": _number(r.get("binding_start_s")),
                    "search": r.get("search")})
    return out


def _number(v: Any) -> float | None:
    return None if v is None or not isinstance(v, (int, float)) or v != v else float(v)


def _settings(p: Any) -> dict:
    from dataclasses import asdict

    return asdict(p.settings)


def _point_json(pt: Any, feed: Any) -> dict:
    search = feed.searches[pt.index]
    out = search.outcome()
    u = pt.unloaded
    return {"point": pt.group, "window": pt.window_label, "holdout": pt.holdout, "label": pt.label,
            "start_s": getattr(pt.run.workload, "start_s", None), "seed": pt.run.workload.seed, "axes": pt.axis_values, "target": pt.target,
            "duration_s": pt.duration_s, "pruned": pt.pruned,
            "unloaded": None if u is None else {"ttft_s": u.ttft_s, "tpot_s": u.tpot_s, "longest_e2e_s": u.e2e_s},
            "error": feed.errors.get(pt.index), "capacity_req_s": out.capacity, "bracket": [out.lo, out.hi],
            "search": out.status, "monotone": out.monotone, "violations": out.violations,
            "probes": [{"rate": pr.rate, "passed": pr.passed, "value": pr.value, "phase": pr.phase,
                        **{k: v for k, v in pr.metrics.items()}} for pr in search.probes]}


def _printed(df: pd.DataFrame) -> pd.DataFrame:
    """The table as printed: an unconfirmed point shows no rate at all (its lowest window capacity
    would read as its capacity: the docs' live example printed 3.126 there), only the line below
    the table saying what held and what failed; table.csv keeps every figure."""
    if "status" not in df or not (df["status"] == "unconfirmed").any():
        return df
    out = df.copy()
    rows = out["status"] == "unconfirmed"
    for col in ("capacity_median_req_s", "capacity_min_req_s", "capacity_max_req_s", "slo_attainment", "confirm_upper"):
        if col in out:
            out.loc[rows, col] = None if out[col].dtype == object else math.nan
    out.loc[rows, "search"] = "unconfirmed"
    return out


def show(console: Any, p: Any, df: pd.DataFrame, ranked: pd.DataFrame | None, wall: float) -> None:
    probes = int(df["probes"].sum()) if "probes" in df else 0
    print_table(console, _printed(df), p.axes, f"{p.name}: capacity per point ({probes} probes, {wall:.1f} s)",
                metrics=PRINT_METRICS)
    planned_cpu, cpu = df.attrs.get("cpu_s") or (None, None)
    if planned_cpu:
        first = (df.attrs.get("estimate_s") or (None,))[0]
        console.print(f"the probes took {wall:.0f} s and {cpu:.0f} s of CPU; estimated {first:.0f} s and "
                      f"{planned_cpu:.0f} s of CPU at the start ({wall / first - 1:+.0%}, {cpu / planned_cpu - 1:+.0%})",
                      highlight=False)
    first, measured = df.attrs.get("estimate_s") or (None, None)
    if first and measured:
        console.print(f"the probes took {wall:.0f} s; estimated {first:.0f} s at the start ({wall / first - 1:+.0%}), "
                      f"{measured:.0f} s after the first probe ({wall / measured - 1:+.0%})", highlight=False)
    for _, r in df[df.get("search", pd.Series(dtype=str)) == "non-monotone"].iterrows():
        console.print(f"[yellow]non-monotone[/yellow] point {r['point']}: {r['violations']}; probes {r['rates']}",
                      highlight=False)
    if ranked is not None:
        from rich.table import Table

        ranked = ranked.drop(columns=["error"], errors="ignore")
        for col, rank, what in (("ties", "rank", "per GPU"), ("ties_by_cost", "rank_by_cost", "per dollar")):
            ties = [f"{r[rank]:g} ~ {r[col]}" for _, r in ranked.iterrows() if isinstance(r.get(col), str) and r[col]]
            if ties:
                console.print(f"not distinguishable {what} (capacity ranges over the windows overlap): rank "
                              + "; ".join(ties), highlight=False)

        t = Table(title=f"deployment ranking (capacity per GPU, idle GPUs of a budget charged; requests per dollar "
                        f"where priced; total = {REPLICAS_NOTE})")
        for c in ranked.columns:
            t.add_column(str(c), no_wrap=True)
        for _, r in ranked.iterrows():
            t.add_row(*["" if v is None or (isinstance(v, float) and math.isnan(v)) else
                        (f"{v:.4g}" if isinstance(v, float) else str(v)) for v in r])
        print_wide(console, t)
