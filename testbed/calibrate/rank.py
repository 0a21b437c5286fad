"""Does the simulator order the policies as the engine does? Rank agreement, error by load, error rows.

The question a researcher asks of a testbed is "is A better than B here?", not "is A's throughput
within 10%?". For each setting (P, workload, rate: every run of it has the same requests) this
compares the engine's order of the policies with the simulator's, per metric (throughput, mean TTFT,
mean TPOT, SLO attainment), by Kendall's tau-b over the policies' pairs. A pair is a tie on the
engine's side when its repeats overlap (the ranges [min, max] of the two policies' runs of that
setting meet: the engine cannot tell them apart; a single run has no range, so no ties); a tied pair
counts as agreeing whatever the simulator says, and `agree` is True when no other pair is ordered
the other way. A (setting, metric) where the engine ties EVERY pair (e.g. SLO attainment 1.0 for every
policy) has no order to agree with: it is reported as "no order" and not counted among the orders (until
2026-11-28 such rows counted as agreeing: four or five of every CPU set's six SLO orders were of that kind).
The engine's figure for a policy is the mean of its repeats; the simulator's is its
replay of the first (the simulator is deterministic: the repeats' replays differ only where the
runs' KV pool or settings do).
"""
from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CSV_METRICS = ("throughput_tok_s", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "tpot_p99_s", "e2el_mean_s",
               "slo_attainment")
RANK_METRICS = (("throughput_tok_s", "throughput"), ("ttft_mean_s", "TTFT mean"),
                ("tpot_mean_s", "TPOT mean"), ("slo_attainment", "SLO attainment"))


@dataclass(frozen=True)
class Replayed:
    """One real run and the simulator's replay of it."""

    run: str
    set: str  # fit | validation | test | "" (no manifest)
    policy: str
    setting: str  # e.g. "P=2 azure 5 req/s"
    offered: float | None  # requests/s offered (None: offline)
    real: dict
    sim: dict
    stall_count: int = 0
    stall_s: float = 0.0


def setting_label(spec) -> tuple[str, float | None]:
    """The setting a run belongs to, minus its policy, and the rate it offered (None: offline)."""
    wl = spec.workload
    rate = getattr(wl, "rate", None)
    offline = getattr(wl, "arrival", None) == "offline" or rate is None
    where = "offline" if offline else f"{rate:g} req/s"
    return f"P={spec.settings.parallel.pp} {spec.workload_name} {where}", (None if offline else float(rate))


def kendall_tau(real: Sequence[float], sim: Sequence[float], tied: Sequence[Sequence[bool]]) -> tuple[float, int, int, int]:
    """(tau-b, concordant, discordant, engine ties) over every pair; `tied[i][j]`: the engine cannot
    order i and j. tau-b counts a simulator tie or an engine tie as neither concordant nor
    discordant and normalises by the untied pairs of each side."""
    n = len(real)
    conc = disc = ties_r = ties_s = 0
    for i in range(n):
        for j in range(i + 1, n):
            dr = 0 if tied[i][j] else _sign(real[i] - real[j])
            ds = _sign(sim[i] - sim[j])
            ties_r += dr == 0
            ties_s += ds == 0
            if dr and ds:
                conc += dr == ds
                disc += dr != ds
    pairs = n * (n - 1) // 2
    denom = math.sqrt((pairs - ties_r) * (pairs - ties_s))
    return ((conc - disc) / denom if denom else float("nan")), conc, disc, ties_r


def _sign(x: float) -> int:
    return (x > 0) - (x < 0) if math.isfinite(x) else 0


def rank_table(rows: Sequence[Replayed]) -> list[dict]:
    """One entry per (setting, metric): the engine's and the simulator's order, tau-b, agreement."""
    out = []
    for setting, group in _by_setting(rows).items():
        policies = sorted({r.policy for r in group})
        if len(policies) < 2:
            continue
        for metric, label in RANK_METRICS:
            real = {p: [float(r.real.get(metric, math.nan)) for r in group if r.policy == p] for p in policies}
            sim = {p: next(float(r.sim.get(metric, math.nan)) for r in group if r.policy == p) for p in policies}
            means = [sum(v) / len(v) for v in real.values()]
            tied = [[_overlap(real[a], real[b]) for b in policies] for a in policies]
            tau, conc, disc, ties = kendall_tau(means, [sim[p] for p in policies], tied)
            higher = metric in ("throughput_tok_s", "slo_attainment")
            out.append({"setting": setting, "metric": label, "tau": tau, "concordant": conc, "discordant": disc,
                        "engine_ties": ties, "agree": disc == 0,
                        "ordered": ties < len(policies) * (len(policies) - 1) // 2,
                        "engine_order": _order(dict(zip(policies, means)), higher),
                        "sim_order": _order(sim, higher)})
    return out


