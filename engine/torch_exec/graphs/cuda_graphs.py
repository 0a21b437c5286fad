"""CUDA graphs for decode-only micro-batches (`executor.cuda_graphs`, CUDA + the Triton attention path).

A decode step of a small model is launch-bound: tiny-llama's forward is ~10 kernels per layer
and the issue's H100 measurement (TPOT 12.4 ms for a 22M-parameter model) is all overhead. As
vLLM and nano-vllm do, a stage captures its forward once per bucket size (`GRAPH_SIZES`: 1, 2,
4, 8, then multiples of 16 up to 256, nano-vllm's buckets) at set-up, and a decode-only micro-batch
of n sequences replays the smallest bucket >= n:

- static input buffers (token ids or incoming hidden states, RoPE cos/sin, slots, context
  lengths, block tables; query offsets 0..B and one kernel row tile per row, constant) sized for the largest bucket; each bucket's graph
  reads their first B rows. `prepare` pads the batch on the host (`inputs.pad_rows`: slot -1,
  context 0, so padding neither writes nor reads the KV pools) and `replay` copies it into the
  buffers: a few device-to-device copies, then one graph launch;
- the block-table buffer has `graph_width` columns (the model's longest context in blocks);
  a batch copies only its own columns, and a batch wider than that runs eagerly;
- capture runs largest bucket first into one shared memory pool (PyTorch's CUDA-graph docs:
  graphs that replay in turn may share a pool), after an eager warm-up on a side stream that
  compiles the Triton kernels outside the capture. Mixed and prefill micro-batches replay
  piecewise graphs (engine/torch_exec/graphs/piecewise.py), with their attention run eagerly.

A graph ends at the last layer's hidden states (all buckets' outputs together: 16 MB for
qwen2.5-7b's shape); the last stage's final norm and lm_head run after the replay on the real
rows only, so no bucket holds a [rows, vocab] float32 output (1.3 GB over the 20 buckets for a
152k vocabulary). The outputs of a replay are overwritten by the next replay: `replay` returns a
copy of the real rows (an activation may still be in flight to the next stage).
"""
from __future__ import annotations

import math

import torch

from engine.torch_exec.tensors.batch_inputs import BatchInputs

GRAPH_SIZES = (1, 2, 4, 8) + tuple(range(16, 257, 16))


def bucket(n: int, sizes: tuple[int, ...] = GRAPH_SIZES) -> int:
    """The smallest bucket holding n rows, 0 if none does."""
    return next((s for s in sorted(sizes) if s >= n), 0) if n > 0 else 0


def graph_width(max_position: int | None, block_size: int, num_blocks: int) -> int:
    """Block-table columns of the graphs: the longest context in blocks, at most the pool."""
    if not max_position:
        return num_blocks
    return min(num_blocks, math.ceil(max_position / block_size))


def graph_rows(hb, width: int, sizes: tuple[int, ...] = GRAPH_SIZES) -> int:
    """Rows of the bucket a host batch (inputs.HostBatch) replays, 0 when it must run eagerly:
    a prefill chunk in it, more sequences than the largest bucket, or a table wider than `width`."""
    if hb.num_prefills or hb.max_query_len != 1 or hb.block_tables.shape[1] > width:
        return 0
    return bucket(hb.num_seqs, sizes)


class GraphCapture:
    """The CUDA calls of capturing (apart, so that a CPU test can stand in for them), shared by the
    decode graphs here and the piecewise graphs (engine/torch_exec/graphs/piecewise.py): every graph
    of a runner is recorded into one memory pool."""

    model = None
    pool = None

    def _sync(self) -> None:
        torch.cuda.synchronize(self.model.device)

    def _warm_up(self, fn) -> None:
        """One eager run on a side stream: Triton compiles its kernels (and cuBLAS makes its
        handle) outside the capture."""
        dev = self.model.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(dev).wait_stream(side)

    def _record(self, fn):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out


