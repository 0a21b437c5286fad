"""Synthetic GPU profiles from a known ground truth, to test the fit without a GPU.

The ground truth (`GpuTruth`) is deliberately NOT the cost model: it uses other functional forms
for the same effects, so a fit that recovers it shows that the cost model's terms can describe a
GPU, not merely that the fitter inverts its own formula:

- GEMM efficiency rises with M as `gemm_eff_max * (1 - exp(-M / gemm_m0))` (the model: a
  hyperbola M / (M + half));
- compute and memory overlap imperfectly: a smooth max `(a^p + b^p)^(1/p)` (the model: max);
- weight streaming reaches `weight_bw_eff` of peak bandwidth, paged KV reads only `kv_bw_eff`;
- attention loses occupancy at short contexts: time / (1 - exp(-context / attn_ctx0));
- eager steps (prefill, mixed) pay a CPU launch cost that hides partly behind GPU work
  (`launch_overlap`); decode-only steps replay a CUDA graph with a smaller fixed cost.

The default numbers are H100-SXM-like (989 TFLOP/s dense bf16 and 3,350 GB/s nominal, the
`h100-80g` table entry): cuBLAS bf16 GEMMs reach ~70% of peak at large M, weight-streaming GEMVs
~85-90% of HBM bandwidth, paged attention well below (FlashAttention-2 / vLLM kernels), eager
PyTorch launches cost a few us per kernel, and this repository's engine is eager PyTorch with many
small kernels per layer (docs/calibration.md). They are a plausible test
target, not measurements: no figure here may be quoted as an H100's.

Measurements carry +-`noise` relative uniform noise from a seeded RNG (3% by default).
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from engine.pricing.profile_table import ProfileRow, ProfileTable
from engine.pricing.costmodel import BatchShape, split_layers
from engine.pricing.hardware import HardwareSpec
from engine.pricing.models import ModelSpec
from engine.pricing.profile_grid import ProfileGrid

__all__ = ["GpuTruth", "HELDOUT_GRID", "truth_forward_s", "synthetic_gpu_profile"]


@dataclass(frozen=True)
class GpuTruth:
    peak_tflops: float = 989.0
    hbm_gbs: float = 3350.0
    gemm_eff_max: float = 0.72
    gemm_m0: float = 160.0  # tokens: GEMM efficiency reaches 63% of its maximum at M = m0
    weight_bw_eff: float = 0.88
    kv_bw_eff: float = 0.35  # paged KV gathered by index, then attended
    attn_eff_max: float = 0.45
    attn_ctx0: float = 192.0  # tokens of context per sequence
    overlap_p: float = 6.0  # smooth-max exponent (infinity = a hard roofline)
    eager_fixed_s: float = 1e-3  # Python step, input tensors, first launches
    eager_per_layer_s: float = 120e-6  # ~25 eager kernels x ~5 us of Python + launch per layer
    launch_overlap: float = 0.3  # share of the smaller of (launch, GPU time) hidden behind the other
    graph_fixed_s: float = 60e-6  # one graph replay
    graph_per_layer_s: float = 12e-6
    prep_fixed_s: float = 400e-6
    prep_per_seq_s: float = 4e-6
    sample_fixed_s: float = 150e-6
    sample_per_token_vocab_s: float = 2e-12

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def bw(self) -> float:
        return self.hbm_gbs * 1e9

    def hardware(self) -> HardwareSpec:
        """The nominal spec the fitter is given: the datasheet peaks, H100-like links."""
        return HardwareSpec("synthetic-gpu", "synthetic H100-like ground truth (testbed/calibrate/synthetic.py)",
                            self.peak_tflops, self.hbm_gbs, 80.0, 360.0, 10e-6, 360.0)


def _smax(a: float, b: float, p: float) -> float:
    hi = max(a, b)
    return hi * ((a / hi) ** p + (b / hi) ** p) ** (1.0 / p) if hi > 0 else 0.0


def _gemm_s(truth: GpuTruth, params: float, m: int, act_bytes: float, db: int) -> float:
    eff = truth.gemm_eff_max * (1.0 - math.exp(-m / truth.gemm_m0))
    comp = 2.0 * params * m / (truth.peak_flops * eff)
    mem = (params * db + act_bytes * m) / (truth.bw * truth.weight_bw_eff)
    return _smax(comp, mem, truth.overlap_p)


def _attention_s(truth: GpuTruth, model: ModelSpec, pairs: float, kv_tokens: float, queries: int,
                 mean_ctx: float) -> float:
    db = model.dtype_bytes
    comp = 4.0 * model.num_heads * model.head_dim * pairs / (truth.peak_flops * truth.attn_eff_max)
    mem = (model.kv_bytes_per_token_per_layer * kv_tokens + 2 * model.q_size * db * queries) / (truth.bw * truth.kv_bw_eff)
    occupancy = 1.0 - math.exp(-mean_ctx / truth.attn_ctx0)
    return _smax(comp, mem, truth.overlap_p) / occupancy


def truth_forward_s(truth: GpuTruth, model: ModelSpec, layers: int, shape: BatchShape, first: bool,
                    last: bool) -> float:
    """Ground-truth forward time of `shape` on a stage of `layers` layers (tp = 1)."""
    db = model.dtype_bytes
    m = shape.num_tokens
    act = db * (10 * model.hidden_size + 2 * model.q_size + 2 * model.kv_size + 3 * model.intermediate_size)
    layer = _gemm_s(truth, model.linear_params_per_layer, m, act, db)
    chunks = shape.num_seqs - shape.num_decode_seqs
    if shape.num_prefill_tokens:
        layer += _attention_s(truth, model, shape.prefill_attention_pairs, shape.prefill_context_sum,
                              shape.num_prefill_tokens, shape.prefill_context_sum / chunks)
    if shape.num_decode_seqs:
        n = shape.num_decode_seqs
        layer += _attention_s(truth, model, shape.decode_context_sum, shape.decode_context_sum, n,
                              shape.decode_context_sum / n)
    gpu = layers * layer
    if first:
        gpu += 2.0 * m * model.hidden_size * db / (truth.bw * truth.weight_bw_eff)
    if last and shape.num_sampled:
        gpu += _gemm_s(truth, model.vocab_size * model.hidden_size, shape.num_sampled, 4.0 * model.vocab_size, db)
    if shape.num_prefill_tokens:  # eager: launches partly hidden behind the GPU's work
        launch = truth.eager_fixed_s + truth.eager_per_layer_s * layers
        return gpu + launch - truth.launch_overlap * min(gpu, launch)
    return gpu + truth.graph_fixed_s + truth.graph_per_layer_s * layers  # graph replay


# Points the `serving` grid does not hold, for held-out checks of a fit.
HELDOUT_GRID = ProfileGrid(
    "serving-heldout", prefill_tokens=(32, 512, 1536, 3072), prefill_batch=(1, 2), prefill_prefix=(0, 2048),
    decode_batch=(3, 12, 48, 96, 200), decode_context=(100, 700, 1500, 3000),
    mixed=((16, 1024, 512), (128, 768, 1024), (32, 3000, 128), (100, 300, 64)),
    max_batch_tokens=8192, max_kv_tokens=2 ** 19)


def synthetic_gpu_profile(model: ModelSpec, grid: ProfileGrid, truth: GpuTruth | None = None, pp: int = 1,
                          layers: Sequence[int] | None = None, noise: float = 0.03, seed: int = 0) -> ProfileTable:
    """A profile table of `grid` measured on the ground truth: forward rows on every stage,
    prepare rows, sample rows on the last stage; +-`noise` relative noise (seeded)."""
    truth = truth or GpuTruth()
    rng = random.Random(seed)
    split = split_layers(model.num_layers, pp, layers)
    rows: list[ProfileRow] = []

    def noisy(v: float) -> float:
        return v * (1.0 + noise * rng.uniform(-1.0, 1.0))

    for kind, b, x, L, c in grid.points():
        row = ProfileRow("forward", 0, kind, b, x, L, c, 0, 1.0)
        sh = row.shape()
        for s, n in enumerate(split):
            t = truth_forward_s(truth, model, n, sh, s == 0, s == pp - 1)
            rows.append(ProfileRow("forward", s, kind, b, x, L, c, 0, noisy(t)))
        rows.append(ProfileRow("prepare", 0, kind, b, x, L, c, 0,
                               noisy(truth.prep_fixed_s + truth.prep_per_seq_s * sh.num_seqs)))
        rows.append(ProfileRow("sample", pp - 1, kind, b, x, L, c, 0, noisy(
            truth.sample_fixed_s + truth.sample_per_token_vocab_s * sh.num_sampled * model.vocab_size)))
    meta = {"model": model.name, "pp": str(pp), "layers": ",".join(map(str, split)),
            "hardware": truth.hardware().name, "source": f"synthetic GPU ground truth (seed {seed}, noise {noise:g})",
            "grid": grid.name}
    return ProfileTable(rows, meta)
