"""What a study searches: `tune.space.<key>=<spec>` entries, the proxy trial a policy's own
`search_space(trial)` sees (pinned parameters and user ranges win), the recorder that walks a
space once to describe it, and the micro-batch count every study searches by default.

The micro-batch count (`parallel.num_microbatches`, docs/ on micro-batches) is searched as an
integer in [P, 2P] (P = the trial's `parallel.pp`) unless the user pins it
(`parallel.num_microbatches=<n>` on the command line) or gives its own space
(`tune.space.parallel.num_microbatches=4,5,6,8`). Fewer than P idles stages on purpose, so the
default range starts at P; 2P is the documented upper bound.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from engine.base.errors import ConfigError
from testbed.config.overrides import check_path, get_path, scalar, split_list

MICROBATCH_KEY = "parallel.num_microbatches"
NOT_TUNABLE = ("seed", "data_dir", "check_integrity")


def microbatch_range(pp: int) -> tuple[int, int]:
    """The default search range of the micro-batch count at pipeline depth `pp`: [P, 2P]."""
    return max(1, pp), max(1, 2 * pp)


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
        if ":" in text and "," not in text and not text.startswith("["):
            return cls._parse_range(key, text, where)
        choices = tuple(scalar(c) for c in split_list(text))
        if not choices:
            raise ConfigError(f"invalid {where}: no values")
        if len(set(map(repr, choices))) != len(choices):
            raise ConfigError(f"invalid {where}: a value is listed twice")
        return cls(key, "categorical", choices=choices)

    @classmethod
    def _parse_range(cls, key: str, text: str, where: str) -> SpaceSpec:
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


def parse_space(raw: Mapping[str, str], cfg: Mapping[str, Any]) -> tuple[SpaceSpec, ...]:
    """`tune.space.*` entries (`section.*` expands to every scalar key of the section), sorted."""
    specs: dict[str, SpaceSpec] = {}
    for key, value in raw.items():
        if not key:
            raise ConfigError("tune.space needs a config key: tune.space.<key>=<values>, "
                              "e.g. tune.space.parallel.pp=2,4")
        for k in _expand(cfg, key):
            if k == "policy.name":
                raise ConfigError("policy.name cannot be tuned: run one study per policy (or `testbed compare`)")
            if k in NOT_TUNABLE or k.startswith("output."):
                raise ConfigError(f"tune.space.{k}: {k} is not a tunable setting")
            check_path(cfg, k, f"tune.space.{k}")
            specs[k] = SpaceSpec.parse(k, value)
    return tuple(specs[k] for k in sorted(specs))


def _expand(cfg: Mapping[str, Any], key: str) -> list[str]:
    if not key.endswith(".*"):
        return [key]
    section = key[:-2]
    node = get_path(cfg, section) if _is_section(cfg, section) else None
    if not isinstance(node, Mapping):
        check_path(cfg, section + ".x", f"tune.space.{key}")  # names the valid keys
        raise ConfigError(f"tune.space.{key}: {section!r} is not a section")
    return [f"{section}.{k}" for k, v in node.items() if not isinstance(v, Mapping)]


def _is_section(cfg: Mapping[str, Any], key: str) -> bool:
    try:
        return isinstance(get_path(cfg, key), Mapping)
    except (KeyError, TypeError):
        return False


class SpaceTrial:
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


class Recorder:
    """A duck-typed trial that records distributions and answers with the base config's values
    (so a conditional space follows the branch of the defaults)."""

    number = -1

    def __init__(self, defaults: Mapping[str, Any]) -> None:
        self.defaults = defaults
        self.space: dict[str, Any] = {}

    def _add(self, name: str, dist: Any, fallback: Any) -> Any:
        self.space[name] = dist
        value = self.defaults.get(name)
        return value if contains(dist, value) else fallback

    def suggest_int(self, name, low, high, *, step=1, log=False):
        return self._add(name, IntDistribution(low, high, log=log, step=step), low)

    def suggest_float(self, name, low, high, *, step=None, log=False):
        return self._add(name, FloatDistribution(low, high, log=log, step=step), low)

    def suggest_categorical(self, name, choices):
        return self._add(name, CategoricalDistribution(list(choices)), list(choices)[0])

    def set_user_attr(self, key, value):
        pass


def contains(dist: Any, value: Any) -> bool:
    """Whether `value` is a point of the Optuna distribution `dist`."""
    if value is None:
        return False
    try:
        return bool(dist._contains(dist.to_internal_repr(value)))
    except (ValueError, TypeError):
        return False


def dist_text(d: Any) -> str:
    """A distribution as the start line prints it: `{2, 4}`, `[128, 4096 log]`."""
    if isinstance(d, CategoricalDistribution):
        return "{" + ", ".join(map(str, d.choices)) + "}"
    tail = " log" if getattr(d, "log", False) else (f" step {d.step}" if getattr(d, "step", None) not in (None, 1)
                                                     else "")
    return f"[{d.low}, {d.high}{tail}]"