class CudaGraphRunner(GraphCapture):
    """One captured forward per bucket size for a StageModel (engine/torch_exec/stage/model.py)."""

    def __init__(self, model, sizes: tuple[int, ...] = GRAPH_SIZES) -> None:
        self.model = model
        self.sizes = tuple(sorted(sizes))
        a = model.arch
        self.width = graph_width(getattr(a, "max_position_embeddings", None), model.block_size, model.num_blocks)
        B, dev, long = self.sizes[-1], model.device, torch.long
        self.token_ids = torch.zeros(B, dtype=long, device=dev)
        self.hidden = None if model.first else torch.zeros(B, a.hidden_size, dtype=model.dtype, device=dev)
        self.cos = torch.zeros(B, a.head_dim, dtype=torch.float32, device=dev)
        self.sin = torch.zeros(B, a.head_dim, dtype=torch.float32, device=dev)
        self.slots = torch.full((B,), -1, dtype=long, device=dev)
        self.context_lens = torch.zeros(B, dtype=long, device=dev)
        self.query_start = torch.arange(B + 1, dtype=long, device=dev)
        self.sample_rows = torch.arange(B, dtype=long, device=dev)
        self.block_tables = torch.zeros(B, self.width, dtype=long, device=dev)
        self.tile_seq = torch.arange(B, dtype=long, device=dev)  # one row tile per decode (inputs.pad_rows)
        self.tile_idx = torch.zeros(B, dtype=long, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0

    def rows_for(self, hb) -> int:
        rows = graph_rows(hb, self.width, self.sizes)
        return rows if rows in self.graphs else 0

    def static_batch(self, rows: int):
        """The static buffers' first `rows` rows as the model's BatchInputs (a decode-only batch)."""
        return BatchInputs(
            num_tokens=rows, token_ids=self.token_ids[:rows] if self.model.first else None,
            cos=self.cos[:rows], sin=self.sin[:rows], slots=self.slots[:rows], sample_rows=self.sample_rows[:rows],
            chunks=[],
            block_tables=self.block_tables[:rows], query_start=self.query_start[:rows + 1],
            context_lens=self.context_lens[:rows], max_query_len=1, tiles=(self.tile_seq[:rows], self.tile_idx[:rows]))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first (the buffers hold padding: nothing touches the pools)."""
        self._sync()
        for rows in reversed(self.sizes):
            b = self.static_batch(rows)
            hidden = None if self.hidden is None else self.hidden[:rows]
            fn = lambda b=b, hidden=hidden: self.model.forward_eager(b, hidden, head=False)  # noqa: E731
            self._warm_up(fn)
            self.graphs[rows] = self._record(fn)
        self._sync()

    def replay(self, b, hidden: torch.Tensor | None) -> torch.Tensor:
        """Run the padded decode-only batch `b` (its `graph_rows` rows, `num_tokens` of them real)."""
        graph, out = self.graphs[b.graph_rows]
        self.load(b, hidden)
        graph.replay()
        self.replays += 1
        return self._finish(out[:b.num_tokens])

    def run_eagerly(self, b, hidden: torch.Tensor | None) -> torch.Tensor:
        """What `replay` computes, through the same buffers but without a graph (CPU tests)."""
        self.load(b, hidden)
        rows = b.graph_rows
        out = self.model.forward_eager(self.static_batch(rows), None if self.hidden is None else self.hidden[:rows],
                                       head=False)
        return self._finish(out[:b.num_tokens])

    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.logits(x) if self.model.last else x.clone()

    def load(self, b, hidden: torch.Tensor | None) -> None:
        """Copy the padded batch into the static buffers (what a replay reads)."""
        rows, n = b.graph_rows, b.num_tokens
        if self.hidden is None:
            self.token_ids[:rows].copy_(b.token_ids)
        else:
            self.hidden[:n].copy_(hidden)
        self.cos[:rows].copy_(b.cos)
        self.sin[:rows].copy_(b.sin)
        self.slots[:rows].copy_(b.slots)
        self.context_lens[:rows].copy_(b.context_lens)
        self.block_tables[:rows, :b.block_tables.shape[1]].copy_(b.block_tables)
