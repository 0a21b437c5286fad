"""Planning a study: the merged override list of every (part, grid), the policy alternative
in use, user overrides applied where meaningful, and the columns derived from each point's
config. A later layer replaces an earlier override of the same key."""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.base.errors import ConfigError
from engine.core.policy import POLICIES
from testbed.sweep.compare import grid
from testbed.config.composer import DEFAULTS, compose
from testbed.config.spec import RunSpec
from testbed.reproduce.studies import GridSpec, Part, Study

def key_of(ov: str) -> str:
    return ov.partition("=")[0].lstrip("+~")


def merge(*layers: Sequence[str]) -> list[str]:
    """Later layers replace earlier overrides of the same key (order of first appearance kept)."""
    out: dict[str, str] = {}
    for layer in layers:
        for ov in layer:
            if "=" not in ov:
                raise ConfigError(f"override {ov!r} is not key=value")
            k = key_of(ov)
            if k in out:
                del out[k]
            out[k] = ov
    return list(out.values())


def _is_sweep(ov: str) -> bool:
    axes, _ = grid([ov])
    return bool(axes)


def _policy_of(overrides: Sequence[str]) -> str:
    for ov in reversed(overrides):
        if key_of(ov) == "policy":
            return ov.partition("=")[2]
    return DEFAULTS["policy"]


def _policy_fields(name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(POLICIES.get(name).Params)}


@dataclass
class Planned:
    part: Part
    grid: GridSpec
    overrides: list[str]


def choose_policy(study: Study, base: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the first usable alternative of `study.policy`, notes on the ones skipped)."""
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
    base = merge(study.base, study.quick if quick else ())
    chosen, notes = choose_policy(study, merge(base, [u for u in user if not key_of(u).startswith("policy")]))
    if chosen:
        notes.append(f"batching policy of every run: `{' '.join(chosen)}` (the first usable of the study's "
                     f"alternatives)")
    user_policy = [u for u in user if key_of(u) == "policy"]
    planned: list[Planned] = []
    for part in study.parts:
        for g in study.grids:
            if g.parts is not None and part.name not in g.parts:
                continue
            ovs = merge(base, chosen, part.overrides, part.quick if quick else (), g.overrides,
                        g.quick if quick else ())
            planned.append(Planned(part, g, ovs))
    if user_policy and len({_policy_of(p.overrides) for p in planned}) > 1:
        raise ConfigError(f"{user_policy[0]} would replace every system of study {study.name} "
                          f"({', '.join(sorted({_policy_of(p.overrides) for p in planned}))}); "
                          f"set a policy's parameter with policy.<param>= instead")
    for u in user:
        _apply_user(study, planned, u, user_policy, notes)
    return planned, notes


def _apply_user(study: Study, planned: list[Planned], u: str, user_policy: list[str], notes: list[str]) -> None:
    """One user override: to every run, or (`policy.<param>=`) to the runs whose policy has it."""
    k = key_of(u)
    if "=" not in u:
        raise ConfigError(f"override {u!r} is not key=value (e.g. hardware=h100-80g, policy.T=16)")
    if _is_sweep(u) and not any(any(key_of(o) == k and _is_sweep(o) for o in p.overrides) for p in planned):
        raise ConfigError(f"{u}: a comma list is allowed only for a key that is already an axis of study "
                          f"{study.name}; the axes: {', '.join(study_axes(planned)) or '(none)'}")
    takers = planned
    if k.startswith("policy.") and k.count(".") == 1:
        param = k.split(".", 1)[1]
        takers = [p for p in planned if param in _policy_fields(_policy_of(merge(p.overrides, user_policy)))]
        if not takers:
            used = {_policy_of(merge(p.overrides, user_policy)) for p in planned}
            raise ConfigError(f"{u}: no policy of study {study.name} has parameter {param!r} "
                              f"(policies: {', '.join(sorted(used))})")
        taken = {id(p) for p in takers}
        skipped = sorted({_policy_of(p.overrides) for p in planned if id(p) not in taken})
        if skipped:
            used = ", ".join(sorted({_policy_of(p.overrides) for p in takers}))
            notes.append(f"{u} applied to the runs of {used} only (not a parameter of {', '.join(skipped)})")
    for p in takers:
        p.overrides = merge(p.overrides, [u])


def study_axes(planned: Sequence[Planned]) -> list[str]:
    axes: list[str] = []
    for p in planned:
        for ov in p.overrides:
            if _is_sweep(ov) and key_of(ov) not in axes:
                axes.append(key_of(ov))
    return axes


def system_label(template: str, values: Mapping[str, Any]) -> str:
    return re.sub(r"\{([^{}]+)\}", lambda m: str(values.get(m.group(1), m.group(0))), template)


def derived_columns(spec: RunSpec) -> dict[str, Any]:
    """Columns computed from a point's config: GPUs (pp x tp) and, when set, the link in Mbps/ms."""
    rc = spec.settings
    out: dict[str, Any] = {"gpus": rc.parallel.pp * rc.parallel.tp}
    if rc.link.bandwidth is not None:
        out["link_mbps"] = round(rc.link.bandwidth * 8 / 1e6, 6)
    if rc.link.latency is not None:
        out["link_ms"] = round(rc.link.latency * 1e3, 6)
    return out


def config_value(spec: RunSpec, key: str) -> Any:
    """A study column's value at a point: the recorded value, or a group's choice by name."""
    try:
        value = spec.value_at(key)
    except KeyError:
        return None
    if isinstance(value, Mapping):
        return value.get("name")
    return list(value) if isinstance(value, tuple) else value


def identity(spec: RunSpec) -> str:
    """Points with the same identity compute the same run (only where it is written differs)."""
    return json.dumps({k: v for k, v in spec.tree().items() if k != "output"}, sort_keys=True, default=str)


