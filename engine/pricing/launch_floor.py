"""The launch floor of an eager step (engine terms `launch_floor_*`, docs/calibration.md#engine-terms).

An eager step (any micro-batch with a prefill chunk; decode-only steps replay a CUDA graph) lasts
at least `per_layer_s` x the stage's layers + `per_seq_s` x its sequences: the host launches its
kernels one by one. The floor and the kernels' time combine by max, or by the p-norm of
`launch_overlap_exponent` where the launches hide only partly behind the GPU (p = 2.4 on the
project's torch engine on an H100: a 2,043-token mixed step took 69 ms for 59 ms of kernels and a
27 ms floor).
"""
from __future__ import annotations

from typing import Any


def use_launch_floor(cost: Any, per_layer_s: float, per_seq_s: float, exponent: float) -> None:
    """Swap `cost`'s (a CostModel's; this module sits below engine/pricing/costmodel.py, which calls it)
    stage-time methods for floored ones, per instance: a profile without the terms keeps the plain
    methods and pays no branch. Shapes are engine.pricing.costmodel.BatchShape."""
    floors = tuple(per_layer_s * n for n in cost.layers)
    plain_one, plain_all = cost.stage_compute_s, cost.stage_compute_all_s
    p = float(exponent)

    def combine(t: float, floor: float) -> float:
        if not p:
            return t if t > floor else floor
        return (t ** p + floor ** p) ** (1.0 / p)

    def one(stage: int, shape: Any) -> float:
        t = plain_one(stage, shape)
        return combine(t, floors[stage] + per_seq_s * shape.num_seqs) if shape.num_prefill_tokens else t

    def every(shape: Any) -> tuple[float, ...]:
        times = plain_all(shape)
        if not shape.num_prefill_tokens:
            return times
        seqs = per_seq_s * shape.num_seqs
        return tuple([combine(t, f + seqs) for t, f in zip(times, floors)])

    cost.stage_compute_s = one  # type: ignore[method-assign]
    cost.stage_compute_all_s = every  # type: ignore[method-assign]
