"""Configuration: Hydra config groups generated from the plug-in registries, and clear errors.

Each group's choices come from the code, not from YAML copies: a policy's group node is its
`Params` dataclass, a workload's is its config dataclass, hardware and model nodes are the
tables in engine/pricing/hardware.py and engine/pricing/models.py, and the top-level sections (`parallel`, `kv`,
`link`, `runtime`, `slo`, `output`) are the dataclasses of engine/base/settings.py. Adding a policy
therefore adds `policy=<name>` and every `policy.<param>=` override with nothing else to edit.

`compose(overrides)` returns the resolved DictConfig, already validated: every user mistake
(unknown group choice, unknown or blank key, `+key`/`~key`, a key given twice, bad syntax, an
unresolvable `${...}`, a value of the wrong type or out of range) becomes a `ConfigError` whose one
line names the value and the valid choices, which the CLI prints without a traceback.
`run_config(cfg)` turns a composed config into the typed `engine.base.settings.RunConfig` that the
runner and the executors read.

Random streams and seeds. `seed` (an integer >= 0, default 0) is the root of every random stream
that is not pinned separately; each stream has a key that pins it:

- `workload.seed` (default `${seed}`): the workload's draws -- synthetic lengths and arrivals,
  ShareGPT's sample of pairs and its arrivals (independent child streams of one SeedSequence,
  workloads/synthetic.py, workloads/sharegpt.py). The Azure trace is deterministic and ignores it.
  The TD-Pipe predictor's synthetic history is drawn with `workload.seed + 1000003`.
- `policy.seed` (default `${seed}`, for policies that draw): gLLM's random decode offset with
  `rules=code` (policies/gllm.py), TD-Pipe's predictor training and history split
  (policies/tdpipe.py, policies/length_predictor.py).
- torch engine (`executor=torch`): `executor.prompt_seed` (default null = `seed`) makes the prompt
  token ids of requests without text; `executor.sample_seed` (default 0) seeds random sampling and
  `executor.model_seed` (default 0) the random weights of a table model -- both pinned on purpose,
  so that sweeping `seed` changes the workload and the policy's draws but not the model.
- `tune.seed` (default null = `seed`): the Optuna sampler (testbed/tune.py).

The simulator itself draws nothing. Because every derived default is `seed` itself, `seed=0`
gives exactly the streams of the runs made before `seed` was their root; `seed=1` and `seed=2`
differ in every unpinned stream, and the same seed gives byte-identical simulated results.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from engine.pricing.costmodel import CostCoefficients
from engine.base.errors import ConfigError, unknown_choice
from engine.core.executor import EXECUTORS
from engine.pricing.hardware import HARDWARE, HardwareSpec, get_hardware
from engine.pricing.models import MODELS, ModelSpec
from engine.core.policy import POLICIES, make_params
from engine.base.settings import SECTIONS, ExecutorChoice, RunConfig
from engine.base.typed import build, coerce
from testbed.config.serve import serve_defaults
from workloads.base import WORKLOADS, workload_config

import engine.simulator.sim  # noqa: F401  (registers executor=sim)
import engine.torch_exec  # noqa: F401  (registers executor=torch; torch itself is imported only when used)
import policies  # noqa: F401  (registers every policy)
import workloads  # noqa: F401  (registers every workload)

DEFAULTS = {"policy": "gllm", "workload": "azure", "executor": "sim", "hardware": "l20-48g",
            "model": "qwen2.5-32b"}
# The main job's operating point (`testbed run` = gLLM, Azure conversation trace, Qwen2.5-32B on
# 4 x L20-48GB, fitted `l20-48g` profile). At the trace's own pace it offers 4.7 req/s, a backlog.
# 0.8 req/s is where gLLM meets its SLO on the run's 2,000 requests: 81.7% attainment (TTFT <= 4 s,
# TPOT <= 0.2 s), mean TTFT 1.8 s, mean TPOT 0.17 s; 1.5 req/s, the default of earlier versions,
# gave 21%. `testbed capacity policy=gllm workload=azure` puts gLLM's capacity at 0.88 req/s, the
# median of three 910 s stretches of the trace (0.80-1.07). `workload.rate=null` replays the timestamps.
GROUP_DEFAULTS = {"workload": {"azure": {"rate": 0.8}}}
GROUP_KINDS = {"policy": "policy", "workload": "workload", "executor": "executor", "hardware": "hardware",
               "model": "model"}

SEED_KEY = "seed"  # a group field of this name defaults to the run's seed (see the module docstring)


def _node(obj: Any) -> dict:
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out
    return dict(obj)


def _seeded(node: dict) -> dict:
    """A workload's or policy's `seed` defaults to the run's `seed` (an interpolation, so that
    `seed=7` moves it and `workload.seed=3` pins it)."""
    if SEED_KEY in node:
        node[SEED_KEY] = "${" + SEED_KEY + "}"
    return node


_DEFAULT = RunConfig()
# The top-level keys and their defaults, from the dataclasses of engine/base/settings.py.
BASE = {
    "seed": _DEFAULT.seed,
    **{name: _node(getattr(_DEFAULT, name)) for name in ("parallel", "kv", "link", "runtime", "slo")},
    "cost": None,  # filled from CostCoefficients
    "data_dir": _DEFAULT.data_dir,
    "output": _node(_DEFAULT.output),
    "check_integrity": _DEFAULT.check_integrity,
    "serve": serve_defaults(),  # `testbed serve` (testbed/config/serve.py)
}


def load_saved_profiles() -> list[str]:
    """Register the calibrated hardware profiles saved by `testbed profile` ($TESTBED_PROFILE_DIR,
    default runs/profiles/*.yaml), after those shipped in engine/pricing/hardware_profiles/, so that
    `hardware=<name>` finds them."""
    from testbed.config.profiles import SHIPPED_PROFILES_DIR, load_profiles_dir

    shipped = load_profiles_dir(SHIPPED_PROFILES_DIR, on_error=_skip_profile)
    return shipped + load_profiles_dir(os.environ.get("TESTBED_PROFILE_DIR") or "runs/profiles", on_error=_skip_profile)


_WARNED: set[str] = set()


def _skip_profile(path, exc: Exception) -> None:
    """One broken profile file is skipped with one warning line, not an error for every command."""
    import sys

    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        print(f"warning: skipping hardware profile {path}: {exc}", file=sys.stderr)


def hardware_node(name: str) -> dict:
    """The `hardware` section of a registered GPU (saved profiles included), as a derived spec
    takes it (`spec.with_values({"hardware": hardware_node(name)})`); one `error:` line naming the
    choices when `name` is none of them."""
    load_saved_profiles()
    return _node(get_hardware(name))


def group_nodes() -> dict[str, dict[str, dict]]:
    """Every config group's choices as plain dicts, straight from the registries."""
    load_saved_profiles()
    groups: dict[str, dict[str, dict]] = {"policy": {}, "workload": {}, "executor": {}, "hardware": {}, "model": {}}
    for name in POLICIES.names():
        groups["policy"][name] = _seeded({"name": name, **_node(POLICIES.get(name).Params())})
    for name in WORKLOADS.names():
        groups["workload"][name] = _seeded({**_node(WORKLOADS.get(name).config_cls()),
                                            **GROUP_DEFAULTS["workload"].get(name, {})})
    for name in EXECUTORS.names():
        groups["executor"][name] = {"name": name, **_node(EXECUTORS.get(name).config_cls())}
    for name, spec in HARDWARE.items():
        groups["hardware"][name] = _node(spec)
    for name, spec in MODELS.items():
        groups["model"][name] = _node(spec)
    return groups


def base_config() -> dict:
    base = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    # null = the hardware profile's fitted value if it has one, else the cost model's default
    base["cost"] = {k: None for k in _node(CostCoefficients())}
    return base


_STORED: dict[str, tuple] = {}  # "nodes": the groups and primary config last put in Hydra's ConfigStore


def compose_validated(overrides: Sequence[str] = ()) -> tuple[DictConfig, dict[str, Any]]:
    """Resolve `key=value` overrides (Hydra syntax) on top of the defaults, and validate the result
    (`validate`): a config that composes is one every command can run. Returns the config and its
    typed sections (testbed/config/spec.py builds the RunSpec from both, validating once)."""
    from hydra import compose as hydra_compose, initialize
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _share_config_store()
    groups = group_nodes()
    _precheck(overrides, groups)
    primary = {"defaults": [{g: DEFAULTS[g]} for g in groups] + ["_self_"], **base_config()}
    if _STORED.get("nodes") != (groups, primary):  # storing converts each node: 28 ms a compose
        cs = ConfigStore.instance()
        for group, choices in groups.items():
            for name, node in choices.items():
                cs.store(group=group, name=name, node=node)
        cs.store(name="testbed_config", node=primary)
        _STORED["nodes"] = copy.deepcopy((groups, primary))
    GlobalHydra.instance().clear()
    try:
        with initialize(version_base=None, config_path=None):
            cfg = hydra_compose(config_name="testbed_config", overrides=list(overrides))
        container = OmegaConf.to_container(cfg, resolve=True)  # every ${...} must resolve
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise _explain(exc, overrides, groups) from None
    finally:
        GlobalHydra.instance().clear()
    OmegaConf.set_struct(cfg, False)
    typed = validate(container)
    _normalize(cfg, typed)
    return cfg, typed


def _share_config_store() -> None:
    """Hydra deep-copies its config repository at every compose, and with it the whole
    ConfigStore singleton that its structured-config source holds: every hardware profile,
    model, policy and workload node, 28 of 88 ms a compose. Hydra PR 2928 stops the source from
    holding the store; until a release carries it, the singleton's deep copy is itself. Safe
    because `ConfigStore.load` deep-copies each node it hands out, so a compose never changes
    the store (byte-identical results: scripts/byte_identity.sh)."""
    from hydra.core.config_store import ConfigStore

    if "__deepcopy__" not in vars(ConfigStore):
        ConfigStore.__deepcopy__ = lambda self, memo: self


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """`compose_validated` without the typed sections."""
    return compose_validated(overrides)[0]


def _precheck(overrides: Sequence[str], groups: Mapping[str, Mapping[str, dict]]) -> None:
    """Catch the common mistakes before Hydra, to word them our way."""
    seen: dict[str, str] = {}
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not key=value (e.g. policy=gllm, workload.rate=4)")
        key, value = ov.split("=", 1)
        if key.split(".")[0] == "hydra":
            raise ConfigError(f"unknown config key {key!r}: Hydra's own settings are not used by testbed; "
                              f"valid keys at the top level: {', '.join(sorted([*base_config(), *groups]))}")
        if key.startswith(("+", "~")):
            raise ConfigError(f"override {ov!r}: adding (+) or deleting (~) config keys is not supported; "
                              f"set an existing key, e.g. {key.lstrip('+~') or 'seed'}=<value> (see `testbed list`)")
        if not key.strip() or any(not part.strip() for part in key.split(".")):
            raise ConfigError(f"override {ov!r} has a blank key or key part; use key=value or section.key=value")
        if key in seen:
            raise ConfigError(f"{key} is given twice ({seen[key]!r} and {ov!r}); give each key once")
        seen[key] = ov
        if key in groups and value not in groups[key]:
            raise unknown_choice(GROUP_KINDS[key], value, groups[key])


def _explain(exc: Exception, overrides: Sequence[str], groups: Mapping[str, Mapping[str, dict]]) -> ConfigError:
    msg = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    bad = getattr(exc, "override", None)  # hydra's OverrideParseException names the override
    if isinstance(bad, str):
        return ConfigError(f"invalid override {bad!r}: {msg} (quote values holding special characters, "
                           f"e.g. key='a,b'; see https://hydra.cc/docs/advanced/override_grammar/basic/)")
    tree = _default_tree(groups, overrides)
    for ov in overrides:
        key = ov.split("=", 1)[0].lstrip("+~")
        node: Any = tree
        parts = key.split(".")
        for depth, part in enumerate(parts):
            if not isinstance(node, dict):
                break
            if part not in node:
                parent = ".".join(parts[:depth])
                where = f"under '{parent}'" if parent else "at the top level"
                return ConfigError(f"unknown config key {key!r}; valid keys {where}: {', '.join(sorted(node))}")
            node = node[part]
    for ov in overrides:
        if ov.split("=", 1)[0].lstrip("+~") in str(exc):
            return ConfigError(f"invalid override {ov!r}: {msg}")
    return ConfigError(msg)


def _default_tree(groups: Mapping[str, Mapping[str, dict]], overrides: Sequence[str]) -> dict:
    """The config as it would compose, from plain dicts (for naming valid keys in errors)."""
    tree = base_config()
    chosen = dict(DEFAULTS)
    for ov in overrides:
        k, _, v = ov.partition("=")
        if k in groups and v in groups[k]:
            chosen[k] = v
    for g in groups:
        tree[g] = groups[g][chosen[g]]
    return tree


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]



def run_config(cfg: Mapping[str, Any]) -> RunConfig:
    """The typed top-level run config of a composed config (engine/base/settings.py)."""
    top = {k: cfg[k] for k in ("seed", "data_dir", "check_integrity") if k in cfg}
    sections = {name: build(cls, _mapping(cfg, name), name) for name, cls in SECTIONS.items()}
    ex = _mapping(cfg, "executor")
    ex_name = ex.pop("name", "sim")
    executor = ExecutorChoice(ex_name, make_params(EXECUTORS.get(ex_name).config_cls, ex, prefix="executor"))
    hardware = make_params(HardwareSpec, _mapping(cfg, "hardware"), prefix="hardware") if cfg.get("hardware") else None
    model = make_params(ModelSpec, _mapping(cfg, "model"), prefix="model") if cfg.get("model") else None
    return build(RunConfig, {**top, **sections, "executor": executor, "hardware": hardware, "model": model}, "")


def validate(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Check a whole composed config before anything runs: the typed sections, then the policy's
    params, the workload's config and the cost overrides (each by its own dataclass).
    Returns {section ('' = top level): its typed object}."""
    rc = run_config(cfg)
    typed = {"": rc, **{name: getattr(rc, name) for name in SECTIONS}, "executor": rc.executor.settings}
    pol = _mapping(cfg, "policy")
    name = pol.pop("name", None)
    if name is not None:
        typed["policy"] = make_params(POLICIES.get(name).Params, pol, prefix="policy")
    if cfg.get("workload") is not None:
        typed["workload"] = workload_config(_mapping(cfg, "workload"))
    make_params(CostCoefficients, {k: v for k, v in _mapping(cfg, "cost").items() if v is not None}, prefix="cost")
    for section in ("policy", "workload"):  # every seed feeds numpy, which takes integers >= 0 only
        if hasattr(typed.get(section), SEED_KEY):
            coerce(f"{section}.{SEED_KEY}", getattr(typed[section], SEED_KEY), int, {"min": 0})
    return typed


def _normalize(cfg: DictConfig, typed: Mapping[str, Any]) -> None:
    """Write back the integers given as integral floats (`seed=1e2` -> 100), so that every reader
    of the composed config, and the run's recorded params, see the value that runs."""
    for section, obj in typed.items():
        node = cfg if not section else cfg.get(section)
        if node is None or obj is None:
            continue
        for f in dataclasses.fields(obj):
            raw = node.get(f.name) if f.name in node else None
            new = getattr(obj, f.name)
            if isinstance(raw, float) and isinstance(new, int) and not isinstance(new, bool):
                node[f.name] = new


def _mapping(cfg: Mapping[str, Any], name: str) -> dict:
    value = cfg.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"invalid {name}={value!r}: must be a section ({name}.<key>=<value>)")
    return dict(value)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}: the MLflow params of a run (URI passwords as `***`)."""
    from testbed.config.redact import redact

    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = redact(v)
    return out
