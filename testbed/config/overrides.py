"""Command-line settings that live beside the Hydra config: `tune.*` and `compare.*`.

`testbed tune` and `testbed compare` take the same `key=value` overrides as `testbed run`, plus
their own `tune.*` / `compare.*` keys. Those keys are not part of the composed config (a run does
not depend on how it was launched), so they are split off here before `compose` and parsed into
frozen dataclasses by the command that owns them. Parsing is deliberately tiny and shell-friendly:
`[a,b]` or `a,b` for lists, `true/false/null`, ints, floats, everything else a string; the values
are then checked by the same system as every other setting (engine/base/typed.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from engine.base.errors import ConfigError
from engine.base.typed import build, coerce


def split_prefixed(overrides: Sequence[str], prefix: str) -> tuple[dict[str, str], list[str]]:
    """Split `prefix.key=value` overrides from the rest: ({key: raw value}, other overrides).
    A key given twice is an error (the second would silently win otherwise)."""
    mine: dict[str, str] = {}
    rest: list[str] = []
    head = prefix + "."
    for ov in overrides:
        key, eq, value = ov.partition("=")
        bare = key.lstrip("+~")
        if bare == prefix or bare.startswith(head):
            if not eq:
                raise ConfigError(f"override {ov!r} is not key=value (e.g. {prefix}.workers=2)")
            sub = bare[len(head):] if bare.startswith(head) else ""
            if not sub:
                raise ConfigError(f"override {ov!r} names no {prefix} key; use {prefix}.<key>=<value>")
            if sub in mine:
                raise ConfigError(f"{prefix}.{sub} is given twice")
            mine[sub] = value
        else:
            rest.append(ov)
    return mine, rest


def check_keys(raw: Mapping[str, str], valid: Iterable[str], prefix: str,
               prefixes: Iterable[str] = ()) -> None:
    """Every key must be a valid one (or start with one of `prefixes`, e.g. 'space.')."""
    valid = sorted(valid)
    prefixes = tuple(prefixes)
    for key in raw:
        if key not in valid and not (prefixes and key.startswith(prefixes)):
            extra = "".join(f", {p}<key>" for p in prefixes)
            raise ConfigError(f"unknown {prefix} key '{prefix}.{key}'; valid keys: {', '.join(valid)}{extra}")


def split_list(raw: str) -> list[str]:
    """'[a,b]' or 'a,b' or 'a' -> ['a', 'b']; brackets may nest one level ('[x,[1,2]]' keeps '[1,2]')."""
    text = raw.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    items, depth, cur = [], 0, []
    for ch in text:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    last = "".join(cur).strip()
    if last or items:
        items.append(last)
    return [i for i in items if i != ""]


def scalar(raw: str) -> Any:
    """'true' -> True, 'null' -> None, '4' -> 4, '0.5' -> 0.5, quoted or other text -> str."""
    text = raw.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        return None
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _bounds(minimum: float | None, maximum: float | None) -> dict[str, float]:
    return {k: v for k, v in (("min", minimum), ("max", maximum)) if v is not None}


# worker processes on one host, for every command that starts them (capacity, compare, tune):
# each imports ~4 s of CPU; unbounded before (issue 48 item 4)
MAX_WORKERS = 64


def as_int(key: str, raw: str, minimum: int | None = None, maximum: int | None = None) -> int:
    return coerce(key, scalar(raw), int, _bounds(minimum, maximum))


def as_float(key: str, raw: str, minimum: float | None = None, maximum: float | None = None) -> float:
    return coerce(key, scalar(raw), float, _bounds(minimum, maximum))


def as_bool(key: str, raw: str) -> bool:
    return coerce(key, scalar(raw), bool)


def parse_settings(cls: type, raw: Mapping[str, str], prefix: str) -> Any:
    """A settings dataclass from `prefix.key=value` strings (split off by `split_prefixed`): each value
    is read by `scalar` and checked by its field's type and metadata (engine/base/typed.py)."""
    return build(cls, {k: scalar(v) for k, v in raw.items()}, prefix)


def merge(*layers: Sequence[str]) -> list[str]:
    """Layer override lists, a later layer replacing an earlier override of the same key (order of
    first appearance kept). For code that adds its own defaults or forced keys to the user's list:
    `compose` refuses a key given twice, since on a command line that is a mistake."""
    out: dict[str, str] = {}
    for layer in layers:
        for ov in layer:
            key = ov.partition("=")[0]
            out.pop(key, None)
            out[key] = ov
    return list(out.values())


def explicit_keys(overrides: Sequence[str]) -> set[str]:
    """The config keys the user set on the command line (without +/~ prefixes)."""
    return {ov.partition("=")[0].lstrip("+~") for ov in overrides if "=" in ov}


def get_path(cfg: Mapping[str, Any], key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node[part]
    return node


def has_path(cfg: Mapping[str, Any], key: str) -> bool:
    try:
        get_path(cfg, key)
        return True
    except (KeyError, TypeError):
        return False


def set_path(cfg: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = cfg
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = value


def check_path(cfg: Mapping[str, Any], key: str, what: str) -> None:
    """ConfigError naming the valid keys at the level where `key` leaves the config."""
    node: Any = cfg
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, Mapping) or part not in node:
            parent = ".".join(parts[:depth])
            where = f"under '{parent}'" if parent else "at the top level"
            valid = ", ".join(sorted(node)) if isinstance(node, Mapping) else "(none: it is a value)"
            raise ConfigError(f"{what}: unknown config key {key!r}; valid keys {where}: {valid}")
        node = node[part]
    if isinstance(node, Mapping):
        raise ConfigError(f"{what}: {key!r} is a section, not a value; valid keys under it: "
                          f"{', '.join(sorted(node))} (or '{key}.*' for all of them)")
