"""A micro-batch's index arrays, built with numpy: no Python work per token.

`host_batch` turns the driver's rows (prefill chunks `(seq_id, start, n, samples, block_table,
token_ids)`, decodes `(seq_id, position, block_table, token_id)`) into flat arrays: the only
Python loops run once per sequence (slicing its block table); positions, slots, row offsets and
sampled rows come from `np.repeat` / `cumsum` / fancy indexing. Rows are the prefill chunks'
tokens in order, then one row per decode; sampled rows are each sampling chunk's last row, then
every decode row (`sampled_sequences()` order).

`pad_rows` pads a decode-only batch to a CUDA-graph bucket (engine/torch_exec/cuda_graphs.py):
padded rows have slot -1 (the KV write skips them) and context 0 (attention reads nothing).

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
    num_prefills: int  # chunks 0..num_prefills-1 are prefill chunks, the rest decodes
    max_query_len: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


ARRAYS = tuple(f.name for f in fields(HostBatch) if f.name not in ("num_prefills", "max_query_len"))


def host_batch(prefills, decodes, block_size: int) -> HostBatch:
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
    return HostBatch(ids, pos, slots, rows, qs, ctx, tbl, P, int(qlen.max()) if S else 0)


def pad_rows(b: HostBatch, rows: int) -> HostBatch:
    """A decode-only batch padded to `rows` sequences (a CUDA-graph bucket): a padding row has
    token 0 at position 0, slot -1 and context 0, and a table row of block 0 (never read)."""
    n = b.num_seqs
    if b.num_prefills or b.max_query_len != 1 or rows < n:
        raise ValueError(f"only a decode-only batch of at most {rows} sequences pads to {rows} rows")

    def grow(a, fill):
        out = np.full(rows, fill, np.int64)
        out[:n] = a
        return out

    tbl = np.zeros((rows, b.block_tables.shape[1]), np.int64)
    tbl[:n] = b.block_tables
    return replace(b, token_ids=grow(b.token_ids, 0), positions=grow(b.positions, 0), slots=grow(b.slots, -1),
                   sample_rows=np.arange(rows, dtype=np.int64), query_start=np.arange(rows + 1, dtype=np.int64),
                   context_lens=grow(b.context_lens, 0), block_tables=tbl)


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
