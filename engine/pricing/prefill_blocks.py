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

import math
from functools import lru_cache
from typing import NamedTuple

from engine.pricing.decode_blocks import SPLIT_KV_FRACTION, num_splits

__all__ = ["BlockForm", "causal_tile_keys", "makespan_s", "split_makespan_s", "LIST_SCHEDULE_TAIL"]

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


class BlockForm(NamedTuple):
    """The per-block form's constants for one layer on one device, as `LayerKernels` holds them: a
    NamedTuple (hashable as a plain tuple) because the per-prefix floor is cached on it."""

    tile: int  # query rows a block (`prefill_tile`)
    kblock: int  # keys a key block (128 for head_dim <= 128)
    sms: int  # the device's SMs (0: no split-KV regime)
    slots_per_sm: int  # resident blocks an SM (`prefill_slots_per_sm`)
    causal_s: float  # seconds a causal tile-key at one slot's share of the FLOP rate
    prefix_s: float  # the same for a prefix tile-key
    tail: float  # the list schedule's tail, a fraction of the longest block (`LIST_SCHEDULE_TAIL`)
    split_s: float  # the split-KV combine kernel (`prefill_split_s`)


def split_makespan_s(xi: int, prefix: float, heads: int, chunks: int, form: BlockForm) -> float:
    """One prefill call's blocks over the GPU's slots, with the split count FlashAttention-2 picks for
    exactly this call: `chunks` chunks of `xi` tokens after `prefix` cached ones each (several chunks
    are taken as equal, the cost model's convention), `heads` query heads. `form.causal_s` /
    `form.prefix_s`: seconds per tile-key at one slot's share of the FLOP rate. The list schedule's
    makespan is approximated as max(longest block, balanced share + `tail` x longest block): the grid
    dispatches a head's tiles in order, so the longest (last) tiles start late. One slot per SM: a
    block runs at its SM's rate. Not monotone in `xi` (the split count steps): `makespan_s` is."""
    tile, kblock, sms, slots_per_sm, causal_s, prefix_s, tail, split_s = form
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


def makespan_s(xi: int, prefix: float, heads: int, chunks: int, form: BlockForm) -> float:
    """`split_makespan_s`, never below a shorter chunk's after the same prefix (issue 46 item 4):
    `chunks` chunks of `xi` tokens (a whole number) after `prefix` cached ones each.

    FlashAttention-2's split count is not monotone in the chunk (`num_splits_heuristic`): on H100
    (132 SMs) 7 query heads a GPU (Qwen2.5-7B at TP 4) make 49 blocks for 385-448 tokens, split 2
    ways while prefix + chunk spans 11 key blocks and 12 ways at 12, so the per-block form priced 416
    tokens after 1,000 17.7% below 408 (34.7 vs 42.2 us; A100's form 33% at 72 vs 64 tokens after
    128). The measured kernel steps down far less: A100's complete 70B table (4,418 prefill rows)
    drops at 284 of 4,338 adjacent chunk pairs, by at most 9.5% (21 -> 19 us, 64 -> 80 tokens after
    96-160), H100's samples at none of 138. The form's split price leaves out each piece's partial
    output and prices H100's combine at its bound (no H100 row splits), so the step is not priced
    here: a call costs at least what any shorter chunk after the same prefix costs."""
    t = split_makespan_s(xi, prefix, heads, chunks, form)
    tile, sms = form.tile, form.sms
    if not sms or chunks * heads >= SPLIT_KV_FRACTION * sms:  # not even one tile a head splits
        return t
    last = (math.ceil(SPLIT_KV_FRACTION * sms / (chunks * heads)) - 1) * tile  # the split regime's longest
    if xi > last:
        # no shorter chunk's span exceeds its longest block L (unsplit, fewer blocks than slots) or, split,
        # half of it + its work over the slots (< 0.8 L: fewer blocks than 0.8 x SMs) + the combine
        longest = -(-last // form.kblock) * form.kblock * form.causal_s + prefix * form.prefix_s
        if t >= max(longest, (SPLIT_KV_FRACTION + 0.5 * form.tail) * longest + form.split_s):
            return t
    # past the regime every shorter end counts: one cache entry for every longer chunk
    floor = _shorter_max_s(min(xi, last + 1), prefix, heads, chunks, form)
    return t if t >= floor else floor


@lru_cache(maxsize=1 << 15)
def _shorter_max_s(xi: int, prefix: float, heads: int, chunks: int, form: BlockForm) -> float:
    """The highest `split_makespan_s` over the shorter chunks `1..xi-1` (the caller keeps them in the split
    regime). The split count changes only where the tile count or prefix + chunk's key blocks do,
    and with a constant count the span grows with the chunk, so the maximum is at a segment's last
    length: a whole number of tiles, or the last length with j key blocks."""
    tile, kblock = form.tile, form.kblock
    top = xi - 1
    ends = set(range(tile, top + 1, tile))
    ends.add(top)
    for j in range(-(-int(prefix + 1) // kblock), -(-int(prefix + top) // kblock) + 1):
        e = math.ceil(kblock * j + 1 - prefix) - 1  # int(prefix + e) <= kblock * j < int(prefix + e + 1)
        if 1 <= e <= top:
            ends.add(e)
    return max((split_makespan_s(e, prefix, heads, chunks, form) for e in ends if e >= 1), default=0.0)
