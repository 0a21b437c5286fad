"""Layers per stage: the even split (`split_layers`, the default) and `parallel.layer_split=balanced`,
layers per stage that balance stage time and KV memory.

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

from collections.abc import Callable, Sequence

from engine.base.errors import ConfigError, ImpossibleFitError


def split_layers(num_layers: int, pp: int, explicit: Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers per stage. Even split; the remainder goes to the FIRST stages, one each.

    Why the first: the last stage already carries the lm_head and (unless sampling runs on CPUs)
    the sampler, so giving it an extra layer would make the bottleneck worse; the first stage's
    extra work (the embedding gather) is negligible. `explicit` (config `parallel.layer_split`)
    overrides it: one positive count per stage, summing to `num_layers`.
    """
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ConfigError(f"invalid parallel.pp={pp!r}: must be an integer >= 1")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError(f"invalid num_layers={num_layers!r}: must be an integer >= 1")
    if explicit is not None:
        split = tuple(explicit)
        if len(split) != pp:
            raise ConfigError(
                f"invalid parallel.layer_split={list(split)}: needs one entry per stage (pp={pp}), got {len(split)}"
            )
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split):
            raise ConfigError(f"invalid parallel.layer_split={list(split)}: every stage needs an integer >= 1 layers")
        if sum(split) != num_layers:
            raise ConfigError(
                f"invalid parallel.layer_split={list(split)}: sums to {sum(split)}, the model has {num_layers} layers"
            )
        return split
    if pp > num_layers:
        raise ConfigError(
            f"invalid parallel.pp={pp}: the model has only {num_layers} layers, so at most pp={num_layers}"
        )
    base, extra = divmod(num_layers, pp)
    return tuple(base + 1 if s < extra else base for s in range(pp))

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
