"""Prefill attention priced per thread block, as FlashAttention-2's paged (split-KV) kernel runs it.

A prefill chunk of x new tokens after a cached prefix of L is read from the paged cache by
FlashAttention-2's split-KV kernel (vLLM's chunked prefill passes a block table, which forces that
kernel): one block per (query head, tile of `prefill_tile` query rows), each block looping over its
keys in key blocks of 128 (head_dim <= 128). A block's keys are the prefix plus, causally, the chunk
up to the end of its tile, whole key blocks (the diagonal's masked block is computed in full). The
blocks are dispatched over `prefill_slots_per_sm` x SMs resident slots; the call ends when the last
one does. Three measured effects motivate this form (docs/calibration.md#prefill-blocks):
- prefix keys add one key to every block: per block a SM they cost 16-17 ns a key on A100 (70B
  table at x = 2,048, 405B samples at x = 1,024) and 12-16 ns on H100 (405B samples at TP 8 and
  TP 1), 3-4x less than a causal key;
- causal blocks are unequal (the last tile attends the whole chunk) and dispatched in grid order,
  so the last ones leave SMs idle: per causal tile-key H100's chunks with no prefix cost 47-54 ns
  over the list schedule at TP 1 and TP 8, 51-71 ns over the balanced share;
- fewer blocks than 0.8 x SMs split each block's keys (`num_splits_heuristic`) and add a combine
  kernel: A100's 70B table at x = 64 (32 blocks) takes 15 us while L + x fits one key block and
  21 us at L = 128 (the split starts).
Held out per shape, the pairs form's 48.5% / 29.9% (H100 TP 1 / TP 8) and 21.5% / 12.6% (A100
70B / 405B) are 9.9% / 9.9% and 9.8% / 4.6% in this form.
Torch-free scalar arithmetic: the simulator calls it per micro-batch.
"""
from __future__ import annotations

from functools import lru_cache

from engine.pricing.decode_blocks import num_splits

__all__ = ["causal_tile_keys", "block_makespan_s", "LIST_SCHEDULE_TAIL"]

# The makespan's tail: FlashAttention-2 dispatches a head's tiles in grid order (the longest, last
# tile last), and a greedy list schedule of those blocks over the slots ends about this fraction of
# the longest block past the balanced share (0.55-0.78 for chunks of 256-4,096 tokens with no prefix
# over 16-128 heads and 108 or 132 slots). With prefixes of 0-4,096 the closed form's makespan is
# within 20% of the schedule, 5% at the median (tests/test_prefill_blocks.py schedules them).
LIST_SCHEDULE_TAIL = 0.63


@lru_cache(maxsize=8192)
def causal_tile_keys(x: int, tile: int, kblock: int) -> tuple[int, int]:
    """(sum over the tiles of one head, the last tile's) causal keys of a chunk of `x` tokens: tile
    i (rows [tile*i, tile*(i+1))) attends the chunk's keys up to its last row, rounded up to whole
    key blocks (the diagonal block is computed in full). Closed form; `tile` and `kblock` are powers
    of two."""
    n = -(-x // tile)
    last = -(-x // kblock) * kblock
    m = n - 1  # the full tiles before the last
    if kblock >= tile:  # k tiles share a key block: sum_j ceil(j / k) * kblock for j = 1..m
        k = kblock // tile
        q, rem = divmod(m, k)
        full = kblock * (k * q * (q + 1) // 2 + rem * (q + 1))
    else:  # each tile ends on a key-block boundary
        full = tile * m * (m + 1) // 2
    return full + last, last


def block_makespan_s(x: float, prefix: float, heads: int, chunks: int, *, tile: int, kblock: int, sms: int,
                     slots_per_sm: int, causal_s: float, prefix_s: float, tail: float, split_s: float) -> float:
    """One prefill call's blocks over the GPU's slots: `chunks` chunks of `x` tokens after `prefix`
    cached ones each (several chunks are taken as equal, the cost model's convention), `heads`
    query heads. `causal_s` / `prefix_s`: seconds per tile-key at one slot's share of the FLOP rate.
    The list schedule's makespan is approximated as max(longest block, balanced share + `tail` x
    longest block): the grid dispatches a head's tiles in order, so the longest (last) tiles start
    late. One slot per SM: a block runs at its SM's rate."""
    xi = max(1, int(round(x)))
    n = -(-xi // tile)
    ck_sum, ck_max = causal_tile_keys(xi, tile, kblock)
    blocks = chunks * heads * n
    splits = num_splits(blocks, sms, -(-int(prefix + xi) // kblock)) if sms else 1
    slots = sms * slots_per_sm
    # a split cuts each block into `splits` pieces of 1/splits its keys: the longest piece shrinks, the
    # work does not (dividing it too priced a 64-token chunk after 8,192 on A40 at 1.15x the dense peak)
    work = chunks * heads * (ck_sum * causal_s + n * prefix * prefix_s)
    longest = (ck_max * causal_s + prefix * prefix_s) / splits
    span = max(longest, work / slots + tail * longest) if blocks * splits > slots else longest
    return span + (split_s if splits > 1 else 0.0)
