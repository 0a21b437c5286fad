"""The blocks of a decode-attention call: FlashAttention-2's split-KV count (`num_splits_heuristic`
in its `flash_api.cpp`, Dao 2023), the rule the published decode tables follow, and the waves they
run in (docs/calibration.md#measured-kernels); `LayerKernels.decode_s` over arrays for the fit.

A decode call runs one block per (sequence, KV head) (query heads of one KV head share a block);
when those fill less than 0.8 of the SMs (`SPLIT_KV_FRACTION`), the kernel splits each
block's KV tiles over several blocks and a second kernel combines their partial outputs. The
split count is the smallest one whose last wave is at least 0.85 as full as the best count's,
among counts that change the tiles per split. Pure integer arithmetic, cached: the simulator asks
per micro-batch.
"""
from __future__ import annotations

import functools
import math

__all__ = ["kv_tile", "splits", "num_splits", "wave_factor", "rows_s", "SPLIT_KV_FRACTION"]

# FlashAttention-2's split-KV boundary (`num_splits_heuristic`: `batch_nheads_mblocks >= 0.8f *
# num_SMs` -> 1 split), for decode and prefill calls alike.
SPLIT_KV_FRACTION = 0.8
MAX_SPLITS = 128


def kv_tile(head_dim: int) -> int:
    """KV tokens per tile of the split-KV kernel (its kBlockN: 256 up to head_dim 64, 128 up to 128)."""
    return 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64


@functools.lru_cache(maxsize=1 << 16)
def splits(blocks: int, sms: int, kv_tiles: int) -> int:
    """How many pieces FlashAttention-2 cuts each block's `kv_tiles` KV tiles into, for `blocks`
    below its split boundary (`SPLIT_KV_FRACTION` x `sms`: the caller's check)."""
    top = min(MAX_SPLITS, sms, kv_tiles)
    fill = [0.0] * (top + 1)
    for n in range(1, top + 1):
        if n == 1 or -(-kv_tiles // n) != -(-kv_tiles // (n - 1)):  # else the same tiles per split
            waves = blocks * n / sms
            fill[n] = waves / math.ceil(waves)
    best = max(fill)
    return next((n for n in range(1, top + 1) if fill[n] and fill[n] >= 0.85 * best), 1)


def num_splits(blocks: int, sms: int, kv_tiles: int) -> int:
    """`splits` with the boundary checked: 1 when `blocks` fill `SPLIT_KV_FRACTION` of the SMs."""
    return 1 if blocks >= SPLIT_KV_FRACTION * sms else splits(blocks, sms, kv_tiles)


def wave_factor(blocks: int, cap: int, tail_recovery: float):
    """The KV term's scale for `blocks` run in waves of `cap`: whole waves, less the share
    `tail_recovery` of the last wave's empty slots that its fewer blocks recover."""
    waves = -(-blocks // cap)
    return (waves - tail_recovery * (waves - blocks / cap)) * cap / blocks


def rows_s(lk, num_seqs, context_sum, kv_width: int = 0):
    """`lk.decode_s` (a `LayerKernels`) over arrays of calls at once: the fit evaluates thousands of
    table rows some 2,000 times (65 s a device with the scalar calls, 5 s so, shared 2-core
    machine); a test checks that the two agree."""
    import numpy as np

    n, ctx = np.asarray(num_seqs, dtype=np.int64), np.asarray(context_sum, dtype=np.int64)
    c = lk.c
    units = n * lk.shape.kv_heads_gpu
    split = units < lk._split_units
    pieces = np.ones_like(units)
    if lk._split_count:
        at = np.nonzero(split)[0]
        tiles = np.full(len(at), -(-kv_width // lk._kv_tile)) if kv_width else -(-ctx[at] // (n[at] * lk._kv_tile))
        pieces[at] = [splits(int(u), lk._sms, int(t)) for u, t in zip(units[at], tiles)]
        split = pieces > 1
    blocks = units * pieces
    kv = ctx * lk._dec_per_token
    if lk._units_cap:
        kv = np.where(blocks > lk._units_cap, kv * wave_factor(blocks, lk._units_cap, c.decode_tail_recovery), kv)
    kv = kv * (1.0 + c.decode_half_blocks / blocks)
    return c.decode_floor_s + kv + n * lk._dec_per_seq * pieces + np.where(split, c.decode_split_s, 0.0)
