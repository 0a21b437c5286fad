"""Piecewise CUDA graphs: mixed and prefill micro-batches off the launch bound.

Measured on an H100 (qwen2.5-7b shape, bf16, one stage): a micro-batch run eagerly costs ~40 ms
of host time whatever its size, the host launching ~1,000 kernels; a mixed 400 + 160 x 512
forward took 36.7 ms of host CPU for 18 ms of GPU work. Decode-only micro-batches replay one
captured graph each (engine/torch_exec/graphs/cuda_graphs.py), but a whole-forward graph cannot hold a
mixed batch: its attention's launch grid (the row tiles of each chunk) and `max_query_len` change
with the chunks. As vLLM's piecewise graphs do (`CompilationConfig.splitting_ops`: attention
runs eagerly between captured pieces), a stage captures, per token-count bucket T, the L + 1
pieces between its L attentions:

    piece 0      : embedding (or the received hidden states), layer 0 up to its attention
    piece i      : layer i-1 after its attention (o_proj, add + norm, MLP), layer i up to its attention
    piece L      : layer L-1 after its attention, the stage's output (MLP output + residual)

and a micro-batch of n <= T tokens replays them in turn with one eager paged-attention launch per
layer between them: L + 1 graph launches and L kernel launches instead of ~35 launches a layer.

Why this and not another design: the pieces are exactly the parts whose shapes depend only on the
token count (GEMMs and elementwise kernels), so one capture per bucket serves every mix of
prefill chunks and decodes; attention, whose grid depends on the chunks, keeps its exact grid
(no padding of chunks or contexts). A graph per (chunks, contexts) shape would never be reused;
torch.compile would add a compiler to the stage. Host time per forward becomes ~L graph and L
kernel launches plus the input copies, well under the GPU time of any batch of hundreds of
tokens.

- Buckets (`piece_sizes`): 16, 32, 64, 128, 256, then every 64 tokens to 2,048, then every 256
  up to the stage's largest micro-batch (`max_tokens`: the policy's token budget). The padding
  costs at most 64 tokens of GEMM work up to 2,048 tokens (a 400 + 160 batch runs as 576) and
  256 beyond. A batch with more tokens runs eagerly.
- `prepare` pads only the token-level arrays (`pad_tokens`: token 0, position 0, slot -1, so a
  padding row writes no K/V); the attention's indices (query offsets, contexts, tables, row
  tiles) stay the batch's own, so it never reads or attends for a padding row.
- Static buffers of the largest bucket carry everything between pieces: the inputs (token ids or
  hidden states, RoPE cos/sin, slots), the residual stream, q (written by a piece, read by the
  attention) and o (written by the attention, read by the next piece), and the stage's output.
  No tensor allocated inside one piece is read by another, so all pieces of all buckets share one
  memory pool whatever order they replay in. Padding rows of these buffers hold stale but finite
  values; every op is row-wise except attention, which reads only the pools.
- Capture happens at set-up, after the KV pool is allocated, largest bucket first, each piece
  warmed up once eagerly (no first-use warm-up inside a run).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from engine.torch_exec.tensors.batch_inputs import BatchInputs
from engine.torch_exec.graphs.cuda_graphs import GraphCapture, graph_width

MAX_SEQS = 1024  # sequences of a batch the attention's static index buffers hold (more: eager)

def piece_sizes(max_tokens: int) -> tuple[int, ...]:
    """Token buckets up to the first one >= max_tokens: 16 ... 256 doubling, then steps of 64 to
    2,048, then steps of 256."""
    max_tokens = max(int(max_tokens), 1)
    sizes = [16, 32, 64, 128, 256]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] + (64 if sizes[-1] < 2048 else 256))
    return tuple(s for s in sizes if s < max_tokens) + (next(s for s in sizes if s >= max_tokens),)


def token_bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest bucket holding n tokens, 0 if none does."""
    return next((s for s in sizes if s >= n), 0) if n > 0 else 0


def pad_tokens(hb, rows: int):
    """An inputs.HostBatch with its token-level arrays padded to `rows` (token 0, position 0, slot
    -1: the K/V write skips it); the sequence-level arrays (attention's indices) are untouched."""
    n = hb.num_tokens
    if rows < n:
        raise ValueError(f"a batch of {n} tokens does not pad to {rows}")

    def grow(a, fill):
        out = np.full(rows, fill, np.int64)
        out[:n] = a
        return out

    return dataclasses.replace(hb, token_ids=grow(hb.token_ids, 0), positions=grow(hb.positions, 0),
                               slots=grow(hb.slots, -1))


