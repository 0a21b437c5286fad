"""`testbed tune`: search a policy's hyperparameters with Optuna, every trial a nested MLflow run.

    testbed tune policy=sarathi workload=azure tune.trials=50 tune.objective=throughput
    testbed tune policy=sarathi tune.objective=[throughput,ttft_p99_s] tune.workers=2
    testbed tune policy=sarathi 'tune.constraints=[slo_attainment>=0.9]' tune.space.parallel.pp=2,4

The `tune.*` keys are not part of the composed run config (how a run was launched does not
change what it computes): they are split off before `compose` and parsed into `TuneSettings`.
Everything else is an ordinary run override and defines the *base* config every trial starts from.

What is searched: the policy's own `search_space(trial)` (required; the policy declares it), plus
optional extra keys `tune.space.<config key>=<spec>` (`2,4` categorical, `1:8` int range,
`0.5:0.95` float range, `128:4096:log`, `0:0.2:0.05` stepped, `tune.space.runtime.*=true,false`
for every key of a section). A policy parameter set explicitly on the command line
(`policy.token_budget=512`) is held fixed instead of searched.

Study and storage. The study lives in its own RDB, `sqlite:///<output.dir>/optuna.db` by default,
never in the MLflow database (both keep an `alembic_version` table, PITFALLS.md). Any Optuna RDB
URL works (`postgresql://...` spreads workers over machines) and `journal:<file>` selects Optuna's
JournalStorage. A study is created once and resumed on every later call with the same name
(`load_if_exists`): `tune.trials` is the *target total* of the study, so a resumed study only runs
what is missing. Trials interrupted by Ctrl-C (or left RUNNING by a killed worker on this host)
are marked FAILED with `fail_reason` "interrupted" and do not count toward the target. The
default study name carries a hash of the problem (base config, objectives, constraints, space),
so re-running the same command resumes and a changed command starts a new study; a named study
(`tune.study=`) refuses to resume with a different problem and names the first difference.

Parallel workers. `tune.workers=N` starts N worker processes (spawn) on one study. The parent
creates the study, the Optuna tables and the MLflow database before any worker starts (the schema
creation is what races, optuna issue 820 / PITFALLS.md); workers open SQLite with a 60 s busy
timeout, and a lock shared by the local workers makes "count the trials, then ask for one" atomic,
so N workers never run more than `tune.trials` trials and never share a trial number (Optuna's
storage numbers trials atomically). On 2 cores with N=2 and SQLite this measured (README) close to
2x the trials per minute of one worker and no "database is locked" error.

Failures. A trial whose sampled config is invalid (ConfigError from building the run), whose run
fails, or whose objective is NaN is told FAILED with its reason in the user attribute
`fail_reason` (also the `error` tag of its MLflow run), and the study goes on.

MLflow. The study is one MLflow run (tag `testbed.kind=study`) in experiment `tune-<study>`
(`tune.experiment=`); each trial is a run nested under it through an explicit `parent_run_id`
(MLflow's active run is thread-local; PITFALLS.md). At the end the study run gets the best value
and parameters (metrics `best.*`, tags `best.params`), the trials table (`trials.csv`, from
`study.trials_dataframe()`) and figures (optimisation history, parameter importances, Pareto
front for several objectives).

Seeding. The sampler is seeded from `seed` (or `tune.seed`): with one worker the same seed gives
the same trials and the same best trial. Worker i of N uses seed + i, so parallel runs are not
reproducible trial by trial (they cannot be: trial order depends on timing).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError, TestbedError
from engine.metrics import SUMMARY_KEYS
from testbed.overrides import (as_bool, as_float, as_int, check_keys, check_path, explicit_keys, get_path,
                               scalar, set_path, split_list, split_prefixed)

# --- objectives ---------------------------------------------------------------------------------

OBJECTIVE_ALIASES = {
    "throughput": "throughput_tok_s", "output_throughput": "output_throughput_tok_s",
    "ttft": "ttft_p99_s", "tpot": "tpot_p99_s", "e2el": "e2el_p99_s", "latency": "e2el_mean_s",
    "slo": "slo_attainment", "goodput": "slo_attainment", "bubble": "bubble_ratio",
    "preemptions": "num_preemptions",
}
MAXIMIZE = {"throughput_tok_s", "output_throughput_tok_s", "request_throughput", "slo_attainment", "num_finished"}
MINIMIZE = {"duration_s", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "tpot_p50_s", "tpot_p99_s",
            "e2el_mean_s", "e2el_p50_s", "e2el_p99_s", "bubble_ratio", "num_preemptions", "num_failed"}
LIST_KEYS = {"stage_bubble_ratio", "stage_utilization"}  # per-stage lists: not an objective
SCALAR_KEYS = [k for k in SUMMARY_KEYS if k not in LIST_KEYS]
VIOLATION_IF_NAN = 1e12  # constraint value of a metric that is NaN (e.g. no request finished)


def resolve_metric(name: str, what: str) -> str:
    key = OBJECTIVE_ALIASES.get(name, name)
    if key in LIST_KEYS:
        raise ConfigError(f"{what} {name!r} is a per-stage list; use a scalar summary key, e.g. bubble_ratio")
    if key not in SCALAR_KEYS:
        raise ConfigError(f"unknown {what} {name!r}; valid choices: {', '.join(sorted(OBJECTIVE_ALIASES))}, "
                          f"{', '.join(SCALAR_KEYS)}")
    return key


def default_direction(key: str) -> str | None:
    return "maximize" if key in MAXIMIZE else "minimize" if key in MINIMIZE else None


@dataclass(frozen=True)
class Constraint:
    """`metric>=threshold` or `metric<=threshold`; Optuna's convention: value <= 0 is feasible."""

    metric: str
    op: str  # ">=" or "<="
    threshold: float

    @classmethod
    def parse(cls, text: str) -> Constraint:
        for op in (">=", "<="):
            if op in text:
                name, _, value = text.partition(op)
                metric = resolve_metric(name.strip(), "constraint metric")
                try:
                    threshold = float(value)
                except ValueError:
                    raise ConfigError(f"invalid constraint {text!r}: {value!r} is not a number") from None
                return cls(metric, op, threshold)
        raise ConfigError(f"invalid constraint {text!r}: write metric>=value or metric<=value "
                          f"(quote it in the shell: 'tune.constraints=[slo_attainment>=0.9]')")

    @property
    def text(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"

    def violation(self, summary: Mapping[str, Any]) -> float:
        value = summary.get(self.metric)
        if value is None or not isinstance(value, (int, float)) or math.isnan(value):
            return VIOLATION_IF_NAN
        return self.threshold - value if self.op == ">=" else value - self.threshold


# --- search space -------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpaceSpec:
    """One extra searched key from `tune.space.<key>=<spec>`."""

    key: str  # config key, e.g. 'parallel.pp' or 'policy.token_budget'
    kind: str  # 'int' | 'float' | 'categorical'
    low: Any = None
    high: Any = None
    step: Any = None
    log: bool = False
    choices: tuple = ()

    @property
    def name(self) -> str:
        """The Optuna parameter name: a policy field's own name, else the full config key."""
        return self.key[len("policy."):] if self.key.startswith("policy.") else self.key

    def suggest(self, trial: Any, name: str | None = None) -> Any:
        name = name or self.name
        if self.kind == "categorical":
            return trial.suggest_categorical(name, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(name, self.low, self.high, step=self.step or 1, log=self.log)
        return trial.suggest_float(name, self.low, self.high, step=self.step, log=self.log)

    @property
    def text(self) -> str:
        if self.kind == "categorical":
            return ",".join(json.dumps(c) if isinstance(c, str) else str(c).lower() if isinstance(c, bool)
                            else str(c) for c in self.choices)
        tail = ":log" if self.log else f":{self.step}" if self.step is not None else ""
        return f"{self.low}:{self.high}{tail}"

    @classmethod
    def parse(cls, key: str, raw: str) -> SpaceSpec:
        text = raw.strip()
        where = f"tune.space.{key}={raw}"
        bracketed = text.startswith("[")
        if ":" in text and "," not in text and not bracketed:
            parts = text.split(":")
            if len(parts) not in (2, 3):
                raise ConfigError(f"invalid {where}: a range is low:high, low:high:log or low:high:step")
            low, high = scalar(parts[0]), scalar(parts[1])
            for v in (low, high):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ConfigError(f"invalid {where}: range bounds must be numbers")
            log, step = False, None
            if len(parts) == 3:
                if parts[2].strip().lower() == "log":
                    log = True
                else:
                    step = scalar(parts[2])
                    if isinstance(step, bool) or not isinstance(step, (int, float)) or step <= 0:
                        raise ConfigError(f"invalid {where}: the third part is 'log' or a step > 0")
            if not low < high:
                raise ConfigError(f"invalid {where}: low must be < high")
            if log and low <= 0:
                raise ConfigError(f"invalid {where}: a log range needs low > 0")
            is_int = isinstance(low, int) and isinstance(high, int) and (step is None or isinstance(step, int))
            return cls(key, "int" if is_int else "float", low, high, step, log)
        choices = tuple(scalar(c) for c in split_list(text))
        if not choices:
            raise ConfigError(f"invalid {where}: no values")
        if len(set(map(repr, choices))) != len(choices):
            raise ConfigError(f"invalid {where}: a value is listed twice")
        return cls(key, "categorical", choices=choices)


class _SpaceTrial:
    """What a policy's `search_space` sees: the real trial (or a recorder), except that parameters
    pinned on the command line return their value and `tune.space.policy.<name>` replaces the
    policy's own range for <name>."""

    def __init__(self, trial: Any, overrides: Mapping[str, SpaceSpec], pinned: Mapping[str, Any]) -> None:
        self._trial = trial
        self._overrides = overrides
        self._pinned = pinned
        self.used: set[str] = set()

    def _route(self, name: str, own: Callable[[], Any]) -> Any:
        self.used.add(name)
        if name in self._pinned:
            return self._pinned[name]
        if name in self._overrides:
            return self._overrides[name].suggest(self._trial, name)
        return own()

    def suggest_int(self, name, low, high, *, step=1, log=False):
        return self._route(name, lambda: self._trial.suggest_int(name, low, high, step=step, log=log))

    def suggest_float(self, name, low, high, *, step=None, log=False):
        return self._route(name, lambda: self._trial.suggest_float(name, low, high, step=step, log=log))

    def suggest_categorical(self, name, choices):
        return self._route(name, lambda: self._trial.suggest_categorical(name, choices))

    def __getattr__(self, attr):
        return getattr(self._trial, attr)


class _Recorder:
    """A duck-typed trial that records distributions and answers with the base config's values
    (so a conditional space follows the branch of the defaults)."""

    def __init__(self, defaults: Mapping[str, Any]) -> None:
        self.defaults = defaults
        self.space: dict[str, Any] = {}

    def _add(self, name: str, dist: Any, fallback: Any) -> Any:
        self.space[name] = dist
        value = self.defaults.get(name)
        return value if _contains(dist, value) else fallback

    def suggest_int(self, name, low, high, *, step=1, log=False):
        from optuna.distributions import IntDistribution

        return self._add(name, IntDistribution(low, high, log=log, step=step), low)

    def suggest_float(self, name, low, high, *, step=None, log=False):
        from optuna.distributions import FloatDistribution

        return self._add(name, FloatDistribution(low, high, log=log, step=step), low)

    def suggest_categorical(self, name, choices):
        from optuna.distributions import CategoricalDistribution

        return self._add(name, CategoricalDistribution(list(choices)), list(choices)[0])

    def set_user_attr(self, key, value):
        pass

    number = -1


def _contains(dist: Any, value: Any) -> bool:
    if value is None:
        return False
    try:
        return bool(dist._contains(dist.to_internal_repr(value)))
    except (ValueError, TypeError):
        return False


# --- settings -----------------------------------------------------------------------------------

TUNE_KEYS = ("objective", "direction", "trials", "study", "storage", "workers", "constraints", "sampler",
             "seed", "startup_trials", "baseline", "timeout", "experiment", "artifacts")
SAMPLERS = ("tpe", "nsga2", "random")


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

    @property
    def multi(self) -> bool:
        return len(self.objectives) > 1


def parse_settings(raw: Mapping[str, str], cfg: Mapping[str, Any]) -> TuneSettings:
    """`tune.*` overrides -> TuneSettings, every mistake a one-line ConfigError."""
    check_keys(raw, TUNE_KEYS, "tune", prefixes=("space.",))
    kw: dict[str, Any] = {}
    if "objective" in raw:
        names = split_list(raw["objective"])
        if not names:
            raise ConfigError("tune.objective is empty; e.g. tune.objective=throughput")
        kw["objectives"] = tuple(resolve_metric(n, "objective") for n in names)
        if len(set(kw["objectives"])) != len(kw["objectives"]):
            raise ConfigError(f"tune.objective lists a metric twice: {raw['objective']}")
    objectives = kw.get("objectives", TuneSettings.objectives)
    if "direction" in raw:
        dirs = tuple(d.lower() for d in split_list(raw["direction"]))
        bad = [d for d in dirs if d not in ("maximize", "minimize")]
        if bad:
            raise ConfigError(f"invalid tune.direction {bad[0]!r}; valid choices: maximize, minimize")
        if len(dirs) != len(objectives):
            raise ConfigError(f"tune.direction has {len(dirs)} entries for {len(objectives)} objective(s) "
                              f"({', '.join(objectives)})")
        kw["directions"] = dirs
    else:
        dirs = []
        for o in objectives:
            d = default_direction(o)
            if d is None:
                raise ConfigError(f"objective {o!r} has no known direction; add tune.direction=maximize or minimize")
            dirs.append(d)
        kw["directions"] = tuple(dirs)
    if "trials" in raw:
        kw["trials"] = as_int("tune.trials", raw["trials"], 1)
    if "workers" in raw:
        kw["workers"] = as_int("tune.workers", raw["workers"], 1)
    if "startup_trials" in raw:
        kw["startup_trials"] = as_int("tune.startup_trials", raw["startup_trials"], 0)
    if "seed" in raw:
        kw["seed"] = as_int("tune.seed", raw["seed"])
    if "timeout" in raw:
        kw["timeout"] = as_float("tune.timeout", raw["timeout"], 0)
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
    kw["space"] = _parse_space({k[len("space."):]: v for k, v in raw.items() if k.startswith("space.")}, cfg)
    return TuneSettings(**kw)


def _parse_space(raw: Mapping[str, str], cfg: Mapping[str, Any]) -> tuple[SpaceSpec, ...]:
    specs: dict[str, SpaceSpec] = {}
    for key, value in raw.items():
        if not key:
            raise ConfigError("tune.space needs a config key: tune.space.<key>=<values>, "
                              "e.g. tune.space.parallel.pp=2,4")
        keys = [key]
        if key.endswith(".*"):
            section = key[:-2]
            node = get_path(cfg, section) if _is_section(cfg, section) else None
            if not isinstance(node, Mapping):
                check_path(cfg, section + ".x", f"tune.space.{key}")  # names the valid keys
                raise ConfigError(f"tune.space.{key}: {section!r} is not a section")
            keys = [f"{section}.{k}" for k, v in node.items() if not isinstance(v, Mapping)]
        for k in keys:
            if k == "policy.name":
                raise ConfigError("policy.name cannot be tuned: run one study per policy (or `testbed compare`)")
            if k == "seed" or k.startswith("output.") or k in ("data_dir", "check_integrity"):
                raise ConfigError(f"tune.space.{k}: {k} is not a tunable setting")
            check_path(cfg, k, f"tune.space.{k}")
            specs[k] = SpaceSpec.parse(k, value)
    return tuple(specs[k] for k in sorted(specs))


def _is_section(cfg: Mapping[str, Any], key: str) -> bool:
    try:
        return isinstance(get_path(cfg, key), Mapping)
    except (KeyError, TypeError):
        return False


# --- the problem: base config + space, shared by the parent and the workers ----------------------

@dataclass(frozen=True)
class Problem:
    """Everything a worker needs (picklable for spawned processes)."""

    base_cfg: dict
    settings: TuneSettings
    study: str
    storage_url: str
    experiment: str
    pinned: dict  # policy field -> value held fixed (set on the command line)
    seed: int
    parent_run_id: str | None = None
    out_dir: str = "runs"

    @property
    def policy_name(self) -> str:
        return self.base_cfg["policy"]["name"]

    def policy_overrides(self) -> dict[str, SpaceSpec]:
        return {s.name: s for s in self.settings.space if s.key.startswith("policy.")}

    def assign(self, trial: Any) -> dict[str, Any]:
        """Suggest every searched value for this trial: {config key: value}."""
        from engine.policy import POLICIES

        proxy = _SpaceTrial(trial, self.policy_overrides(), self.pinned)
        values = POLICIES.get(self.policy_name).search_space(proxy) or {}
        out = {f"policy.{k}": v for k, v in values.items()}
        for spec in self.settings.space:
            if spec.key in out or (spec.key.startswith("policy.") and spec.name in proxy.used):
                continue
            out[spec.key] = spec.suggest(trial)
        return out

    def config_for(self, assignments: Mapping[str, Any]) -> dict:
        cfg = copy.deepcopy(self.base_cfg)
        for key, value in assignments.items():
            if key.startswith("policy.") and key[7:] not in cfg["policy"]:
                valid = ", ".join(sorted(k for k in cfg["policy"] if k != "name"))
                raise ConfigError(f"policy {self.policy_name!r} search space returned unknown key "
                                  f"{key!r}; valid keys: {valid}")
            set_path(cfg, key, value)
        return cfg

    def space(self) -> dict[str, Any]:
        """The effective space {optuna name: distribution}, walked once with a recorder."""
        defaults = {**{k: v for k, v in self.base_cfg["policy"].items() if k != "name"},
                    **{s.key: get_path(self.base_cfg, s.key) for s in self.settings.space
                       if not s.key.startswith("policy.")}}
        rec = _Recorder(defaults)
        self.assign(rec)
        return rec.space

    def baseline_params(self) -> dict[str, Any] | None:
        """The base config's value of every searched parameter, if each lies in its range."""
        space = self.space()
        params = {}
        for name, dist in space.items():
            key = name if "." in name else f"policy.{name}"
            value = get_path(self.base_cfg, key)
            if not _contains(dist, value):
                return None
            params[name] = value
        return params


def problem_fingerprint(cfg: Mapping[str, Any], settings: TuneSettings, pinned: Mapping[str, Any]) -> dict:
    """What defines a study's problem (compared on resume; hashed into the default name)."""
    from testbed.config import flatten

    base = {k: v for k, v in flatten({k: v for k, v in cfg.items() if k not in ("output", "data_dir",
                                                                               "check_integrity")}).items()}
    return {"config": {k: _jsonable(v) for k, v in sorted(base.items())},
            "objectives": list(settings.objectives), "directions": list(settings.directions),
            "constraints": [c.text for c in settings.constraints],
            "space": {s.key: s.text for s in settings.space}, "pinned": {k: _jsonable(v) for k, v in pinned.items()}}


def _jsonable(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:8]


def _first_difference(old: Mapping, new: Mapping) -> str:
    for section in ("objectives", "directions", "constraints", "space", "pinned"):
        if old.get(section) != new.get(section):
            return f"tune {section}: {old.get(section)} then, {new.get(section)} now"
    oc, nc = old.get("config", {}), new.get("config", {})
    for key in sorted(set(oc) | set(nc)):
        if oc.get(key, "<absent>") != nc.get(key, "<absent>"):
            return f"{key}={oc.get(key, '<absent>')} then, {nc.get(key, '<absent>')} now"
    return "(no difference found)"


# --- storage and samplers -------------------------------------------------------------------------

SQLITE_TIMEOUT_S = 60


def make_storage(url: str):
    """An Optuna storage from a URL: SQLite with a busy timeout, any other RDB URL, or
    `journal:<file>` for Optuna's JournalStorage (file backend)."""
    import optuna

    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        path = Path(url[len("journal:"):])
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    kwargs: dict[str, Any] = {}
    sqlite_file = _sqlite_path(url)
    if url.startswith("sqlite:"):
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
        if sqlite_file is not None:
            _sqlite_wal(sqlite_file)
    try:
        storage = optuna.storages.RDBStorage(url, **kwargs)
        if sqlite_file is not None:
            _sqlite_fast_commits(storage.engine)
        return storage
    except ImportError as exc:
        raise ConfigError(f"tune.storage={redact(url)} needs a database driver: {exc}") from None
    except Exception as exc:  # bad URL, unreachable server
        raise ConfigError(f"cannot open tune.storage={redact(url)}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def _sqlite_wal(path: Path) -> None:
    """Write-ahead logging (persistent in the file): readers (a second worker, optuna-dashboard)
    no longer block the writer. Measured: 139 -> 31 ms of storage time per trial together with
    `synchronous=NORMAL` (one fsync per checkpoint instead of per commit). Not for SQLite files
    on network filesystems (WAL needs shared memory): use PostgreSQL or `journal:` there."""
    import sqlite3

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        con = sqlite3.connect(str(path), timeout=SQLITE_TIMEOUT_S)
        try:
            con.execute("PRAGMA journal_mode=WAL")
        finally:
            con.close()
    except sqlite3.Error:
        pass  # busy or read-only: the default rollback journal still works, only slower


def _sqlite_fast_commits(engine: Any) -> None:
    from sqlalchemy import event

    def on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.execute("PRAGMA synchronous=NORMAL")

    event.listen(engine, "connect", on_connect)
    engine.dispose()  # pooled connections made before the listener get replaced


def redact(url: str) -> str:
    """The storage URL without a password (it goes into tags and logs)."""
    if "@" not in url:
        return url
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("://")[0] + "://***@" + url.rsplit("@", 1)[-1]


def _sqlite_path(uri: str) -> Path | None:
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).resolve()
    return None


def make_sampler(settings: TuneSettings, seed: int):
    import optuna

    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if settings.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=settings.startup_trials)


def _quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


# --- one trial ----------------------------------------------------------------------------------

INTERRUPTED = "interrupted"
TRIAL_SUMMARY_KEYS = ("throughput_tok_s", "ttft_p99_s", "tpot_p99_s", "e2el_mean_s", "slo_attainment",
                      "num_finished", "num_preemptions")


def _worker_tag() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class TrialRunner:
    """Runs trials in one process: suggest, build, run, log to MLflow, tell the study."""

    def __init__(self, problem: Problem) -> None:
        self.p = problem
        self.tracker = None
        out = problem.base_cfg.get("output") or {}
        if out.get("mlflow", True):
            from testbed.tracking import Tracker

            self.tracker = Tracker(problem.base_cfg, problem.experiment)
        self._requests: dict[str, list] = {}

    def _requests_for(self, cfg: Mapping[str, Any]):
        """Build the workload once per process (it is immutable) unless a trial changes it."""
        from testbed.config import data_dir
        from workloads.base import build_workload

        key = json.dumps([cfg.get("workload"), data_dir(cfg)], sort_keys=True, default=str)
        if key not in self._requests:
            self._requests.clear()
            self._requests[key] = build_workload(dict(cfg["workload"]), data_dir(cfg))
        return self._requests[key]

    def run(self, study: Any, trial: Any) -> dict:
        from optuna.trial import TrialState

        from testbed.runner import prepare_experiment

        p = self.p
        t0 = time.perf_counter()
        trial.set_user_attr("worker", _worker_tag())
        run_id = None
        event = {"number": trial.number, "worker": _worker_tag()}
        try:
            try:
                assignments = p.assign(trial)
                cfg = p.config_for(assignments)
            except TestbedError as exc:
                return self._fail(study, trial, run_id, f"invalid config: {exc}", event, t0)
            event["params"] = {k: _jsonable(v) for k, v in assignments.items()}
            if self.tracker is not None:
                run_id = self.tracker.start(cfg, f"trial-{trial.number:04d}", parent_run_id=p.parent_run_id,
                                            tags={"testbed.kind": "trial", "optuna.study": p.study,
                                                  "optuna.trial": str(trial.number),
                                                  "optuna.params": json.dumps(trial.params, default=str)})
                trial.set_user_attr("mlflow_run_id", run_id)
            try:
                prepared = prepare_experiment(cfg, requests=self._requests_for(cfg))
            except TestbedError as exc:
                return self._fail(study, trial, run_id, f"invalid config: {exc}", event, t0)
            except Exception as exc:  # a bug while building: fail the trial, keep where it happened
                return self._fail(study, trial, run_id, f"build error: {type(exc).__name__}: {exc} "
                                  f"({_where(exc)})", event, t0)
            try:
                result = prepared.run()
            except Exception as exc:  # a policy bug for these parameters: a failed trial, not a dead study
                return self._fail(study, trial, run_id, f"run error: {type(exc).__name__}: {exc} "
                                  f"({_where(exc)})", event, t0)
            run_dir = None
            if p.settings.artifacts:
                from testbed.outputs import write_run_dir

                run_dir = write_run_dir(result, Path(p.out_dir) / "trials" / f"trial-{trial.number:04d}",
                                        plots=bool((cfg.get("output") or {}).get("plots", True)))
            if self.tracker is not None:
                if p.settings.artifacts:
                    self.tracker.finish(run_id, result, run_dir)  # everything, as `testbed run` logs it
                else:
                    self.tracker.finish(run_id, result, None, steps=False)
            if result.error:
                return self._fail(study, trial, None, f"run failed: {result.error}", event, t0)
            s = result.summary
            values = [float(s[o]) for o in p.settings.objectives]
            if any(math.isnan(v) for v in values):
                bad = [o for o, v in zip(p.settings.objectives, values) if math.isnan(v)]
                if self.tracker is not None:
                    self.tracker.client.set_tag(run_id, "optuna.state", "FAIL")
                return self._fail(study, trial, None, f"objective {bad[0]} is NaN "
                                  f"({s['num_finished']} of {s['num_requests']} requests finished)", event, t0)
            violations = [c.violation(s) for c in p.settings.constraints]
            for c, v in zip(p.settings.constraints, violations):
                trial.set_constraint(c.text, v)
            # one attribute (one commit): trials.csv expands it into columns
            trial.set_user_attr("summary", {k: _finite(s.get(k)) for k in TRIAL_SUMMARY_KEYS})
            study.tell(trial, values if p.settings.multi else values[0])
            event.update(state="COMPLETE", values=values, feasible=all(v <= 0 for v in violations),
                         wall_s=time.perf_counter() - t0)
            return event
        except KeyboardInterrupt:
            trial.set_user_attr(INTERRUPTED, True)
            trial.set_user_attr("fail_reason", INTERRUPTED)
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            if self.tracker is not None and run_id is not None:
                self.tracker.client.set_tag(run_id, "error", INTERRUPTED)
                self.tracker.client.set_terminated(run_id, "KILLED")
            raise

    def _fail(self, study, trial, run_id, reason: str, event: dict, t0: float) -> dict:
        from optuna.trial import TrialState

        trial.set_user_attr("fail_reason", reason[:2000])
        if self.tracker is not None and run_id is not None:
            self.tracker.fail(run_id, reason)
        study.tell(trial, state=TrialState.FAIL)
        event.update(state="FAIL", fail_reason=reason, wall_s=time.perf_counter() - t0)
        return event


def _where(exc: BaseException) -> str:
    """file:line of the innermost frame, so a failed trial's reason points at the bug."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}"


def _finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def counted(trials: Sequence[Any]) -> int:
    """Trials that count toward `tune.trials`: all but those interrupted."""
    return sum(1 for t in trials if not t.user_attrs.get(INTERRUPTED))


def worker_loop(problem: Problem, index: int, lock: Any = None, emit: Callable[[dict], None] | None = None,
                ready: Callable[[], None] | None = None) -> int:
    """Ask for trials until the study holds `tune.trials` counted trials (or the timeout).
    `ready` is called once set up, before the first trial (the start barrier of parallel workers)."""
    import optuna

    _quiet_optuna()
    study = optuna.load_study(study_name=problem.study, storage=make_storage(problem.storage_url),
                              sampler=make_sampler(problem.settings, problem.seed + index))
    runner = TrialRunner(problem)
    if ready is not None:
        ready()
    deadline = time.monotonic() + problem.settings.timeout if problem.settings.timeout else None
    done = 0
    while deadline is None or time.monotonic() < deadline:
        with lock if lock is not None else nullcontext():
            if counted(study.get_trials(deepcopy=False)) >= problem.settings.trials:
                break
            trial = study.ask()
        event = runner.run(study, trial)
        done += 1
        if emit is not None:
            emit(event)
    return done


START_TIMEOUT_S = 120


def _worker_main(problem: Problem, index: int, lock: Any, queue: Any, start: Any) -> None:
    """Entry point of a spawned worker process."""
    code = 0

    def ready() -> None:
        queue.put({"ready": index})
        start.wait(START_TIMEOUT_S)

    try:
        worker_loop(problem, index, lock, queue.put, ready)
    except KeyboardInterrupt:
        code = 130
    except BaseException as exc:  # a bug: report it to the parent, then die loudly
        import traceback

        queue.put({"worker_error": f"worker {index}: {type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()})
        code = 1
    finally:
        queue.put({"worker_done": index, "code": code})
    sys.exit(code)


# --- the command --------------------------------------------------------------------------------

@dataclass
class TuneOutcome:
    study: str
    storage: str
    out_dir: Path
    best: list  # FrozenTrials: the best (single objective) or the Pareto front
    baseline: Any  # the baseline FrozenTrial, if any
    trials_run: int
    wall_s: float
    counts: dict = field(default_factory=dict)
    interrupted: bool = False
    worker_errors: list = field(default_factory=list)
    figures: list = field(default_factory=list)
    objectives: tuple = ()

    @property
    def trials_per_min(self) -> float:
        return 60.0 * self.trials_run / self.wall_s if self.wall_s > 0 else 0.0


def prepare(overrides: Sequence[str]) -> Problem:
    """Parse and validate everything (no study, no MLflow run yet)."""
    from testbed.config import compose, to_container

    raw, rest = split_prefixed(overrides, "tune")
    cfg = to_container(compose(rest))
    settings = parse_settings(raw, cfg)
    explicit = explicit_keys(rest)
    policy_cls_name = cfg["policy"]["name"]
    pinned = {k[len("policy."):]: get_path(cfg, k) for k in explicit if k.startswith("policy.") and k != "policy.name"}
    for spec in settings.space:
        if spec.key in explicit:
            raise ConfigError(f"{spec.key} is both set ({spec.key}={get_path(cfg, spec.key)}) and searched "
                              f"(tune.space.{spec.key}); drop one of them")
    seed = settings.seed if settings.seed is not None else int(cfg.get("seed") or 0)
    out = cfg.get("output") or {}
    out_root = Path(out.get("dir") or "runs")
    fp = problem_fingerprint(cfg, settings, pinned)
    study = settings.study or f"{policy_cls_name}-{cfg['workload']['name']}-{'+'.join(settings.objectives)}-{_hash(fp)}"
    if "/" in study or study.startswith("."):
        raise ConfigError(f"invalid tune.study={study!r}: no '/' and no leading '.'")
    storage = settings.storage or f"sqlite:///{(out_root.resolve() / 'optuna.db')}"
    if storage.startswith("sqlite:///"):
        _sqlite_path(storage).parent.mkdir(parents=True, exist_ok=True)
        from testbed.tracking import tracking_uri

        if out.get("mlflow", True) and _sqlite_path(storage) == _sqlite_path(tracking_uri(cfg)):
            raise ConfigError(f"tune.storage={storage} is the MLflow tracking database; Optuna and MLflow must "
                              f"not share one (both keep an alembic_version table): use another file")
    problem = Problem(base_cfg=cfg, settings=settings, study=study, storage_url=storage,
                      experiment=settings.experiment or f"tune-{study}", pinned=pinned, seed=seed,
                      out_dir=str(out_root / "tune" / study))
    space = problem.space()
    if not space:
        raise ConfigError(f"nothing to tune: policy {policy_cls_name!r} declares no search space"
                          + (" (or every parameter of it is fixed on the command line)" if pinned else "")
                          + "; add tune.space.<key>=<values>, e.g. tune.space.parallel.pp=2,4")
    return problem


def _open_study(problem: Problem, fingerprint: dict):
    """Create or resume the study; refuse to resume a different problem."""
    import optuna

    storage = make_storage(problem.storage_url)
    s = problem.settings
    try:
        study = optuna.create_study(study_name=problem.study, storage=storage, load_if_exists=True,
                                    directions=list(s.directions),
                                    sampler=make_sampler(s, problem.seed))
    except ValueError as exc:  # e.g. directions differ from the stored study
        raise ConfigError(f"cannot resume study {problem.study!r}: {exc}") from None
    stored_dirs = [d.name.lower() for d in study.directions]
    if stored_dirs != list(s.directions):
        raise ConfigError(f"study {problem.study!r} exists with directions {stored_dirs}, not {list(s.directions)}; "
                          f"use another tune.study=")
    fingerprint = json.loads(json.dumps(fingerprint, default=str))
    old = study.user_attrs.get("testbed.problem")
    if old is None and not study.trials:
        study.set_user_attr("testbed.problem", fingerprint)
        study.set_user_attr("testbed.policy", problem.policy_name)
    elif old is not None and old != fingerprint:
        raise ConfigError(f"study {problem.study!r} in {redact(problem.storage_url)} was created for another problem "
                          f"({_first_difference(old, fingerprint)}); use another tune.study= or the same overrides")
    return study, storage


def _fail_stale(study: Any, storage: Any, tracker: Any) -> int:
    """RUNNING trials of dead worker processes on this host: mark them interrupted + FAILED."""
    from optuna.trial import TrialState

    host = socket.gethostname()
    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        w = str(t.user_attrs.get("worker", ""))
        whost, _, pid = w.rpartition(":")
        if whost != host or not pid.isdigit() or _alive(int(pid)):
            continue
        storage.set_trial_user_attr(t._trial_id, INTERRUPTED, True)
        storage.set_trial_user_attr(t._trial_id, "fail_reason", f"{INTERRUPTED}: worker {w} is gone")
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        run_id = t.user_attrs.get("mlflow_run_id")
        if tracker is not None and run_id:
            try:
                tracker.client.set_terminated(run_id, "KILLED")
            except Exception:
                pass
        n += 1
    return n


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _study_run(problem: Problem, study: Any, tracker: Any) -> str | None:
    """The study's MLflow run: reused when this tracking store already has it (resume)."""
    if tracker is None:
        return None
    runs = dict(study.user_attrs.get("testbed.mlflow_runs") or {})
    uri = redact(tracker.uri)
    run_id = runs.get(uri)
    if run_id:
        try:
            tracker.client.get_run(run_id)
            tracker.client.update_run(run_id, status="RUNNING")
            return run_id
        except Exception:
            pass
    s = problem.settings
    tags = {"testbed.kind": "study", "optuna.study": problem.study, "optuna.storage": redact(problem.storage_url),
            "tune.objectives": ",".join(s.objectives), "tune.directions": ",".join(s.directions),
            "tune.constraints": ",".join(c.text for c in s.constraints),
            "tune.space": json.dumps({sp.key: sp.text for sp in s.space}),
            "tune.pinned": json.dumps(problem.pinned, default=str), "tune.sampler": s.sampler,
            "tune.seed": str(problem.seed)}
    run_id = tracker.start(problem.base_cfg, problem.study, tags=tags)
    runs[uri] = run_id
    study.set_user_attr("testbed.mlflow_runs", runs)
    return run_id


_SIGTERM = {"received": False}


def _on_sigterm(signum, frame) -> None:
    """SIGTERM (a scheduler, `kill <pid>`) takes the Ctrl-C path: trials are marked interrupted."""
    _SIGTERM["received"] = True
    raise KeyboardInterrupt


def run_tune(overrides: Sequence[str], console: Any = None) -> TuneOutcome:
    """The whole command: validate, open the study and its MLflow run, run the workers, report."""
    import signal
    import threading

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _run_tune(overrides, console)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run_tune(overrides: Sequence[str], console: Any) -> TuneOutcome:
    import optuna

    _quiet_optuna()
    problem = prepare(overrides)
    s = problem.settings
    fp = problem_fingerprint(problem.base_cfg, s, problem.pinned)
    study, storage = _open_study(problem, fp)
    out = problem.base_cfg.get("output") or {}
    tracker = None
    if out.get("mlflow", True):
        from testbed.tracking import Tracker

        tracker = Tracker(problem.base_cfg, problem.experiment)  # creates the MLflow DB before any worker
    stale = _fail_stale(study, storage, tracker)
    if s.baseline and not study.trials:
        params = problem.baseline_params()
        if params is not None:
            study.enqueue_trial(params, user_attrs={"baseline": True})
    parent = _study_run(problem, study, tracker)
    problem = dataclasses.replace(problem, parent_run_id=parent)
    Path(problem.out_dir).mkdir(parents=True, exist_ok=True)

    trials = study.get_trials(deepcopy=False)
    already = counted(trials)
    display = _Display(console, bool(out.get("progress", True)), problem, trials)
    if console is not None:
        _print_start(console, problem, trials, stale)
    t0 = time.perf_counter()
    run_count = 0
    interrupted = False
    worker_errors: list[str] = []
    try:
        with display:
            if s.workers == 1 or already >= s.trials:
                run_count = worker_loop(problem, 0, None, display.event) if already < s.trials else 0
            else:
                run_count, worker_errors = _run_workers(problem, display)
    except KeyboardInterrupt:
        interrupted = True
    run_count = max(run_count, display.events)  # an interrupted loop returns no count
    wall = time.perf_counter() - t0
    study = optuna.load_study(study_name=problem.study, storage=storage)
    return finish_study(problem, study, tracker, run_count, wall, interrupted, worker_errors)


def _run_workers(problem: Problem, display: _Display) -> tuple[int, list[str]]:
    """Worker 0 is this process (its imports are paid for already); workers 1..N-1 are spawned
    processes. A thread drains their events into the display while worker 0 runs trials."""
    import multiprocessing as mp
    import queue as queue_mod
    import threading

    ctx = mp.get_context("spawn")
    lock = ctx.Lock()
    q = ctx.Queue()
    start = ctx.Event()
    procs = [ctx.Process(target=_worker_main, args=(problem, i, lock, q, start), name=f"tune-worker-{i}",
                         daemon=False) for i in range(1, problem.settings.workers)]
    for p in procs:
        p.start()
    state = {"count": 0, "errors": [], "done": set(), "ready": set()}
    stop = threading.Event()
    all_ready = threading.Event()

    def drain() -> None:
        while True:
            try:
                msg = q.get(timeout=0.2)
            except queue_mod.Empty:
                for i, p in enumerate(procs, start=1):  # a worker killed without a word (OOM, signal)
                    if not p.is_alive() and i not in state["done"] and p.exitcode not in (0, None, 130):
                        state["done"].add(i)
                        state["errors"].append(f"worker {i} died with exit code {p.exitcode}")
                        if len(state["ready"] | state["done"]) == len(procs):
                            all_ready.set()
                if stop.is_set() and not any(p.is_alive() for p in procs):
                    return
                continue
            if "ready" in msg:
                state["ready"].add(msg["ready"])
                if len(state["ready"]) == len(procs):
                    all_ready.set()
            elif "worker_done" in msg:
                state["done"].add(msg["worker_done"])
                if len(state["ready"] | state["done"]) == len(procs):
                    all_ready.set()
            elif "worker_error" in msg:
                state["errors"].append(msg["worker_error"])
                display.note(f"[red]{msg['worker_error']}[/red]\n{msg.get('traceback', '')}")
            else:
                state["count"] += 1
                display.event(msg)

    reader = threading.Thread(target=drain, name="tune-events", daemon=True)
    reader.start()
    own = 0
    try:
        def ready() -> None:
            """Start together (the spawned workers need a few seconds of imports): every worker
            then really shares the study, and the first trials do not all land on worker 0."""
            all_ready.wait(START_TIMEOUT_S)
            start.set()

        own = worker_loop(problem, 0, lock, display.event, ready)
        for p in procs:  # the others finish the trials they hold, then find the target reached
            p.join()
    finally:
        start.set()
        if _SIGTERM["received"]:  # only this process was told: pass it on as SIGINT
            import signal

            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGINT)
        # On Ctrl-C the children got SIGINT too (same process group) and mark their own trials.
        deadline = time.monotonic() + 30
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        stop.set()
        reader.join(timeout=10)
    return own + state["count"], state["errors"]


