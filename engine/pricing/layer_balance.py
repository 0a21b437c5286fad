"""`parallel.layer_split=balanced`: layers per stage that balance stage time and KV memory.

An even split gives every stage the same number of transformer layers, but the first stage also
holds the embedding and the last the LM head, the final norm and (unless sampling runs on CPUs)
the sampler: the last stage is the slowest and both end stages have the least memory left for
KV, so the whole pipeline's KV pool (the minimum over stages) and its period (the slowest stage)
are set by the ends. vLLM PR #6920 moved layers off the end stages by hand (Llama-3-70B-FP8 on
8 x L4: KV blocks 1,476 -> 3,078).

The balanced split starts from the even one and moves one layer at a time, from any stage to any
other, taking the move that most raises the KV blocks every stage can hold (compared smallest
first: the pipeline's pool is the minimum, and both end stages are low, so raising one of them
is progress towards raising it); a move is allowed
only while no stage gets slower than the even split's slowest stage on a reference decode step
(128 sequences at 1,024 tokens of context, sampling included; `REFERENCE_DECODE`), and among moves with equal KV the one with the faster slowest stage wins. It stops when
no move helps. Both the time and the memory come from the run's own cost model (its weights per
stage, `kv_capacity_blocks`, `stage_times_s`), so the simulator and the real engine (which loads
the same split) use one answer.
"""
from __future__ import annotations

from collections.abc import Callable

from engine.base.errors import ConfigError, ImpossibleFitError

BALANCED = "balanced"
# The stage time a move must not worsen: a decode step of 128 sequences at 1,024 tokens of context
# (max_num_seqs of Sarathi and vLLM), where the LM head and the sampler make the last stage the
# slowest (Llama-3.1-70B on L20, P=8: 47.7 ms against 42.4 ms for a middle stage). A prefill
# micro-batch samples one row per prompt, so there the end stages are hardly slower and any
# stage given an 11th layer of 80 is ~9% slower than the even split's slowest (2,048 tokens:
# 494 ms against 453 ms): whole layers cannot balance a prefill-bound pipeline, which is why the
# even split stays the default.
REFERENCE_DECODE = (128, 1024)  # (decode sequences, context tokens)


def balanced_split(make: Callable[[tuple[int, ...]], object], even: tuple[int, ...], shapes: tuple,
                   gpu_memory_utilization: float = 0.9, block_size: int = 16) -> tuple[int, ...]:
    """The balanced split, from `make(split) -> CostModel`, the even split to start from and the
    reference micro-batches (`BatchShape`s: the decode step of `REFERENCE_DECODE`) no stage may
    get slower on. The caller builds the shapes: this module sits below the cost model."""
    base = make(even)
    limit = [max(base.stage_times_s(sh)) for sh in shapes]

    def score(split: tuple[int, ...]) -> tuple[tuple[int, ...], float] | None:
        cm = make(split)
        worst = max(max(cm.stage_times_s(sh)) / lim for sh, lim in zip(shapes, limit))
        if worst > 1.0 + 1e-9:
            return None
        return _blocks(cm, gpu_memory_utilization, block_size), -worst

    best, best_score = even, score(even)
    assert best_score is not None
    while True:
        move = None
        for i in range(len(best)):
            if best[i] <= 1:
                continue
            for j in range(len(best)):
                if i == j:
                    continue
                cand = tuple(n - (k == i) + (k == j) for k, n in enumerate(best))
                s = score(cand)
                if s is not None and s > best_score and (move is None or s > move[1]):
                    move = (cand, s)
        if move is None:
            return best
        best, best_score = move


def _blocks(cm, gpu_memory_utilization: float, block_size: int) -> tuple[int, ...]:
    """Every stage's KV blocks, smallest first: compared as tuples, a move that raises the
    pipeline's minimum wins, and one that only raises the second smallest (the other end stage:
    both ends hold extra weights) still counts as progress towards it (leximin)."""
    try:
        return tuple(sorted(cm.kv_blocks_per_stage(gpu_memory_utilization, block_size)))
    except ImpossibleFitError:
        return (0,)


def check_name(value: str) -> None:
    if value != BALANCED:
        raise ConfigError(f"invalid parallel.layer_split={value!r}: valid choices: a list of layers per stage, "
                          f"{BALANCED}, or null (even)")
