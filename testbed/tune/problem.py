"""The problem a study solves: the base config every trial starts from, the settings, the
parameters pinned on the command line, and how a trial's suggestions become a run spec.
`Problem` is what the parent hands to spawned workers, so it stays plain and picklable.

The default study name carries a hash of `problem_fingerprint` (base config, objectives,
constraints, space), so re-running the same command resumes and a changed command starts a new
study; a named study (`tune.study=`) refuses to resume with a different problem and names the
first difference."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.base.errors import ConfigError
from engine.core.policy import POLICIES
from testbed.config.composer import flatten
from testbed.config.spec import compose_spec
from testbed.config.overrides import explicit_keys, split_prefixed
from testbed.config.spec import RunSpec
from testbed.tracking.tracker import tracking_uri
from testbed.tune.settings import TuneSettings, parse_settings
from testbed.tune.space import MICROBATCH_KEY, Recorder, SpaceSpec, SpaceTrial, contains, microbatch_range
from testbed.tune.storage import sqlite_path

FINGERPRINT_SKIPS = ("output", "data_dir", "check_integrity")  # how a run is stored, not what it computes


@dataclass(frozen=True)
class Problem:
    """Everything a worker needs (picklable for spawned processes)."""

    base: RunSpec
    settings: TuneSettings
    study: str
    storage_url: str
    experiment: str
    pinned: dict  # policy field -> value held fixed (set on the command line)
    seed: int
    parent_run_id: str | None = None
    out_dir: str = "runs"
    search_microbatches: bool = False  # the default [P, 2P] search of parallel.num_microbatches

    @property
    def policy_name(self) -> str:
        return self.base.policy_name

    def policy_overrides(self) -> dict[str, SpaceSpec]:
        return {s.name: s for s in self.settings.space if s.key.startswith("policy.")}

    def assign(self, trial: Any) -> dict[str, Any]:
        """Suggest every searched value for this trial: {config key: value}."""
        proxy = SpaceTrial(trial, self.policy_overrides(), self.pinned)
        values = POLICIES.get(self.policy_name).search_space(proxy) or {}
        out = {f"policy.{k}": v for k, v in values.items()}
        for spec in self.settings.space:
            if spec.key in out or (spec.key.startswith("policy.") and spec.name in proxy.used):
                continue
            out[spec.key] = spec.suggest(trial)
        if self.search_microbatches:
            pp = int(out.get("parallel.pp", self.base.settings.parallel.pp))
            out[MICROBATCH_KEY] = trial.suggest_int(MICROBATCH_KEY, *microbatch_range(pp))
        return out

    def spec_for(self, assignments: Mapping[str, Any]) -> RunSpec:
        """The trial's run: the base spec with the suggested values (validated again)."""
        fields = {f.name for f in dataclasses.fields(self.base.policy)}
        for key in assignments:
            if key.startswith("policy.") and key[7:] not in fields:
                raise ConfigError(f"policy {self.policy_name!r} search space returned unknown key "
                                  f"{key!r}; valid keys: {', '.join(sorted(fields))}")
        return self.base.with_values(assignments)

    def defaults(self) -> dict[str, Any]:
        """The base config's value of every searched name. An unset micro-batch count means the
        policy's own choice, which is P for every policy but MoLink's extension: P stands for it."""
        base = self.base
        out = {**{k: v for k, v in base.value_at("policy").items() if k != "name"},
               **{s.key: base.value_at(s.key) for s in self.settings.space if not s.key.startswith("policy.")}}
        pp = base.settings.parallel.pp
        if self.search_microbatches:
            out[MICROBATCH_KEY] = base.settings.parallel.num_microbatches or pp
        elif out.get(MICROBATCH_KEY, 0) is None:
            out[MICROBATCH_KEY] = pp
        return out

    def space(self) -> dict[str, Any]:
        """The effective space {optuna name: distribution}, walked once with a recorder."""
        rec = Recorder(self.defaults())
        self.assign(rec)
        return rec.space

    def baseline_params(self) -> dict[str, Any] | None:
        """The base config's value of every searched parameter, if each lies in its range."""
        defaults = self.defaults()
        params = {}
        for name, dist in self.space().items():
            value = defaults.get(name)
            if not contains(dist, value):
                return None
            params[name] = value
        return params


def problem_fingerprint(spec: RunSpec, settings: TuneSettings, pinned: Mapping[str, Any],
                        search_microbatches: bool = False) -> dict:
    """What defines a study's problem (compared on resume; hashed into the default name)."""
    base = flatten({k: v for k, v in spec.tree().items() if k not in FINGERPRINT_SKIPS})
    space = {s.key: s.text for s in settings.space}
    if search_microbatches:
        space[MICROBATCH_KEY] = "P:2P"
    return {"config": {k: jsonable(v) for k, v in sorted(base.items())},
            "objectives": list(settings.objectives), "directions": list(settings.directions),
            "constraints": [c.text for c in settings.constraints],
            "space": space, "pinned": {k: jsonable(v) for k, v in pinned.items()}}


