"""Operator-level GPU costs fitted to measured kernel times (docs/calibration.md#measured-kernels).

The roofline of engine/pricing/costmodel.py prices a layer with six hand-set efficiencies. Checked against
the published per-operator CUDA kernel times of the Vidur profiling tables (Agrawal et al., MLSys
2024; A100, H100, A40), it is optimistic and unevenly so: GEMMs just past a tile step cost up to
twice a smooth roofline, decode attention has a per-call floor of 10-20 us and reads KV at a rate
that falls with the query heads per KV head, and causal prefill attention runs at 0.1-0.25 of the
dense peak. This module prices each operator of one decoder layer with the terms those
measurements demand; each term's docstring (on `KernelCoefficients`, kernel_coefficients.py) names the residual it
removes. `testbed/calibrate/kernel_fit.py` fits the coefficients; `CostModel` uses them when the hardware
profile carries them (`HardwareSpec.kernels`).

Torch-free, plain float arithmetic: `CostModel` precomputes what depends only on the token count
into a table, so the simulator's hot path stays a lookup plus a few multiplications.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.base.errors import ConfigError
from engine.pricing import decode_blocks
from engine.pricing.decode_blocks import SPLIT_KV_FRACTION
from engine.pricing.prefill_blocks import BlockForm, makespan_s

from engine.pricing.kernel_coefficients import ELEMENTWISE, GEMMS, KernelCoefficients

__all__ = ["KernelCoefficients", "LayerShape", "LayerKernels", "GEMMS", "ELEMENTWISE"]


@dataclass(frozen=True)
class LayerShape:
    """The shape of one decoder layer on one GPU of a tensor-parallel group (what a table row or
    a `ModelSpec` describes). `gated_mlp`: gate and up projections multiplied (SwiGLU: the up GEMM
    is twice as wide and the activation reads two tensors), else one up projection and an
    activation of one tensor (phi-2's GELU MLP: pricing it as gated made its linear part 25-32%
    too slow)."""

    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int = 32000
    gated_mlp: bool = True
    tp: int = 1
    dtype_bytes: int = 2
    hidden_act: str = "silu"

    @property
    def q_heads_gpu(self) -> int:
        return self.q_heads // self.tp

    @property
    def kv_heads_gpu(self) -> int:
        return max(1, self.kv_heads // self.tp)

    @property
    def gqa(self) -> float:
        return self.q_heads / self.kv_heads

    def gemm_dims(self) -> dict[str, tuple[int, int]]:
        """(K, N) of each GEMM on one GPU: column-parallel QKV and gate+up, row-parallel O and down."""
        h, hd, tp = self.hidden, self.head_dim, self.tp
        up = (2 if self.gated_mlp else 1) * self.intermediate // tp
        return {"gemm_qkv": (h, (self.q_heads_gpu + 2 * self.kv_heads_gpu) * hd),
                "gemm_o": (self.q_heads_gpu * hd, h), "gemm_up": (h, up), "gemm_down": (self.intermediate // tp, h)}

    def elementwise_bytes(self) -> dict[str, float]:
        """Bytes per token moved by each elementwise op (read + write)."""
        h, db = self.hidden, self.dtype_bytes
        act_tensors = 3.0 if self.gated_mlp else 2.0  # gate and up read, product written; or one in, one out
        return {"norm": 2.0 * h * db, "rope": 2.0 * (self.q_heads_gpu + self.kv_heads_gpu) * self.head_dim * db,
                "act": act_tensors * (self.intermediate // self.tp) * db, "add": 3.0 * h * db, "emb": 2.0 * h * db}

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token, this GPU's KV heads."""
        return 2.0 * self.kv_heads_gpu * self.head_dim * self.dtype_bytes


# `SPLIT_KV_FRACTION`, FlashAttention-2's split-KV boundary for decode and prefill calls alike, is
# defined with its split count (engine/pricing/decode_blocks.py).

