"""One pipeline stage of a Llama/Qwen2 decoder in plain torch, over a paged KV cache.

A stage holds layers [first, first + n) (stage 0 also the embedding, the last stage the final
norm and lm_head) and, per layer, two pools `[num_blocks * block_size, kv_heads, head_dim]`
(K and V) indexed by the controller's block tables: token position p of a sequence lives in
slot `table[p // block_size] * block_size + p % block_size`. Every stage stores the same slots
for its own layers (engine/core/kv.py).

Numerics follow transformers' Llama/Qwen2 code (float32 RMSNorm, RoPE from float32 inverse
frequencies, SwiGLU) so greedy tokens match Hugging Face's `generate` token for token in
float32.

KV layout per layer: `[kv_heads, num_blocks, block_size, head_dim]`, so gathering a
sequence's blocks along dim 1 (`index_select`, one 2 KB-8 KB copy per block) yields, for a batch
of D decodes, a contiguous `[kv_heads * D, max_blocks * block_size, head_dim]` that batched
matmuls read without another copy. Gathering by block is 3-6x faster than gathering by slot
(measured on this 2-core machine: 64 decodes x 608 context, 2.8-5.8 ms against 7-18 ms per
layer) but reads whole blocks, including slots not written yet; blocks are therefore zeroed the
first time a table names them (the pools themselves are `torch.empty`, so CPU pages are
committed only as blocks are used), masked slots hold finite values, and a masked probability of
exactly 0 times them adds exactly 0.

Attention per micro-batch:
- prefill chunks one by one: the chunk's queries against its whole context, causal with the
  chunk's offset (query i sees keys <= start + i), through `scaled_dot_product_attention`
  (`enable_gqa=True`);
- decodes in groups of similar context (`decode_groups`; one group when their lengths are near):
  scores `[kv_heads, D, group, context]` by one `bmm`, padding masked, one softmax, one `bmm` with V.

That is the `torch` attention path (the default on CPU). The `triton` path (the default on CUDA,
`executor.attention`) makes one launch per layer for the whole micro-batch, reading K/V through
the block tables (engine/torch_exec/kernels/paged_attention.py), and one launch writing the new K/V; its
forward has no Python loop over sequences and no host synchronisation, so decode-only micro-batches
can be replayed from CUDA graphs (engine/torch_exec/graphs/cuda_graphs.py), and mixed and prefill ones
from piecewise graphs around their attentions (engine/torch_exec/graphs/piecewise.py: a layer is split
into `attention_in`, `attend` and `attention_out` for them). On CUDA it also runs fused Triton
kernels for the residual add + RMSNorm, RoPE with the K/V write, and SiLU x up
(engine/torch_exec/kernels/fused.py); the residual stream travels apart from each sub-layer's output so
the add happens inside the next norm. Both paths take their
indices from `host_batch` (engine/torch_exec/tensors/inputs.py: numpy, nothing per token), which cross to
the GPU in one copy from pinned memory.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.torch_exec.tensors.batch_inputs import BatchInputs, DecodeGroup
from engine.torch_exec.tensors.inputs import ARRAYS, HostBatch, host_batch, pack, packed_size, pad_rows
from engine.torch_exec.graphs.piecewise import pad_tokens
from engine.pricing.models import ModelSpec
from engine.torch_exec.weights.checkpoint import EMBED, LM_HEAD, NORM, stage_tensor_names, tensor_files
from engine.torch_exec.kernels import fused
from engine.torch_exec.kernels.fused import rms_norm, rope

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION = ("auto", "torch", "triton")
ROPE_TABLE = 32768  # positions with precomputed cos/sin (32 MB for head_dim 128); later ones are computed


def resolve_attention(name: str, device: torch.device) -> str:
    """`executor.attention` for this device: auto = triton on CUDA when triton imports, else torch.
    `triton` on CPU runs the kernels under Triton's interpreter (tests): TRITON_INTERPRET must be
    set before the kernels are defined, i.e. before paged_attention is first imported."""
    if name not in ATTENTION:
        raise ValueError(f"attention {name!r}: must be one of {', '.join(ATTENTION)}")
    if name == "auto":
        if device.type != "cuda":
            return "torch"
        from engine.torch_exec.kernels import paged_attention as pa

        return "triton" if pa.HAVE_TRITON else "torch"
    if name == "triton":
        if device.type == "cpu":
            if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError("executor.attention=triton on CPU runs Triton's interpreter, which must be "
                                   "chosen before triton is imported: set TRITON_INTERPRET=1 at start")
            os.environ["TRITON_INTERPRET"] = "1"
        from engine.torch_exec.kernels import paged_attention as pa

        if not pa.HAVE_TRITON:
            raise RuntimeError("executor.attention=triton, but triton does not import here")
        if device.type == "cpu" and not pa.interpreted():
            raise RuntimeError("executor.attention=triton on CPU: the kernels were compiled for a GPU in this "
                               "process (set TRITON_INTERPRET=1 before triton is first imported)")
    return name


PADDING_SLACK = 1.5  # a decode group's padded blocks stay within this many times its real blocks


def decode_groups(blocks: np.ndarray, slack: float = PADDING_SLACK) -> list[np.ndarray]:
    """The decodes (by their block counts) in groups attended together, longest first.

    The torch path pads a group's decodes to its longest: one ~1,000-token decode among 45 short
    ones made a step take 406 ms where the same step took 120 ms after it finished (a context sum
    only 16% smaller; tiny-llama on this project's 2-core machine). A group grows, in order of
    length, while its padded size stays within `slack` x its real size; each group costs a few
    small operations per layer, so near-equal decodes stay together."""
    order = np.argsort(-blocks, kind="stable")
    groups, start, total = [], 0, 0
    for i, seq in enumerate(order):
        if i > start and (i - start + 1) * blocks[order[start]] > slack * (total + blocks[seq]):
            groups.append(order[start:i])
            start, total = i, 0
        total += int(blocks[seq])
    if len(order):
        groups.append(order[start:])
    return groups


def inv_freq(arch: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies as transformers computes them (default, linear, llama3)."""
    d = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype=torch.float) / d))
    sc = arch.rope_scaling
    if sc is None:
        return inv
    if sc["rope_type"] == "linear":
        return inv / float(sc["factor"])
    # llama3
    factor = float(sc["factor"])
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old = float(sc["original_max_position_embeddings"])
    low_wl, high_wl = old / low, old / high
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, inv_l)


