"""The fitted coefficients of the operator-level GPU costs (engine/pricing/kernels.py prices a layer
with them): one term per residual the measured kernel times demand, each named in its field's
docstring (docs/calibration.md#measured-kernels). `testbed/calibrate/kernel_fit.py` fits them; a
hardware profile carries them as a mapping (`HardwareSpec.kernels`)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from engine.base.errors import ConfigError

__all__ = ["KernelCoefficients", "GEMMS", "ELEMENTWISE"]

# The four GEMMs of a decoder layer and the elementwise ops, by the names of the profile rows.
GEMMS = ("gemm_qkv", "gemm_o", "gemm_up", "gemm_down")
ELEMENTWISE = ("norm", "rope", "act", "add")


@dataclass(frozen=True)
class KernelCoefficients:
    """Fitted per device. Times in seconds; efficiencies are fractions of the datasheet peak.

    GEMMs (QKV, O, gate+up, down; and the lm_head): time = floor + max(compute, memory), with
    compute = 2 * M_q * N * K / (peak * gemm_compute_efficiency), M_q the token count rounded up to
    `gemm_token_quantum` (cuBLAS tiles the token dimension: on A100 a GEMM of 129-256 tokens costs
    what 256 tokens cost, the step the smooth roofline misses by up to 2x), and memory = weights +
    activations / (bandwidth * gemm_memory_efficiency) (1-8 token GEMMs stream their weights at
    ~0.77 of A100's peak bandwidth). The floor is the shortest GEMM kernel (~5 us).
    """

    gemm_compute_efficiency: float = 0.73
    gemm_memory_efficiency: float = 0.77
    gemm_floor_s: float = 5e-6
    gemm_token_quantum: int = 64
    # The floor of a weight-streaming (memory-bound) GEMM: time = max(floor + compute, memory floor
    # + memory); equal floors are the form above. One shared floor made the fit trade small against
    # large weights: on H100 it put the streaming efficiency at 0.96 of peak and priced TP=1
    # GEMMs of 1-128 tokens (the largest weights) 8% low; with its own floor, 0.88 and -4%.
    gemm_memory_floor_s: float = 5e-6
    # Elementwise ops (RMSNorm x2, rotary, SiLU x mul, residual add, embedding gather): bandwidth
    # bound with a launch floor. Measured norms reach a third of peak bandwidth (fp32 accumulation,
    # two passes), so they are not free as the roofline's activation traffic assumed.
    # One efficiency per op: on A100 a residual add streams at ~0.9 of peak bandwidth while an
    # RMSNorm reaches ~0.3 (one shared efficiency left add 80% and norm 30% off, median).
    norm_efficiency: float = 0.35
    rope_efficiency: float = 0.4
    act_efficiency: float = 0.6
    add_efficiency: float = 0.9
    emb_efficiency: float = 0.5
    elementwise_floor_s: float = 2e-6
    # Decode attention: floor + KV bytes / (bandwidth * efficiency(g)), g = query heads per KV head.
    # The floor is the A100's 10-20 us for one short sequence (-73% to -94% without it). The
    # efficiency points (g, fraction) are interpolated in log2(g), flat beyond them. The fit
    # (testbed/calibrate/kernel_fit.py) sets one point (one read rate for every g) and lets
    # `decode_compute_efficiency` make large g FLOP bound; a profile may carry several points.
    # That point is the fastest fraction of peak bandwidth a measured row reached (a row read that
    # fast; no faster rate is assumed); fitted freely, held-out MHA Llama-2-7B got 0.79 from shapes
    # reaching 0.88 and was priced 15-23% slow at 1,728 tokens.
    decode_floor_s: float = 12e-6
    decode_kv_efficiency: tuple[tuple[float, float], ...] = ((1.0, 0.85), (8.0, 0.75), (16.0, 0.4))
    # Once a decode batch has more (sequence, KV head) blocks than the GPU holds at once
    # (`decode_waves` resident blocks per SM x sm_count), the kernel runs in whole waves: on the A100
    # table the time jumps 1.46x from batch 54 to 55 with 4 KV heads (216 -> 220 blocks, 2 x 108
    # SMs). 0 = no wave term. The fit picks 0, 1, 2 or 4 by median error; with whole waves only it
    # picked 0 on both devices (H100's steps are 1.4x, whole waves 1.9x), with the part-empty last
    # wave (`decode_tail_recovery`) 2 on both.
    decode_waves: int = 2
    # The decode kernel's FLOPs (QK and PV: 4 x query heads x head_dim per KV token) at
    # `decode_compute_efficiency` of peak: a KV token costs max(KV bytes / read rate, FLOPs / FLOP
    # rate), so the read rate falls as 1/g once g query heads per KV head make the kernel FLOP
    # bound. One read efficiency and this FLOP rate describe all three A100 shapes (g = 1, 8, 16;
    # ~0.05 of the dense peak: the 405B shape, g = 16, reads at 0.44 of peak where g = 1 reaches
    # 0.97); per-g efficiency points fitted the shapes they saw and missed the held-out g by 40%.
    decode_compute_efficiency: float = 1.0
    # Per (sequence, KV head) block: a block's fixed work (its query load, softmax reductions, output
    # write) amortised over the SMs. MHA Llama-2-7B at 32 tokens of context tops out at 0.17 of
    # A100's bandwidth for batch >= 20 (45 ns per block); without it decode at context < 512 and
    # batch >= 9 was priced 31-65% low.
    decode_block_s: float = 0.0
    # Few blocks leave SMs idle even with split-KV: the KV term is scaled by 1 + half / blocks
    # (blocks = sequences x KV heads a GPU). A100 70B shape at TP 2 (4 KV heads): batch 1 reads at
    # 0.23 of what batch 128 reaches, batch 4 at 0.54; without it batch <= 8 was priced 26-45% low.
    decode_half_blocks: float = 0.0
    # Split-KV (flash-decoding) regime: with fewer (sequence, KV head) blocks than
    # `SPLIT_KV_FRACTION` x SMs, FlashAttention-2's decode splits each block's KV over several
    # blocks and adds a combine kernel. The A100 70B table (4 KV heads a GPU, 108 SMs) steps down at
    # the boundary at every context: batch 21 -> 22 (84 -> 88 blocks, 86.4 between) takes 17 -> 9 us
    # at 32 tokens of context, 38 -> 22 us at 512; without this term its batches <= 21 were priced
    # 20-47% low. Added to the call when the batch is below the boundary (with
    # `decode_split_count`, when the heuristic splits); 0 = no regime.
    decode_split_s: float = 0.0
    # Prefill attention (causal, one chunk of x new tokens after a cached prefix of L):
    # floor + 4 * heads * head_dim * pairs / (peak * efficiency(x, L)), pairs = x*L + x(x+1)/2, with
    # efficiency = prefill_efficiency * k / (k + prefill_half_keys), k = L + x/2 the mean keys a
    # query attends: short chunks with no prefix leave the kernel's blocks short of work (measured
    # 0.13 of A100's peak at 1,024 tokens, 0.19 at 4,096; the roofline assumed 0.5).
    prefill_floor_s: float = 12e-6
    prefill_efficiency: float = 0.25
    prefill_half_keys: float = 500.0
    # A prefill chunk also reads its prefix's KV from HBM: time = floor + max(the FLOP term above,
    # context KV bytes / (bandwidth * decode_efficiency(g))). No published prefill row is KV-bound
    # (the shortest chunk is 64 tokens after at most 4,032 at g = 8, 10x more FLOP time than KV
    # time), so the read rate is the decode kernel's measured one at the same g; without it a
    # 16-token chunk after 4,000 tokens on A100 with an MHA model was priced at 1/10 of its KV read.
    # KV write (the kernel storing each new token's K and V into the paged cache, one call per layer
    # for all the step's tokens): floor + tokens * KV bytes / (bandwidth * kv_write_efficiency).
    # The newer tables' `attn_kv_cache_save` column: ~0.05 of peak bandwidth on A100 and H100.
    # The fit sets the floor to `elementwise_floor_s` (a copy kernel; H100's TP 8 rows all store
    # ~1.1 MB and cannot separate a floor from the rate).
    kv_write_floor_s: float = 4e-6
    kv_write_efficiency: float = 0.05
    # Prefill waves: the kernel runs one block per (query head, `prefill_tile` query rows) of a
    # chunk; blocks beyond a whole number of waves over the SMs leave the last wave part empty, so
    # the FLOP rate is scaled by blocks / (waves * SMs). On H100's 405B samples at TP 8 (16 heads a
    # GPU) a 2,112-token chunk is 272 blocks of 128 rows on 132 SMs, 3 waves at 0.69: the FLOP
    # term alone priced it 20% low and TP 1 (128 heads) 20% high. 0 = no wave term.
    prefill_tile: int = 0
    # Prefill pairs against the cached prefix (x * L of a chunk of x after L) at their own FLOP
    # efficiency, without the half-keys and wave terms, which then price only the chunk's causal
    # pairs (x(x+1)/2, mean keys x/2). On H100's 405B samples the time's slope in the prefix is
    # 0.26-0.31 of peak at TP 1 and TP 8 alike, while a chunk with no prefix runs at 0.04-0.08: one
    # efficiency for both put the two shapes 95% / 46% apart held out (48% / 30% with this term).
    # Several chunks in one call are taken as equal (their causal pairs' lower bound).
    # 0 = one efficiency for all pairs (the form above).
    prefill_prefix_efficiency: float = 0.0
    # Prefill per thread block (engine/pricing/prefill_blocks.py): with `prefill_slots_per_sm` > 0 the
    # FLOP term is FlashAttention-2's paged kernel's blocks (query head x `prefill_tile` rows, keys in
    # whole key blocks, the diagonal's computed in full) scheduled over slots_per_sm x SMs slots:
    # causal tile-keys at `prefill_efficiency`, prefix tile-keys at `prefill_prefix_efficiency`, the
    # last tiles' `prefill_tail` past the balanced share, and `prefill_split_s` for the combine
    # kernel of a split-KV call (fewer blocks than 0.8 x SMs). H100's 405B samples: one shape
    # predicted from the other's fit was 48.5% / 29.9% off with the pairs form (TP 1 / TP 8), 9.9% /
    # 9.9% with this one; A100's 70B / 405B shapes 21.5% / 12.6% -> 9.8% / 4.6% (docs/calibration.md).
    # 0 = the pairs form above (`prefill_half_keys` and the wave fill price the causal pairs).
    prefill_slots_per_sm: int = 0
    prefill_tail: float = 0.0
    prefill_split_s: float = 0.0
    # GEMM output-tile waves: cuBLAS computes one output tile (`gemm_token_quantum` tokens x
    # `gemm_tile_n` columns) per block, so tiles = ceil(M / quantum) x ceil(N / tile_n) run in
    # waves over the SMs, and the last wave leaves SMs idle. The compute term is priced on
    # waves = tiles / SMs + `gemm_tail_wave` x (whole waves - tiles / SMs): 0 = the tail's idle
    # slots are filled (the smooth form above: split-K, stream-K), 1 = whole waves. On H100's
    # Qwen-72B QKV at TP 1 (N 24,576, K 8,192) 136 tokens take 216 us against 145 us at 128 (96 ->
    # 192 tiles of 128 x 256 on 132 SMs: 0.73 -> 1.45 waves), which the smooth form priced at 154
    # us. The fit picks 128 x 256 tiles and 0.08 of the tail on H100 (held-out linear p90 13.5% ->
    # 11.9% with this term alone), 128 x 64 and 0.16 on A100 (8.7% -> 8.5%), 128 x 64 and 0.29 on
    # A40. The tail counts most for small grids (a 13-tile GEMM on H100 is priced 1.7x its smooth
    # compute: so few tiles cannot use every SM). 0 = no wave term.
    gemm_tile_n: int = 0
    gemm_tail_wave: float = 0.0
    # Weight streaming above `GEMM_SMALL_TOKENS` tokens: up to 64 tokens cuBLAS streams the weights
    # with a small-M kernel, beyond it with the tiled kernel, which streams them more slowly. Every
    # device's tables step between 64 and 72 tokens: relative to 1 token the median H100 GEMM takes
    # 1.03-1.11x at 64 and 1.08-1.33x at 72 (the smaller the weights, the larger the step), A100
    # 1.05-1.12x -> 1.13-1.34x, A40 1.10-1.16x -> 1.14-1.29x. One streaming efficiency averaged the
    # two kernels: on H100 it came out at 0.87 of peak bandwidth where 1-token GEMMs of 20-940 MB
    # read at 0.89-0.93 beyond a 5 us floor, so 1-16-token layers were priced 3-4% high and
    # 65-128-token ones 4% low (fitted: 0.91 and 0.77 of peak). 0 = `gemm_memory_efficiency` for
    # every token count.
    gemm_tile_memory_efficiency: float = 0.0
    # Elementwise ops with one block per token (RMSNorm, rotary, SiLU x mul; a non-gated
    # activation, phi-2's GELU, is a flat kernel at 1-2 us and keeps its token count): with fewer
    # tokens than the GPU runs blocks at once, each token's block streams its row alone at one SM's
    # rate, so an op costs what `<op>_min_tokens` tokens cost (time = floor + bytes x max(m, min) /
    # (bandwidth x efficiency)). On H100 an RMSNorm of the 70B shape takes 6 us for 1 to 256
    # tokens, and SiLU x mul of one token 15 us at TP 1 (28,672 columns) against 2 us at TP 8: the
    # time follows the row, not the token count. One shared floor (1.4 us) priced these ops 56-70%
    # low in 1-16-token layers, where they are 7-19% of the linear part (fitted minimums on H100:
    # 140-210 tokens). 0 = the token count itself.
    norm_min_tokens: float = 0.0
    rope_min_tokens: float = 0.0
    act_min_tokens: float = 0.0
    add_min_tokens: float = 0.0
    emb_min_tokens: float = 0.0
    # The last, part-empty decode wave takes less than a whole one (its fewer blocks stream faster):
    # the KV term counts whole waves less this share of its empty slots. H100's 405B samples step by
    # 1.40x at 264 -> 272 blocks (2 x 132 slots) and 1.13x at 792 -> 800, whole waves 1.94x / 1.32x:
    # 0.6 recovered. 0 = whole waves.
    decode_tail_recovery: float = 0.0
    # 1 = count the blocks FlashAttention-2 launches (`decode_blocks.splits`: below the split-KV
    # boundary each (sequence, KV head)'s KV tiles are cut into pieces): the per-block cost, waves
    # and few-blocks term count pieces; the split regime is paid where it splits. H100's TP 8 samples
    # step where the count changes (batch 36 -> 37, 11 -> 3 pieces: 40 -> 30 us). 0 = one block per
    # (sequence, KV head).
    decode_split_count: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "decode_kv_efficiency":
                _check_points(value)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"invalid kernels.{f.name}={value!r}: must be a finite number")
            if f.name in ("prefill_prefix_efficiency", "gemm_tile_memory_efficiency") and value == 0.0:
                continue
            if f.name.endswith("_efficiency") and not 0.0 < value <= 1.0:
                raise ConfigError(f"invalid kernels.{f.name}={value!r}: must be in (0, 1]")
            if value < 0:
                raise ConfigError(f"invalid kernels.{f.name}={value!r}: must be >= 0")
        if self.prefill_slots_per_sm and not (self.prefill_tile and self.prefill_prefix_efficiency):
            raise ConfigError(f"invalid kernels.prefill_slots_per_sm={self.prefill_slots_per_sm!r}: the per-block "
                              "form needs prefill_tile > 0 and prefill_prefix_efficiency > 0")
        if not isinstance(self.prefill_slots_per_sm, int):
            raise ConfigError(f"invalid kernels.prefill_slots_per_sm={self.prefill_slots_per_sm!r}: must be an integer >= 0")
        if not isinstance(self.prefill_tile, int):
            raise ConfigError(f"invalid kernels.prefill_tile={self.prefill_tile!r}: must be an integer >= 0")
        if not isinstance(self.gemm_tile_n, int):
            raise ConfigError(f"invalid kernels.gemm_tile_n={self.gemm_tile_n!r}: must be an integer >= 0")
        if self.gemm_tail_wave > 1.0:
            raise ConfigError(f"invalid kernels.gemm_tail_wave={self.gemm_tail_wave!r}: must be in [0, 1]")
        if self.decode_tail_recovery > 1.0:
            raise ConfigError(f"invalid kernels.decode_tail_recovery={self.decode_tail_recovery!r}: must be in [0, 1]")
        if self.decode_split_count not in (0, 1):
            raise ConfigError(f"invalid kernels.decode_split_count={self.decode_split_count!r}: must be 0 or 1")
        if not isinstance(self.decode_waves, int):
            raise ConfigError(f"invalid kernels.decode_waves={self.decode_waves!r}: must be an integer >= 0")
        if not isinstance(self.gemm_token_quantum, int) or self.gemm_token_quantum < 1:
            raise ConfigError(f"invalid kernels.gemm_token_quantum={self.gemm_token_quantum!r}: must be an integer >= 1")

    @classmethod
    def from_mapping(cls, values: Mapping) -> KernelCoefficients:
        """From a profile's `kernels:` mapping (YAML lists become tuples)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown kernels keys {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        data = dict(values)
        if "gemm_floor_s" in data and "gemm_memory_floor_s" not in data:  # a profile of the one-floor form
            data["gemm_memory_floor_s"] = data["gemm_floor_s"]
        if "decode_kv_efficiency" in data:
            data["decode_kv_efficiency"] = tuple(tuple(float(v) for v in p) for p in data["decode_kv_efficiency"])
        for key in ("gemm_token_quantum", "decode_waves", "prefill_tile", "prefill_slots_per_sm", "gemm_tile_n",
                    "decode_split_count"):
            if key in data:
                data[key] = int(data[key])
        return cls(**data)

    def to_mapping(self) -> dict:
        data = asdict(self)
        data["decode_kv_efficiency"] = [list(p) for p in self.decode_kv_efficiency]
        return data

    def decode_efficiency(self, gqa: float) -> float:
        """KV read efficiency at `gqa` query heads per KV head: linear in log2(g) between the fitted
        points, flat beyond them."""
        pts = self.decode_kv_efficiency
        if gqa <= pts[0][0]:
            return pts[0][1]
        for (g0, e0), (g1, e1) in zip(pts, pts[1:]):
            if gqa <= g1:
                w = math.log2(gqa / g0) / math.log2(g1 / g0)
                return e0 + w * (e1 - e0)
        return pts[-1][1]


def _check_points(points: object) -> None:
    ok = isinstance(points, tuple) and len(points) >= 1 and all(
        isinstance(p, tuple) and len(p) == 2 and all(isinstance(v, (int, float)) and math.isfinite(v) for v in p)
        for p in points)
    if not ok or any(g < 1 or not 0 < e <= 1 for g, e in points) or any(
            a[0] >= b[0] for a, b in zip(points, points[1:])):
        raise ConfigError(f"invalid kernels.decode_kv_efficiency={points!r}: needs (gqa >= 1, efficiency in (0, 1]) "
                          "points with increasing gqa")
