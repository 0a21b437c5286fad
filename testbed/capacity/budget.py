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

from collections.abc import Sequence
from typing import Any

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


def within(specs: Sequence[Any], settings: CapacitySettings) -> tuple[list[Any], int]:
    """(the points whose GPUs fit the budget, how many were dropped); all of them without a budget."""
    if settings.gpus is None:
        return list(specs), 0
    kept = [s for s in specs if s.run.num_gpus <= settings.gpus]
    return kept, len(specs) - len(kept)


def replicas(gpus: int, settings: CapacitySettings) -> int:
    """Copies of a configuration of `gpus` GPUs that the budget holds (1 without a budget)."""
    return settings.gpus // gpus if settings.gpus else 1