# --- display ------------------------------------------------------------------------------------

class _Display:
    """Progress (trials done of the target, best so far) and one line per finished trial."""

    def __init__(self, console: Any, enabled: bool, problem: Problem, trials: Sequence[Any]) -> None:
        from optuna.trial import TrialState

        self.console = console
        self.enabled = enabled and console is not None
        self.p = problem
        self.done = sum(1 for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)
                        and not t.user_attrs.get(INTERRUPTED))
        self.best: float | None = None
        self.front = 0
        self.points: list[list[float]] = []
        for t in trials:
            if t.state == TrialState.COMPLETE and all(v <= 0 for v in t.constraints.values()):
                self._consider(list(t.values))
        self.progress = None
        self.task = None
        self._lock = __import__("threading").Lock()
        self.events = 0

    def _consider(self, values: list[float]) -> None:
        dirs = self.p.settings.directions
        if len(values) == 1:
            v = values[0]
            if self.best is None or (v > self.best if dirs[0] == "maximize" else v < self.best):
                self.best = v
        else:
            self.points.append(values)
            self.front = len(_pareto_indices(self.points, dirs))

    def _best_text(self) -> str:
        obj = self.p.settings.objectives
        if len(obj) > 1:
            return f"Pareto front: {self.front}"
        return f"best {obj[0]}: {self.best:.6g}" if self.best is not None else "best: -"

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("trials"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.description}"), TimeElapsedColumn(), console=self.console,
                                     transient=True)
            self.progress.__enter__()
            self.task = self.progress.add_task(self._best_text(), total=self.p.settings.trials,
                                               completed=min(self.done, self.p.settings.trials))
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)
        return False

    def note(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text)

    def event(self, ev: dict) -> None:
        with self._lock:
            self._event(ev)

    def _event(self, ev: dict) -> None:
        self.done += 1
        self.events += 1
        if ev.get("state") == "COMPLETE" and ev.get("feasible", True):
            self._consider(ev["values"])
        if self.console is not None and self.enabled:
            params = " ".join(f"{k.removeprefix('policy.')}={v}" for k, v in (ev.get("params") or {}).items())
            if ev.get("state") == "COMPLETE":
                vals = " ".join(f"{o}={v:.6g}" for o, v in zip(self.p.settings.objectives, ev["values"]))
                tail = "" if ev.get("feasible", True) else " [yellow](infeasible)[/yellow]"
                self.console.print(f"trial {ev['number']:>4} [green]done[/green]   {vals}{tail}  {params}",
                                   highlight=False)
            else:
                self.console.print(f"trial {ev['number']:>4} [red]failed[/red] {ev.get('fail_reason', '')[:120]}"
                                   f"  {params}", highlight=False, markup=True)
        if self.progress is not None:
            self.progress.update(self.task, completed=min(self.done, self.p.settings.trials),
                                 description=self._best_text())