def jsonable(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def short_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:8]


def first_difference(old: Mapping, new: Mapping) -> str:
    for section in ("objectives", "directions", "constraints", "space", "pinned"):
        if old.get(section) != new.get(section):
            return f"tune {section}: {old.get(section)} then, {new.get(section)} now"
    oc, nc = old.get("config", {}), new.get("config", {})
    for key in sorted(set(oc) | set(nc)):
        if oc.get(key, "<absent>") != nc.get(key, "<absent>"):
            return f"{key}={oc.get(key, '<absent>')} then, {nc.get(key, '<absent>')} now"
    return "(no difference found)"


def fingerprint_of(problem: Problem) -> dict:
    return problem_fingerprint(problem.base, problem.settings, problem.pinned, problem.search_microbatches)


def prepare(overrides: Sequence[str]) -> Problem:
    """Parse and validate everything (no study, no MLflow run yet)."""
    raw, rest = split_prefixed(overrides, "tune")
    base = compose_spec(rest)
    settings = parse_settings(raw, base.tree())
    explicit = explicit_keys(rest)
    pinned = {k[len("policy."):]: base.value_at(k) for k in explicit if k.startswith("policy.") and k != "policy.name"}
    for sp in settings.space:
        if sp.key in explicit:
            raise ConfigError(f"{sp.key} is both set ({sp.key}={base.value_at(sp.key)}) and searched "
                              f"(tune.space.{sp.key}); drop one of them")
    for sp in settings.space:
        _check_space_values(base, sp)
    search_mb = MICROBATCH_KEY not in explicit and all(s.key != MICROBATCH_KEY for s in settings.space)
    out_root = Path(base.output.dir)
    fp = problem_fingerprint(base, settings, pinned, search_mb)
    study = settings.study or f"{base.policy_name}-{base.workload_name}-" \
                              f"{'+'.join(settings.objectives)}-{short_hash(fp)}"
    if "/" in study or study.startswith("."):
        raise ConfigError(f"invalid tune.study={study!r}: no '/' and no leading '.'")
    storage = settings.storage or f"sqlite:///{(out_root.resolve() / 'optuna.db')}"
    _check_storage(storage, base, given=settings.storage is not None)
    problem = Problem(base=base, settings=settings, study=study, storage_url=storage,
                      experiment=settings.experiment or f"tune-{study}", pinned=pinned,
                      seed=settings.seed if settings.seed is not None else base.settings.seed,
                      out_dir=str(out_root / "tune" / study), search_microbatches=search_mb)
    if not problem.space():
        raise ConfigError(f"nothing to tune: policy {base.policy_name!r} declares no search space"
                          + (" (or every parameter of it is fixed on the command line)" if pinned else "")
                          + "; add tune.space.<key>=<values>, e.g. tune.space.parallel.pp=2,4")
    return problem


def _check_space_values(base: RunSpec, spec: SpaceSpec) -> None:
    """A searched key's values against its setting: a value of the wrong kind (text or a fraction
    for an integer: `tune.space.policy.T=a,b` started a study whose every trial failed, issue 38
    item 9), or a space none of whose values the setting accepts, is refused before any study; a
    value that is only out of bounds fails its own trials with the reason, as documented. Only the
    key's own check counts: a value that conflicts with another setting may suit a trial that
    moves that setting too."""
    values = spec.choices if spec.kind == "categorical" else (spec.low, spec.high)
    try:
        current = base.value_at(spec.key)
    except KeyError:  # a policy field the tree does not spell out: its kind is unknown here
        current = None
    bad = []
    for value in values:
        try:
            base.with_values({spec.key: value})
        except ConfigError as exc:
            if str(exc).startswith(f"invalid {spec.key}="):
                bad.append((value, exc))
    wrong = next((exc for value, exc in bad if not _same_kind(value, current)), None)
    if wrong is not None or (bad and len(bad) == len(values)):
        raise ConfigError(f"tune.space.{spec.key}={spec.text}: {wrong or bad[0][1]}")


def _same_kind(value: Any, current: Any) -> bool:
    if isinstance(current, bool):
        return isinstance(value, bool)
    if isinstance(current, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(current, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def _check_storage(storage: str, base: RunSpec, given: bool) -> None:
    """The default SQLite file's folder is made; a file the user named must be in a folder that
    exists: `tune.storage=journal:/nonexistent/dir/j.log` created /nonexistent/dir (issue 38 item 9),
    where a typo in the path means a study nobody else will find."""
    path = sqlite_path(storage) or (Path(storage[len("journal:"):]).resolve() if storage.startswith("journal:") else None)
    if path is None:
        return
    if given and not path.parent.is_dir():
        raise ConfigError(f"invalid tune.storage={storage}: the folder {path.parent} does not exist; "
                          f"create it first or name a file in an existing folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    if base.output.mlflow and path == sqlite_path(tracking_uri(base.output)):
        raise ConfigError(f"tune.storage={storage} is the MLflow tracking database; Optuna and MLflow must "
                          f"not share one (both keep an alembic_version table): use another file")

