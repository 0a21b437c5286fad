"""A configuration search within a GPU budget (`capacity.gpus=N`), after Vidur-Search (MLSys'24),
which searches parallel layouts, batch sizes, chunk sizes and schedulers under a GPU budget and
ranks them by QPS per dollar.

The space is the grid's axes: hardware, `parallel.pp`, `parallel.tp`, `parallel.num_microbatches`,
the policy and its own knobs (token budget / chunk size: `policy.token_budget` for sarathi,
`policy.max_num_batched_tokens` for vllm, `policy.max_p` for gllm; batch cap: `policy.max_num_seqs`).
With a budget and no `parallel.pp` / `parallel.tp` given, both become axes over the powers of two
that fit it. Every configuration of more GPUs than the budget is dropped; one of fewer runs as
`replicas = N // (pp x tp)` copies, whose total capacity is `replicas x capacity` (requests split
evenly). Before any probe a configuration is pruned when the model does not fit its memory or
when one request alone misses the SLO (testbed/capacity/steady.py); the rest are searched and
ranked by capacity per GPU and per dollar (testbed/capacity/results.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.base.errors import ConfigError
from testbed.capacity.settings import CapacitySettings
from testbed.config.overrides import explicit_keys

DEGREES = (1, 2, 4, 8, 16)  # default P and TP values under a budget (those <= the budget)
LAYOUT_KEYS = ("parallel.pp", "parallel.tp")


def with_layout_axes(overrides: Sequence[str], settings: CapacitySettings) -> list[str]:
    """The overrides, plus `parallel.pp` / `parallel.tp` axes when a budget is set and they are not."""
    out = list(overrides)
    if settings.gpus is None:
        return out
    given = explicit_keys(overrides)
    for key in LAYOUT_KEYS:
        if key not in given:
            values = [d for d in DEGREES if d <= settings.gpus]
            if len(values) > 1:
                out.append(f"{key}={','.join(map(str, values))}")
    return out


def compose_points(points: Sequence[Any], settings: CapacitySettings,
                   compose: Callable[[Any], Any]) -> tuple[list[Any], list[str]]:
    """Every grid point composed; under a budget, a combination the simulator refuses (e.g.
    `parallel.num_microbatches` above 2 x P, a TP that does not divide the heads) is skipped and
    said why, since a search space crosses axes that not every layout accepts. Without a budget
    it is the user's grid: the first refusal is the command's error."""
    composed, refused = [], []
    for pt in points:
        try:
            composed.append(compose(pt))
        except ConfigError as exc:
            if settings.gpus is None:
                raise
            refused.append(f"{pt.label}: {exc}")
    return composed, refused


def within(specs: Sequence[Any], settings: CapacitySettings) -> tuple[list[Any], int]:
    """(the points whose GPUs fit the budget, how many were dropped); all of them without a budget."""
    if settings.gpus is None:
        return list(specs), 0
    kept = [s for s in specs if s.run.num_gpus <= settings.gpus]
    return kept, len(specs) - len(kept)


def replicas(gpus: int, settings: CapacitySettings) -> int:
    """Copies of a configuration of `gpus` GPUs that the budget holds (1 without a budget)."""
    return settings.gpus // gpus if settings.gpus else 1