def _print_start(console: Any, problem: Problem, trials: Sequence[Any], stale: int) -> None:
    s = problem.settings
    space = problem.space()
    desc = ", ".join(f"{name} {_dist_text(d)}" for name, d in space.items())
    from optuna.trial import TrialState

    finished = sum(1 for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)
                   and not t.user_attrs.get(INTERRUPTED))
    resumed = f"resuming: {finished} of {s.trials} trials done" if finished else f"new: {s.trials} trials"
    console.print(f"study [bold]{problem.study}[/bold] in {redact(problem.storage_url)} "
                  f"({resumed}; {s.workers} worker{'s' if s.workers > 1 else ''})", highlight=False)
    goal = ", ".join(f"{d} {o}" for o, d in zip(s.objectives, s.directions))
    cons = f" subject to {', '.join(c.text for c in s.constraints)}" if s.constraints else ""
    console.print(f"{goal}{cons} over {desc}", highlight=False)
    if problem.pinned:
        console.print("fixed: " + ", ".join(f"policy.{k}={v}" for k, v in problem.pinned.items()), highlight=False)
    if stale:
        console.print(f"{stale} trial(s) left RUNNING by dead workers were marked failed (interrupted)")


def _dist_text(d: Any) -> str:
    from optuna.distributions import CategoricalDistribution

    if isinstance(d, CategoricalDistribution):
        return "{" + ", ".join(map(str, d.choices)) + "}"
    tail = " log" if getattr(d, "log", False) else (f" step {d.step}" if getattr(d, "step", None) not in (None, 1)
                                                     else "")
    return f"[{d.low}, {d.high}{tail}]"


