"""`testbed reproduce <study>`: rerun a seed paper's headline experiments in simulation and say,
claim by claim, whether the testbed reproduces what the paper published.

    testbed reproduce --list
    testbed reproduce tdpipe-scaling
    testbed reproduce gllm-rates --quick
    testbed reproduce gllm-rates hardware=h100-80g policy.T=16      # your profile / hyperparameters
    testbed reproduce my-study.yaml                                  # a study file of your own

A study is a YAML file in `testbed/studies/` (found next to this module, so an editable install
and a source checkout both see it) plus the generic code below:

- `base`, `parts` (setups, e.g. one per GPU + model) and `grids` (systems, e.g. one per policy),
  each a list of `key=value` overrides; a comma list is an axis, as in `testbed compare`. Every
  grid runs in every part (or in the parts it names); the points are `testbed compare` points
  (`compare.grid`, `compare.run_point`, `compare._run_jobs`), all nested under one parent MLflow
  run in experiment `reproduce-<study>` (`reproduce-<study>-quick` with `--quick`).
- `quick` lists (study, part or grid level) replace keys in `--quick` mode: fewer requests and
  sweep points, for CI smoke tests.
- `policy`: alternatives, the first whose policy is registered (and composes) is used for every
  run; e.g. SiPipe's study uses `policy=sipipe` once it lands, else Sarathi with the runtime.*
  switches.
- `claims`: what REFERENCE.md states, each computed from the table (a ratio of two systems, a
  value, or a spread over a sweep) and judged by `verdict` (the rules are in its docstring and in
  every report).
- `figures`: which rows to plot against which x (`report.plot_comparison`).

Extra `key=value` overrides on the command line apply to every run, where meaningful: a key the
study sets is replaced (a comma list is allowed only for a key that is already an axis, e.g.
`workload.rate=1,2,4`); `policy.<param>=` goes only to the runs whose policy has that parameter;
`policy=` is refused when the study compares several policies (it would make them all one).

Output: `<output.dir>/reproduce/<study>[-quick]/` with `report.md` (setup, claim table with the
published value beside the testbed's, verdict lines, figures, result table), `claims.json`,
`table.csv`, `table.md`, `figures/` and `runs/<point>/`. Identical runs (e.g. 1 GPU with "PP" or
"TP") run once. The last line printed is the report's path.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from engine.errors import ConfigError, TestbedError

STUDY_SUFFIX = ".yaml"
DEFAULT_TOLERANCE = 0.25  # size: within +-25% of the claimed effect (ratio - baseline)
DEFAULT_ABS_TOL = 0.02  # ... but never tighter than +-0.02 (2 points of a ratio or a fraction)
DEFAULT_MIN_EFFECT = 0.01  # direction: the effect must be at least 1% of the baseline
MARKER = "reproduce.json"  # written in every study directory; only such a directory is replaced

VERDICT_TEXT = {
    "size": "reproduced in direction and size",
    "direction": "reproduced in direction only",
    "none": "not reproduced",
    "info": "no published number (shown for information)",
    "n/a": "not assessed",
}


# --- study files ----------------------------------------------------------------------------------

def studies_dir() -> Path:
    """The packaged study files (importlib.resources, so an installed package finds them too)."""
    from importlib.resources import files

    return Path(str(files("testbed.studies")))


def list_studies() -> list[str]:
    return sorted(p.stem for p in studies_dir().glob(f"*{STUDY_SUFFIX}"))


@dataclass(frozen=True)
class Part:
    name: str
    label: str
    overrides: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()


@dataclass(frozen=True)
class GridSpec:
    system: str  # label; may hold {axis.key} placeholders
    overrides: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    parts: tuple[str, ...] | None = None  # None: every part


@dataclass(frozen=True)
class Claim:
    id: str
    text: str  # what the claim is about, one line
    published: str  # the claim as REFERENCE.md states it
    metric: str
    kind: str = "ratio"  # ratio (a / b) | value (a, b = direction reference) | spread (max/min - 1 over a)
    a: Mapping[str, Any] = field(default_factory=dict)
    b: Mapping[str, Any] = field(default_factory=dict)
    where: Mapping[str, Any] = field(default_factory=dict)
    pair_by: tuple[str, ...] = ("part",)
    a_reduce: str = "only"  # only | max | min | mean, over the a rows of one group
    b_reduce: str = "only"
    aggregate: str = "only"  # only | max | min | mean (geometric for ratios), over groups
    claimed: float | tuple[float, float] | None = None
    at_most: float | None = None  # a bound claim ("within 2%")
    baseline: float | None = None  # neutral value (ratio: 1.0); value claims: b's value
    direction: str | None = None  # higher | lower (when claimed gives none)
    tolerance: float = DEFAULT_TOLERANCE
    abs_tol: float = DEFAULT_ABS_TOL
    min_effect: float = DEFAULT_MIN_EFFECT
    show: str = "ratio"  # ratio (1.23x) | percent (+23%) | value (0.87)


@dataclass(frozen=True)
class FigureSpec:
    name: str
    title: str
    x: str | None
    series: tuple[str, ...]
    metrics: tuple[str, ...]
    where: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Study:
    name: str
    title: str
    paper: str
    reference: str
    setup: str
    requires: tuple[str, ...]
    policy: tuple[tuple[str, ...], ...]  # alternatives; () = the grids choose
    base: tuple[str, ...]
    quick: tuple[str, ...]
    parts: tuple[Part, ...]
    grids: tuple[GridSpec, ...]
    claims: tuple[Claim, ...]
    figures: tuple[FigureSpec, ...]
    notes: str = ""
    path: str = ""


def _strs(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float, bool)) for v in value):
        raise ConfigError(f"{where}: expected a list of key=value strings, got {value!r}")
    return tuple(str(v) for v in value)


def _claimed(value: Any, where: str) -> float | tuple[float, float] | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
        lo, hi = sorted(float(v) for v in value)
        return (lo, hi)
    raise ConfigError(f"{where}: claimed must be a number, [low, high] or null, got {value!r}")


def load_study(name_or_path: str) -> Study:
    """A study by name (`testbed reproduce --list`) or a path to a study YAML file."""
    import yaml

    path = Path(name_or_path)
    if not (name_or_path.endswith(STUDY_SUFFIX) and path.is_file()):
        names = list_studies()
        if name_or_path not in names:
            raise ConfigError(f"unknown study {name_or_path!r}; valid choices: {', '.join(names)}")
        path = studies_dir() / f"{name_or_path}{STUDY_SUFFIX}"
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"study file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"study file {path}: expected a mapping at the top level")
    known = {"name", "title", "paper", "reference", "setup", "requires", "policy", "base", "quick", "parts", "grids",
             "claims", "figures", "notes"}
    extra = sorted(set(raw) - known)
    if extra:
        raise ConfigError(f"study file {path}: unknown key(s) {', '.join(extra)}; "
                          f"valid keys: {', '.join(sorted(known))}")
    name = str(raw.get("name") or path.stem)
    parts = tuple(Part(name=str(p["name"]), label=str(p.get("label", p["name"])),
                       overrides=_strs(p.get("overrides"), f"{name}: part {p['name']}"),
                       quick=_strs(p.get("quick"), f"{name}: part {p['name']} quick"))
                  for p in (raw.get("parts") or [{"name": "main"}]))
    part_names = {p.name for p in parts}
    grids = []
    for g in raw.get("grids") or []:
        only = g.get("parts")
        if only is not None:
            only = _strs(only, f"{name}: grid {g.get('system')} parts")
            bad = sorted(set(only) - part_names)
            if bad:
                raise ConfigError(f"study {name}: grid {g.get('system')!r} names unknown part(s) {', '.join(bad)}; "
                                  f"valid choices: {', '.join(sorted(part_names))}")
        grids.append(GridSpec(system=str(g["system"]), overrides=_strs(g.get("overrides"), f"{name}: grid"),
                              quick=_strs(g.get("quick"), f"{name}: grid quick"), parts=only))
    if not grids:
        raise ConfigError(f"study {name}: no grids")
    claims = []
    for c in raw.get("claims") or []:
        where = f"study {name}: claim {c.get('id')}"
        kind = c.get("kind", "ratio")
        if kind not in ("ratio", "value", "spread"):
            raise ConfigError(f"{where}: kind must be ratio, value or spread, got {kind!r}")
        for key in ("a_reduce", "b_reduce", "aggregate"):
            if c.get(key, "only") not in REDUCERS:
                raise ConfigError(f"{where}: {key} must be one of {', '.join(REDUCERS)}")
        if c.get("direction") not in (None, "higher", "lower"):
            raise ConfigError(f"{where}: direction must be higher or lower")
        claims.append(Claim(
            id=str(c["id"]), text=str(c.get("text", c["id"])), published=str(c.get("published", "")),
            metric=str(c["metric"]), kind=kind, a=dict(c.get("a") or {}), b=dict(c.get("b") or {}),
            where=dict(c.get("where") or {}), pair_by=_strs(c.get("pair_by", ["part"]), where),
            a_reduce=c.get("a_reduce", "only"), b_reduce=c.get("b_reduce", "only"),
            aggregate=c.get("aggregate", "only"), claimed=_claimed(c.get("claimed"), where),
            at_most=c.get("at_most"), baseline=c.get("baseline"), direction=c.get("direction"),
            tolerance=float(c.get("tolerance", DEFAULT_TOLERANCE)), abs_tol=float(c.get("abs_tol", DEFAULT_ABS_TOL)),
            min_effect=float(c.get("min_effect", DEFAULT_MIN_EFFECT)), show=c.get("show", "ratio")))
    figures = tuple(FigureSpec(name=str(f["name"]), title=str(f.get("title", f["name"])), x=f.get("x"),
                               series=_strs(f.get("series", ["system"]), f"{name}: figure"),
                               metrics=_strs(f.get("metrics", ["throughput_tok_s"]), f"{name}: figure"),
                               where=dict(f.get("where") or {}))
                    for f in raw.get("figures") or [])
    policy = tuple(_strs(alt, f"{name}: policy") for alt in (raw.get("policy") or []))
    return Study(name=name, title=str(raw.get("title", name)), paper=str(raw.get("paper", "")),
                 reference=str(raw.get("reference", "")), setup=str(raw.get("setup", "")).strip(),
                 requires=_strs(raw.get("requires"), f"{name}: requires"), policy=policy,
                 base=_strs(raw.get("base"), f"{name}: base"), quick=_strs(raw.get("quick"), f"{name}: quick"),
                 parts=parts, grids=tuple(grids), claims=tuple(claims), figures=figures,
                 notes=str(raw.get("notes", "")).strip(), path=str(path))


# --- verdicts --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    category: str  # size | direction | none | info | n/a
    text: str  # one line: why
    sized: bool = True  # False: the claim states a direction but no number

    @property
    def label(self) -> str:
        if self.category == "direction" and not self.sized:
            return "reproduced in direction (no size published)"
        return VERDICT_TEXT[self.category]


def verdict(measured: float | None, claimed: float | tuple[float, float] | None = None, *, baseline: float = 1.0,
            direction: str | None = None, at_most: float | None = None, tolerance: float = DEFAULT_TOLERANCE,
            abs_tol: float = DEFAULT_ABS_TOL, min_effect: float = DEFAULT_MIN_EFFECT, fmt=None) -> Verdict:
    """Judge a measured number against a published claim.

    - The effect is `measured - baseline` (baseline: 1 for a ratio, 2 for "super-linear 2->4
      GPU scaling", the reference system's value for a value claim).
    - Direction: the effect has the claimed sign (the sign of claimed - baseline, or `direction`
      when no number is claimed) and is at least `min_effect` x |baseline| (1%), so a tie is no
      reproduction.
    - Size: the measured value lies in the claimed value or range, widened on each side by
      `tolerance` (25%) of the claimed effect at that end, and by at least `abs_tol` (0.02).
      E.g. "1.91x": effect 0.91, band 1.68x-2.14x; "+3-6%": band 1.01x-1.08x.
    - Verdict: direction and size -> "reproduced in direction and size"; direction only ->
      "reproduced in direction only"; otherwise "not reproduced".
    - A bound claim (`at_most`, e.g. "within 2%"): |measured| <= bound x (1 + tolerance) is
      reproduced (direction and size), else not reproduced.
    - No number and no direction: "no published number" (informational row).
    """
    fmt = fmt or _num
    if measured is None or (isinstance(measured, float) and math.isnan(measured)):
        return Verdict("n/a", "no measurement")
    if at_most is not None:
        limit = abs(at_most) * (1 + tolerance)
        ok = abs(measured) <= limit
        return Verdict("size" if ok else "none",
                       f"{_pct(measured)} {'<=' if ok else '>'} {_pct(limit)} "
                       f"(bound {_pct(at_most)} + {tolerance:.0%})")
    if claimed is None and direction is None:
        return Verdict("info", "")
    lo = hi = None
    if claimed is not None:
        lo, hi = (claimed, claimed) if isinstance(claimed, (int, float)) else claimed
        mid = (lo + hi) / 2
        direction = direction or ("higher" if mid > baseline else "lower")
    effect = measured - baseline
    floor = min_effect * abs(baseline) if baseline else min_effect
    dir_ok = (effect > 0 if direction == "higher" else effect < 0) and abs(effect) >= floor
    sign = "above" if direction == "higher" else "below"
    dir_text = f"{'is' if dir_ok else 'is not'} {sign} {fmt(baseline)} by >= {min_effect:.0%}"
    if lo is None:
        return Verdict("direction" if dir_ok else "none", f"{dir_text}; no size published", sized=False)
    band_lo = lo - max(tolerance * abs(lo - baseline), abs_tol)
    band_hi = hi + max(tolerance * abs(hi - baseline), abs_tol)
    size_ok = band_lo <= measured <= band_hi
    size_text = f"{'inside' if size_ok else 'outside'} the size band {fmt(band_lo)} to {fmt(band_hi)}"
    if dir_ok and size_ok:
        return Verdict("size", f"{dir_text}, {size_text}")
    if dir_ok:
        return Verdict("direction", f"{dir_text}, {size_text}")
    return Verdict("none", f"{dir_text}")


def _num(v: float) -> str:
    return f"{v:.3g}"


def _pct(v: float) -> str:
    return f"{v * 100:.1f}%"


# --- evaluating a claim on the table ---------------------------------------------------------------

def _geomean(values: Sequence[float]) -> float:
    if all(v > 0 for v in values):
        return math.exp(sum(math.log(v) for v in values) / len(values))
    return sum(values) / len(values)


REDUCERS = {"only": None, "max": max, "min": min, "mean": lambda v: sum(v) / len(v), "geomean": _geomean}


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
    rows = select(rows, claim.where)
    a_rows = select(rows, claim.a)
    b_rows = select(rows, claim.b) if claim.b else []
    keys = [k for k in claim.pair_by]
    groups: dict[tuple, None] = {}
    for r in a_rows + b_rows:
        groups.setdefault(_group_key(r, keys), None)
    values: list[tuple[str, float | None, str]] = []
    refs: list[float] = []
    for g in groups:
        spec = {k: v for k, v in zip(keys, g) if v is not None}
        label = ", ".join(f"{v}" for v in g if v is not None) or "all"
        ga = select(a_rows, spec)
        if claim.kind == "spread":
            done = [r[claim.metric] for r in ga if r.get("status") == "finished"]
            if len(done) < 2:
                values.append((label, None, "fewer than two finished runs"))
                continue
            values.append((label, max(done) / min(done) - 1.0, ""))
            continue
        va, why_a = _reduce(ga, claim.metric, claim.a_reduce)
        gb = select(b_rows, spec)
        vb, why_b = _reduce(gb, claim.metric, claim.b_reduce) if claim.b else (None, "")
        if va is None or (claim.b and vb is None):
            values.append((label, None, why_a or why_b))
            continue
        if claim.kind == "ratio":
            values.append((label, va / vb if vb else None, "" if vb else "division by zero"))
        else:  # value, b is the direction reference
            values.append((label, va, ""))
            if vb is not None:
                refs.append(vb)
    good = [v for _, v, _ in values if v is not None]
    if claim.kind == "ratio":
        baseline = 1.0 if claim.baseline is None else float(claim.baseline)
    elif claim.kind == "value":
        if claim.baseline is not None:
            baseline = float(claim.baseline)
        else:
            baseline = sum(refs) / len(refs) if refs else math.nan
    else:
        baseline = 0.0
    if not good:
        reasons = sorted({r for _, _, r in values if r}) or ["no matching runs"]
        return ClaimResult(claim, None, baseline, Verdict("n/a", "; ".join(reasons)), values)
    how = claim.aggregate
    if how == "only":
        if len(values) > 1:
            raise ConfigError(f"claim {claim.id}: {len(values)} groups ({', '.join(g for g, _, _ in values)}) "
                              f"where one was expected; set aggregate: max, min or mean")
        measured = good[0]
    elif how == "mean":
        measured = _geomean(good) if claim.kind == "ratio" else sum(good) / len(good)
    else:
        measured = float(REDUCERS[how](good))
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


# --- planning: overrides -> grid points -----------------------------------------------------------

def _key(ov: str) -> str:
    return ov.partition("=")[0].lstrip("+~")


def merge(*layers: Sequence[str]) -> list[str]:
    """Later layers replace earlier overrides of the same key (order of first appearance kept)."""
    out: dict[str, str] = {}
    for layer in layers:
        for ov in layer:
            if "=" not in ov:
                raise ConfigError(f"override {ov!r} is not key=value")
            k = _key(ov)
            if k in out:
                del out[k]
            out[k] = ov
    return list(out.values())


def _is_sweep(ov: str) -> bool:
    from testbed.compare import grid

    axes, _ = grid([ov])
    return bool(axes)


def _policy_of(overrides: Sequence[str]) -> str:
    from testbed.config import DEFAULTS

    for ov in reversed(overrides):
        if _key(ov) == "policy":
            return ov.partition("=")[2]
    return DEFAULTS["policy"]


def _policy_fields(name: str) -> set[str]:
    import dataclasses

    from engine.policy import POLICIES

    return {f.name for f in dataclasses.fields(POLICIES.get(name).Params)}


@dataclass
class Planned:
    part: Part
    grid: GridSpec
    overrides: list[str]


def check_requirements(study: Study) -> None:
    from engine.policy import POLICIES

    import policies  # noqa: F401  (registers every policy)

    for name in study.requires:
        if name not in POLICIES:
            raise TestbedError(f"policy {name} is not available (registered: {', '.join(POLICIES.names())}); "
                               f"study {study.name} needs it")


def choose_policy(study: Study, base: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the first usable alternative of `study.policy`, notes on the ones skipped)."""
    from engine.policy import POLICIES
    from testbed.config import compose

    notes: list[str] = []
    if not study.policy:
        return [], notes
    for alt in study.policy:
        name = _policy_of(alt)
        if name not in POLICIES:
            notes.append(f"policy {name} is not registered: using the next alternative")
            continue
        try:
            compose(merge(base, alt))
        except ConfigError as exc:
            notes.append(f"{' '.join(alt)}: {exc}; using the next alternative")
            continue
        return list(alt), notes
    raise ConfigError(f"study {study.name}: no usable policy among {[' '.join(a) for a in study.policy]}: "
                      + "; ".join(notes))


def plan(study: Study, quick: bool, user: Sequence[str]) -> tuple[list[Planned], list[str]]:
    """Every (part, grid) with its merged overrides; user overrides applied where meaningful."""
    notes: list[str] = []
    base = merge(study.base, study.quick if quick else ())
    chosen, notes = choose_policy(study, merge(base, [u for u in user if not _key(u).startswith("policy")]))
    if chosen:
        notes.append(f"batching policy of every run: `{' '.join(chosen)}` (the first usable of the study's "
                     f"alternatives)")
    user_policy = [u for u in user if _key(u) == "policy"]
    planned: list[Planned] = []
    for part in study.parts:
        for g in study.grids:
            if g.parts is not None and part.name not in g.parts:
                continue
            ovs = merge(base, chosen, part.overrides, part.quick if quick else (), g.overrides,
                        g.quick if quick else ())
            planned.append(Planned(part, g, ovs))
    policies_used = {_policy_of(merge(p.overrides, user_policy)) for p in planned}
    if user_policy and len({_policy_of(p.overrides) for p in planned}) > 1:
        raise ConfigError(f"{user_policy[0]} would replace every system of study {study.name} "
                          f"({', '.join(sorted({_policy_of(p.overrides) for p in planned}))}); "
                          f"set a policy's parameter with policy.<param>= instead")
    for u in user:
        k = _key(u)
        if "=" not in u:
            raise ConfigError(f"override {u!r} is not key=value (e.g. hardware=h100-80g, policy.T=16)")
        sweep = _is_sweep(u)
        if sweep and not any(any(_key(o) == k and _is_sweep(o) for o in p.overrides) for p in planned):
            raise ConfigError(f"{u}: a comma list is allowed only for a key that is already an axis of study "
                              f"{study.name}; the axes: {', '.join(study_axes(planned)) or '(none)'}")
        if k.startswith("policy.") and k.count(".") == 1:
            param = k.split(".", 1)[1]
            takers = [p for p in planned if param in _policy_fields(_policy_of(merge(p.overrides, user_policy)))]
            if not takers:
                raise ConfigError(f"{u}: no policy of study {study.name} has parameter {param!r} "
                                  f"(policies: {', '.join(sorted(policies_used))})")
            taken = {id(p) for p in takers}
            skipped = sorted({_policy_of(p.overrides) for p in planned if id(p) not in taken})
            if skipped:
                used = ", ".join(sorted({_policy_of(p.overrides) for p in takers}))
                notes.append(f"{u} applied to the runs of {used} only (not a parameter of {', '.join(skipped)})")
            for p in takers:
                p.overrides = merge(p.overrides, [u])
        else:
            for p in planned:
                p.overrides = merge(p.overrides, [u])
    return planned, notes


def study_axes(planned: Sequence[Planned]) -> list[str]:
    axes: list[str] = []
    for p in planned:
        for ov in p.overrides:
            if _is_sweep(ov) and _key(ov) not in axes:
                axes.append(_key(ov))
    return axes


def _label(template: str, values: Mapping[str, Any]) -> str:
    return re.sub(r"\{([^{}]+)\}", lambda m: str(values.get(m.group(1), m.group(0))), template)


def derived_columns(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Columns computed from a point's config: GPUs (pp x tp) and, when set, the link in Mbps/ms."""
    from testbed.config import run_config

    rc = run_config(cfg)
    out: dict[str, Any] = {"gpus": rc.parallel.pp * rc.parallel.tp}
    if rc.link.bandwidth is not None:
        out["link_mbps"] = round(rc.link.bandwidth * 8 / 1e6, 6)
    if rc.link.latency is not None:
        out["link_ms"] = round(rc.link.latency * 1e3, 6)
    return out


def _config_value(cfg: Mapping[str, Any], key: str) -> Any:
    from testbed.overrides import get_path

    try:
        value = get_path(cfg, key)
    except (KeyError, TypeError):
        return None
    if isinstance(value, Mapping):
        return value.get("name")
    return list(value) if isinstance(value, tuple) else value


def _identity(cfg: Mapping[str, Any]) -> str:
    return json.dumps({k: v for k, v in cfg.items() if k != "output"}, sort_keys=True, default=str)


# --- running a study -------------------------------------------------------------------------------

@dataclass
class StudyOutcome:
    study: Study
    out_dir: Path
    report: Path
    experiment: str
    claims: list[ClaimResult]
    table: Any  # pandas DataFrame
    wall_s: float
    notes: list[str]


def run_study(name: str, *, quick: bool = False, overrides: Sequence[str] = (), workers: int = 1,
              experiment: str | None = None, console: Any = None, argv: Sequence[str] | None = None) -> StudyOutcome:
    import pandas as pd

    from testbed.compare import Point, _axis_value, _run_jobs, grid
    from testbed.config import compose, to_container

    study = load_study(name)
    check_requirements(study)
    if workers < 1:
        raise ConfigError(f"invalid --workers={workers}: must be an integer >= 1")
    user = list(overrides)
    if quick and not any(_key(u) == "output.plots" for u in user):
        user.append("output.plots=false")  # per-run timeline plots: ~1 s each, not needed for a smoke test
    planned, notes = plan(study, quick, user)
    axes_keys = study_axes(planned)
    # every point composed and validated before anything runs (a typo exits 2 at once)
    points: list[tuple[Planned, Point, dict]] = []
    for p in planned:
        _, pts = grid(p.overrides)
        for pt in pts:
            points.append((p, pt, to_container(compose(list(pt.overrides)))))
    cfg0 = points[0][2]
    out = cfg0.get("output") or {}
    tag = f"{study.name}-quick" if quick else study.name
    exp_name = experiment or f"reproduce-{tag}"
    out_dir = Path(out.get("dir") or "runs") / "reproduce" / tag
    if out_dir.exists():
        if not (out_dir / MARKER).exists():
            raise ConfigError(f"{out_dir} exists and was not written by `testbed reproduce`; move it away")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    (out_dir / MARKER).write_text(json.dumps({"study": study.name, "quick": quick, "state": "running"}) + "\n")

    extra_cols: list[str] = []
    jobs: list[dict] = []
    unique: dict[str, int] = {}
    dup_of: list[int] = []  # for each point: index of the job that runs it
    point_meta: list[dict] = []
    all_axes = ["part", "system"]
    for i, (p, pt, cfg) in enumerate(points):
        values = {k: _config_value(cfg, k) for k in axes_keys}  # every axis of the study, from the config
        values.update({k: _axis_value(cfg, k, v) for k, v in pt.axes})
        derived = derived_columns(cfg)
        for k in derived:
            if k not in extra_cols:
                extra_cols.append(k)
        meta = {"part": p.part.name, "system": _label(p.grid.system, {**values, **derived}), **values, **derived}
        point_meta.append(meta)
        ident = _identity(cfg)
        if ident in unique:
            dup_of.append(unique[ident])
            continue
        unique[ident] = len(jobs)
        dup_of.append(len(jobs))
        label = f"{meta['part']}/{meta['system']}" + "".join(f",{k}={v}" for k, v in pt.axes)
        dirname = f"{len(jobs):03d}_" + re.sub(r"[^A-Za-z0-9_.=+-]+", "_", label)[:120]
        jobs.append({"index": len(jobs), "cfg": cfg, "label": label, "axes": None, "axis_values": meta,
                     "experiment": exp_name, "parent_run_id": None, "run_dir": str(out_dir / "runs" / dirname)})
    all_axes += [k for k in axes_keys if k not in all_axes] + [k for k in extra_cols if k not in axes_keys]
    for job in jobs:
        job["axes"] = all_axes
    tracker = parent = None
    if out.get("mlflow", True):
        from testbed.tracking import Tracker

        tracker = Tracker(cfg0, exp_name)
        parent = tracker.client.create_run(tracker.experiment_id, run_name=tag, tags={
            "testbed.kind": "compare", "testbed.reproduce": study.name, "testbed.quick": str(quick).lower(),
            "testbed.axes": json.dumps(all_axes), "reproduce.overrides": " ".join(overrides)[:5000],
            "compare.points": str(len(jobs))}).info.run_id
        for job in jobs:
            job["parent_run_id"] = parent
    if console is not None:
        console.print(f"study [bold]{study.name}[/bold]{' (quick)' if quick else ''}: {len(points)} point(s), "
                      f"{len(jobs)} distinct run(s), {len(study.claims)} claim(s); MLflow experiment {exp_name}",
                      highlight=False)
        for n in notes:
            console.print(f"note: {n}", highlight=False)
    t0 = time.perf_counter()
    try:
        job_rows = _run_jobs(jobs, workers, console, bool(out.get("progress", True)))
    except BaseException:
        if tracker is not None:
            tracker.client.set_terminated(parent, "KILLED")
        raise
    wall = time.perf_counter() - t0
    by_index = {r["point"]: r for r in job_rows}
    rows = []
    for i, meta in enumerate(point_meta):
        ran = jobs[dup_of[i]]["axis_values"]  # the axis values of the point that ran, replaced by this one's
        r = {k: v for k, v in by_index[dup_of[i]].items() if k not in ran}
        r.update(meta)
        r["point"] = i
        r["run"] = dup_of[i]
        if r.get("status") != "finished" and "does not fit" in str(r.get("error")):
            r["status"] = "does not fit"
        util = [v for k, v in r.items() if k.startswith("stage_utilization.stage")]
        if util:
            r["utilization_mean"] = sum(util) / len(util)
        rows.append(r)
    claims = [_evaluate_safely(c, rows) for c in study.claims]
    df = pd.DataFrame(rows)
    figures = write_figures(study, df, out_dir)
    from testbed.report import write_comparison

    write_comparison(df, all_axes, out_dir, plots=False)
    (out_dir / "claims.json").write_text(json.dumps([c.as_dict() for c in claims], indent=2, default=str) + "\n")
    report = out_dir / "report.md"
    report.write_text(render_report(study, quick=quick, claims=claims, df=df, axes=all_axes, figures=figures,
                                    notes=notes, user=list(overrides), experiment=exp_name, wall_s=wall,
                                    runs=len(jobs), out_dir=out_dir, argv=argv))
    (out_dir / MARKER).write_text(json.dumps({"study": study.name, "quick": quick, "state": "done", "wall_s": wall,
                                              "experiment": exp_name, "points": len(points), "runs": len(jobs)},
                                             indent=2) + "\n")
    if tracker is not None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric("compare.runs", float(len(jobs)), now, 0), Metric("compare.wall_s", wall, now, 0),
                   Metric("compare.failed", float(sum(r.get("status") != "finished" for r in job_rows)), now, 0)]
        metrics += [Metric(f"claim.{c.claim.id}", float(c.measured), now, 0) for c in claims if c.measured is not None]
        tracker.client.log_batch(parent, metrics=metrics)
        for c in claims:
            tracker.client.set_tag(parent, f"claim.{c.claim.id}", c.verdict.label)
        for path in sorted(out_dir.iterdir()):
            if path.is_file():
                tracker.client.log_artifact(parent, str(path))
        if (out_dir / "figures").is_dir():
            tracker.client.log_artifacts(parent, str(out_dir / "figures"), "figures")
        tracker.client.set_terminated(parent, "FINISHED")
    if console is not None:
        print_claims(console, study, claims,
                     f"{study.name}{' (quick)' if quick else ''}: {len(jobs)} runs, {wall:.1f} s")
    return StudyOutcome(study, out_dir, report, exp_name, claims, df, wall, notes)


def _evaluate_safely(claim: Claim, rows: Sequence[dict]) -> ClaimResult:
    """A claim the study file words badly (e.g. two runs where one was expected) becomes a 'not
    assessed' line with the reason, not a lost report after a long run."""
    try:
        return evaluate_claim(claim, rows)
    except ConfigError as exc:
        return ClaimResult(claim, None, 1.0, Verdict("n/a", f"study file: {exc}"), [])


# --- figures and the report ------------------------------------------------------------------------

def write_figures(study: Study, df: Any, out_dir: Path) -> list[tuple[FigureSpec, list[Path]]]:
    from testbed.report import plot_comparison

    done = []
    for f in study.figures:
        rows = select(df.to_dict("records"), f.where)
        if not rows:
            continue
        import pandas as pd

        sub = pd.DataFrame(rows)
        series = [s for s in f.series if any(_text(r.get(s)) for r in rows)] or ["system"]
        name = " / ".join(series)
        if name in sub.columns and len(series) > 1:
            name += " "
        sub[name] = [" / ".join(_text(r.get(s)) for s in series if _text(r.get(s))) or "-" for r in rows]
        axes = [name] + ([f.x] if f.x else [])
        if f.x and (f.x not in sub.columns or sub[f.x].dropna().nunique() < 2):
            axes, x = [name], None
        else:
            x = f.x
        if x is None and f.x:
            sub[name] = [f"{r[name]} / {f.x}={r.get(f.x)}" for r in sub.to_dict("records")]
        fig_dir = out_dir / "figures" / re.sub(r"[^A-Za-z0-9_.=+-]+", "_", f.name)
        fig_dir.mkdir(parents=True, exist_ok=True)
        paths = plot_comparison(sub, axes, fig_dir, x=x, metrics=list(f.metrics))
        if paths:
            done.append((f, paths))
    return done


def _text(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return str(v)


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip() + (" (with local changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _claimed_text(c: Claim) -> str:
    if c.at_most is not None:
        return f"<= {_pct(c.at_most)}"
    if c.claimed is None:
        return f"{c.direction or '-'} (no number)" if c.direction else "-"
    fake = Claim(id="", text="", published="", metric="", kind=c.kind, show=c.show)
    if isinstance(c.claimed, tuple):
        return f"{format_value(fake, c.claimed[0])} to {format_value(fake, c.claimed[1])}"
    return format_value(fake, c.claimed)


def render_report(study: Study, *, quick: bool, claims: Sequence[ClaimResult], df: Any, axes: Sequence[str],
                  figures: Sequence[tuple[FigureSpec, list[Path]]], notes: Sequence[str], user: Sequence[str],
                  experiment: str, wall_s: float, runs: int, out_dir: Path, argv: Sequence[str] | None) -> str:
    from testbed.report import to_markdown

    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mode = "quick smoke-test mode: reduced size, numbers not comparable to the paper" if quick else "full mode"
    cmd = "testbed reproduce " + " ".join(argv) if argv else f"testbed reproduce {study.name}" + (
        " --quick" if quick else "") + "".join(f" {u}" for u in user)
    lines = [f"# {study.title}", "",
             f"Study `{study.name}` ({mode}); "
             f"paper: {study.paper}; claims from {study.reference}.", "",
             f"- command: `{cmd}`",
             f"- {now}; testbed commit {_git_commit()}; {runs} simulated run(s), {len(df)} point(s), "
             f"{wall_s:.1f} s wall time",
             f"- MLflow experiment `{experiment}` (one parent run, one nested run per distinct point)", ""]
    lines += ["## Setup", "", study.setup, ""]
    if study.notes:
        lines += [study.notes, ""]
    base_desc = [f"- parts (setups): " + "; ".join(f"**{p.name}**: {p.label}" for p in study.parts)]
    lines += base_desc
    lines.append("- grids (systems): " + "; ".join(f"**{g.system}**: `{' '.join(g.overrides) or '-'}`"
                                                  + (f" (parts {', '.join(g.parts)})" if g.parts else "")
                                                  for g in study.grids))
    lines.append(f"- overrides of every run: `{' '.join(study.base) or '-'}`"
                 + (f"; quick mode: `{' '.join(study.quick)}`" if quick and study.quick else ""))
    if user:
        lines.append(f"- user overrides: `{' '.join(user)}`")
    for n in notes:
        lines.append(f"- note: {n}")
    lines += ["", "## Claims: published vs testbed", "",
              "| claim | published (REFERENCE.md) | claimed | testbed | verdict |", "|---|---|---:|---:|---|"]
    for r in claims:
        c = r.claim
        lines.append(f"| {c.text} | {c.published} | {_claimed_text(c)} | {format_value(c, r.measured)} | "
                     f"{r.verdict.label} |")
    lines += ["", "### Verdicts", ""]
    for r in claims:
        c = r.claim
        per = "; ".join(f"{g}: {format_value(c, v) if v is not None else why}" for g, v, why in r.groups)
        detail = f" ({r.verdict.text})" if r.verdict.text else ""
        lines.append(f"- **{c.id}**: {r.verdict.label}: testbed {format_value(c, r.measured)} vs published "
                     f"{c.published}{detail}. Per {', '.join(c.pair_by) or 'group'}: {per or '-'}"
                     f"{'' if c.aggregate == 'only' else f'; aggregated by {c.aggregate}'}.")
    lines += ["", "Rules (computed by `testbed.reproduce.verdict`): a claim's effect is value - baseline (1 for a "
              "ratio). *Direction*: the testbed's effect has the published sign and is at least 1% of the "
              "baseline. *Size*: the value lies in the published value or range widened on each side by 25% of "
              "the published effect (at least 0.02). Both: \"reproduced in direction and size\"; direction "
              "alone: \"reproduced in direction only\"; else \"not reproduced\". A bound (\"within 2%\") is "
              "reproduced when the value is within the bound + 25%. \"up to\" claims take the best group "
              "(max or min), ranges the geometric mean over groups.", ""]
    if figures:
        lines += ["## Figures", ""]
        for f, paths in figures:
            main = next((p for p in paths if p.name == "overview.png"), paths[0])
            lines += [f"**{f.title}**", "", f"![{f.title}]({main.relative_to(out_dir).as_posix()})", ""]
    lines += ["## Results", ""]
    metrics = [m for m in ("throughput_tok_s", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "tpot_p99_s",
                           "e2el_mean_s", "slo_attainment", "utilization_mean", "num_preemptions") if m in df.columns]
    cols = [c for c in ["part", "system", *axes] if c in df.columns]
    cols = list(dict.fromkeys(cols)) + ["status"] + metrics
    view = df[cols].copy()
    lines += [to_markdown(view), f"Every column: `table.csv`; each run's directory: `runs/`.", ""]
    return "\n".join(lines)


def print_claims(console: Any, study: Study, claims: Sequence[ClaimResult], title: str) -> None:
    from rich.table import Table

    t = Table(title=title)
    for col in ("claim", "published", "testbed", "verdict"):
        t.add_column(col, justify="left" if col in ("claim", "verdict") else "right")
    colour = {"size": "green", "direction": "yellow", "none": "red", "info": "dim", "n/a": "dim"}
    for r in claims:
        t.add_row(r.claim.id, _claimed_text(r.claim), format_value(r.claim, r.measured),
                  f"[{colour[r.verdict.category]}]{r.verdict.label}[/{colour[r.verdict.category]}]")
    console.print(t)


def describe_studies() -> list[str]:
    """One line per study for `testbed reproduce --list`."""
    from engine.policy import POLICIES

    import policies  # noqa: F401

    lines = []
    for name in list_studies():
        s = load_study(name)
        missing = [p for p in s.requires if p not in POLICIES]
        state = f"  [needs policy {', '.join(missing)}: not available]" if missing else ""
        lines.append(f"{name:18s} {s.paper}: {s.title} ({len(s.claims)} claims){state}")
    return lines


# --- the command line ------------------------------------------------------------------------------

def _option_parser():
    import argparse

    p = argparse.ArgumentParser(prog="testbed reproduce", add_help=False)
    p.add_argument("--list", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workers", type=int)
    p.add_argument("--experiment")
    p.add_argument("items", nargs="*")
    return p


def cli_reproduce(args: Any, console: Any) -> int:
    """`testbed reproduce`: options may come before or after the study and its overrides."""
    rest = _option_parser().parse_intermixed_args(list(args.args or []))
    listing = bool(args.list or rest.list)
    quick = bool(args.quick or rest.quick)
    workers = rest.workers if rest.workers is not None else (args.workers or 1)
    experiment = rest.experiment or args.experiment
    if listing:
        for line in describe_studies():
            print(line)
        return 0
    if not rest.items:
        raise ConfigError(f"name a study (testbed reproduce <study> [--quick] [key=value ...]); valid choices: "
                          f"{', '.join(list_studies())}")
    study, overrides = rest.items[0], rest.items[1:]
    if "=" in study:
        raise ConfigError(f"the first argument names the study, got {study!r}; valid choices: "
                          f"{', '.join(list_studies())}")
    argv = [study, *(["--quick"] if quick else []), *overrides]
    outcome = run_study(study, quick=quick, overrides=overrides, workers=workers, experiment=experiment,
                        console=console, argv=argv)
    print(outcome.report.resolve())
    return 0
