"""One coercion and validation system for every settings dataclass.

Policy `Params`, workload configs, executor settings, the run config's sections (engine/base/settings.py)
and the CLI's `tune.*`/`compare.*` keys are all frozen dataclasses whose values arrive as plain
data (Hydra/OmegaConf containers, or `key=value` strings parsed by testbed/config/overrides.py). This
module turns such data into the dataclass, driven only by each field's type annotation and its
metadata, so a new setting gets checking and its error wording for free:

- types: `bool`, `int`, `float`, `str`, `tuple[X, ...]`, `dict`, `Literal[...]` and their
  `| None` forms. Lossless conversions only: an int for a float (OmegaConf reads `rate=4` as an
  int), an integral float for an int (`1e3`), a list for a tuple, a path for a str. A bool is never
  a number, NaN and infinities are refused, None only where the annotation allows it.
- metadata, set with `setting(default, min=, max=, gt=, lt=, choices=, parse=)`: inclusive
  (`min`/`max`) and strict (`gt`/`lt`) bounds, a set of choices, or a `parse(value, key)` function
  for values with units (engine/base/units.py) that replaces the type coercion.

Every mistake is a `ConfigError` of one line naming the key, the bad value and what is valid:
`invalid policy.T=None: must be an integer >= 1`. Cross-field rules stay in `__post_init__`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.base.errors import ConfigError, bad_value

_CHECKS = ("min", "max", "gt", "lt", "choices", "parse")


def setting(default: Any = dataclasses.MISSING, *, min: float | None = None, max: float | None = None,
            gt: float | None = None, lt: float | None = None, choices: Sequence[Any] | None = None,
            parse: Callable[[Any, str], Any] | None = None, **kwargs: Any) -> Any:
    """A dataclass field with validation metadata (see the module docstring)."""
    meta = {k: v for k, v in (("min", min), ("max", max), ("gt", gt), ("lt", lt), ("choices", choices),
                              ("parse", parse)) if v is not None}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use an immutable default (tuple) for settings")
    return dataclasses.field(default=default, metadata=meta, **kwargs)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that names something unimportable: fall back to the defaults' types
        return {f.name: _hint_from_default(f) for f in dataclasses.fields(cls)}


def _hint_from_default(f: dataclasses.Field) -> Any:
    d = f.default
    if d is dataclasses.MISSING or d is None:
        return Any
    return type(d)


def _options(hint: Any) -> tuple[Any, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _describe_type(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if hint is bool:
        return "true or false"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(hint))
    if origin in (tuple, list) or hint in (tuple, list):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return "a mapping"
    return getattr(hint, "__name__", str(hint))


def _plural(hint: Any) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(hint, _describe_type(hint))


def describe(hint: Any, meta: Mapping[str, Any] | None = None) -> str:
    """'an integer >= 1 or null': what a field accepts, for error messages."""
    meta = meta or {}
    opts = _options(hint)
    nullable = type(None) in opts
    parts = [_describe_type(o) for o in opts if o is not type(None)]
    text = " or ".join(parts) if parts else "null"
    if "choices" in meta:
        text = "one of " + ", ".join(str(c) for c in meta["choices"])
    bounds = _bounds_text(meta)
    if bounds:
        text = f"{text} {bounds}"
    return f"{text} or null" if nullable and parts else text


def _bounds_text(meta: Mapping[str, Any]) -> str:
    lo = ("min", ">=") if "min" in meta else ("gt", ">") if "gt" in meta else None
    hi = ("max", "<=") if "max" in meta else ("lt", "<") if "lt" in meta else None
    if lo and hi:
        left = "[" if lo[0] == "min" else "("
        right = "]" if hi[0] == "max" else ")"
        return f"in {left}{_num(meta[lo[0]])}, {_num(meta[hi[0]])}{right}"
    if lo:
        return f"{lo[1]} {_num(meta[lo[0]])}"
    if hi:
        return f"{hi[1]} {_num(meta[hi[0]])}"
    return ""


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


class _Mismatch(Exception):
    pass


def _coerce_one(value: Any, hint: Any) -> Any:
    """`value` as type `hint` (one option of a union), or _Mismatch."""
    origin = typing.get_origin(hint)
    if hint is Any or hint is object:
        return value
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if isinstance(value, bool):
        raise _Mismatch  # a bool is never a number nor a string
    if hint is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        raise _Mismatch
    if hint is float:
        if isinstance(value, int):
            return float(value)
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise _Mismatch
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise _Mismatch
    if origin is typing.Literal:
        if value in typing.get_args(hint):
            return value
        raise _Mismatch
    if origin in (tuple, list) or hint in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        item = args[0] if args else Any
        out = tuple(_coerce_union(v, item) for v in value)
        return list(out) if (origin is list or hint is list) else out
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        if isinstance(value, Mapping):
            return dict(value)
        raise _Mismatch
    if isinstance(hint, type):
        if isinstance(value, hint):
            return value
        raise _Mismatch
    return value  # an annotation this module does not model: left to __post_init__


def _coerce_union(value: Any, hint: Any) -> Any:
    for option in _options(hint):
        try:
            return _coerce_one(value, option)
        except _Mismatch:
            continue
    raise _Mismatch


def coerce(key: str, value: Any, hint: Any, meta: Mapping[str, Any] | None = None) -> Any:
    """`value` checked and converted for a field of type `hint` with `meta` (see `setting`)."""
    meta = meta or {}
    if value is not None and "parse" in meta:
        out = meta["parse"](value, key)
        bounds = {k: v for k, v in meta.items() if k in ("min", "max", "gt", "lt")}
        if bounds and isinstance(out, (int, float)):  # "2h" parses to 7200 s: the bounds apply to that
            _check_meta(key, value, out, float, bounds)
        return out
    try:
        out = _coerce_union(value, hint)
    except _Mismatch:
        raise bad_value(key, value, _must(hint, meta, value)) from None
    if out is not None:
        _check_meta(key, value, out, hint, meta)
    return out


def _must(hint: Any, meta: Mapping[str, Any], value: Any) -> str:
    text = f"must be {describe(hint, meta)}"
    if isinstance(value, float) and not math.isfinite(value):
        text += " (finite)"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and str in _options(hint):
        text += " (quote numbers meant as text)"
    return text


def _check_meta(key: str, raw: Any, value: Any, hint: Any, meta: Mapping[str, Any]) -> None:
    bad = (("choices" in meta and value not in meta["choices"])
           or ("min" in meta and value < meta["min"]) or ("max" in meta and value > meta["max"])
           or ("gt" in meta and value <= meta["gt"]) or ("lt" in meta and value >= meta["lt"]))
    if bad:
        raise bad_value(key, raw, f"must be {describe(hint, meta)}")


def field_specs(cls: type) -> dict[str, tuple[Any, Mapping[str, Any]]]:
    """{field name: (type hint, metadata)} of a settings dataclass."""
    hints = _hints(cls)
    return {f.name: (hints.get(f.name, Any), f.metadata) for f in dataclasses.fields(cls)}


def build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    """The dataclass `cls` from a mapping of config values: unknown keys and bad values are one-line
    ConfigErrors naming `<prefix>.<key>`; errors raised by `cls.__post_init__` pass through."""
    specs = field_specs(cls)
    settable = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in values if k not in settable)
    if unknown:
        valid = ", ".join(sorted(settable)) or "(none)"
        raise ConfigError(f"unknown key {_key(prefix, unknown[0])}; valid keys: {valid}")
    kwargs = {}
    for key, value in values.items():
        hint, meta = specs[key]
        kwargs[key] = coerce(_key(prefix, key), value, hint, meta)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # a required field missing, or a __post_init__ without our wording
        raise ConfigError(f"invalid {prefix or 'config'}: {_one_line(exc)}") from None


def check(obj: Any, prefix: str) -> None:
    """Coerce and check every field of a (frozen) dataclass instance in place; for `__post_init__`,
    so that direct construction is checked like `build`."""
    for name, (hint, meta) in field_specs(type(obj)).items():
        value = getattr(obj, name)
        new = coerce(_key(prefix, name), value, hint, meta)
        if new is not value:
            object.__setattr__(obj, name, new)


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


__all__ = ["setting", "build", "check", "coerce", "describe", "field_specs"]