@dataclass
class Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    b_gate: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None


def head_layout(lm_head: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """The lm_head as the head's GEMM reads it fastest: on CPU the same values stored [hidden, vocab]
    (a transposed view of a column-major copy), elsewhere as given.

    Why: torch's CPU float32 GEMM with a row-major [vocab, hidden] weight takes a per-row path below
    4 rows, so the head cost more at 3 sampled rows than at 4: tiny-llama's (32,000 x 256) took
    1.67 / 3.13 / 4.76 / 2.87 ms at 1 / 2 / 3 / 4 rows, against 0.89 / 1.81 / 2.83 / 2.37 ms stored
    [hidden, vocab], and 0.94-1.0x at 64-512 rows (one thread, `chrt -f 10`, the shared 2-core AMD EPYC,
    2026-11-29; the layers' smaller GEMMs showed no difference). No price of a roofline follows a head
    that costs less at 4 rows than at 3: set 15's P=2 fit runs priced gllm's small mixed steps 0.3-0.8 ms
    low on the last stage (docs/measurements/real-runs-2026-11-29.md, "Set 16"). The copy is new
    memory: a tied head on a stage that is both first and last (P=1) keeps the embedding and this
    copy, vocab x hidden more floats (tiny-qwen2, tied, at P=1: +49 MB in float32); an untied head is replaced."""
    if lm_head is None or device.type != "cpu":
        return lm_head
    return lm_head.t().contiguous().t()


class StageModel:
    def __init__(self, arch: ModelSpec, first_layer: int, num_layers: int, first: bool, last: bool,
                 num_blocks: int, block_size: int, dtype: str = "float32", device: str = "cpu",
                 attention: str = "auto", fused: bool | None = None) -> None:
        self.arch = arch
        self.first_layer = first_layer
        self.num_layers = num_layers
        self.first = first
        self.last = last
        self.block_size = block_size
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device)
        self.scale = arch.head_dim ** -0.5
        self.inv_freq = inv_freq(arch).to(self.device)
        # cos/sin of positions up to the model's maximum (at most ROPE_TABLE), computed as
        # `_rope_rows` does; a micro-batch gathers its rows (2 ops instead of 5: the elementwise
        # ops took 0.18 ms of a 0.3 ms prepare for 640 rows of tiny-llama on CPU, measured)
        table = min(arch.max_position_embeddings or 0, ROPE_TABLE)
        self.rope_cos, self.rope_sin = self._rope_rows(torch.arange(table, device=self.device))
        self.layers: list[Layer] = []
        self.embed: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        self.attention = resolve_attention(attention, self.device)
        self.fused = self._resolve_fused(fused)
        # torch.empty: pages are committed only as blocks are used (CPU), see module docstring
        self.allocate_kv(num_blocks)

    def allocate_kv(self, num_blocks: int) -> None:
        """(Re)allocate the KV pools: a CUDA stage profiles with a small pool, then takes the size
        the driver derived from measured memory (engine/torch_exec/shared/kv_sizing.py). Before any CUDA
        graph is captured: graphs keep the addresses of the pools they were captured with."""
        self.k_cache = self.v_cache = []  # release the old pools before allocating the new
        self.num_blocks = num_blocks
        self.num_slots = num_blocks * self.block_size
        self._zeroed = np.zeros(num_blocks, dtype=bool)
        self.graphs = None  # captured by `configure(cuda_graphs=True)`, for these pools only
        self.pieces = None  # piecewise graphs of mixed and prefill batches (piecewise.py), also for these pools only
        shape = (self.arch.num_kv_heads, num_blocks, self.block_size, self.arch.head_dim)
        self.k_cache = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_cache = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def _resolve_fused(self, fused_kernels: bool | None) -> bool:
        """The fused Triton kernels (engine/torch_exec/kernels/fused.py): by default on CUDA with the Triton
        attention path; on CPU only when asked (tests: Triton's interpreter, which the triton
        attention path has selected)."""
        if fused_kernels is None:
            return self.device.type == "cuda" and self.attention == "triton"
        if fused_kernels and self.attention != "triton":
            raise ValueError("fused kernels need executor.attention=triton (Triton, or its interpreter on CPU)")
        return fused_kernels

    # --- weights ----------------------------------------------------------------------------------
    def load(self, path: str) -> None:
        """Read only this stage's tensors from the checkpoint's safetensors files."""
        from safetensors import safe_open

        files = tensor_files(path)
        names = stage_tensor_names(self.arch, self.first_layer, self.num_layers, self.first, self.last)
        # dst name -> checkpoint name; a tied lm_head reads the embedding
        want = {n: (EMBED if n == LM_HEAD and LM_HEAD not in files else n) for n in names}
        missing = sorted({src for src in want.values() if src not in files})
        if missing:
            raise KeyError(f"checkpoint {path!r} lacks tensor(s) {', '.join(missing[:3])}")
        by_file: dict[str, list[tuple[str, str]]] = {}
        for dst, src in want.items():
            by_file.setdefault(files[src], []).append((dst, src))
        got: dict[str, torch.Tensor] = {}
        for f, pairs in by_file.items():
            with safe_open(f, framework="pt", device="cpu") as fh:
                for dst, src in pairs:
                    got[dst] = fh.get_tensor(src).to(device=self.device, dtype=self.dtype)
        self.set_weights(got)

    def set_weights(self, got: dict[str, torch.Tensor]) -> None:
        """Install this stage's tensors by checkpoint name (from `load`, or built in memory by
        checkpoint.random_tensors), already on the device in the stage's dtype."""
        self.embed = got.get(EMBED)
        self.norm = got.get(NORM)
        self.lm_head = head_layout(got.get(LM_HEAD), self.device)
        for i in range(self.first_layer, self.first_layer + self.num_layers):
            p = f"model.layers.{i}."
            g = lambda n: got.get(p + n)  # noqa: E731
            self.layers.append(Layer(
                g("input_layernorm.weight"), g("post_attention_layernorm.weight"),
                g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"), g("self_attn.v_proj.weight"),
                g("self_attn.o_proj.weight"), g("mlp.gate_proj.weight"), g("mlp.up_proj.weight"),
                g("mlp.down_proj.weight"), g("self_attn.q_proj.bias"), g("self_attn.k_proj.bias"),
                g("self_attn.v_proj.bias"), g("mlp.gate_proj.bias"), g("mlp.up_proj.bias"), g("mlp.down_proj.bias")))

    # --- set-up -------------------------------------------------------------------------------------
    def configure(self, attention: str | None = None, cuda_graphs: bool = False, max_tokens: int = 0) -> None:
        """After `load`: the attention path (`executor.attention`) and, on CUDA with the Triton path,
        CUDA graphs, all captured now: one per decode-only bucket (engine/torch_exec/graphs/cuda_graphs.py)
        and the piecewise graphs of every token bucket up to `max_tokens` (the policy's token
        budget, `executor.profile_tokens`; 0: 8,192) plus 256 decode rows for mixed and prefill batches
        (engine/torch_exec/graphs/piecewise.py). Ignored elsewhere: the torch path's shapes depend on the
        batch's contexts."""
        if attention is not None:
            self.attention = resolve_attention(attention, self.device)
        self.graphs = self.pieces = None
        if cuda_graphs and self.device.type == "cuda" and self.attention == "triton":
            from engine.torch_exec.graphs.cuda_graphs import CudaGraphRunner
            from engine.torch_exec.graphs.piecewise import PiecewiseGraphs
            from engine.torch_exec.shared.kv_sizing import stage_sizes

            self.graphs = CudaGraphRunner(self)
            self.graphs.capture_all()
            self.pieces = PiecewiseGraphs(self, stage_sizes(max_tokens))
            self.pieces.capture_all()

    # --- inputs -------------------------------------------------------------------------------------
    def prepare(self, prefills, decodes) -> BatchInputs:
        """Tensors for one micro-batch from the driver's metadata.

        prefills: [(seq_id, start, n, samples, block_table, token_ids)]
        decodes:  [(seq_id, position, block_table, token_id)]
        Rows are the prefill chunks' tokens in order, then one row per decode; sampled rows are
        each sampling chunk's last row, then every decode row (`sampled_sequences()` order).
        The indices are built by numpy (inputs.py) and reach the device in one copy."""
        hb = host_batch(prefills, decodes, self.block_size, self.arch.num_heads // self.arch.num_kv_heads)
        num_tokens = hb.num_tokens
        rows = self.graphs.rows_for(hb) if self.graphs is not None else 0
        if rows:
            hb = pad_rows(hb, rows)
        elif self.pieces is not None and (tokens := self.pieces.rows_for(hb)):
            hb = pad_tokens(hb, tokens)  # token-level arrays only: the attention's indices stay the batch's
        t = self._to_device(hb)
        if len(hb.positions) and hb.positions.max() < len(self.rope_cos):
            cos, sin = self.rope_cos.index_select(0, t["positions"]), self.rope_sin.index_select(0, t["positions"])
        else:
            cos, sin = self._rope_rows(t["positions"])
        b = BatchInputs(num_tokens=num_tokens, token_ids=t["token_ids"] if self.first else None,
                        cos=cos, sin=sin, slots=t["slots"], sample_rows=t["sample_rows"],
                        chunks=[], graph_rows=rows)
        if self.attention == "triton":
            b.block_tables, b.query_start, b.context_lens = t["block_tables"], t["query_start"], t["context_lens"]
            b.max_query_len, b.tiles = hb.max_query_len, (t["tile_seq"], t["tile_idx"])
        else:
            self._torch_path_inputs(hb, b)
        return b

    def _rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos/sin [T, head_dim] float32 of `positions`, as transformers computes them."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _to_device(self, hb: HostBatch) -> dict[str, torch.Tensor]:
        """hb's arrays as tensors: views of numpy on CPU; on CUDA one pinned int64 buffer, copied
        once (non-blocking; the caching host allocator keeps the buffer until the copy is done)."""
        if self.device.type == "cpu":
            return {name: torch.from_numpy(getattr(hb, name)) for name in ARRAYS}
        host = torch.empty(packed_size(hb), dtype=torch.int64, pin_memory=True)
        _, layout = pack(hb, host.numpy())
        dev = host.to(self.device, non_blocking=True)
        return {name: dev[o:o + math.prod(shape)].view(shape) for name, (o, shape) in layout.items()}

    def _torch_path_inputs(self, hb: HostBatch, b: BatchInputs) -> None:
        """Per prefill chunk its blocks and causal mask (None from position 0), the decodes' blocks
        (padded with each one's first block) and context mask, and the blocks to zero first."""
        bs, dev = self.block_size, self.device
        P, qs, ctx = hb.num_prefills, hb.query_start, hb.context_lens
        nblocks = -(-ctx // bs)
        used = hb.block_tables[np.arange(hb.block_tables.shape[1])[None, :] < nblocks[:, None]]
        fresh = np.unique(used[~self._zeroed[used]])
        if len(fresh):
            self._zeroed[fresh] = True
            b.new_blocks = torch.from_numpy(fresh).to(dev)
        for i in range(P):
            r0, r1, c = int(qs[i]), int(qs[i + 1]), int(ctx[i])
            pos = torch.from_numpy(hb.positions[r0:r1])
            mask = None if c == r1 - r0 else (torch.arange(c)[None, :] <= pos[:, None]).to(dev)  # [n, ctx]
            b.chunks.append((r0, r1 - r0, c, torch.from_numpy(hb.block_tables[i, :nblocks[i]]).to(dev), mask))
        row0 = int(qs[P])
        for seqs in decode_groups(nblocks[P:]):
            maxb, rows = int(nblocks[P + seqs[0]]), seqs + row0
            blocks = np.ascontiguousarray(hb.block_tables[P + seqs, :maxb]).reshape(-1)
            grid, pos = torch.arange(maxb * bs), torch.from_numpy(ctx[P + seqs] - 1)
            b.decode_groups.append(DecodeGroup(torch.from_numpy(rows).to(dev), torch.from_numpy(blocks).to(dev),
                                               (grid[None, :] <= pos[:, None]).view(1, len(seqs), 1, -1).to(dev)))

    # --- forward ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, b: BatchInputs, hidden: torch.Tensor | None) -> torch.Tensor:
        """Stage 0 embeds `b.token_ids`; others take `hidden` [T, hidden]. Returns the hidden
        states for the next stage, or, on the last stage, the logits of the sampled rows (float32).
        A batch padded to a CUDA-graph bucket replays that graph; one padded to a token bucket
        replays its pieces with the attentions between them."""
        if b.graph_rows:
            return self.graphs.replay(b, hidden)
        if self.pieces is not None and self.pieces.covers(b):
            return self.pieces.run(b, hidden)
        return self.forward_eager(b, hidden)

    def forward_eager(self, b: BatchInputs, hidden: torch.Tensor | None, head: bool = True) -> torch.Tensor:
        """The forward itself (what a CUDA graph captures, with head=False: the last stage's logits
        are computed after the replay, so no bucket keeps a [rows, vocab] output alive): on the
        triton path it launches a fixed sequence of kernels whose shapes depend only on the row
        count, and never reads a device value back to the host. The residual stream travels apart
        from each sub-layer's output (`res`), so the fused path adds it inside the next norm."""
        self.zero_new_blocks(b)
        x, res = self.embed_input(b, hidden), None
        for li in range(self.num_layers):
            q, res = self.attention_in(li, x, res, b)
            x, res = self.attention_out(li, self.attend(li, q, b), res)
        x = x + res
        if not self.last or not head:
            return x
        return self.logits(x.index_select(0, b.sample_rows))

    # --- a layer in two halves around its attention (piecewise CUDA graphs capture each half) -------
    def zero_new_blocks(self, b: BatchInputs) -> None:
        if b.new_blocks is not None:
            for kc, vc in zip(self.k_cache, self.v_cache):
                kc.index_fill_(1, b.new_blocks, 0)
                vc.index_fill_(1, b.new_blocks, 0)

    def embed_input(self, b: BatchInputs, hidden: torch.Tensor | None) -> torch.Tensor:
        return F.embedding(b.token_ids, self.embed) if self.first else hidden

    def add_norm(self, x: torch.Tensor, res: torch.Tensor | None, w: torch.Tensor,
                 res_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + res) * w, x + res); res None: the stream starts at x. Fused: one kernel, the
        sum written over x (or res_out)."""
        eps = self.arch.rms_norm_eps
        if self.fused:
            return fused.add_rms_norm(x, res, w, eps, residual_out=res_out)
        res = x if res is None else x + res
        if res_out is not None:
            res = res_out.copy_(res)
        return rms_norm(res, w, eps), res

    def attention_in(self, li: int, x: torch.Tensor, res: torch.Tensor | None, b: BatchInputs,
                     q_out: torch.Tensor | None = None,
                     res_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer li up to its attention: residual add and input norm, q/k/v, RoPE, the new K/V in
        their slots. Returns (q [T, heads, head_dim], the residual stream)."""
        a, L = self.arch, self.layers[li]
        h, res = self.add_norm(x, res, L.ln1, res_out)
        T, kvh, d = h.shape[0], a.num_kv_heads, a.head_dim  # a CUDA-graph bucket's rows include its padding
        q = F.linear(h, L.wq, L.bq).view(T, a.num_heads, d)
        k = F.linear(h, L.wk, L.bk).view(T, kvh, d)
        v = F.linear(h, L.wv, L.bv).view(T, kvh, d)
        kc, vc = self.k_cache[li], self.v_cache[li]
        if self.fused:
            return fused.rope_write_kv(q, k, v, b.cos, b.sin, kc, vc, b.slots, q_out=q_out), res
        cos, sin = b.cos.to(self.dtype)[:, None, :], b.sin.to(self.dtype)[:, None, :]
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if self.attention == "triton":
            from engine.torch_exec.kernels import paged_attention as pa  # already imported by resolve_attention

            pa.write_kv(k, v, kc, vc, b.slots)
        else:
            kc.view(kvh, -1, d).index_copy_(1, b.slots, k.transpose(0, 1))
            vc.view(kvh, -1, d).index_copy_(1, b.slots, v.transpose(0, 1))
        return (q if q_out is None else q_out.copy_(q)), res

    def attend(self, li: int, q: torch.Tensor, b: BatchInputs, out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer li's attention over the pools (the K/V of this batch already written)."""
        kc, vc = self.k_cache[li], self.v_cache[li]
        if self.attention == "triton":
            from engine.torch_exec.kernels import paged_attention as pa

            return pa.paged_attention(q, kc, vc, b.block_tables, b.query_start, b.context_lens, self.scale,
                                      b.max_query_len, out=out, tiles=b.tiles)
        return self._attention(b, q, kc, vc)

    def attention_out(self, li: int, o: torch.Tensor, res: torch.Tensor,
                      res_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer li after its attention: o_proj, residual add and norm, the MLP. Returns (the MLP's
        output, the residual stream): the next layer's norm adds them."""
        a, L = self.arch, self.layers[li]
        x = F.linear(o.reshape(o.shape[0], a.num_heads * a.head_dim), L.wo)
        h, res = self.add_norm(x, res, L.ln2, res_out)
        gate, up = F.linear(h, L.w_gate, L.b_gate), F.linear(h, L.w_up, L.b_up)
        act = fused.silu_mul(gate, up) if self.fused else F.silu(gate) * up
        return F.linear(act, L.w_down, L.b_down), res

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's head: final norm and lm_head of the sampled rows, float32."""
        h = rms_norm(x, self.norm, self.arch.rms_norm_eps)
        return F.linear(h, self.lm_head).float()

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """[kvh, nb, bs, d] by block ids [B] -> [kvh, B * bs, d] (contiguous).

        On the 3-D view [kvh, nb, bs * d] index_select copies whole rows: 0.27 ms against 1.28 ms
        on the 4-D tensor for 416 blocks of tiny-llama (measured)."""
        kvh, nb, bs, d = cache.shape
        return cache.view(kvh, nb, bs * d).index_select(1, blocks).view(kvh, -1, d)

    def _attention(self, b: BatchInputs, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        a = self.arch
        kvh, d = a.num_kv_heads, a.head_dim
        out = torch.empty_like(q)
        for row0, n, ctx, blocks, mask in b.chunks:
            qc = q[row0:row0 + n].transpose(0, 1)[None]  # [1, H, n, d]
            kk = self._gather(kc, blocks)[None, :, :ctx]  # [1, kvh, ctx, d]
            vv = self._gather(vc, blocks)[None, :, :ctx]
            o = F.scaled_dot_product_attention(qc, kk, vv, attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale, enable_gqa=True)
            out[row0:row0 + n] = o[0].transpose(0, 1)
        g = a.num_heads // kvh
        for grp in b.decode_groups:
            D, M = len(grp.rows), grp.mask.shape[-1]
            qd = q.index_select(0, grp.rows).view(D, kvh, g, d).transpose(0, 1).reshape(kvh * D, g, d)
            kk = self._gather(kc, grp.blocks).view(kvh * D, M, d)
            vv = self._gather(vc, grp.blocks).view(kvh * D, M, d)
            s = torch.bmm(qd, kk.transpose(1, 2)).view(kvh, D, g, M) * self.scale
            s = s.masked_fill(~grp.mask, float("-inf")).softmax(dim=-1)
            o = torch.bmm(s.view(kvh * D, g, M), vv).view(kvh, D, g, d)
            out.index_copy_(0, grp.rows, o.permute(1, 0, 2, 3).reshape(D, a.num_heads, d))
        return out
