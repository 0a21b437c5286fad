"""Evaluating a study's claims on its result table: select the rows a claim compares, reduce
them per group, aggregate over groups, judge with `verdicts.verdict`."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.base.errors import ConfigError
from testbed.reproduce.studies import Claim
from testbed.reproduce.verdicts import REDUCERS, Verdict, geomean, verdict

def _same(value: Any, want: Any) -> bool:
    if isinstance(want, list):
        return any(_same(value, w) for w in want)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return want is None
    if isinstance(value, (int, float)) and isinstance(want, (int, float)) and not isinstance(want, bool):
        return math.isclose(float(value), float(want), rel_tol=1e-9, abs_tol=1e-12)
    return str(value) == str(want)


def select(rows: Sequence[dict], spec: Mapping[str, Any]) -> list[dict]:
    return [r for r in rows if all(_same(r.get(k), v) for k, v in spec.items())]


def _group_key(row: dict, keys: Sequence[str]) -> tuple:
    out = []
    for k in keys:
        v = row.get(k)
        out.append(None if v is None or (isinstance(v, float) and math.isnan(v)) else v)
    return tuple(out)


def _why_failed(rows: Sequence[dict]) -> str:
    errs = [str(r.get("error") or r.get("status")) for r in rows if r.get("status") != "finished"]
    if any("does not fit" in e for e in errs):
        return "does not fit"
    return errs[0][:100] if errs else "no rows"


def _reduce(rows: Sequence[dict], metric: str, how: str) -> tuple[float | None, str]:
    """(value, reason when None) over the finished rows."""
    if not rows:
        return None, "no such runs in this mode"
    done = [r for r in rows if r.get("status") == "finished" and isinstance(r.get(metric), (int, float))
            and not math.isnan(r[metric])]
    if how == "only":
        if len(rows) > 1:
            raise ConfigError(f"{len(rows)} runs match where one was expected; add a filter or a reducer "
                              f"(a_reduce/b_reduce: max, min, mean)")
        if not done:
            return None, _why_failed(rows)
        return float(done[0][metric]), ""
    if not done:
        return None, _why_failed(rows)
    return float(REDUCERS[how]([r[metric] for r in done])), ""


@dataclass
class ClaimResult:
    claim: Claim
    measured: float | None
    baseline: float
    verdict: Verdict
    groups: list[tuple[str, float | None, str]]  # (group label, value, reason when None)

    def as_dict(self) -> dict:
        c = self.claim
        return {"id": c.id, "text": c.text, "published": c.published, "metric": c.metric, "kind": c.kind,
                "claimed": list(c.claimed) if isinstance(c.claimed, tuple) else c.claimed, "at_most": c.at_most,
                "measured": self.measured, "baseline": self.baseline, "verdict": self.verdict.category,
                "verdict_text": self.verdict.label, "detail": self.verdict.text,
                "groups": [{"group": g, "value": v, "reason": r} for g, v, r in self.groups]}


def evaluate_claim(claim: Claim, rows: Sequence[dict]) -> ClaimResult:
    """The claim's value on the table (per group, then aggregated) and its verdict."""
    values, refs = _group_values(claim, select(rows, claim.where))
    baseline = _baseline(claim, refs)
    good = [v for _, v, _ in values if v is not None]
    if not good:
        reasons = sorted({r for _, _, r in values if r}) or ["no matching runs"]
        return ClaimResult(claim, None, baseline, Verdict("n/a", "; ".join(reasons)), values)
    measured = _aggregate(claim, values, good)
    if claim.kind == "value" and math.isnan(baseline):
        return ClaimResult(claim, measured, baseline, Verdict("n/a", "no reference runs (b) to judge the direction"),
                           values)
    v = verdict(measured, claim.claimed, baseline=baseline, direction=claim.direction, at_most=claim.at_most,
                tolerance=claim.tolerance, abs_tol=claim.abs_tol, min_effect=claim.min_effect,
                fmt=lambda x: format_value(claim, x))
    if claim.kind == "spread" and claim.claimed is None and claim.at_most is None:
        v = Verdict("info", "")
    missing = [f"{g} ({why})" for g, val, why in values if val is None]
    if missing:
        v = Verdict(v.category, f"{v.text}; not measured: {', '.join(missing)}" if v.text else
                    f"not measured: {', '.join(missing)}", v.sized)
    return ClaimResult(claim, measured, baseline, v, values)


