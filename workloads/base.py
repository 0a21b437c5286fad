"""The workload registry, config checking shared by all workloads, and `build_workload`.

A workload is a frozen dataclass of plain settings (so Hydra/OmegaConf, the tuner and the CLI
can all pass a flat dict) plus a `build(cfg, data_dir)` function returning requests. Keeping
configs flat and typed means a typo or a bad value is caught here, with the key named, before
any simulation time is spent.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from engine.base import typed
from engine.base.errors import ConfigError, bad_value
from engine.base.registry import Registry
from engine.core.request import Request

PREFIX = "workload"  # config keys are reported as workload.<field>, as in the Hydra config
# Tokens in one prompt or one reply, at most: larger counts are not token counts (no model has
# such a context) and overflow the int64 sums of a run (a synthetic input_mean=9e18 ran with every
# request failed, an Azure row of 2**62 tokens was read as is: issue 38 item 9).
MAX_TOKENS = 2**31 - 1


class WorkloadSpec(NamedTuple):
    """What a workload registers: its config dataclass and the function that builds requests."""

    config_cls: type
    build: Callable[[Any, str | None], list[Request]]


WORKLOADS: Registry[WorkloadSpec] = Registry("workload")


def key(field: str) -> str:
    return f"{PREFIX}.{field}"


# ---------------------------------------------------------------- config checking

def check_types(cfg: Any) -> None:
    """Check every field of a workload config against its annotation and `setting(...)` metadata
    (engine/base/typed.py, the one system every setting goes through), coercing where lossless.
    Call it first thing in `__post_init__`; it also checks that `name` is the registered one."""
    typed.check(cfg, PREFIX)
    name_field = dataclasses.fields(cfg)[0]
    if name_field.name != "name" or cfg.name != name_field.default:
        raise bad_value(key("name"), cfg.name, f"this config class is for workload {name_field.default!r}")


def check_choice(field: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise bad_value(key(field), value, f"must be one of {', '.join(choices)}")


def check_min(field: str, value: float | None, low: float, *, strict: bool = False) -> None:
    """`value` must be >= low (or > low when strict); None passes (it means 'no limit')."""
    if value is None:
        return
    if value < low or (strict and value == low):
        raise bad_value(key(field), value, f"must be {'>' if strict else '>='} {low}")


def check_range(lo_field: str, lo: int, hi_field: str, hi: int | None) -> None:
    """A [min, max] pair of length filters: min >= 1, max None or >= min."""
    check_min(lo_field, lo, 1)
    if hi is not None and hi < lo:
        raise bad_value(key(hi_field), hi, f"must be >= {key(lo_field)}={lo} (or null for no limit)")


# ---------------------------------------------------------------- building

def make_requests(arrivals: Sequence[float], prompt_lens: Sequence[int], output_lens: Sequence[int],
                  texts: Sequence[str | None] | None = None) -> list[Request]:
    """Requests sorted by arrival (stable, so ties keep their given order), ids 0..n-1."""
    n = len(arrivals)
    if not (len(prompt_lens) == len(output_lens) == n) or (texts is not None and len(texts) != n):
        raise ValueError("make_requests: arrivals, lengths and texts must have the same length")
    order = sorted(range(n), key=lambda i: arrivals[i])
    return [Request(request_id=rid, arrival_s=float(arrivals[i]), prompt_len=int(prompt_lens[i]),
                    output_len=int(output_lens[i]), prompt_text=None if texts is None else texts[i])
            for rid, i in enumerate(order)]


def workload_config(name_or_cfg: str | Mapping[str, Any] | Any) -> Any:
    """Turn a workload name, a flat dict `{name: ..., field: value}` or a config into a config.

    Unknown keys are an error listing the valid keys, so a misspelt setting is never ignored.
    """
    if dataclasses.is_dataclass(name_or_cfg) and not isinstance(name_or_cfg, type):
        WORKLOADS.get(getattr(name_or_cfg, "name", None))
        return name_or_cfg
    if isinstance(name_or_cfg, str):
        name, settings = name_or_cfg, {}
    elif isinstance(name_or_cfg, Mapping):
        settings = dict(name_or_cfg)
        name = settings.pop("name", None)
        if name is None:
            raise ConfigError(f"workload config has no 'name'; valid names: {', '.join(WORKLOADS.names())}")
    else:
        raise ConfigError(f"workload must be a name or a mapping with a 'name', got {type(name_or_cfg).__name__}")
    spec = WORKLOADS.get(name)
    return typed.build(spec.config_cls, {**settings, "name": name}, PREFIX)


def workload_key(cfg: Any, data_dir: str | os.PathLike | None) -> str:
    """What a built request list depends on: runs with the same key can share one list."""
    return repr((cfg, data_dir))


def build_workload(name_or_cfg: str | Mapping[str, Any] | Any, data_dir: str | os.PathLike | None = None
                   ) -> list[Request]:
    """Build the requests of a workload: sorted by arrival, `request_id` 0..n-1 in that order."""
    cfg = workload_config(name_or_cfg)
    spec = WORKLOADS.get(cfg.name)
    requests = spec.build(cfg, None if data_dir is None else os.fspath(data_dir))
    for i, r in enumerate(requests):  # the contract every consumer relies on
        if r.request_id != i or (i and r.arrival_s < requests[i - 1].arrival_s):
            raise AssertionError(f"workload {cfg.name!r} returned requests out of order at index {i}")
    return requests