# The most tokens cuBLAS's small-M (weight-streaming) GEMM kernels take: every published table steps
# between 64 and 72 tokens (`KernelCoefficients.gemm_tile_memory_efficiency`).
GEMM_SMALL_TOKENS = 64


# How often each elementwise op runs per layer (two RMSNorms; the table's other ops once).
ELEMENTWISE_PER_LAYER = {"norm": 2, "rope": 1, "act": 1, "add": 1}


class LayerKernels:
    """Kernel times of one layer shape on one GPU with fitted coefficients.

    Token-count ops (GEMMs, elementwise) are numpy-vectorised: the fit evaluates ~100k table rows
    at once and `CostModel` tabulates them once per token count. Attention is scalar Python: the
    simulator calls it per micro-batch, where numpy's per-call overhead would dominate."""

    def __init__(self, shape: LayerShape, coefficients: KernelCoefficients, peak_flops: float, mem_bw_Bps: float,
                 sm_count: int | None) -> None:
        self.shape, self.c = shape, coefficients
        self.peak, self.bw = peak_flops, mem_bw_Bps
        self._dims = shape.gemm_dims()
        self._ew = shape.elementwise_bytes()
        # a non-gated activation (phi-2's GELU) is a flat elementwise kernel, not one block per token
        self._min_tokens = {op: getattr(coefficients, f"{op}_min_tokens") if op != "act" or shape.gated_mlp else 0.0
                            for op in self._ew}
        c = coefficients
        self._units_cap = (sm_count or 0) * c.decode_waves
        self._sms = sm_count or 0
        self._split_units = SPLIT_KV_FRACTION * self._sms
        self._split_count = bool(c.decode_split_count and self._sms)
        self._kv_tile = decode_blocks.kv_tile(shape.head_dim)  # KV tokens a key block (decode and prefill)
        self._dec_rate = mem_bw_Bps * c.decode_efficiency(shape.gqa)
        self._pre_flops_per_pair = 4.0 * shape.q_heads_gpu * shape.head_dim
        # one decode KV token: its read or its FLOPs, whichever is slower; one sequence's blocks
        self._dec_per_token = max(shape.kv_bytes_per_token / self._dec_rate,
                                  self._pre_flops_per_pair / (peak_flops * c.decode_compute_efficiency))
        self._dec_per_seq = shape.kv_heads_gpu * c.decode_block_s
        if c.prefill_slots_per_sm and not self._sms:
            raise ConfigError("kernels.prefill_slots_per_sm needs the hardware profile's sm_count")
        # seconds per tile-key (one block's query rows against one key) at one slot's FLOP share
        slot_flops = 4.0 * c.prefill_tile * shape.head_dim * self._sms * c.prefill_slots_per_sm / peak_flops
        self._tile_key_s = (slot_flops / c.prefill_efficiency, slot_flops / (c.prefill_prefix_efficiency or 1.0))
        self._block_form = BlockForm(c.prefill_tile, self._kv_tile, self._sms, c.prefill_slots_per_sm,
                                     *self._tile_key_s, c.prefill_tail, c.prefill_split_s)

    # ---- token-count ops (numpy arrays or scalars) ------------------------------------------
    def gemm_s(self, m, k: int, n: int):
        """max(floor + compute on the token count rounded up to the tile quantum (or on the output
        tiles' waves, `gemm_tile_n`), memory floor + weight and activation traffic at the small-M
        or the tiled kernel's streaming rate)."""
        import numpy as np

        c, db = self.c, self.shape.dtype_bytes
        q = c.gemm_token_quantum
        m = np.asarray(m, dtype=float)
        mq = np.ceil(m / q) * q
        tn, sms = c.gemm_tile_n, self._sms
        if tn and sms:  # M x N of the tiles' waves: whole ones for the tail's idle share
            waves = mq / q * -(-n // tn) / sms
            waves = waves + c.gemm_tail_wave * (np.ceil(waves) - waves)
            comp = 2.0 * waves * sms * q * tn * k / (self.peak * c.gemm_compute_efficiency)
        else:
            comp = 2.0 * mq * n * k / (self.peak * c.gemm_compute_efficiency)
        eff = c.gemm_memory_efficiency
        if c.gemm_tile_memory_efficiency:
            eff = np.where(m > GEMM_SMALL_TOKENS, c.gemm_tile_memory_efficiency, eff)
        mem = (k * n + m * (k + n)) * db / (self.bw * eff)
        return np.maximum(c.gemm_floor_s + comp, c.gemm_memory_floor_s + mem)

    def op_s(self, op: str, m):
        """A GEMM or an elementwise op (`GEMMS`, `ELEMENTWISE`, or `emb`) on `m` tokens."""
        import numpy as np

        if op in self._dims:
            k, n = self._dims[op]
            return self.gemm_s(m, k, n)
        m = np.maximum(np.asarray(m, dtype=float), self._min_tokens[op])
        return self.c.elementwise_floor_s + m * self._ew[op] / (self.bw * getattr(self.c, f"{op}_efficiency"))

    def token_part_s(self, m):
        """Everything in a layer that depends only on the token count: the four GEMMs and the
        elementwise ops (all-reduces are the link's, added by the cost model; the KV write is
        `kv_write_s`)."""
        total = sum(self.op_s(op, m) for op in GEMMS)
        return total + sum(n * self.op_s(op, m) for op, n in ELEMENTWISE_PER_LAYER.items())

    def kv_write_s(self, m):
        """Storing the K and V of `m` new tokens (prefill and decode alike) into the paged cache."""
        import numpy as np

        m = np.asarray(m, dtype=float)
        per_token = self.shape.kv_bytes_per_token / (self.bw * self.c.kv_write_efficiency)
        return np.where(m > 0, self.c.kv_write_floor_s + m * per_token, 0.0)

    # ---- attention (scalar) -------------------------------------------------------------------
    def decode_s(self, num_seqs: int, context_sum: int, kv_width: int = 0) -> float:
        """One decode-attention call over `num_seqs` sequences attending `context_sum` KV tokens.
        `kv_width`: the KV tokens the split heuristic sees (a block table padded to that width), 0 =
        the mean context (a table as wide as the batch needs, as the simulated engines pass)."""
        if not num_seqs:
            return 0.0
        kv = context_sum * self._dec_per_token
        blocks = units = num_seqs * self.shape.kv_heads_gpu
        split = units < self._split_units
        if split and self._split_count:  # FlashAttention-2's pieces of each (sequence, KV head)'s KV
            tiles = -(-kv_width // self._kv_tile) if kv_width else -(-context_sum // (num_seqs * self._kv_tile))
            pieces = decode_blocks.splits(units, self._sms, tiles)
            blocks, split = units * pieces, pieces > 1
        cap = self._units_cap
        if cap and blocks > cap:  # waves of `cap` blocks, each streaming its share of the KV
            kv *= decode_blocks.wave_factor(blocks, cap, self.c.decode_tail_recovery)
        kv *= 1.0 + self.c.decode_half_blocks / blocks
        per_block = num_seqs * self._dec_per_seq * (blocks // units)
        return self.c.decode_floor_s + kv + per_block + (self.c.decode_split_s if split else 0.0)

    def prefill_s(self, tokens: int, chunks: int, pairs: float, context_sum: int) -> float:
        """One prefill-attention call over `chunks` chunks of `tokens` new tokens in all, with
        `pairs` causal query-key pairs and `context_sum` KV tokens (prefixes + chunks): the FLOP
        term, or reading the KV at the decode kernel's rate when that takes longer (a short chunk
        after a long prefix)."""
        if not tokens:
            return 0.0
        compute = self.prefill_compute_s(tokens, chunks, pairs, context_sum)
        return self.c.prefill_floor_s + max(compute, self.prefill_kv_read_s(context_sum))

    def prefill_compute_s(self, tokens: int, chunks: int, pairs: float, context_sum: int) -> float:
        """The FLOP term of a prefill call."""
        c = self.c
        if c.prefill_slots_per_sm:
            return makespan_s(max(1, int(round(tokens / chunks))), (context_sum - tokens) / chunks,
                              self.shape.q_heads_gpu, chunks, self._block_form)
        fill = self.prefill_wave_fill(tokens, chunks)
        if not c.prefill_prefix_efficiency:
            keys = (context_sum - tokens / 2.0) / chunks  # the mean over chunks of L + x/2
            eff = c.prefill_efficiency * keys / (keys + c.prefill_half_keys)
            return self._pre_flops_per_pair * pairs / (self.peak * eff) / fill
        per_pair = self._pre_flops_per_pair / self.peak
        x = tokens / chunks  # chunks of equal size: the causal pairs' lower bound for unequal ones
        causal = min(pairs, chunks * x * (x + 1.0) / 2.0)
        keys = x / 2.0
        return per_pair * (causal * (keys + c.prefill_half_keys) / keys / c.prefill_efficiency / fill
                           + (pairs - causal) / c.prefill_prefix_efficiency)

    def prefill_wave_fill(self, tokens: int, chunks: int) -> float:
        """Fraction of the SMs' block slots a prefill call fills over its waves (1 without the
        term): blocks = query heads x tiles, tiles ~ ceil(tokens / tile) + chunks - 1."""
        tile, sms = self.c.prefill_tile, self._sms
        if not tile or not sms:
            return 1.0
        blocks = self.shape.q_heads_gpu * (-(-tokens // tile) + chunks - 1)
        return blocks / (-(-blocks // sms) * sms)

    def prefill_kv_read_s(self, context_sum: int) -> float:
        """Reading `context_sum` tokens of KV (a prefill call's prefixes and chunks) once."""
        return context_sum * self.shape.kv_bytes_per_token / self._dec_rate


class KernelPricer:
    """`CostModel`'s per-layer and per-stage pricing when the hardware profile has fitted kernels.

    What depends only on the token count (the GEMMs, elementwise ops and the tensor-parallel
    all-reduces) is tabulated once per token count, so a micro-batch costs one list lookup, the two
    attention calls and a few multiplications: the same order of work as the roofline.
    """

    def __init__(self, kernels: LayerKernels, allreduce_s_per_token: float, allreduce_fixed_s: float,
                 lm_head_dims: tuple[int, int], lm_gather_s_per_row: float, lm_gather_fixed_s: float) -> None:
        self.k = kernels
        self._ar_tok, self._ar_fix = allreduce_s_per_token, allreduce_fixed_s
        self._lm_dims = lm_head_dims
        self._lm_gather = (lm_gather_s_per_row, lm_gather_fixed_s)
        self._tok: list[float] = [0.0]  # token part + all-reduces, by token count
        self._emb: list[float] = [0.0]
        self._lm: dict[int, float] = {}
        c, sh = kernels.c, kernels.shape
        self._dec_per_token, self._dec_per_seq = kernels._dec_per_token, kernels._dec_per_seq
        self._kv_per_token = sh.kv_bytes_per_token / kernels._dec_rate  # a prefill call's KV read
        self._cap, self._kv_heads, self._dec_floor = kernels._units_cap, sh.kv_heads_gpu, c.decode_floor_s
        self._dec_half, self._dec_tail = c.decode_half_blocks, c.decode_tail_recovery
        self._split_units, self._dec_split = kernels._split_units, c.decode_split_s
        self._split_count, self._sms, self._kv_tile = kernels._split_count, kernels._sms, kernels._kv_tile
        self._pre_floor, self._pre_half, self._pre_tile = c.prefill_floor_s, c.prefill_half_keys, c.prefill_tile
        self._pre_per_pair = kernels._pre_flops_per_pair / (kernels.peak * c.prefill_efficiency)
        self._pre_split = bool(c.prefill_prefix_efficiency)

    def _extend(self, m: int) -> None:
        import numpy as np

        start, stop = len(self._tok), max(m + 1, 2 * len(self._tok))
        ms = np.arange(start, stop, dtype=float)
        part = self.k.token_part_s(ms) + self.k.kv_write_s(ms) + (ms * self._ar_tok + self._ar_fix if self._ar_tok else 0.0)
        self._tok += [float(v) for v in part]
        self._emb += [float(v) for v in self.k.op_s("emb", ms)]

    def token_s(self, m: int) -> float:
        if m >= len(self._tok):
            self._extend(m)
        return self._tok[m]

    def layer_s(self, shape, tokens: int) -> float:
        """One layer's time for a `BatchShape` with `tokens` > 0 (decodes and prefill chunks are
        separate attention calls, as in the serving engines the tables were measured on; the KV
        write of every new token is in the token table). The
        attention terms are `LayerKernels.decode_s` / `prefill_s` inlined on precomputed constants
        (1.9 -> 1.5 us a micro-batch, shared 2-core machine); a test checks they agree."""
        tok = self._tok
        if tokens >= len(tok):
            self._extend(tokens)
            tok = self._tok
        layer = tok[tokens]
        n_dec = shape.num_decode_seqs
        if n_dec:
            ctx = shape.decode_context_sum
            kv = ctx * self._dec_per_token
            blocks = units = n_dec * self._kv_heads
            split = units < self._split_units
            if split and self._split_count:
                pieces = decode_blocks.splits(units, self._sms, -(-ctx // (n_dec * self._kv_tile)))
                blocks, split = units * pieces, pieces > 1
            cap = self._cap
            if cap and blocks > cap:
                kv *= decode_blocks.wave_factor(blocks, cap, self._dec_tail)
            layer += self._dec_floor + kv * (1.0 + self._dec_half / blocks) + n_dec * self._dec_per_seq * (blocks // units)
            if split:
                layer += self._dec_split
        n_pre = tokens - n_dec
        if n_pre:
            ctx = shape.prefill_context_sum
            if self._pre_split:
                comp = self.k.prefill_compute_s(n_pre, shape.num_seqs - n_dec, shape.prefill_attention_pairs, ctx)
            else:
                keys = (ctx - 0.5 * n_pre) / (shape.num_seqs - n_dec)
                comp = self._pre_per_pair * shape.prefill_attention_pairs * (keys + self._pre_half) / keys
                if self._pre_tile:
                    comp /= self.k.prefill_wave_fill(n_pre, shape.num_seqs - n_dec)
            kv = ctx * self._kv_per_token
            layer += self._pre_floor + (comp if comp > kv else kv)
        return layer

    def lm_head_s(self, rows: int) -> float:
        t = self._lm.get(rows)
        if t is None:
            k, n = self._lm_dims
            per_row, fixed = self._lm_gather
            t = self._lm[rows] = float(self.k.gemm_s(rows, k, n)) + rows * per_row + fixed
        return t

    def stage_totals(self, stages: tuple, layer: float, tokens: int, shape) -> tuple[float, ...]:
        """`stage_total` of every stage's constants in one call: the same operations in the same
        order, without a call per stage (`CostModel.stage_compute_all_s`, once per micro-batch)."""
        if tokens >= len(self._emb):
            self._extend(tokens)
        emb = self._emb[tokens]
        rows = shape.num_sampled
        out = []
        for n, fixed, first, last in stages:
            total = n * layer + fixed
            if first:
                total += emb
            if last and rows:
                total += self.lm_head_s(rows)
            out.append(total)
        return tuple(out)

    def stage_total(self, consts: tuple, layer: float, tokens: int, shape) -> float:
        """A stage's time: its layers, fixed cost, the embedding gather on the first stage and the
        lm_head GEMM (sampled rows only) on the last."""
        n, fixed, first, last = consts
        total = n * layer + fixed
        if first:
            if tokens >= len(self._emb):
                self._extend(tokens)
            total += self._emb[tokens]
        if last and shape.num_sampled:
            total += self.lm_head_s(shape.num_sampled)
        return total