class PiecewiseGraphs(GraphCapture):
    """The L + 1 pieces of a StageModel (engine/torch_exec/stage/model.py) per token bucket."""

    def __init__(self, model, sizes: tuple[int, ...]) -> None:
        self.model = model
        self.sizes = tuple(sorted(sizes))
        a, B, dev, dt = model.arch, self.sizes[-1], model.device, model.dtype
        self.token_ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.hidden = None if model.first else torch.zeros(B, a.hidden_size, dtype=dt, device=dev)
        self.cos = torch.zeros(B, a.head_dim, dtype=torch.float32, device=dev)
        self.sin = torch.zeros(B, a.head_dim, dtype=torch.float32, device=dev)
        self.slots = torch.full((B,), -1, dtype=torch.long, device=dev)  # capture: every row is padding
        self.res = torch.zeros(B, a.hidden_size, dtype=dt, device=dev)
        self.out = torch.zeros(B, a.hidden_size, dtype=dt, device=dev)
        self.q = torch.zeros(B, a.num_heads, a.head_dim, dtype=dt, device=dev)
        self.o = torch.zeros(B, a.num_heads, a.head_dim, dtype=dt, device=dev)
        # the attention's indices, copied here too: Triton specialises a kernel on its pointers'
        # 16-byte alignment and on integer arguments (a table's row stride) that are 1 or multiples
        # of 16, so indices at varying offsets of the packed input would compile new variants
        # mid-run; from fixed buffers, the two variants (decode-sized and prefill-sized row tiles)
        # compile at capture (`warm_attention`)
        S = self.max_seqs = min(B, MAX_SEQS)
        self.width = graph_width(getattr(a, "max_position_embeddings", None), model.block_size, model.num_blocks)
        self.block_tables = torch.zeros(S, self.width, dtype=torch.long, device=dev)
        self.query_start = torch.zeros(S + 1, dtype=torch.long, device=dev)
        self.context_lens = torch.zeros(S, dtype=torch.long, device=dev)
        self.max_tiles = B + S  # row tiles: at most rows x group / 16 + one per sequence (group <= 16)
        self.tile_seq = torch.zeros(self.max_tiles, dtype=torch.long, device=dev)
        self.tile_idx = torch.zeros(self.max_tiles, dtype=torch.long, device=dev)
        self.graphs: dict[int, list] = {}
        self.pool = None
        self.replays = 0

    def rows_for(self, hb) -> int:
        """The bucket a host batch runs in (0: eagerly: more tokens than the largest bucket, or more
        sequences, table columns or row tiles than the attention's buffers hold)."""
        rows = token_bucket(hb.num_tokens, self.sizes)
        fits = self._fits(hb.num_seqs, hb.block_tables.shape[1], len(hb.tile_seq))
        return rows if rows in self.graphs and fits else 0

    def covers(self, b: BatchInputs) -> bool:
        """Whether `prepare` padded `b` to a captured bucket (its slots have the bucket's rows)."""
        return (not b.graph_rows and b.slots.shape[0] in self.graphs and b.tiles is not None
                and self._fits(b.context_lens.shape[0], b.block_tables.shape[1], b.tiles[0].shape[0]))

    def _fits(self, seqs: int, width: int, tiles: int) -> bool:
        return seqs <= self.max_seqs and width <= self.width and tiles <= self.max_tiles

    def pieces(self, rows: int) -> list:
        """The functions each piece of bucket `rows` runs: they read and write only static buffers."""
        m, n = self.model, self.model.num_layers
        sb = BatchInputs(num_tokens=rows, token_ids=self.token_ids[:rows], cos=self.cos[:rows], sin=self.sin[:rows],
                         slots=self.slots[:rows], sample_rows=self.slots[:0], chunks=[])
        q, o, res = self.q[:rows], self.o[:rows], self.res[:rows]

        def first():
            x = m.embed_input(sb, None if self.hidden is None else self.hidden[:rows])
            m.attention_in(0, x, None, sb, q_out=q, res_out=res)

        def middle(li):
            x, _ = m.attention_out(li - 1, o, res, res_out=res)
            m.attention_in(li, x, res, sb, q_out=q, res_out=res)

        def last():
            x, _ = m.attention_out(n - 1, o, res, res_out=res)
            torch.add(x, res, out=self.out[:rows])

        return [first] + [lambda li=li: middle(li) for li in range(1, n)] + [last]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every piece of every bucket, largest bucket first, each warmed up once before its capture;
        then the attention's two kernel variants."""
        self._sync()
        for rows in reversed(self.sizes):
            recorded = []
            for fn in self.pieces(rows):
                self._warm_up(fn)
                recorded.append(self._record(fn)[0])
            self.graphs[rows] = recorded
        self.warm_attention()
        self._sync()

    def warm_attention(self) -> None:
        """One launch of each attention variant a run uses (one decode; one chunk of 17 queries,
        more than a 16-row tile) on empty contexts, through the static buffers as a run launches
        it: nothing is read, o's rows are scratch."""
        rows, group = self.sizes[-1], self.model.arch.num_heads // self.model.arch.num_kv_heads
        for q_len in (1, 17):
            if q_len <= rows:
                hb = _one_chunk(q_len, group)
                t = {k: torch.from_numpy(getattr(hb, k)).to(self.q.device) for k in
                     ("block_tables", "query_start", "context_lens", "tile_seq", "tile_idx")}
                b = BatchInputs(num_tokens=q_len, token_ids=None, cos=self.cos, sin=self.sin, slots=self.slots,
                                sample_rows=self.slots[:0], chunks=[],
                                block_tables=t["block_tables"], query_start=t["query_start"],
                                context_lens=t["context_lens"], max_query_len=q_len,
                                tiles=(t["tile_seq"], t["tile_idx"]))
                self.model.attend(0, self.q[:rows], self._attention_batch(b), out=self.o[:rows])

    def run(self, b: BatchInputs, hidden: torch.Tensor | None, replay: bool = True) -> torch.Tensor:
        """The forward of `b` (padded to a bucket by `prepare`): the pieces replayed (or, with
        replay=False, run eagerly through the same buffers: tests) with the attentions between."""
        rows, n = b.slots.shape[0], b.num_tokens
        self.load(b, hidden)
        steps = self.graphs[rows] if replay else [_Eager(fn) for fn in self.pieces(rows)]
        q, o, ab = self.q[:rows], self.o[:rows], self._attention_batch(b)
        steps[0].replay()
        for li in range(self.model.num_layers):
            self.model.attend(li, q, ab, out=o)
            steps[li + 1].replay()
        self.replays += replay
        x = self.out[:n]
        return self.model.logits(x.index_select(0, b.sample_rows)) if self.model.last else x.clone()

    def load(self, b: BatchInputs, hidden: torch.Tensor | None) -> None:
        """Copy the padded batch into the static buffers (what the pieces read)."""
        rows = b.slots.shape[0]
        if self.hidden is None:
            self.token_ids[:rows].copy_(b.token_ids)
        else:
            self.hidden[:b.num_tokens].copy_(hidden)
        self.cos[:rows].copy_(b.cos)
        self.sin[:rows].copy_(b.sin)
        self.slots[:rows].copy_(b.slots)


    def _attention_batch(self, b: BatchInputs) -> BatchInputs:
        """b's attention indices copied into the static buffers, as the batch the attention reads
        (the tables' columns past b's own are stale: the kernel reads only a context's blocks)."""
        S, w, nt = b.context_lens.shape[0], b.block_tables.shape[1], b.tiles[0].shape[0]
        self.block_tables[:S, :w].copy_(b.block_tables)
        self.query_start[:S + 1].copy_(b.query_start)
        self.context_lens[:S].copy_(b.context_lens)
        self.tile_seq[:nt].copy_(b.tiles[0])
        self.tile_idx[:nt].copy_(b.tiles[1])
        return dataclasses.replace(b, block_tables=self.block_tables[:S], query_start=self.query_start[:S + 1],
                                   context_lens=self.context_lens[:S],
                                   tiles=(self.tile_seq[:nt], self.tile_idx[:nt]))


def _one_chunk(q_len: int, group: int):
    """The host indices of one chunk of q_len (<= 64) queries over an empty context, one block of
    64 in its table (`warm_attention`)."""
    from engine.torch_exec.tensors.inputs import host_batch

    hb = host_batch([(0, 0, q_len, False, [0], [0] * q_len)], [], 64, group)
    return dataclasses.replace(hb, context_lens=np.zeros(1, np.int64))


class _Eager:
    """A piece run without a graph (`PiecewiseGraphs.run(replay=False)`)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()
