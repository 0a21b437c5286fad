"""FlashAttention-2's split-KV count for a decode call (`num_splits_heuristic` in its `flash_api.cpp`,
Dao 2023), the rule the published decode tables follow (docs/calibration.md#measured-kernels).

A decode call runs one block per (sequence, KV head) (query heads of one KV head share a block);
when those fill less than 0.8 of the SMs (`kernels.SPLIT_KV_FRACTION`), the kernel splits each
block's KV tiles over several blocks and a second kernel combines their partial outputs. The split count is the smallest one
whose last wave is at least 0.85 as full as the best count's, among counts that change the tiles
per split. Pure integer arithmetic, cached: the simulator asks per micro-batch.
"""
from __future__ import annotations

import functools
import math

__all__ = ["kv_tile", "splits"]

MAX_SPLITS = 128


def kv_tile(head_dim: int) -> int:
    """KV tokens per tile of the split-KV kernel (its kBlockN: 256 up to head_dim 64, 128 up to 128)."""
    return 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64


@functools.lru_cache(maxsize=1 << 16)
def splits(blocks: int, sms: int, kv_tiles: int) -> int:
    """How many pieces FlashAttention-2 cuts each block's `kv_tiles` KV tiles into, for `blocks`
    below its split boundary (`kernels.SPLIT_KV_FRACTION` x `sms`: the caller's check)."""
    top = min(MAX_SPLITS, sms, kv_tiles)
    fill = [0.0] * (top + 1)
    for n in range(1, top + 1):
        if n == 1 or -(-kv_tiles // n) != -(-kv_tiles // (n - 1)):  # else the same tiles per split
            waves = blocks * n / sms
            fill[n] = waves / math.ceil(waves)
    best = max(fill)
    return next((n for n in range(1, top + 1) if fill[n] and fill[n] >= 0.85 * best), 1)