# --- results ------------------------------------------------------------------------------------

def _pareto_indices(points: Sequence[Sequence[float]], directions: Sequence[str]) -> list[int]:
    signs = [1.0 if d == "minimize" else -1.0 for d in directions]
    pts = [[s * v for s, v in zip(signs, p)] for p in points]
    front = []
    for i, a in enumerate(pts):
        dominated = any(all(x <= y for x, y in zip(b, a)) and any(x < y for x, y in zip(b, a))
                        for j, b in enumerate(pts) if j != i)
        if not dominated:
            front.append(i)
    return front


def best_trials(study: Any, directions: Sequence[str]) -> list:
    """The best feasible trial (one objective) or the feasible Pareto front (several), ordered."""
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if all(v <= 0 for v in t.constraints.values())]
    if not done:
        return []
    if len(directions) == 1:
        sign = -1.0 if directions[0] == "maximize" else 1.0
        return [min(done, key=lambda t: (sign * t.values[0], t.number))]
    idx = _pareto_indices([t.values for t in done], directions)
    return sorted((done[i] for i in idx), key=lambda t: t.number)


def finish_study(problem: Problem, study: Any, tracker: Any, trials_run: int, wall_s: float,
                 interrupted: bool, worker_errors: list[str]) -> TuneOutcome:
    """Write the study directory, log it to the study's MLflow run, and say what was found."""
    from optuna.trial import TrialState

    s = problem.settings
    out_dir = Path(problem.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trials = study.get_trials(deepcopy=False)
    counts = {st.name.lower(): sum(1 for t in trials if t.state == st)
              for st in (TrialState.COMPLETE, TrialState.FAIL, TrialState.RUNNING, TrialState.WAITING)}
    best = best_trials(study, s.directions)
    baseline = next((t for t in trials if t.user_attrs.get("baseline") and t.state == TrialState.COMPLETE), None)
    df = trials_frame(study, problem)
    df.to_csv(out_dir / "trials.csv", index=False)
    summary = {"study": problem.study, "storage": redact(problem.storage_url), "objectives": list(s.objectives),
               "directions": list(s.directions), "constraints": [c.text for c in s.constraints],
               "trials": counts, "target": s.trials,
               "best": [_trial_json(t, problem) for t in best],
               "baseline": _trial_json(baseline, problem) if baseline is not None else None,
               "session": {"trials_run": trials_run, "wall_s": wall_s,
                           "trials_per_min": 60.0 * trials_run / wall_s if wall_s > 0 else 0.0,
                           "workers": s.workers}}
    if baseline is not None and len(best) == 1 and len(s.objectives) == 1 and baseline.values[0]:
        summary["gain_over_baseline"] = best[0].values[0] / baseline.values[0] - 1.0
    (out_dir / "best.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    plots = bool((problem.base_cfg.get("output") or {}).get("plots", True))
    figures = write_study_figures(study, problem, out_dir) if plots else []
    if tracker is not None and problem.parent_run_id:
        _log_study(tracker, problem, summary, best, counts, out_dir)
        status = "KILLED" if interrupted else "FAILED" if worker_errors else "FINISHED"
        tracker.client.set_terminated(problem.parent_run_id, status)
    return TuneOutcome(study=problem.study, storage=problem.storage_url, out_dir=out_dir, best=best,
                       baseline=baseline, trials_run=trials_run, wall_s=wall_s, counts=counts,
                       interrupted=interrupted, worker_errors=worker_errors, figures=figures,
                       objectives=s.objectives)


def _trial_json(t: Any, problem: Problem) -> dict:
    return {"number": t.number, "values": dict(zip(problem.settings.objectives, t.values or [])),
            "params": dict(t.params), "config": {k if "." in k else f"policy.{k}": v for k, v in t.params.items()},
            "constraints": dict(t.constraints), "mlflow_run_id": t.user_attrs.get("mlflow_run_id")}


def trials_frame(study: Any, problem: Problem):
    """`study.trials_dataframe()` with the objective names as column names."""
    import pandas as pd

    df = study.trials_dataframe(attrs=("number", "value", "datetime_start", "datetime_complete", "duration",
                                       "params", "user_attrs", "state"))
    if df.empty:
        return pd.DataFrame(columns=["number", "state"])
    names = list(problem.settings.objectives)
    if len(names) == 1 and "value" in df.columns:
        df = df.rename(columns={"value": names[0]})
    else:
        df = df.rename(columns={f"values_{i}": n for i, n in enumerate(names)})
    if "user_attrs_summary" in df.columns:
        for key in TRIAL_SUMMARY_KEYS:
            if key not in df.columns:
                df[key] = [d.get(key) if isinstance(d, dict) else None for d in df["user_attrs_summary"]]
        df = df.drop(columns=["user_attrs_summary"])
    constraints = {t.number: t.constraints for t in study.get_trials(deepcopy=False)}
    for c in problem.settings.constraints:
        df[f"constraint {c.text}"] = [constraints.get(n, {}).get(c.text) for n in df["number"]]
    return df


def write_study_figures(study: Any, problem: Problem, out_dir: Path) -> list[Path]:
    """Optimisation history, parameter importances and (several objectives) the Pareto front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as ovm

    s = problem.settings
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    paths: list[Path] = []

    def save(ax_or_fig, name: str) -> None:
        fig = ax_or_fig if hasattr(ax_or_fig, "savefig") else (
            ax_or_fig.flat[0].figure if hasattr(ax_or_fig, "flat") else ax_or_fig.figure)
        fig.set_size_inches(max(fig.get_size_inches()[0], 7), max(fig.get_size_inches()[1], 4.5))
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)

    if not done:
        return paths
    # optuna's matplotlib plots switch the global style to ggplot: keep that local
    with warnings.catch_warnings(), matplotlib.rc_context():
        warnings.simplefilter("ignore")
        for i, obj in enumerate(s.objectives):
            target = None if not s.multi else (lambda t, i=i: t.values[i])
            suffix = "" if not s.multi else f"_{obj}"
            try:
                save(ovm.plot_optimization_history(study, target=target, target_name=obj),
                     f"optimization_history{suffix}.png")
            except Exception:
                plt.close("all")
            if len(done) >= 2:
                try:
                    save(ovm.plot_param_importances(study, target=target, target_name=obj),
                         f"param_importances{suffix}.png")
                except Exception:  # e.g. no parameter varied yet
                    plt.close("all")
        if s.multi and len(s.objectives) in (2, 3):
            try:
                save(ovm.plot_pareto_front(study, target_names=list(s.objectives)), "pareto_front.png")
            except Exception:
                plt.close("all")
    return paths


def _log_study(tracker: Any, problem: Problem, summary: dict, best: list, counts: dict, out_dir: Path) -> None:
    from mlflow.entities import Metric

    s = problem.settings
    run_id = problem.parent_run_id
    total = sum(counts.values())
    now = int(time.time() * 1000)
    metrics = [Metric(f"trials.{k}", float(v), now, total) for k, v in counts.items()]
    sess = summary["session"]
    if sess["trials_run"]:
        metrics.append(Metric("tune.trials_per_min", float(sess["trials_per_min"]), now, total))
    tags = {}
    if best:
        if not s.multi:
            b = best[0]
            metrics.append(Metric(f"best.{s.objectives[0]}", float(b.values[0]), now, total))
            metrics.append(Metric("best.trial", float(b.number), now, total))
            for name, value in b.params.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metrics.append(Metric(f"best.{name}", float(value), now, total))
                tags[f"best.{name}"] = str(value)
            tags["best.params"] = json.dumps(b.params, default=str)
            tags["best.trial"] = str(b.number)
            if "gain_over_baseline" in summary:
                metrics.append(Metric("best.gain_over_baseline", float(summary["gain_over_baseline"]), now, total))
        else:
            metrics.append(Metric("pareto.size", float(len(best)), now, total))
            tags["pareto.trials"] = ",".join(str(t.number) for t in best)
            tags["pareto.params"] = json.dumps([{"trial": t.number, **t.params} for t in best], default=str)[:5000]
    from mlflow.entities import RunTag

    tracker.client.log_batch(run_id, metrics=metrics, tags=[RunTag(k, v[:5000]) for k, v in tags.items()])
    for path in sorted(out_dir.iterdir()):  # the study's files (trial run dirs go to the trial runs)
        if path.is_file():
            tracker.client.log_artifact(run_id, str(path))


def print_outcome(outcome: TuneOutcome) -> None:
    """The last lines: the best trial's value(s) and parameters (stdout)."""
    problem_objectives = outcome.objectives
    print(f"trials: {outcome.counts.get('complete', 0)} complete, {outcome.counts.get('fail', 0)} failed; "
          f"this session {outcome.trials_run} in {outcome.wall_s:.1f} s ({outcome.trials_per_min:.1f} trials/min)")
    print(f"study directory: {outcome.out_dir.resolve()}")
    if not outcome.best:
        print("no completed (feasible) trial yet")
        return
    if len(outcome.best) == 1 and len(problem_objectives) == 1:
        b = outcome.best[0]
        gain = ""
        if outcome.baseline is not None and outcome.baseline.values[0]:
            g = b.values[0] / outcome.baseline.values[0] - 1.0
            gain = f" ({g:+.1%} vs the defaults, trial {outcome.baseline.number}: {outcome.baseline.values[0]:.6g})"
        print(f"best trial {b.number}: {problem_objectives[0]}={b.values[0]:.6g}{gain}")
        print("best params: " + " ".join(f"{_cfg_key(k)}={v}" for k, v in b.params.items()))
        return
    print(f"Pareto front ({len(outcome.best)} trials):")
    for t in outcome.best:
        vals = " ".join(f"{o}={v:.6g}" for o, v in zip(problem_objectives, t.values))
        print(f"  trial {t.number}: {vals}  " + " ".join(f"{_cfg_key(k)}={v}" for k, v in t.params.items()))


def _cfg_key(name: str) -> str:
    return name if "." in name else f"policy.{name}"