Group = tuple[str, "float | None", str]  # (group label, value, reason when None)


def _group_values(claim: Claim, rows: list[dict]) -> tuple[list[Group], list[float]]:
    """Per `pair_by` group: the claim's value (a/b ratio, a's value, or a's spread), and the
    reference values of b (value claims)."""
    a_rows = select(rows, claim.a)
    b_rows = select(rows, claim.b) if claim.b else []
    keys = [k for k in claim.pair_by]
    groups: dict[tuple, None] = {}
    for r in a_rows + b_rows:
        groups.setdefault(_group_key(r, keys), None)
    values: list[Group] = []
    refs: list[float] = []
    for g in groups:
        spec = {k: v for k, v in zip(keys, g) if v is not None}
        label = ", ".join(f"{v}" for v in g if v is not None) or "all"
        ga = select(a_rows, spec)
        if claim.kind == "spread":
            values.append(_spread(label, ga, claim.metric))
            continue
        gb = select(b_rows, spec)
        unmatched = _unmatched_load(claim, ga, gb)
        if unmatched:
            values.append((label, None, unmatched))
            continue
        va, why_a = _reduce(ga, claim.metric, claim.a_reduce)
        vb, why_b = _reduce(gb, claim.metric, claim.b_reduce) if claim.b else (None, "")
        if va is None or (claim.b and vb is None):
            values.append((label, None, why_a or why_b))
        elif claim.kind == "ratio":
            values.append((label, va / vb if vb else None, "" if vb else "division by zero"))
        else:  # value, b is the direction reference
            values.append((label, va, ""))
            if vb is not None:
                refs.append(vb)
    return values, refs


LOAD_METRIC = "request_throughput"  # finished requests per second over the run's window


def _unmatched_load(claim: Claim, ga: list[dict], gb: list[dict]) -> str:
    """Why the group's a and b did not serve the same load ("" when they did, or when not asked):
    their request throughputs differ by more than `claim.matched_load`."""
    if claim.matched_load is None or not claim.b:
        return ""
    ta, _ = _reduce(ga, LOAD_METRIC, claim.a_reduce)
    tb, _ = _reduce(gb, LOAD_METRIC, claim.b_reduce)
    if ta is None or tb is None or tb <= 0:
        return ""  # the metric's own reduction reports the missing run
    if abs(ta / tb - 1.0) > claim.matched_load:
        return f"load not matched: request throughput {ta / tb:.2f}x"
    return ""


def _spread(label: str, rows: list[dict], metric: str) -> Group:
    done = [r[metric] for r in rows if r.get("status") == "finished"]
    if len(done) < 2:
        return (label, None, "fewer than two finished runs")
    return (label, max(done) / min(done) - 1.0, "")


def _baseline(claim: Claim, refs: list[float]) -> float:
    if claim.kind == "ratio":
        return 1.0 if claim.baseline is None else float(claim.baseline)
    if claim.kind == "value":
        if claim.baseline is not None:
            return float(claim.baseline)
        return sum(refs) / len(refs) if refs else math.nan
    return 0.0


def _aggregate(claim: Claim, values: list[Group], good: list[float]) -> float:
    how = claim.aggregate
    if how == "only":
        if len(values) > 1:
            raise ConfigError(f"claim {claim.id}: {len(values)} groups ({', '.join(g for g, _, _ in values)}) "
                              f"where one was expected; set aggregate: max, min or mean")
        return good[0]
    if how == "mean":
        return geomean(good) if claim.kind == "ratio" else sum(good) / len(good)
    return float(REDUCERS[how](good))


def format_value(claim: Claim, v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if claim.kind == "spread":
        return f"{v * 100:.1f}%"
    if claim.show == "percent":
        return f"{(v - 1) * 100:+.1f}%"
    if claim.show == "value" or claim.kind == "value":
        return f"{v:.3g}"
    return f"{v:.2f}x"




def evaluate_safely(claim: Claim, rows: Sequence[dict]) -> ClaimResult:
    """A claim the study file words badly (e.g. two runs where one was expected) becomes a 'not
    assessed' line with the reason, not a lost report after a long run."""
    try:
        return evaluate_claim(claim, rows)
    except ConfigError as exc:
        return ClaimResult(claim, None, 1.0, Verdict("n/a", f"study file: {exc}"), [])