def _overlap(a: list[float], b: list[float]) -> bool:
    """Repeats overlap: both policies were run more than once and their ranges meet."""
    return len(a) > 1 and len(b) > 1 and min(a) <= max(b) and min(b) <= max(a)


def _order(values: dict[str, float], higher_first: bool) -> str:
    return " > ".join(sorted(values, key=lambda p: values[p], reverse=higher_first)) if higher_first else \
        " < ".join(sorted(values, key=lambda p: values[p]))


def _by_setting(rows: Sequence[Replayed]) -> dict[str, list[Replayed]]:
    groups: dict[str, list[Replayed]] = {}
    for r in rows:
        groups.setdefault(r.setting, []).append(r)
    return groups


def error_by_load(rows: Sequence[Replayed], metrics: Sequence[str] = ("throughput_tok_s", "ttft_mean_s",
                                                                      "tpot_mean_s")) -> list[dict]:
    """Mean |error| per setting, with the load the engine carried there: offered req/s over the
    engine's served req/s (offline: 'offline', the engine saturated)."""
    out = []
    for setting, group in _by_setting(rows).items():
        served = sum(float(r.real.get("request_throughput", math.nan)) for r in group) / len(group)
        offered = group[0].offered
        entry = {"setting": setting, "runs": len(group),
                 "load": "offline" if offered is None else f"{offered / served:.2f}" if served else "?"}
        for m in metrics:
            errs = [abs(_err(r.sim.get(m), r.real.get(m))) for r in group]
            errs = [e for e in errs if math.isfinite(e)]
            entry[m] = sum(errs) / len(errs) if errs else math.nan
        out.append(entry)
    return out


def _err(sim, real) -> float:
    try:
        s, r = float(sim), float(real)
    except (TypeError, ValueError):
        return math.nan
    return s / r - 1.0 if r else math.nan


def write_errors_csv(rows: Sequence[Replayed], path: Path, metrics: Sequence[str]) -> None:
    """One row per (run, metric, predicted, actual, error): a table any tool reads."""
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["run", "set", "policy", "setting", "metric", "predicted", "actual", "error",
                    "stalls", "stall_s"])
        for r in rows:
            for m in metrics:
                pred, act = r.sim.get(m), r.real.get(m)
                err = _err(pred, act)
                w.writerow([r.run, r.set, r.policy, r.setting, m, _num(pred), _num(act),
                            "" if not math.isfinite(err) else f"{err:.6f}", r.stall_count, f"{r.stall_s:.4f}"])


def _num(x) -> str:
    try:
        return f"{float(x):.6g}"
    except (TypeError, ValueError):
        return ""


def _verdict(t: dict) -> str:
    return "-" if not t["ordered"] else "yes" if t["agree"] else "NO"


def format_rank(table: list[dict], by_load: list[dict]) -> str:
    lines = ["\nrank agreement: the policies ordered by the engine (mean of its repeats) and by the simulator",
             f"  {'setting':<28}{'metric':<16}{'tau':>6}{'disc.':>6}{'ties':>5}  agree  engine order | simulator order"]
    for t in table:
        tau = "  nan" if not math.isfinite(t["tau"]) else f"{t['tau']:+.2f}"
        lines.append(f"  {t['setting']:<28}{t['metric']:<16}{tau:>6}{t['discordant']:>6}{t['engine_ties']:>5}  "
                     f"{_verdict(t):<5}  {t['engine_order']} | {t['sim_order']}")
    ordered = [t for t in table if t["ordered"]]
    n_agree = sum(t["agree"] for t in ordered)
    lines.append(f"  {n_agree} of {len(ordered)} (setting, metric) orders agree (ties: the engine's repeats overlap)"
                 + (f"; {len(table) - len(ordered)} more with every pair tied on the engine: no order, not counted"
                    if len(ordered) < len(table) else ""))
    lines.append("\nerror by load (mean |sim / real - 1| over the setting's runs; load = offered / served req/s)")
    lines.append(f"  {'setting':<28}{'runs':>5}{'load':>9}{'throughput':>12}{'TTFT mean':>11}{'TPOT mean':>11}")
    for e in by_load:
        lines.append(f"  {e['setting']:<28}{e['runs']:>5}{e['load']:>9}"
                     + "".join(f"{100 * e[m]:>10.1f}% " for m in ("throughput_tok_s", "ttft_mean_s", "tpot_mean_s")))
    return "\n".join(lines)
