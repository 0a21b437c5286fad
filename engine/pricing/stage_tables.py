"""A measured per-stage correction of the stage-time prices, swapped into one CostModel instance:
the decode-only steps' factors by batch size (engine/pricing/decode_batch.py) and the mixed steps'
terms by sampled rows (engine/pricing/mixed_rows.py) share the swap and the depth check here."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.base.errors import ConfigError


Row = tuple[float, ...]


def correct_stage_times(cost: Any, name: str, table: tuple[Row, ...], applies: Callable[[Any], bool],
                        adjust: Callable[[Row, Any, float], float]) -> None:
    """Swap `cost`'s stage-time methods for ones that, for a shape `applies` holds for, replace a
    stage's non-zero time t by `adjust(that stage's row of table, shape, t)` (a profile without the
    table pays no branch). `name`: the coefficient, for the error when the depths differ."""
    if len(table) != cost.pp:
        raise ConfigError(f"invalid cost.{name}: {len(table)} row(s) for parallel.pp={cost.pp}; "
                          "it needs one row per stage (a profile fitted at another depth?)")
    rows = tuple(tuple(r) for r in table)
    pp = cost.pp
    plain_one, plain_all = cost.stage_compute_s, cost.stage_compute_all_s

    def one(stage: int, shape: Any) -> float:
        t = plain_one(stage, shape)
        return adjust(rows[stage % pp], shape, t) if t and applies(shape) else t

    def every(shape: Any) -> tuple[float, ...]:
        times = plain_all(shape)
        if not applies(shape):
            return times
        return tuple([adjust(row, shape, t) if t else t for t, row in zip(times, rows)])

    cost.stage_compute_s = one  # type: ignore[method-assign]
    cost.stage_compute_all_s = every  # type: ignore[method-assign]


def held(row: Row, i: int) -> float:
    """row[i], the last entry held above the table."""
    return row[i] if i < len(row) else row[-1]
