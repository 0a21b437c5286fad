"""`tune.*` overrides -> `TuneSettings`. The `tune.*` keys are not part of the composed run
config (how a run was launched does not change what it computes): they are split off before
`compose`, and every mistake is one `ConfigError` line naming the valid choices."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.base.errors import ConfigError
from testbed.config.overrides import MAX_WORKERS, as_bool, as_float, as_int, check_keys, split_list
from testbed.config.objectives import Constraint, default_direction, resolve_metric
from testbed.tune.space import SpaceSpec, parse_space

TUNE_KEYS = ("objective", "direction", "trials", "study", "storage", "workers", "constraints", "sampler",
             "seed", "startup_trials", "baseline", "timeout", "experiment", "artifacts", "heartbeat", "grace_period")
SAMPLERS = ("tpe", "nsga2", "random")
# Heartbeat interval and grace period: a thread waits `heartbeat` seconds at a time and Optuna
# compares `grace_period` as a timedelta; tune.heartbeat=1e12 ended in "OverflowError: timestamp
# too large" (issue 38 item 7). A day between heartbeats / a week of grace is beyond any study.
MAX_HEARTBEAT_S = 86_400
MAX_GRACE_S = 7 * 86_400
MAX_TIMEOUT_S = 365 * 86_400


@dataclass(frozen=True)
class TuneSettings:
    objectives: tuple[str, ...] = ("throughput_tok_s",)
    directions: tuple[str, ...] = ("maximize",)
    trials: int = 20  # target total of the study (trials marked interrupted do not count)
    study: str | None = None  # None: '<policy>-<workload>-<objectives>-<problem hash>'
    storage: str | None = None  # None: sqlite:///<output.dir>/optuna.db
    workers: int = 1
    constraints: tuple[Constraint, ...] = ()
    space: tuple[SpaceSpec, ...] = ()
    sampler: str = "tpe"
    seed: int | None = None  # None: the config's `seed`
    startup_trials: int = 10  # TPE's random start-up trials
    baseline: bool = True  # enqueue the base config's values (the policy defaults) as trial 0
    timeout: float | None = None  # seconds; workers stop asking for trials after it
    experiment: str | None = None  # MLflow experiment; None: 'tune-<study>'
    artifacts: bool = False  # write and log each trial's run directory (trace, tables)
    heartbeat: int | None = None  # s between a trial's heartbeats; None: 10 for server DBs, off for SQLite
    grace_period: int | None = None  # s without a heartbeat before a trial is failed and retried

    @property
    def multi(self) -> bool:
        return len(self.objectives) > 1


def parse_settings(raw: Mapping[str, str], cfg: Mapping[str, Any]) -> TuneSettings:
    """`tune.*` overrides -> TuneSettings, every mistake a one-line ConfigError."""
    check_keys(raw, TUNE_KEYS, "tune", prefixes=("space.",))
    kw: dict[str, Any] = {}
    if "objective" in raw:
        kw["objectives"] = _objectives(raw["objective"])
    kw["directions"] = _directions(raw.get("direction"), kw.get("objectives", TuneSettings.objectives))
    kw.update(_numbers(raw))
    for key in ("baseline", "artifacts"):
        if key in raw:
            kw[key] = as_bool(f"tune.{key}", raw[key])
    for key in ("study", "storage", "experiment"):
        if key in raw:
            value = raw[key].strip()
            if not value:
                raise ConfigError(f"tune.{key} is empty")
            kw[key] = value
    if "sampler" in raw:
        s = raw["sampler"].strip().lower()
        if s not in SAMPLERS:
            raise ConfigError(f"unknown tune.sampler {s!r}; valid choices: {', '.join(SAMPLERS)}")
        kw["sampler"] = s
    if "constraints" in raw:
        kw["constraints"] = tuple(Constraint.parse(c) for c in split_list(raw["constraints"]))
    if kw.get("sampler") == "random" and kw.get("constraints"):
        raise ConfigError("tune.sampler=random ignores constraints; use tpe or nsga2 with tune.constraints")
    kw["space"] = parse_space({k[len("space."):]: v for k, v in raw.items() if k.startswith("space.")}, cfg)
    return TuneSettings(**kw)


def _objectives(text: str) -> tuple[str, ...]:
    names = split_list(text)
    if not names:
        raise ConfigError("tune.objective is empty; e.g. tune.objective=throughput")
    objectives = tuple(resolve_metric(n, "objective") for n in names)
    if len(set(objectives)) != len(objectives):
        raise ConfigError(f"tune.objective lists a metric twice: {text}")
    return objectives


def _directions(text: str | None, objectives: tuple[str, ...]) -> tuple[str, ...]:
    if text is not None:
        dirs = tuple(d.lower() for d in split_list(text))
        bad = [d for d in dirs if d not in ("maximize", "minimize")]
        if bad:
            raise ConfigError(f"invalid tune.direction {bad[0]!r}; valid choices: maximize, minimize")
        if len(dirs) != len(objectives):
            raise ConfigError(f"tune.direction has {len(dirs)} entries for {len(objectives)} objective(s) "
                              f"({', '.join(objectives)})")
        return dirs
    dirs = []
    for o in objectives:
        d = default_direction(o)
        if d is None:
            raise ConfigError(f"objective {o!r} has no known direction; add tune.direction=maximize or minimize")
        dirs.append(d)
    return tuple(dirs)


def _numbers(raw: Mapping[str, str]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if "trials" in raw:
        kw["trials"] = as_int("tune.trials", raw["trials"], 1)
    if "workers" in raw:
        kw["workers"] = as_int("tune.workers", raw["workers"], 1, MAX_WORKERS)
    if "startup_trials" in raw:
        kw["startup_trials"] = as_int("tune.startup_trials", raw["startup_trials"], 0)
    if "seed" in raw:
        kw["seed"] = as_int("tune.seed", raw["seed"])
    if "timeout" in raw:
        kw["timeout"] = as_float("tune.timeout", raw["timeout"], 0, MAX_TIMEOUT_S)
    if "heartbeat" in raw:
        kw["heartbeat"] = as_int("tune.heartbeat", raw["heartbeat"], 0, MAX_HEARTBEAT_S)
    if "grace_period" in raw:
        kw["grace_period"] = as_int("tune.grace_period", raw["grace_period"], 1, MAX_GRACE_S)
    return kw
