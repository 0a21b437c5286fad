"""`CostCoefficients`: the efficiency factors and fixed overheads of the cost model (engine/pricing/costmodel.py).

A hardware profile's `calibration` mapping (a fitted profile, `testbed profile`, or the host
costs of `testbed calibrate tables`) sets some of them; `cost.<field>=` overrides any.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from engine.base.errors import ConfigError

TABLE_FIELDS = ("decode_batch_factors", "mixed_row_extra_s")  # per-stage tables, not numbers

__all__ = ["CostCoefficients"]


@dataclass(frozen=True)
class CostCoefficients:
    """Efficiency factors and fixed overheads. Defaults are literature-informed guesses, to be
    calibrated against the real engine's profiles; the numbers they give are in the tests
    (TestAbsoluteNumbers) and below.

    With the defaults, on A100-80GB (312 TFLOPS, 2,039 GB/s):
    - Llama2-70B, pp=4 (20 layers a stage), a decode micro-batch of 32 sequences at context 512:
      22.8 ms on a middle stage, 23.6 ms on the last (lm_head) + 0.55 ms GPU sampling. The floor
      is streaming the stage's 34.2 GB of weights: 16.8 ms even at 100% of peak bandwidth, so a
      10-15 ms per-stage decode is physically out of reach for this model and GPU.
    - the same stage, one 2,048-token prefill chunk (no prefix): 0.309 s (70 TFLOP of GEMMs at
      75% of peak = 0.300 s, + ~9 ms of causal attention); after a 4,096-token prefix: 0.344 s.
    - Llama2-70B, pp=4, decode of 256 at context 1,024: 51.5 ms (compute-bound GEMMs 37 ms +
      13 ms of KV reads). Llama2-13B (MHA: 800 KB of KV a token), pp=4, the same batch: 40.4 ms,
      33 ms of it reading 54 GB of KV cache.
    - Llama-3.1-70B on 8x H100, pp=8, decode of 512 at context 800: 18.6 ms a middle stage; the
      last stage adds lm_head (+1.5 ms) and sampling (+3.8 ms): 29% more, inside SiPipe's 22-40%.
    - CPU input preparation: 1.0 ms for 32 decodes, 4.0 ms for 512 (SiPipe: 12-19% of a step).
    """

    # Fraction of peak tensor FLOPs that large GEMMs reach end to end. cuBLAS reaches ~80-87% on
    # big square fp16 GEMMs on A100; real forward passes with M=512..2048 rows sit lower.
    linear_efficiency: float = 0.75
    # Fraction of peak reached by attention's FLOPs. FlashAttention-2 reports up to ~70% of A100
    # peak in the forward pass on long sequences; chunked/causal serving kernels reach less.
    attention_efficiency: float = 0.5
    # Fraction of peak memory bandwidth reached by weight-streaming GEMVs and paged attention
    # (~1.6 TB/s of A100's 2.04 TB/s is commonly measured for large copies / GEMV).
    memory_efficiency: float = 0.8
    # Fixed per micro-batch per stage: Python step, launch of the first kernels, syncs.
    stage_overhead_s: float = 200e-6
    # Per layer per micro-batch: ~10 kernel launches at a few us each that the GPU cannot hide at
    # small batch (no CUDA graphs assumed).
    per_layer_overhead_s: float = 30e-6
    # CPU input preparation per micro-batch (block tables, positions, slot mappings, H2D copies).
    # SiPipe measured it at 12-19% of an iteration; these give ~1 ms for 32 decodes and ~3.9 ms
    # for 512 decodes.
    prep_fixed_s: float = 800e-6
    prep_per_seq_s: float = 6e-6
    prep_per_token_s: float = 0.2e-6
    # A runtime that ships every step's whole sequence data to each stage and unpickles it there
    # pays per token id of each scheduled sequence's context (prompt + output so far), each stage,
    # each step. vLLM 0.5.3's mp executor does: `ProcessWorkerWrapper._enqueue_task` puts the
    # `ExecuteModelRequest` on each stage's `mp.Queue` (vllm/executor/multiproc_worker_utils.py);
    # its `SequenceData` holds the prompt twice and all tokens again (vllm/sequence.py). TD-Pipe
    # sends its own `seq_group_metadata_list` to every Ray worker each step (TD_Pipe/engine/
    # llm_engine.py `LLMEngine.step`), with prompt and output once. Unpickling measured on the
    # shared 2-core EPYC (thread CPU time, 256 sequences, load 7-10): 0.5.3 75-85 ns, TD-Pipe 20-27
    # ns a context token (docs/measurements/tdpipe-baseline-2026-11-27.md); TD-Pipe / PP+SB 1.243x
    # -> 1.257x at 8e-8 / 2.5e-8. 0 (off) by default: a what-if, the papers' host CPUs are unknown.
    prep_per_context_token_s: float = 0.0
    # vLLM 0.5.3's mp PP executor hands a stage its next step only once its last result is back at
    # the driver: each stage's call runs under that stage's asyncio lock and the request is put on the
    # stage's mp.Queue inside it (`MultiprocessingGPUExecutorAsync._driver_execute_model_async`,
    # vllm/executor/multiproc_gpu_executor.py; `_run_task_with_lock`, vllm/utils.py;
    # `ProcessWorkerWrapper._enqueue_task`, vllm/executor/multiproc_worker_utils.py), and the queue's
    # feeder thread pickles it in the driver. The last stage returns only after sampling, so that
    # round trip (result back, event loop, lock, pickling, the pipe) idles it between steps; TD-Pipe
    # submits each step to every worker when it schedules it (TD_Pipe/engine/llm_engine.py
    # `LLMEngine.step`). Priced from scripts/measure_vllm053_roundtrip.py on this project's CPU
    # (engine/pricing/measured/vllm053_roundtrip.json); 0 (off) by default, the papers' host CPUs
    # being unknown. The unpickling on the stage is `prep_per_context_token_s`'s.
    last_stage_request_fixed_s: float = 0.0
    last_stage_request_per_seq_s: float = 0.0
    last_stage_request_per_context_token_s: float = 0.0
    # GPU sampling on the last stage (softmax, penalties, top-k/top-p): a fixed part (many small
    # kernels) and a part per sampled sequence per vocabulary entry. 5e-11 s gives 3.3 ms for 512
    # sequences x 128k vocab: ~22% of an H100 70B stage, the low end of SiPipe's 22-40%.
    sample_fixed_s: float = 500e-6
    sample_per_token_vocab_s: float = 5e-11
    # CPU sampler (SiPipe): this project's sampler (engine/torch_exec/stage/sampling.py) measured on one
    # core with SiPipe's settings (temperature, top-p, top-k and all three penalties on, a 512-token
    # prompt a row): 57 us a row (its seeded draw, the gather of its penalty hits) + 1.41 ns per row x
    # vocabulary entry, 30x its greedy path per entry (topk, then top-p on the k candidates;
    # penalties at the hit entries only). Median error 3.5%, 9.7% at worst over the 18 points; the
    # form without the per-row term missed by 20% / 36% (32k rows underpriced). Was 60 ns an entry
    # when the sampler sorted the whole vocabulary per row (7.7 ms a 152k row).
    # engine/pricing/measured/cpu_sampler.json (scripts/measure_cpu_sampler.py) has the points and
    # provenance. The fixed part (a job's messages) is not measured: 200 us, hand-set (the sampler
    # call's own fixed part fits at 137 us). Other sampling settings take other paths of the sampler,
    # priced as these terms + the difference between the paths (engine/pricing/cpu_sampling_paths.py).
    cpu_sample_fixed_s: float = 200e-6
    cpu_sample_per_row_s: float = 5.697542711005174e-05
    cpu_sample_per_token_vocab_s: float = 1.4074301729565028e-09
    # The path's growth per stage before the last that is working when it starts (the samplers are
    # more processes on the same cores). 0 = not modelled; fitted from runs by `calibrate runs
    # --sampler-contention` (testbed/calibrate/cpu_sampling_fit.py).
    cpu_sample_per_busy_stage_s: float = 0.0
    # Extra per-hop cost of a transfer that is not structure-aware (size, metadata blob, then each
    # tensor). SiPipe measured 2-5 ms per hop; we take the low end, consistent with its 3-6%
    # end-to-end gain from structure-aware transmission.
    transfer_metadata_s: float = 2e-3
    # GPU memory kept back for activations, sampler buffers and the CUDA context, per GPU.
    activation_reserve_gib: float = 1.5
    # Tensors of [tokens, hidden] sent stage to stage. 1 = hidden states only (MoLink's 13,312 B
    # per token for LLaMA-30B); vLLM also ships the residual (2).
    activation_copies: int = 1
    # ---- GPU terms (docs/calibration.md#gpu-terms). Each default is neutral: the model is then
    # exactly the one above, so every existing config simulates byte-identically.
    # Fraction of peak bandwidth reached by attention's KV reads. Paged-attention gathers reach
    # less per byte than weight-streaming GEMMs (and the CPU engine's gather far less); 0 = the
    # same as memory_efficiency.
    kv_read_efficiency: float = 0.0
    # GEMM efficiency as a function of M (tokens): linear_efficiency * M / (M + linear_half_tokens).
    # Small-M GEMMs run well below peak (tile quantisation, too few thread blocks to fill the SMs):
    # the compute time becomes (M + linear_half_tokens) x the per-token time. 0 = flat.
    linear_half_tokens: float = 0.0
    # Attention efficiency as a function of the mean context per sequence (or per prefill chunk):
    # time x (1 + attention_half_context / context), i.e. efficiency x ctx / (ctx + half). Short
    # contexts leave the attention kernel's blocks under-occupied. 0 = flat.
    attention_half_context: float = 0.0
    # Fixed overhead of a decode-only step as a fraction of the eager one (stage_overhead_s +
    # per_layer_overhead_s x layers): a decode-only step can replay a CUDA graph, whose launch
    # costs one replay instead of ~10 kernel launches per layer. 1 = eager (no graphs).
    decode_overhead_ratio: float = 1.0
    # ---- Engine terms (docs/calibration.md#engine-terms): the host around the kernels, fitted
    # from a real engine's traced runs (`testbed calibrate runs`). Neutral (0) by default.
    # An eager (not graph-replayed) step cannot finish before the host has launched its kernels:
    # its forward is at least this x the stage's layers. The project's torch engine on an H100
    # launched a mixed micro-batch's ~1,000 kernels in ~37 ms for 18 ms of GPU work (qwen2.5-7b,
    # 28 layers), so mixed steps took 1.2-4.9x their kernels.
    launch_floor_per_layer_s: float = 0.0
    # ... plus this per sequence (host work per sequence in an eager step): launch-bound mixed steps
    # took ~25 ms with 10-20 decodes and ~30 ms with 100-190 on that engine (its `testbed profile`
    # table: 20.6 ms for 256 + 8 decodes, 30.6 ms for 256 + 192).
    launch_floor_per_seq_s: float = 0.0
    # How far the host's launches hide behind the GPU in an eager step: its time is
    # (kernels^p + floor^p)^(1/p); 0 = max(kernels, floor), full overlap. On that engine a large mixed
    # step took kernels + ~60% of the floor (2,043 + 10 decodes: 69 ms for 59 ms of kernels and a
    # 27 ms floor), a small one about the floor: p ~ 2.4.
    launch_overlap_exponent: float = 0.0
    # From the completion that freed a pipeline slot until stage 0 starts preparing the next
    # micro-batch: the controller's own step (policy, commit), the metadata's serialisation and
    # its trip to the stage. Measured 1.1 ms a decode step on that H100 engine (0.24 ms in the
    # controller, 0.86 ms from launch to the stage's prepare).
    dispatch_fixed_s: float = 0.0
    dispatch_per_seq_s: float = 0.0
    # A step with a prefill chunk takes longer to dispatch (its token ids travel, the policy builds
    # chunks): +1.0 ms on that engine (mixed 2.1 ms vs decode 1.1 ms, median).
    dispatch_prefill_s: float = 0.0
    # From the last stage's sampling end until the driver holds the ids (the reply's trip and
    # decoding): 0.78 ms a decode step on that engine.
    return_fixed_s: float = 0.0
    # How much of the padding of decodes to the longest one the decode attention reads: its KV
    # tokens are sum + decode_padding x (D x longest - sum). The torch attention path (the CPU
    # default, engine/torch_exec/stage/model.py) gathers every decode's blocks up to the longest decode's
    # and masks the rest: on tiny-llama P=1 (a gllm ShareGPT run, shared 2-core CPU) a mixed step of
    # 32 prefill tokens + 46 decodes took 406 ms while one long decode was running and 120 ms after it
    # finished (the decodes' context sum only 16% lower). 0 = no padding (the Triton path, vLLM).
    decode_padding: float = 0.0
    # A host BLAS that multiplies M <= gemv_rows rows as M matrix-vector products: such a GEMM costs
    # M x its one-row time (engine/pricing/small_m.py; fp32 on this project's CPU: 3 rows, the
    # lm_head 2.08 / 3.78 / 5.83 ms for 1 / 2 / 3 rows, 3.15 ms for 4). 0 = off (GPUs, roofline).
    gemv_rows: int = 0
    # A host device's stage-to-stage receive (gloo on CPU): the receiving stage reads the activation
    # itself, busy for fixed + per byte before its forward (0 = off: a GPU's copy engine, the link's
    # latency alone). tiny-llama P=2 on the shared 2-core CPU: 0.45 ms flat behind gllm's blocking
    # sends, 0.65-1.54 ms growing with the tokens behind SiPipe's asynchronous ones (issue 47).
    recv_fixed_s: float = 0.0
    recv_per_byte_s: float = 0.0
    # SiPipe's CPU sampling: the last stage copies its logits to the sampler processes before it is
    # free (`to_samplers`), fixed + per row x vocabulary entry: 0.39 ms for <8 rows to 1.05 ms for 48
    # on that CPU (tiny-llama, vocab 32k). 0 = the stage is free at its forward's end.
    cpu_handoff_fixed_s: float = 0.0
    cpu_handoff_per_token_vocab_s: float = 0.0
    # A host device's blocking send is a rendezvous (gloo): the sending stage is held until the next
    # stage begins receiving that activation, then this long (engine/simulator/handover.py). Where
    # the sender was first, its send ended 0.28-0.38 ms (median) after the receive began (tiny-llama
    # P=2, 2-core CPU, set 6). 0 = off: the stage goes on once its bytes have left the link.
    handover_rendezvous_s: float = 0.0
    # A measured correction of a decode-only step's price by batch size, one row per stage: a decode
    # step of n sequences on stage s costs row_s[n - 1] x its price, the last entry held above
    # (engine/pricing/decode_batch.py; `testbed calibrate runs --decode-by-batch`). On the CPU engine
    # the set-6 P=1 profile priced 1 / 2-3 / 4-6 sequences 12% cheap / 15-19% dear / 11-16% cheap.
    # Empty = off.
    decode_batch_factors: tuple[tuple[float, ...], ...] = ()
    # A measured correction of a step with a prefill chunk by its sampled rows, one row per stage: such
    # a step sampling r rows costs its price + row_s[r] seconds on stage s, the last entry held above
    # (engine/pricing/mixed_rows.py; `testbed calibrate runs --mixed-by-rows`). On the CPU engine the
    # set-16 P=1 profile priced 3-5 rows 0.65-1.08 ms cheap (the lm_head) and 0 rows 0.73 ms dear.
    # Empty = off.
    mixed_row_extra_s: tuple[tuple[float, ...], ...] = ()
    # 1: the forward prices are a stage's own work on a GPU its stages shared (`testbed calibrate runs
    # --shared-gpu`, testbed/calibrate/shared_device.py), so a replay of a run whose stages shared a GPU
    # lets them take turns on it (`executor.devices`); 0: fitted as measured (the stretch of sharing
    # priced into every forward). The cost model itself does not read it.
    shared_device_fit: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "decode_batch_factors", _factor_rows(self.decode_batch_factors))
        object.__setattr__(self, "mixed_row_extra_s", _extra_rows(self.mixed_row_extra_s))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in TABLE_FIELDS:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"invalid cost.{f.name}={value!r}: must be a finite number")
            if f.name == "kv_read_efficiency":
                if not 0.0 <= value <= 1.0:
                    raise ConfigError(f"invalid cost.{f.name}={value!r}: must be in (0, 1], or 0 for "
                                      "memory_efficiency")
            elif f.name == "decode_padding":
                if not 0.0 <= value <= 1.0:
                    raise ConfigError(f"invalid cost.{f.name}={value!r}: must be in [0, 1]")
            elif f.name.endswith("_efficiency"):
                if not 0.0 < value <= 1.0:
                    raise ConfigError(f"invalid cost.{f.name}={value!r}: must be in (0, 1]")
            elif value < 0:
                raise ConfigError(f"invalid cost.{f.name}={value!r}: must be >= 0")
        if not isinstance(self.gemv_rows, int) or self.gemv_rows < 0:
            raise ConfigError(f"invalid cost.gemv_rows={self.gemv_rows!r}: must be an integer >= 0")
        if self.shared_device_fit not in (0, 1):
            raise ConfigError(f"invalid cost.shared_device_fit={self.shared_device_fit!r}: must be 0 or 1")
        if not isinstance(self.activation_copies, int) or self.activation_copies < 1:
            raise ConfigError(f"invalid cost.activation_copies={self.activation_copies!r}: must be an integer >= 1")


def _factor_rows(value) -> tuple[tuple[float, ...], ...]:
    """`decode_batch_factors` as a tuple of per-stage tuples (a profile's YAML gives lists), each a
    non-empty row of finite factors > 0."""
    bad = ConfigError(f"invalid cost.decode_batch_factors={value!r}: must be one list per stage of factors > 0 "
                      "(for 1, 2, 3, ... sequences), or [] for off")
    return _stage_rows(value, bad, lambda x: x > 0)


def _extra_rows(value) -> tuple[tuple[float, ...], ...]:
    """`mixed_row_extra_s` as a tuple of per-stage tuples, each a non-empty row of finite seconds
    (negative allowed: a step priced dear)."""
    bad = ConfigError(f"invalid cost.mixed_row_extra_s={value!r}: must be one list per stage of seconds "
                      "(for 0, 1, 2, ... sampled rows), or [] for off")
    return _stage_rows(value, bad, lambda x: True)


def _stage_rows(value, bad: ConfigError, allowed) -> tuple[tuple[float, ...], ...]:
    """A per-stage table (lists of finite numbers passing `allowed`) as tuples; `bad` otherwise."""
    if not isinstance(value, (list, tuple)):
        raise bad
    rows = []
    for row in value:
        if not isinstance(row, (list, tuple)) or not row:
            raise bad
        for x in row:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not allowed(x):
                raise bad
        rows.append(tuple(float(x) for x in row))
    return tuple(rows)
