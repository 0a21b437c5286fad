"""Study files: `testbed/studies/<name>.yaml` (or a path to a file of your own) parsed into a
typed `Study`: parts (setups), grids (systems), claims (what the paper states) and figures.
The format is described in the package docstring (`testbed/reproduce/__init__.py`)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

import policies  # noqa: F401  (registers every policy: a study's `requires` names them)
from engine.base.errors import ConfigError, TestbedError
from engine.core.policy import POLICIES
from testbed.reproduce.verdicts import DEFAULT_ABS_TOL, DEFAULT_MIN_EFFECT, DEFAULT_TOLERANCE, REDUCERS

STUDY_SUFFIX = ".yaml"
MARKER = "reproduce.json"  # written in every study directory; only such a directory is replaced


def studies_dir() -> Path:
    """The packaged study files (importlib.resources, so an installed package finds them too)."""
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
    published: str  # the claim as the paper states it
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
    # Ratio claims at matched load: a group counts only where a and b served the same load, their
    # request throughputs within this fraction of each other. Past its capacity a system's
    # throughput falls behind the offered rate and its latency measures a backlog, not the system
    # (MoLink's rate sweep: at 0.5 req/s only the simulated vLLM was past capacity and the TTFT
    # ratio read 0.04x). None: every group counts.
    matched_load: float | None = None


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
    path = _study_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"study file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"study file {path}: expected a mapping at the top level")
    extra = sorted(set(raw) - STUDY_KEYS)
    if extra:
        raise ConfigError(f"study file {path}: unknown key(s) {', '.join(extra)}; "
                          f"valid keys: {', '.join(sorted(STUDY_KEYS))}")
    name = str(raw.get("name") or path.stem)
    parts = tuple(Part(name=str(p["name"]), label=str(p.get("label", p["name"])),
                       overrides=_strs(p.get("overrides"), f"{name}: part {p['name']}"),
                       quick=_strs(p.get("quick"), f"{name}: part {p['name']} quick"))
                  for p in (raw.get("parts") or [{"name": "main"}]))
    figures = tuple(FigureSpec(name=str(f["name"]), title=str(f.get("title", f["name"])), x=f.get("x"),
                               series=_strs(f.get("series", ["system"]), f"{name}: figure"),
                               metrics=_strs(f.get("metrics", ["throughput_tok_s"]), f"{name}: figure"),
                               where=dict(f.get("where") or {}))
                    for f in raw.get("figures") or [])
    return Study(name=name, title=str(raw.get("title", name)), paper=str(raw.get("paper", "")),
                 reference=str(raw.get("reference", "")), setup=str(raw.get("setup", "")).strip(),
                 requires=_strs(raw.get("requires"), f"{name}: requires"),
                 policy=tuple(_strs(alt, f"{name}: policy") for alt in (raw.get("policy") or [])),
                 base=_strs(raw.get("base"), f"{name}: base"), quick=_strs(raw.get("quick"), f"{name}: quick"),
                 parts=parts, grids=_grids(raw, name, {p.name for p in parts}),
                 claims=tuple(_claim(c, name) for c in raw.get("claims") or []), figures=figures,
                 notes=str(raw.get("notes", "")).strip(), path=str(path))


STUDY_KEYS = {"name", "title", "paper", "reference", "setup", "requires", "policy", "base", "quick", "parts",
              "grids", "claims", "figures", "notes"}


def _study_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if name_or_path.endswith(STUDY_SUFFIX) and path.is_file():
        return path
    names = list_studies()
    if name_or_path not in names:
        raise ConfigError(f"unknown study {name_or_path!r}; valid choices: {', '.join(names)}")
    return studies_dir() / f"{name_or_path}{STUDY_SUFFIX}"


def _grids(raw: dict, name: str, part_names: set[str]) -> tuple[GridSpec, ...]:
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
    return tuple(grids)


def _claim(c: dict, name: str) -> Claim:
    where = f"study {name}: claim {c.get('id')}"
    kind = c.get("kind", "ratio")
    if kind not in ("ratio", "value", "spread"):
        raise ConfigError(f"{where}: kind must be ratio, value or spread, got {kind!r}")
    for key in ("a_reduce", "b_reduce", "aggregate"):
        if c.get(key, "only") not in REDUCERS:
            raise ConfigError(f"{where}: {key} must be one of {', '.join(REDUCERS)}")
    if c.get("direction") not in (None, "higher", "lower"):
        raise ConfigError(f"{where}: direction must be higher or lower")
    return Claim(
        id=str(c["id"]), text=str(c.get("text", c["id"])), published=str(c.get("published", "")),
        metric=str(c["metric"]), kind=kind, a=dict(c.get("a") or {}), b=dict(c.get("b") or {}),
        where=dict(c.get("where") or {}), pair_by=_strs(c.get("pair_by", ["part"]), where),
        a_reduce=c.get("a_reduce", "only"), b_reduce=c.get("b_reduce", "only"),
        aggregate=c.get("aggregate", "only"), claimed=_claimed(c.get("claimed"), where),
        at_most=c.get("at_most"), baseline=c.get("baseline"), direction=c.get("direction"),
        tolerance=float(c.get("tolerance", DEFAULT_TOLERANCE)), abs_tol=float(c.get("abs_tol", DEFAULT_ABS_TOL)),
        min_effect=float(c.get("min_effect", DEFAULT_MIN_EFFECT)), show=c.get("show", "ratio"),
        matched_load=_matched_load(c.get("matched_load"), where, kind))


def _matched_load(value: Any, where: str, kind: str) -> float | None:
    if value is None:
        return None
    if kind != "ratio" or isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError(f"{where}: matched_load must be a fraction in (0, 1) on a ratio claim, got {value!r}")
    return float(value)


def check_requirements(study: Study) -> None:
    for name in study.requires:
        if name not in POLICIES:
            raise TestbedError(f"policy {name} is not available (registered: {', '.join(POLICIES.names())}); "
                              f"study {study.name} needs it")


def describe_studies() -> list[str]:
    """One line per study for `testbed reproduce --list`."""
    lines = []
    for name in list_studies():
        s = load_study(name)
        missing = [p for p in s.requires if p not in POLICIES]
        state = f"  [needs policy {', '.join(missing)}: not available]" if missing else ""
        lines.append(f"{name:18s} {s.paper}: {s.title} ({len(s.claims)} claims){state}")
    return lines
