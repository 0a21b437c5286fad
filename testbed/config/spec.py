"""`RunSpec`: one run, composed from the command line and validated once, as typed objects.

The command modules turn `key=value` overrides into a `RunSpec` (`compose_spec`, testbed/config/composer.py)
and hand it down; nothing below them indexes a config mapping by string. What a run is made of
is in one place:

    settings   engine.base.settings.RunConfig: seed, parallel, kv, link, runtime, slo, output,
               executor (name + its settings), model (ModelSpec), hardware (HardwareSpec)
    policy     the policy's name and its `Params` dataclass
    workload   the workload's config dataclass (its `name` included)
    cost       the cost model's coefficients, resolved: the hardware profile's fitted values,
               then every `cost.*` the user set
    serve      `testbed serve`'s settings

The composed tree the spec was built from is kept (read-only, handed out as a copy) because the
records of a run are its words, not its parsed values: `config.yaml`, the MLflow params and the
run's display name show `link.bandwidth=100Mbps` as given, where `settings.link.bandwidth` holds
12.5e6 bytes/s. `with_values` derives a spec (a trial's params, a shorter simulation, a capacity
probe's rate) by editing that tree and validating again, so the typed objects and the record of
a derived run never disagree.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.pricing.cost_coefficients import CostCoefficients
from engine.base.errors import ConfigError, bad_value
from engine.core.policy import make_params
from engine.base.settings import OutputSettings, RunConfig
from testbed.config.composer import compose_validated, flatten, to_container, validate
from testbed.config.serve import ServeSettings

MAX_RUN_NAME_BYTES = 200  # file systems allow 255 bytes per name; MLflow's run-name limit is 250 characters


def compose_spec(overrides: Sequence[str] = ()) -> RunSpec:
    """`compose` (testbed/config/composer.py: Hydra, every mistake one line), then the typed spec
    from the sections it validated."""
    cfg, typed = compose_validated(overrides)
    return RunSpec.from_validated(to_container(cfg), typed)


@dataclass(frozen=True)
class RunSpec:
    """What one run is made of (module docstring); build it with `compose_spec` or
    `RunSpec.from_tree`."""

    settings: RunConfig
    policy_name: str
    policy: Any  # the policy's Params dataclass
    workload: Any  # the workload's config dataclass
    cost: CostCoefficients
    serve: ServeSettings
    _tree: dict = field(repr=False, compare=False)

    @classmethod
    def from_tree(cls, tree: Mapping[str, Any]) -> RunSpec:
        """Validate a composed config tree (every section by its own dataclass) into a spec.
        Raises ConfigError (one line naming the value and the valid choices) for any mistake."""
        tree = copy.deepcopy(dict(tree))
        return cls.from_validated(tree, validate(tree))

    @classmethod
    def from_validated(cls, tree: dict[str, Any], typed: Mapping[str, Any]) -> RunSpec:
        """A spec from a tree (owned by the spec from now on) and its sections as `validate`
        returned them."""
        rc: RunConfig = typed[""]
        if rc.output.run_name is not None:
            check_run_name(str(rc.output.run_name))
        if "policy" not in typed:
            from engine.core.policy import POLICIES

            raise ConfigError(f"no policy chosen; valid choices: {', '.join(POLICIES.names())}")
        return cls(settings=rc, policy_name=str(tree["policy"]["name"]), policy=typed["policy"],
                   workload=typed.get("workload"), cost=_coefficients(rc, tree.get("cost") or {}),
                   serve=make_params(ServeSettings, dict(tree.get("serve") or {}), prefix="serve"), _tree=tree)

    # --- the record -------------------------------------------------------------------------
    def tree(self) -> dict[str, Any]:
        """The composed config as given (a copy): what `config.yaml` holds."""
        return copy.deepcopy(self._tree)

    def params(self) -> dict[str, Any]:
        """The MLflow params: the tree flattened (`policy.T`), URI passwords as `***`."""
        return flatten(self._tree)

    def with_values(self, values: Mapping[str, Any]) -> RunSpec:
        """A spec with dotted keys set (`{"policy.T": 4, "executor": {"name": "sim"}}`; a mapping
        replaces the whole section), validated like the original."""
        tree = self.tree()
        for key, value in values.items():
            *parents, leaf = key.split(".")
            node = tree
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = copy.deepcopy(dict(value)) if isinstance(value, Mapping) else value
        return RunSpec.from_tree(tree)

    def value_at(self, key: str) -> Any:
        """The recorded value of a dotted key the user named (a grid axis, a study's column);
        KeyError when the tree has no such key."""
        node: Any = self._tree
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                raise KeyError(key)
            node = node[part]
        return copy.deepcopy(node)

    # --- short names for what every command reads ----------------------------------------------
    @property
    def output(self) -> OutputSettings:
        return self.settings.output

    @property
    def workload_name(self) -> str:
        return str(self.workload.name)

    @property
    def data_dir(self) -> str | None:
        """`data_dir=`, else $TESTBED_DATA_DIR (workloads/data.py applies the rest of the rule)."""
        return self.settings.data_dir or os.environ.get("TESTBED_DATA_DIR") or None

    @property
    def num_gpus(self) -> int:
        return self.settings.parallel.pp * self.settings.parallel.tp


def _coefficients(rc: RunConfig, overrides: Mapping[str, Any]) -> CostCoefficients:
    """The hardware profile's fitted coefficients, then the user's `cost.*` (null = not set)."""
    values = dict((rc.hardware.calibration if rc.hardware is not None else None) or {})
    values.update({k: v for k, v in overrides.items() if v is not None})
    return make_params(CostCoefficients, values, prefix="cost")


def check_run_name(name: str) -> str:
    """A run name is one folder inside output.dir: no separators, no '.'/'..', no control chars."""
    bad = (not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name
           or any(ord(c) < 32 for c in name))
    if bad:
        raise bad_value("output.run_name", name, "must be a plain folder name inside output.dir "
                                                 "(no '/', not '.' or '..')")
    if len(name.encode("utf-8", "surrogateescape")) > MAX_RUN_NAME_BYTES:  # leaves room for a '-2' suffix
        raise bad_value("output.run_name", _ellipsis(name), f"is {len(name.encode('utf-8', 'surrogateescape'))} "
                        f"bytes long; a folder name may have at most {MAX_RUN_NAME_BYTES}")
    return name


def _ellipsis(text: str, keep: int = 40) -> str:
    return text if len(text) <= keep else f"{text[:keep]}... ({len(text)} characters)"


__all__ = ["RunSpec", "compose_spec", "check_run_name"]
