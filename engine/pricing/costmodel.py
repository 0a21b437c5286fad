"""Analytical cost model: predicted time of one micro-batch on one pipeline stage.

Roofline per operator group, for the layers a stage holds (docs/calibration.md):
- linear layers (q/k/v/o + SwiGLU MLP) by token count: FLOPs = 2 * tokens * linear params per
  layer; bytes = the layer's weights + activation traffic; time = max(compute, memory).
- attention by context: FLOPs = 4 * heads * head_dim * query-key pairs (QK^T and PV); bytes = the
  KV read (+ q/o and the new K/V written). Prefill chunks and decodes are separate kernels, each its
  own max(compute, memory). A prefill chunk of x tokens after a prefix of L therefore costs
  c + g*L + b*x + a*(2*L*x + x^2) (docs/calibration.md): later chunks of a long prompt cost more.
- the embedding on the first stage (a gather, memory only) and the lm_head on the last stage for
  the `num_sampled` rows only (vLLM computes logits only where a token is sampled).
- tensor parallelism divides compute and weights by tp and adds 2 ring all-reduces per layer.
- fixed CPU/launch overheads: `stage_overhead_s` + `per_layer_overhead_s` * layers.
- GPU terms (docs/calibration.md#gpu-terms), neutral by default: KV reads at their own
  `kv_read_efficiency`; GEMM efficiency rising with M (`linear_half_tokens`); attention efficiency
  rising with context (`attention_half_context`); a decode-only step's fixed overhead scaled by
  `decode_overhead_ratio` (a CUDA-graph replay instead of eager launches).
- engine terms (docs/calibration.md#engine-terms), neutral by default: an eager step's launch
  floor, the driver's dispatch of a micro-batch to stage 0 and the ids' return (`dispatch_s`,
  `return_s`, which the simulator places on the critical path).
Sampling, CPU input preparation and transfers are separate methods because the simulator places
them on different resources (SiPipe moves sampling to CPUs and overlaps input preparation).

Hot path: `stage_compute_s` is called per micro-batch per stage (~1e5 times a run); it is plain
float arithmetic on constants precomputed in the constructor (about 1 us a call, see the test).

All times are seconds, sizes bytes, bandwidths bytes per second.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from engine.pricing.cost_coefficients import CostCoefficients
from engine.base.errors import ConfigError, ImpossibleFitError
from engine.pricing.hardware import HardwareSpec
from engine.pricing.batch_shape import BatchShape
from engine.pricing.launch_floor import use_launch_floor
from engine.pricing.layer_balance import split_layers
from engine.pricing.small_m import use_gemv_rows
from engine.pricing.models import ModelSpec
from engine.pricing.cpu_sampling_paths import path_delta_s
from engine.pricing.sampling_ops import REFERENCE, SamplerSettings, kernels_s

__all__ = ["split_layers", "CostCoefficients", "BatchShape", "CostModel"]

GIB = float(2**30)


class CostModel:
    """Per-stage time predictions for `model` split into `pp` stages of `tp` GPUs on `hardware`.

    Construction validates the parallel layout (pp >= 1, tp >= 1, pp <= layers, tp compatible with
    the head counts) but not the memory fit: `kv_capacity_tokens` raises `ImpossibleFitError`.
    `dtype_bytes=None` takes the model's own element size.
    """

    def __init__(
        self,
        model: ModelSpec,
        hardware: HardwareSpec,
        pp: int,
        tp: int = 1,
        layer_split: Sequence[int] | str | None = None,
        coefficients: CostCoefficients | None = None,
        dtype_bytes: int | None = None,
    ) -> None:
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"invalid parallel.tp={tp!r}: must be an integer >= 1")
        if model.num_heads % tp:
            raise ConfigError(
                f"invalid parallel.tp={tp}: must divide the {model.num_heads} attention heads of {model.name}"
            )
        if model.num_kv_heads % tp and tp % model.num_kv_heads:
            raise ConfigError(
                f"invalid parallel.tp={tp}: must divide, or be a multiple of, the {model.num_kv_heads} "
                f"KV heads of {model.name}"
            )
        if dtype_bytes is None:
            dtype_bytes = model.dtype_bytes
        if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes < 1:
            raise ConfigError(f"invalid dtype_bytes={dtype_bytes!r}: must be a positive integer")
        self.model = model
        self.hardware = hardware
        self.pp = pp
        self.tp = tp
        if isinstance(layer_split, str):  # `balanced` (engine/pricing/layer_balance.py)
            from engine.pricing.layer_balance import REFERENCE_DECODE, balanced_split, check_name

            check_name(layer_split)
            even = split_layers(model.num_layers, pp)
            layer_split = balanced_split(lambda split: CostModel(model, hardware, pp, tp, split, coefficients,
                                                                 dtype_bytes), even,
                                         (BatchShape.decode(*REFERENCE_DECODE),))
        self.layers: tuple[int, ...] = split_layers(model.num_layers, pp, layer_split)
        self.coefficients = c = coefficients if coefficients is not None else CostCoefficients()
        self.dtype_bytes = db = dtype_bytes

        h, hd, vocab = model.hidden_size, model.head_dim, model.vocab_size
        heads_gpu = model.num_heads // tp
        kv_heads_gpu = max(1, model.num_kv_heads // tp)  # replicated when tp > num_kv_heads
        lin_rate = hardware.peak_flops * c.linear_efficiency
        attn_rate = hardware.peak_flops * c.attention_efficiency
        mem_rate = hardware.mem_bw_Bps * c.memory_efficiency
        ar_bw = hardware.allreduce_bw_Bps
        ring = 2.0 * (tp - 1) / tp  # bytes on the wire per byte reduced, ring all-reduce

        # Per layer, per GPU. Seconds per token / per pair / fixed.
        lin_params = model.linear_params_per_layer / tp
        self.kv_bytes_per_token_per_layer_gpu = 2 * kv_heads_gpu * hd * db
        act_bytes_per_token = db * (
            10 * h  # norms, residual adds, GEMM inputs of hidden width (replicated under tp)
            + (2 * model.q_size + 2 * model.kv_size + (3 if model.gated_mlp else 2) * model.intermediate_size) / tp
        )
        self._lin_c = 2.0 * lin_params / lin_rate
        self._lin_w = (lin_params + model.norm_params_per_layer) * db / mem_rate
        self._lin_a = act_bytes_per_token / mem_rate
        self._attn_c = 4.0 * heads_gpu * hd / attn_rate
        kv_rate = hardware.mem_bw_Bps * c.kv_read_efficiency if c.kv_read_efficiency else mem_rate
        self._kv_r = self.kv_bytes_per_token_per_layer_gpu / kv_rate
        # GPU terms (neutral at their defaults: + 0.0 and no branch taken).
        self._m_half = float(c.linear_half_tokens)  # GEMM compute ~ (M + m_half)
        self._attn_half = float(c.attention_half_context)  # attention time x (1 + half / context)
        self._pad = float(c.decode_padding)  # decodes read this much of their padding to the longest
        self._qo = (2 * heads_gpu * hd * db + self.kv_bytes_per_token_per_layer_gpu) / mem_rate
        if tp > 1:  # two all-reduces of [tokens, hidden] per layer (after attention and MLP)
            self._ar_tok = 2.0 * ring * h * db / ar_bw
            self._ar_fix = 2.0 * 2 * (tp - 1) * hardware.p2p_latency_s
        else:
            self._ar_tok = self._ar_fix = 0.0

        # Per stage: (layers, fixed s, embedding s/token, lm_head s/row compute, lm_head weight
        # read s, lm_head s/row memory, logits gather s/row, logits gather fixed s, GEMM M offset).
        consts = []
        decode_fixed = []  # the fixed part of a decode-only step (CUDA-graph replay)
        for s, n in enumerate(self.layers):
            fixed = c.stage_overhead_s + c.per_layer_overhead_s * n
            decode_fixed.append(fixed * c.decode_overhead_ratio - fixed)
            emb = 0.0
            if s == 0:
                emb = 2.0 * h * db / mem_rate  # gather: read a row, write it
                if tp > 1:  # vocab-parallel embedding ends with an all-reduce
                    emb += ring * h * db / ar_bw
                    fixed += 2 * (tp - 1) * hardware.p2p_latency_s
            lm_c = lm_w = lm_r = lm_g = lm_gf = 0.0
            if s == pp - 1:
                lm_c = 2.0 * h * vocab / tp / lin_rate
                lm_w = (vocab * h / tp + h) * db / mem_rate  # + the final norm
                lm_r = (h * db + vocab / tp * 4) / mem_rate  # read hidden, write fp32 logits
                if tp > 1:  # logits gathered to rank 0
                    lm_g = (tp - 1) / tp * vocab * db / ar_bw
                    lm_gf = (tp - 1) * hardware.p2p_latency_s
            consts.append((n, fixed, emb, lm_c, lm_w, lm_r, lm_g, lm_gf, self._m_half))
        self._stage_consts: tuple[tuple, ...] = tuple(consts)
        if self._m_half or self._attn_half or self._pad:
            self._layer_s = self._layer_s_terms  # type: ignore[method-assign]
        # Decode-only steps use these; the same tuple unless decode_overhead_ratio != 1.
        self._decode_consts: tuple[tuple, ...] = self._stage_consts
        if c.decode_overhead_ratio != 1.0:
            self._decode_consts = tuple((k[0], k[1] + d) + k[2:] for k, d in zip(consts, decode_fixed))
        self._vocab = vocab
        self._act_bytes_per_token = c.activation_copies * h * db
        self.kernels = None  # a KernelPricer when the hardware profile has fitted kernels
        if hardware.kernels is not None:
            self._use_kernels(consts, decode_fixed)
        if c.gemv_rows:  # a CPU BLAS's few-row GEMMs (engine/pricing/small_m.py)
            use_gemv_rows(self, int(c.gemv_rows))
        if c.launch_floor_per_layer_s or c.launch_floor_per_seq_s:
            use_launch_floor(self, c.launch_floor_per_layer_s, c.launch_floor_per_seq_s, c.launch_overlap_exponent)
        if c.decode_batch_factors:  # a measured decode price by batch size (engine/pricing/decode_batch.py)
            from engine.pricing.decode_batch import use_decode_batch_factors

            use_decode_batch_factors(self, c.decode_batch_factors)
        if c.mixed_row_extra_s:  # a measured mixed-step price by sampled rows (engine/pricing/mixed_rows.py)
            from engine.pricing.mixed_rows import use_mixed_row_extra

            use_mixed_row_extra(self, c.mixed_row_extra_s)

    def _use_kernels(self, consts: list[tuple], decode_fixed: list[float]) -> None:
        """Price operators with the hardware profile's fitted kernels (engine/pricing/kernels.py) instead of
        the roofline; the stage layout, fixed overheads, sampling, CPU and transfer costs are as above."""
        from engine.pricing.kernels import KernelCoefficients, KernelPricer, LayerKernels, LayerShape

        m, hw, tp, db, pp = self.model, self.hardware, self.tp, self.dtype_bytes, self.pp
        shape = LayerShape(hidden=m.hidden_size, q_heads=m.num_heads, kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                           intermediate=m.intermediate_size, vocab=m.vocab_size, gated_mlp=m.gated_mlp, tp=tp,
                           dtype_bytes=db, hidden_act=m.hidden_act)
        kernels = LayerKernels(shape, KernelCoefficients.from_mapping(hw.kernels), hw.peak_flops, hw.mem_bw_Bps,
                               hw.sm_count)
        ar_lat = hw.p2p_latency_s if hw.allreduce_latency_s is None else hw.allreduce_latency_s
        ar_tok = ar_fix = gather_row = gather_fix = 0.0
        if tp > 1:  # two ring all-reduces of [tokens, hidden] per layer; logits gathered to rank 0
            ar_tok = 2.0 * 2.0 * (tp - 1) / tp * m.hidden_size * db / hw.allreduce_bw_Bps
            ar_fix = 2.0 * 2 * (tp - 1) * ar_lat
            gather_row = (tp - 1) / tp * m.vocab_size * db / hw.allreduce_bw_Bps
            gather_fix = (tp - 1) * ar_lat
        pricer = KernelPricer(kernels, ar_tok, ar_fix, (m.hidden_size, m.vocab_size // tp), gather_row, gather_fix)
        self.kernels = pricer
        self._layer_s = pricer.layer_s  # type: ignore[method-assign]
        self._stage_total = pricer.stage_total  # type: ignore[method-assign]
        stages = [(k[0], k[1], s == 0, s == pp - 1) for s, k in enumerate(consts)]
        self._stage_consts = tuple(stages)
        self._decode_consts = tuple((k[0], k[1] + d, *k[2:]) for k, d in zip(stages, decode_fixed)) \
            if self.coefficients.decode_overhead_ratio != 1.0 else self._stage_consts

    def __repr__(self) -> str:
        return (
            f"CostModel(model={self.model.name!r}, hardware={self.hardware.name!r}, pp={self.pp}, "
            f"tp={self.tp}, layers={self.layers})"
        )

    # ---- compute --------------------------------------------------------------------------
    def stage_compute_s(self, stage: int, shape: BatchShape) -> float:
        """GPU time of `shape` on `stage` (0-based; a negative index counts from the end), without
        sampling. An empty micro-batch costs 0."""
        tokens = shape.num_prefill_tokens + shape.num_decode_seqs
        if not tokens:
            return 0.0
        consts = self._stage_consts if shape.num_prefill_tokens else self._decode_consts
        return self._stage_total(consts[stage], self._layer_s(shape, tokens), tokens, shape)

    def stage_compute_all_s(self, shape: BatchShape) -> tuple[float, ...]:
        """`stage_compute_s` of every stage (the same floats): the per-layer time is priced once
        instead of once per stage, 1.0 us of CPU per micro-batch instead of 1.8 us at P=4
        (micro-benchmark, shared 2-core machine)."""
        tokens = shape.num_prefill_tokens + shape.num_decode_seqs
        if not tokens:
            return (0.0,) * self.pp
        layer = self._layer_s(shape, tokens)
        stages = self._stage_consts if shape.num_prefill_tokens else self._decode_consts
        if self.kernels is not None:  # every stage in one call (the same floats): 4 calls fewer at P=4
            return self.kernels.stage_totals(stages, layer, tokens, shape)
        total = self._stage_total
        return tuple([total(consts, layer, tokens, shape) for consts in stages])

    def _layer_s(self, shape: BatchShape, tokens: int) -> float:
        """One decoder layer's time for `shape` (`tokens` > 0), all-reduces included. The classic
        model; `_layer_s_terms` replaces it per instance when a GEMM-by-M or attention-by-context
        term is set (two variants rather than branches: 0.63 -> 0.69 us a call with the branches,
        micro-benchmark on the shared 2-core machine)."""
        n_pre = shape.num_prefill_tokens
        n_dec = shape.num_decode_seqs
        # Linear layers.
        comp = tokens * self._lin_c
        mem = self._lin_w + tokens * self._lin_a
        layer = comp if comp > mem else mem
        # Attention: prefill chunks and decodes as separate kernels.
        if n_pre:
            comp = shape.prefill_attention_pairs * self._attn_c
            mem = shape.prefill_context_sum * self._kv_r + n_pre * self._qo
            layer += comp if comp > mem else mem
        if n_dec:
            ctx = shape.decode_context_sum
            comp = ctx * self._attn_c
            mem = ctx * self._kv_r + n_dec * self._qo
            layer += comp if comp > mem else mem
        if self._ar_tok:
            layer += tokens * self._ar_tok + self._ar_fix
        return layer

    def _layer_s_terms(self, shape: BatchShape, tokens: int) -> float:
        """`_layer_s` with GEMM efficiency M / (M + m_half) (compute ~ M + m_half) and attention
        time x (1 + half / mean context)."""
        n_pre = shape.num_prefill_tokens
        n_dec = shape.num_decode_seqs
        comp = (tokens + self._m_half) * self._lin_c
        mem = self._lin_w + tokens * self._lin_a
        layer = comp if comp > mem else mem
        half = self._attn_half
        if n_pre:
            comp = shape.prefill_attention_pairs * self._attn_c
            mem = shape.prefill_context_sum * self._kv_r + n_pre * self._qo
            attn = comp if comp > mem else mem
            if half:  # by the mean context of a chunk
                attn *= 1.0 + half * (shape.num_seqs - n_dec) / shape.prefill_context_sum
            layer += attn
        if n_dec:
            ctx = self._decode_kv_tokens(shape)
            comp = ctx * self._attn_c
            mem = ctx * self._kv_r + n_dec * self._qo
            attn = comp if comp > mem else mem
            if half:  # by the mean context of a decode
                attn *= 1.0 + half * n_dec / ctx
            layer += attn
        if self._ar_tok:
            layer += tokens * self._ar_tok + self._ar_fix
        return layer

    def _decode_kv_tokens(self, shape: BatchShape) -> float:
        """KV tokens the decodes' attention reads: their contexts, plus `decode_padding` of the
        padding to the longest decode (a shape without its longest decode has none)."""
        ctx = shape.decode_context_sum
        if self._pad and shape.decode_context_max:
            ctx += self._pad * (shape.num_decode_seqs * shape.decode_context_max - ctx)
        return ctx

    def layer_parts_s(self, shape: BatchShape) -> tuple[float, float, float, float, float]:
        """One layer's (linear part, tensor-parallel all-reduces, decode attention, prefill
        attention, KV write) for `shape`: the operator families `testbed calibrate tables` compares
        with measured kernels, summing to what the simulation prices. The linear part holds the
        GEMMs and the elementwise ops; the roofline counts the KV write in its attention bytes (0 here)."""
        tokens = shape.num_tokens
        allreduce = tokens * self._ar_tok + self._ar_fix if self._ar_tok else 0.0
        if self.kernels is not None:
            p, k = self.kernels, self.kernels.k
            dec = k.decode_s(shape.num_decode_seqs, shape.decode_context_sum)
            pre = k.prefill_s(shape.num_prefill_tokens, shape.num_seqs - shape.num_decode_seqs,
                              shape.prefill_attention_pairs, shape.prefill_context_sum)
            allreduce = tokens * p._ar_tok + p._ar_fix if p._ar_tok else 0.0  # allreduce_latency_s, as simulated
            return float(k.token_part_s(tokens)), allreduce, dec, pre, float(k.kv_write_s(tokens))
        linear = max((tokens + self._m_half) * self._lin_c, self._lin_w + tokens * self._lin_a)
        dec = pre = 0.0
        if shape.num_decode_seqs:
            ctx = self._decode_kv_tokens(shape)
            dec = max(ctx * self._attn_c, ctx * self._kv_r + shape.num_decode_seqs * self._qo)
        if shape.num_prefill_tokens:
            pre = max(shape.prefill_attention_pairs * self._attn_c,
                      shape.prefill_context_sum * self._kv_r + shape.num_prefill_tokens * self._qo)
        return linear, allreduce, dec, pre, 0.0

    @staticmethod
    def _stage_total(consts: tuple, layer: float, tokens: int, shape: BatchShape) -> float:
        """A stage's time from the per-layer time: its layers, fixed costs, embedding, LM head."""
        n, fixed, emb, lm_c, lm_w, lm_r, lm_g, lm_gf, m_half = consts
        total = n * layer + fixed
        if emb:
            total += tokens * emb
        if lm_w:
            rows = shape.num_sampled
            if rows:
                comp = (rows + m_half) * lm_c
                mem = lm_w + rows * lm_r
                total += (comp if comp > mem else mem) + rows * lm_g + lm_gf
        return total

    def stage_times_s(self, shape: BatchShape, include_sampling: bool = True) -> tuple[float, ...]:
        """`stage_compute_s` of every stage, GPU sampling added to the last one if asked."""
        times = [self.stage_compute_s(s, shape) for s in range(self.pp)]
        if include_sampling:
            times[-1] += self.sample_s(shape)
        return tuple(times)

    def bottleneck_s(self, shape: BatchShape, include_sampling: bool = True) -> float:
        """The slowest stage's time for `shape`: the steady-state pipeline period."""
        return max(self.stage_times_s(shape, include_sampling))

    def decode_step_s(self, batch_size: int, context_len: int) -> float:
        """Bottleneck stage time of a decode micro-batch of `batch_size` sequences each attending
        `context_len` tokens, GPU sampling included (TD-Pipe's T(b))."""
        return self.bottleneck_s(BatchShape.decode(batch_size, context_len))

    def prefill_s(self, tokens: int, num_seqs: int = 1) -> float:
        """Bottleneck stage time of prefilling `tokens` prompt tokens split evenly over `num_seqs`
        whole prompts (no prefix), each sampling its first token."""
        if tokens < 1 or not 1 <= num_seqs <= tokens:
            raise ValueError(f"bad prefill: tokens={tokens}, num_seqs={num_seqs}")
        base, extra = divmod(tokens, num_seqs)
        parts = [(0, base + (1 if i < extra else 0), True) for i in range(num_seqs)]
        return self.bottleneck_s(BatchShape.from_parts(parts))

    # ---- sampling and CPU work ------------------------------------------------------------
    def sample_s(self, shape: BatchShape, sampling: SamplerSettings | None = None) -> float:
        """GPU sampling on the last stage (0 when nothing samples): the host tables' fit, which
        measured temperature-1 random sampling, + what `sampling`'s kernels cost more or less
        than that path's (engine/pricing/sampling_ops.py; None or the reference: the fit alone)."""
        rows = shape.num_sampled
        if not rows:
            return 0.0
        c = self.coefficients
        t = c.sample_fixed_s + c.sample_per_token_vocab_s * rows * self._vocab
        if sampling is None or sampling == REFERENCE:
            return t
        return max(0.0, t + self._sampling_kernels_s(sampling, rows) - self._sampling_kernels_s(REFERENCE, rows))

    def _sampling_kernels_s(self, sampling: SamplerSettings, rows: int) -> float:
        """vLLM's sampler kernels for `sampling` at the device's measured element-wise rates."""
        from engine.pricing.kernels import KernelCoefficients

        k = KernelCoefficients.from_mapping(self.hardware.kernels) if self.hardware.kernels else KernelCoefficients()
        return kernels_s(sampling, rows, self._vocab, self.dtype_bytes, self.hardware.mem_bw_Bps,
                         k.add_efficiency, k.norm_efficiency, k.elementwise_floor_s)

    def dispatch_s(self, shape: BatchShape) -> float:
        """Driver to stage 0: from the completion that freed the slot until stage 0 prepares
        `shape` (engine terms `dispatch_*`; 0 unless calibrated from a real engine's runs)."""
        c = self.coefficients
        t = c.dispatch_fixed_s + c.dispatch_per_seq_s * shape.num_seqs
        return t + c.dispatch_prefill_s if shape.num_prefill_tokens else t

    def return_s(self, shape: BatchShape) -> float:
        """Last stage to driver: from the end of sampling until the driver holds the ids, on top
        of the link's latency (engine term `return_fixed_s`)."""
        return self.coefficients.return_fixed_s

    def last_stage_request_s(self, shape: BatchShape) -> float:
        """From the last stage's previous result until `shape`'s request is on it, where a runtime
        sends a stage its next step only once the last one came back (vLLM 0.5.3's mp executor;
        `last_stage_request_*`, 0 by default)."""
        c = self.coefficients
        if not (c.last_stage_request_fixed_s or c.last_stage_request_per_seq_s or c.last_stage_request_per_context_token_s):
            return 0.0
        return (c.last_stage_request_fixed_s + c.last_stage_request_per_seq_s * shape.num_seqs
                + c.last_stage_request_per_context_token_s * (shape.decode_context_sum + shape.prefill_context_sum))

    def cpu_sample_s(self, shape: BatchShape, workers: int = 1, sampling: SamplerSettings | None = None,
                     busy_stages: int = 0) -> float:
        """CPU sampling of `shape`'s rows spread over `workers` sampler processes (SiPipe), on the
        sampler's path for `sampling` (engine/pricing/cpu_sampling_paths.py; None or the defaults:
        the terms' own path), with `busy_stages` stages before the last working as it starts."""
        rows = shape.num_sampled
        if not rows:
            return 0.0
        c = self.coefficients
        fixed = c.cpu_sample_fixed_s
        per_row = c.cpu_sample_per_row_s + c.cpu_sample_per_token_vocab_s * self._vocab
        if sampling is not None and sampling != REFERENCE:
            d_fixed, d_row = path_delta_s(sampling, self._vocab)
            fixed, per_row = max(0.0, fixed + d_fixed), max(0.0, per_row + d_row)
        return fixed + per_row * rows / max(1, workers) + c.cpu_sample_per_busy_stage_s * busy_stages

    def cpu_handoff_s(self, shape: BatchShape) -> float:
        """The last stage's copy of `shape`'s logits to the CPU samplers, on the stage (SiPipe)."""
        c = self.coefficients
        if not shape.num_sampled or not (c.cpu_handoff_fixed_s or c.cpu_handoff_per_token_vocab_s):
            return 0.0
        return c.cpu_handoff_fixed_s + c.cpu_handoff_per_token_vocab_s * shape.num_sampled * self._vocab

    def recv_s(self, shape: BatchShape) -> float:
        """A host device's receive of `shape`'s activation, on the receiving stage (0 unless fitted)."""
        c = self.coefficients
        if not (c.recv_fixed_s or c.recv_per_byte_s):
            return 0.0
        return c.recv_fixed_s + c.recv_per_byte_s * self.activation_bytes(shape)

    def prep_s(self, shape: BatchShape) -> float:
        """CPU input preparation of one micro-batch on one stage."""
        c = self.coefficients
        t = c.prep_fixed_s + c.prep_per_seq_s * shape.num_seqs + c.prep_per_token_s * (
            shape.num_prefill_tokens + shape.num_decode_seqs
        )
        if c.prep_per_context_token_s:  # every scheduled sequence's token ids, unpickled (off by default)
            t += c.prep_per_context_token_s * (shape.decode_context_sum + shape.prefill_context_sum)
        return t

    # ---- transfers ------------------------------------------------------------------------
    def activation_bytes(self, shape: BatchShape) -> int:
        """Bytes one stage sends the next: tokens x hidden x dtype (x activation_copies)."""
        return (shape.num_prefill_tokens + shape.num_decode_seqs) * self._act_bytes_per_token

    def token_return_bytes(self, shape: BatchShape) -> int:
        """Sampled token ids returned to the driver: 4 bytes each."""
        return shape.num_sampled * 4

    def logits_bytes(self, shape: BatchShape) -> int:
        """fp32 logits shipped to CPU samplers (SiPipe): rows x vocab x 4."""
        return shape.num_sampled * self._vocab * 4

    def transfer_s(self, nbytes: float, bandwidth_Bps: float, latency_s: float, structure_aware: bool = True) -> float:
        """latency + nbytes / bandwidth, + `transfer_metadata_s` unless structure-aware (SiPipe)."""
        t = latency_s + nbytes / bandwidth_Bps
        if not structure_aware:
            t += self.coefficients.transfer_metadata_s
        return t

    def hop_s(self, shape: BatchShape, structure_aware: bool = True) -> float:
        """One stage-to-stage activation transfer on the hardware's default link."""
        hw = self.hardware
        return self.transfer_s(self.activation_bytes(shape), hw.p2p_bw_Bps, hw.p2p_latency_s, structure_aware)

    # ---- memory ---------------------------------------------------------------------------
    def weight_bytes_per_stage(self) -> tuple[int, ...]:
        """Weight bytes of each whole stage (all tp GPUs together): its layers, the embedding on
        the first stage, the lm_head and final norm on the last. A tied lm_head is the embedding
        itself when pp == 1, but the last stage holds its own copy when pp > 1 (as vLLM does)."""
        m, db = self.model, self.dtype_bytes
        out = []
        for s, n in enumerate(self.layers):
            params = n * m.params_per_layer
            if s == 0:
                params += m.embedding_params
            if s == self.pp - 1:
                params += m.final_norm_params
                if not (m.tie_word_embeddings and self.pp == 1):
                    params += m.lm_head_params
            out.append(params * db)
        return tuple(out)

    def kv_capacity_blocks(self, gpu_memory_utilization: float = 0.9, block_size: int = 16) -> int:
        """KV blocks of `block_size` tokens that every stage can hold (the minimum over stages).

        Per GPU: mem * utilisation - weights / tp - activation_reserve, divided by the block's
        bytes on that stage (KV bytes per token per layer / tp x the stage's layers x block).
        Raises ImpossibleFitError when some stage cannot hold even one block.
        """
        return min(self.kv_blocks_per_stage(gpu_memory_utilization, block_size))

    def kv_blocks_per_stage(self, gpu_memory_utilization: float = 0.9, block_size: int = 16) -> tuple[int, ...]:
        """KV blocks each stage's memory holds (`kv_capacity_blocks` is their minimum: one block
        manager serves the whole pipeline). Raises ImpossibleFitError as `kv_capacity_blocks`."""
        if isinstance(gpu_memory_utilization, bool) or not (
            isinstance(gpu_memory_utilization, (int, float)) and 0.0 < gpu_memory_utilization <= 1.0
        ):
            raise ConfigError(
                f"invalid engine.gpu_memory_utilization={gpu_memory_utilization!r}: must be in (0, 1]"
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"invalid engine.block_size={block_size!r}: must be an integer >= 1")
        hw, m = self.hardware, self.model
        reserve = self.coefficients.activation_reserve_gib * GIB
        usable = hw.mem_bytes * gpu_memory_utilization - reserve
        out = []
        for s, (n, wbytes) in enumerate(zip(self.layers, self.weight_bytes_per_stage())):
            weights = wbytes / self.tp
            block_bytes = self.kv_bytes_per_token_per_layer_gpu * n * block_size
            free = usable - weights
            blocks = math.floor(free / block_bytes) if free > 0 else 0
            if blocks < 1:
                where = (
                    f"stage {s} of {self.pp} ({n} layers) needs {weights / GIB:.1f} GiB of weights per GPU "
                    f"but only {usable / GIB:.1f} GiB is usable ({hw.mem_gib:g} GiB x "
                    f"gpu_memory_utilization {gpu_memory_utilization:g} - "
                    f"{self.coefficients.activation_reserve_gib:g} GiB activation reserve)"
                )
                if free > 0:
                    where += f", leaving less than one KV block ({block_bytes / 2**20:.1f} MiB)"
                raise ImpossibleFitError(
                    f"model {m.name} does not fit on hardware {hw.name} with pp={self.pp}, tp={self.tp}: "
                    f"{where}; raise parallel.pp (or parallel.tp) or choose a bigger GPU"
                )
            out.append(blocks)
        return tuple(out)

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9, block_size: int = 16) -> int:
        """Tokens of KV cache every stage can hold, in whole blocks (= blocks x block_size)."""
        return self.kv_capacity_blocks(gpu_memory_utilization, block_size) * block_size
