"""Configuration: Hydra config groups generated from the plug-in registries, and clear errors.

Each group's choices come from the code, not from YAML copies: a policy's group node is its
`Params` dataclass, a workload's is its config dataclass, hardware and model nodes are the
tables in engine/hardware.py and engine/models.py. Adding a policy therefore adds
`policy=<name>` and every `policy.<param>=` override with nothing else to edit.

`compose(overrides)` returns the resolved DictConfig; every user mistake (unknown group choice,
unknown key, bad syntax) becomes a `ConfigError` whose one line names the value and the valid
choices, which the CLI prints without a traceback.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from engine.costmodel import CostCoefficients
from engine.errors import ConfigError, unknown_choice
from engine.executor import EXECUTORS
from engine.hardware import HARDWARE
from engine.models import MODELS
from engine.policy import POLICIES
from workloads.base import WORKLOADS

import engine.sim  # noqa: F401  (registers executor=sim)
import engine.torch_exec  # noqa: F401  (registers executor=torch; torch itself is imported only when used)
import policies  # noqa: F401  (registers every policy)
import workloads  # noqa: F401  (registers every workload)

DEFAULTS = {"policy": "gllm", "workload": "azure", "executor": "sim", "hardware": "l20-48g",
            "model": "qwen2.5-32b"}
# The main job's operating point (`testbed run` = gLLM, Azure conversation trace, Qwen2.5-32B on
# 4 x L20-48GB). At the trace's own pace it offers 4.7 req/s (6.5k tok/s) to a system that serves
# 2.9 req/s, so the first table was a backlog (78 s mean TTFT, 1.5% SLO attainment). At 1.5 req/s
# gLLM runs at ~half its capacity: 1.5 s mean TTFT, 0.17 s TPOT, 75% SLO attainment, while Sarathi
# (128-sequence cap) is past its 1.1 req/s and says so. `workload.rate=null` replays the timestamps.
GROUP_DEFAULTS = {"workload": {"azure": {"rate": 1.5}}}
GROUP_KINDS = {"policy": "policy", "workload": "workload", "executor": "executor", "hardware": "hardware",
               "model": "model"}

BASE = {
    "seed": 0,
    "parallel": {"pp": 4, "tp": 1, "layer_split": None},
    "kv": {"block_size": 16, "gpu_memory_utilization": 0.9, "num_blocks": None},
    "link": {"bandwidth": None, "latency": None},  # None: the hardware's stage-to-stage link
    "runtime": {"cpu_sampling": None, "overlap_input_prep": None, "structure_aware_transfer": None},
    "slo": {"ttft_s": 4.0, "tpot_s": 0.2},
    "cost": None,  # filled from CostCoefficients
    "data_dir": None,  # None: $TESTBED_DATA_DIR, then the cache (see workloads/data.py)
    "output": {"dir": "runs", "run_name": None, "mlflow": True, "tracking_uri": None,
               "experiment": "testbed", "max_trace_spans": 200_000, "trace": "sampled", "plots": True,
               "progress": True},
    "check_integrity": False,
}


def _node(obj: Any) -> dict:
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out
    return dict(obj)


def load_saved_profiles() -> list[str]:
    """Register the calibrated hardware profiles saved by `testbed profile` ($TESTBED_PROFILE_DIR,
    default runs/profiles/*.yaml) so that `hardware=<name>` finds them."""
    from engine.calibration import load_profiles_dir

    return load_profiles_dir(os.environ.get("TESTBED_PROFILE_DIR") or "runs/profiles", on_error=_skip_profile)


_WARNED: set[str] = set()


def _skip_profile(path, exc: Exception) -> None:
    """One broken profile file is skipped with one warning line, not an error for every command."""
    import sys

    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        print(f"warning: skipping hardware profile {path}: {exc}", file=sys.stderr)


def group_nodes() -> dict[str, dict[str, dict]]:
    """Every config group's choices as plain dicts, straight from the registries."""
    load_saved_profiles()
    groups: dict[str, dict[str, dict]] = {"policy": {}, "workload": {}, "executor": {}, "hardware": {}, "model": {}}
    for name in POLICIES.names():
        groups["policy"][name] = {"name": name, **_node(POLICIES.get(name).Params())}
    for name in WORKLOADS.names():
        groups["workload"][name] = {**_node(WORKLOADS.get(name).config_cls()),
                                    **GROUP_DEFAULTS["workload"].get(name, {})}
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


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Resolve `key=value` overrides (Hydra syntax) on top of the defaults."""
    from hydra import compose as hydra_compose, initialize
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    groups = group_nodes()
    _precheck(overrides, groups)
    cs = ConfigStore.instance()
    for group, choices in groups.items():
        for name, node in choices.items():
            cs.store(group=group, name=name, node=node)
    primary = {"defaults": [{g: DEFAULTS[g]} for g in groups] + ["_self_"], **base_config()}
    cs.store(name="testbed_config", node=primary)
    GlobalHydra.instance().clear()
    try:
        with initialize(version_base=None, config_path=None):
            cfg = hydra_compose(config_name="testbed_config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise _explain(exc, overrides, groups) from None
    finally:
        GlobalHydra.instance().clear()
    OmegaConf.set_struct(cfg, False)
    return cfg


def _precheck(overrides: Sequence[str], groups: Mapping[str, Mapping[str, dict]]) -> None:
    """Catch the common mistakes before Hydra, to word them our way."""
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not key=value (e.g. policy=gllm, workload.rate=4)")
        key, value = ov.split("=", 1)
        key = key.lstrip("+~")
        if key in groups and value not in groups[key]:
            raise unknown_choice(GROUP_KINDS[key], value, groups[key])


def _explain(exc: Exception, overrides: Sequence[str], groups: Mapping[str, Mapping[str, dict]]) -> ConfigError:
    msg = str(exc)
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
        if ov.split("=", 1)[0].lstrip("+~") in msg:
            return ConfigError(f"invalid override {ov!r}: {msg.splitlines()[0]}")
    return ConfigError(msg.splitlines()[0] if msg else type(exc).__name__)


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


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}: the MLflow params of a run."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def data_dir(cfg: Mapping[str, Any]) -> str | None:
    return cfg.get("data_dir") or os.environ.get("TESTBED_DATA_DIR") or None
