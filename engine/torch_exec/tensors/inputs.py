"""A micro-batch's index arrays, built with numpy: no Python work per token.

`host_batch` turns the driver's rows (prefill chunks `(seq_id, start, n, samples, block_table,
token_ids)`, decodes `(seq_id, position, block_table, token_id)`) into flat arrays: the only
Python loops run once per sequence (slicing its block table); positions, slots, row offsets and
sampled rows come from `np.repeat` / `cumsum` / fancy indexing. Rows are the prefill chunks'
tokens in order, then one row per decode; sampled rows are each sampling chunk's last row, then
every decode row (`sampled_sequences()` order).

`pad_rows` pads a decode-only batch to a CUDA-graph bucket (engine/torch_exec/graphs/cuda_graphs.py):
padded rows have slot -1 (the KV write skips them) and context 0 (attention reads nothing).

`row_tiles` maps the Triton kernel's programs to (sequence, row tile) pairs, so a launch has one
program per tile that has work (engine/torch_exec/kernels/paged_attention.py), not max-tiles x sequences.

`pack` lays every array end to end in one int64 buffer, so a micro-batch crosses to the GPU in
one host-to-device copy from pinned memory (`StageModel.prepare`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from itertools import chain

import numpy as np


@dataclass(frozen=True)
class HostBatch:
    """One micro-batch's indices on the host (int64 arrays)."""

    token_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T] where each new token's K/V goes (-1: a padding row)
    sample_rows: np.ndarray  # [R] rows whose logits are sampled
    query_start: np.ndarray  # [S + 1] rows of chunk s: query_start[s]:query_start[s + 1]
    context_lens: np.ndarray  # [S] keys of chunk s, its own queries included
    block_tables: np.ndarray  # [S, max_blocks], each row padded with its first block
    tile_seq: np.ndarray  # [tiles] the sequence of each row tile of the attention kernel
    tile_idx: np.ndarray  # [tiles] its tile index inside that sequence's rows
    num_prefills: int  # chunks 0..num_prefills-1 are prefill chunks, the rest decodes
    max_query_len: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


ARRAYS = tuple(f.name for f in fields(HostBatch) if f.name not in ("num_prefills", "max_query_len"))


def pick_block_m(max_rows: int) -> int:
    """Query rows per kernel program for a batch whose longest chunk has `max_rows` rows
    (queries x GQA group): 16, tl.dot's minimum, when every chunk fits (decode-only batches),
    else 64."""
    return 16 if max_rows <= 16 else 64


def row_tiles(query_start: np.ndarray, group: int, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, tile index) of every row tile: chunk s has ceil(rows_s * group / block_m) tiles."""
    tiles = -(-np.diff(query_start) * group // block_m)
    seq = np.repeat(np.arange(len(tiles)), tiles)
    first = np.cumsum(tiles) - tiles
    return seq, np.arange(int(tiles.sum())) - first[seq]


def host_batch(prefills, decodes, block_size: int, group: int = 1) -> HostBatch:
    """`group`: query heads per KV head (sizes the attention kernel's row tiles)."""
    P, D = len(prefills), len(decodes)
    S = P + D
    starts = np.fromiter(chain((p[1] for p in prefills), (d[1] for d in decodes)), np.int64, S)
    qlen = np.ones(S, np.int64)
    qlen[:P] = np.fromiter((p[2] for p in prefills), np.int64, P)
    ctx = starts + qlen
    nblocks = -(-ctx // block_size)
    tables = chain((p[4] for p in prefills), (d[2] for d in decodes))
    flat = np.fromiter(chain.from_iterable(t[:k] for t, k in zip(tables, nblocks.tolist())), np.int64,
                       int(nblocks.sum()))
    ends = np.cumsum(nblocks)
    maxb = int(nblocks.max()) if S else 0
    tbl = np.repeat(flat[ends - nblocks][:, None], maxb, axis=1)  # pad with each row's first block
    tbl[np.arange(maxb)[None, :] < nblocks[:, None]] = flat  # row-major: each row's blocks in order
    qs = np.zeros(S + 1, np.int64)
    np.cumsum(qlen, out=qs[1:])
    T = int(qs[-1])
    seq = np.repeat(np.arange(S), qlen)
    pos = np.arange(T) - qs[seq] + starts[seq]
    slots = tbl[seq, pos // block_size] * block_size + pos % block_size
    ids = np.fromiter(chain(chain.from_iterable(p[5] for p in prefills), (d[3] for d in decodes)), np.int64, T)
    samples = np.fromiter((p[3] for p in prefills), bool, P)
    rows = np.concatenate((qs[1:P + 1][samples] - 1, np.arange(qs[P], T)))
    max_q = int(qlen.max()) if S else 0
    tile_seq, tile_idx = row_tiles(qs, group, pick_block_m(max_q * group))
    return HostBatch(ids, pos, slots, rows, qs, ctx, tbl, tile_seq, tile_idx, P, max_q)


def pad_rows(b: HostBatch, rows: int) -> HostBatch:
    """A decode-only batch padded to `rows` sequences (a CUDA-graph bucket): a padding row has
    token 0 at position 0, slot -1 and context 0, a table row of block 0 (never read) and one
    row tile (its program finds no key and writes zeros)."""
    n = b.num_seqs
    if b.num_prefills or b.max_query_len != 1 or rows < n:
        raise ValueError(f"only a decode-only batch of at most {rows} sequences pads to {rows} rows")

    def grow(a, fill):
        out = np.full(rows, fill, np.int64)
        out[:n] = a
        return out

    tbl = np.zeros((rows, b.block_tables.shape[1]), np.int64)
    tbl[:n] = b.block_tables
    if len(b.tile_seq) != n:
        raise ValueError("a decode's GQA group must fit one row tile (at most 64 query heads per KV head)")
    return replace(b, token_ids=grow(b.token_ids, 0), positions=grow(b.positions, 0), slots=grow(b.slots, -1),
                   sample_rows=np.arange(rows, dtype=np.int64), query_start=np.arange(rows + 1, dtype=np.int64),
                   context_lens=grow(b.context_lens, 0), block_tables=tbl,
                   tile_seq=np.arange(rows, dtype=np.int64), tile_idx=np.zeros(rows, np.int64))


def pack(b: HostBatch, out: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, tuple[int, tuple[int, ...]]]]:
    """Every array of `b` end to end in one int64 buffer (`out`, e.g. a pinned tensor's numpy view,
    or a new array); returns it and {name: (offset, shape)}."""
    layout, off = {}, 0
    for name in ARRAYS:
        a = getattr(b, name)
        layout[name] = (off, a.shape)
        off += a.size
    if out is None:
        out = np.empty(off, np.int64)
    for name in ARRAYS:
        o, shape = layout[name]
        a = getattr(b, name)
        out[o:o + a.size] = a.reshape(-1)
    return out[:off], layout


def packed_size(b: HostBatch) -> int:
    return sum(getattr(b, name).size for name in ARRAYS)
