"""Fit `KernelCoefficients`, links and host costs to operator-level profile rows, and report errors.

The rows come from testbed/calibrate/gpu_tables.py (the published tables) or from a user's own profile in
the same form. Every fit minimises relative error (a 10 us kernel matters as much, relatively, as
a 2 ms one: decode steps are made of the short ones) with bounded least squares on log-parameters.

Held out by default (`DEFAULT_FIT_MODELS`): the fit sees the Llama-2 pair's compute tables; every
other model is reported as held out. Attention is fitted per device on every attention shape it
has (a table's head counts at one TP degree), each shape weighted equally (the A100 70B table at
TP 2 has 99% of the A100 rows), and judged leave-one-shape-out: each shape is predicted by a fit
of the others (`held_out_attention`). A device with one attention shape (a user's own profile)
falls back to alternate grid points (`attention_split`).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from engine.pricing.profile_table import ATTENTION_OPS, ProfileRow, ProfileTable
from engine.base.errors import ConfigError
from engine.pricing import decode_blocks
from engine.pricing.kernels import (ELEMENTWISE_PER_LAYER, GEMM_SMALL_TOKENS, GEMMS, KernelCoefficients,
                                   LayerKernels, LayerShape)
from engine.pricing.prefill_blocks import LIST_SCHEDULE_TAIL

__all__ = ["DEFAULT_FIT_MODELS", "Device", "LinkFit", "HostFit", "KernelFit", "AttentionShape", "fit_kernels",
           "layer_shape", "attention_shapes", "attention_split", "held_out_attention", "fit_link", "fit_host", "QUANTA"]

DEFAULT_FIT_MODELS = ("Llama-2-7b-hf", "Llama-2-70b-hf")
QUANTA = (1, 16, 32, 64, 128)  # candidate GEMM token quanta (cuBLAS tile heights)
# candidate GEMM output tiles (tokens x columns) of the wave term: the common cuBLAS tiles
GEMM_TILES = tuple((q, n) for q in (64, 128) for n in (64, 128, 256))
LINEAR_OPS = GEMMS + tuple(ELEMENTWISE_PER_LAYER)


@dataclass(frozen=True)
class Device:
    """Datasheet peaks the efficiencies are fractions of."""

    name: str
    peak_flops: float
    mem_bw_Bps: float
    sm_count: int | None


@dataclass(frozen=True)
class LinkFit:
    """latency + bytes / bandwidth (send/recv); all-reduce: 2(n-1) x latency + 2(n-1)/n x bytes / bus bandwidth."""

    latency_s: float
    bw_Bps: float
    rows: int


@dataclass(frozen=True)
class HostFit:
    prepare_fixed_s: float
    prepare_per_seq_s: float
    sample_fixed_s: float
    sample_per_seq_s: float
    schedule_fixed_s: float
    schedule_per_seq_s: float
    rows: int


@dataclass(frozen=True)
class AttentionShape:
    """One attention shape of a device's tables: a table's head counts at one TP degree, its rows."""

    label: str  # "<table>/tp<n>"
    shape: LayerShape
    rows: tuple[ProfileRow, ...]
    kv_width: int = 0  # the block tables' width the decode kernel saw (0: each row's context)

    def of(self, op: str) -> list[ProfileRow]:
        return [r for r in self.rows if r.op == op]


@dataclass
class KernelFit:
    coefficients: KernelCoefficients
    device: Device
    links: dict[str, LinkFit] = field(default_factory=dict)  # "<setup>/<collective>/<link>"
    host: HostFit | None = None
    rows_used: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what was extrapolated, and from what
    attention: list[AttentionShape] = field(default_factory=list)
    # shape label -> the coefficients fitted without that shape (leave-one-shape-out); empty when
    # the device has one attention shape (then alternate grid points are held out)
    held_out: dict[str, KernelCoefficients] = field(default_factory=dict)
    # the fastest large weight stream of the GEMM rows, a fraction of peak bandwidth (calibrate/borrowed.py)
    stream_cap: float | None = None


def layer_shape(meta: dict, tp: int) -> LayerShape:
    """A table's layer shape at TP degree `tp` (meta from engine/gpu_tables.shape_meta)."""
    h, q, kv = int(meta["hidden"]), int(meta["q_heads"]), int(meta["kv_heads"])
    return LayerShape(hidden=h, q_heads=q, kv_heads=kv, head_dim=h // q, intermediate=int(meta.get("intermediate") or 0),
                      vocab=int(meta.get("vocab") or 0), gated_mlp=meta.get("gated", "true") == "true", tp=tp,
                      hidden_act=meta.get("hidden_act", "silu"))


def _solve(resid, x0: Sequence[float], lo: Sequence[float], hi: Sequence[float]):
    from scipy.optimize import least_squares

    x0 = np.clip(np.log(x0), np.log(lo), np.log(hi))
    res = least_squares(lambda x: resid(np.exp(x)), x0, bounds=(np.log(lo), np.log(hi)), loss="soft_l1", f_scale=0.1)
    return np.exp(res.x)


# ---- token-count ops ---------------------------------------------------------------------------
def _token_groups(tables: Iterable[ProfileTable], ops: Sequence[str]) -> list[tuple[LayerShape, str, np.ndarray, np.ndarray]]:
    groups = []
    for table in tables:
        by_key: dict[tuple[int, str], tuple[list[int], list[float]]] = {}
        for r in table.rows:
            if r.op in ops:
                ms, ts = by_key.setdefault((r.tp, r.op), ([], []))
                ms.append(r.tokens)
                ts.append(r.time_s)
        for (tp, op), (ms, ts) in sorted(by_key.items()):
            groups.append((layer_shape(table.meta, tp), op, np.array(ms, dtype=float), np.array(ts)))
    return groups


def _token_resid(groups, device: Device, make) -> np.ndarray:
    out = []
    for shape, op, m, t in groups:
        lk = LayerKernels(shape, make(), device.peak_flops, device.mem_bw_Bps, device.sm_count)
        out.append(lk.op_s(op, m) / t - 1.0)
    return np.concatenate(out)


# (name, start, lower, upper bound) of the GEMM parameters every candidate fits
_GEMM_PARAMS = (("gemm_compute_efficiency", 0.7, 0.05, 1.0), ("gemm_memory_efficiency", 0.8, 0.05, 1.0),
                ("gemm_floor_s", 5e-6, 1e-7, 1e-3), ("gemm_memory_floor_s", 3e-6, 1e-7, 1e-3))


def fit_gemms(tables: Sequence[ProfileTable], device: Device, base: KernelCoefficients) -> KernelCoefficients:
    """GEMM efficiencies (compute; weight streaming by the small-M and, where rows lie on both sides
    of `GEMM_SMALL_TOKENS`, the tiled kernel) and floors for each candidate token quantum, and for
    each output tile (`GEMM_TILES`) with its tail-wave share; the candidate with the smallest
    median error wins (the smooth form first, so a tie keeps it)."""
    groups = _token_groups(tables, GEMMS)
    if not groups:
        return base
    tokens = np.concatenate([m for _, _, m, _ in groups])
    split = bool((tokens <= GEMM_SMALL_TOKENS).any() and (tokens > GEMM_SMALL_TOKENS).any())
    best = None
    for q, tn in [(q, 0) for q in QUANTA] + (list(GEMM_TILES) if device.sm_count else []):
        params = list(_GEMM_PARAMS) + ([("gemm_tile_memory_efficiency", 0.8, 0.05, 1.0)] if split else []) + (
            [("gemm_tail_wave", 0.5, 1e-3, 1.0)] if tn else [])

        def make(x, q=q, tn=tn, params=params):
            return replace(base, **({"gemm_token_quantum": q, "gemm_tile_n": tn, "gemm_tail_wave": 0.0,
                                     "gemm_tile_memory_efficiency": 0.0} | {p[0]: float(v) for p, v in zip(params, x)}))
        x = _solve(lambda x: _token_resid(groups, device, lambda: make(x)), *zip(*(p[1:] for p in params)))
        err = float(np.median(np.abs(_token_resid(groups, device, lambda: make(x)))))
        if best is None or err < best[0]:
            best = (err, make(x))
    return best[1]


ELEMENTWISE_OPS = (*ELEMENTWISE_PER_LAYER, "emb")


def fit_elementwise(tables: Sequence[ProfileTable], device: Device, base: KernelCoefficients) -> KernelCoefficients:
    """One bandwidth efficiency and one minimum token count (a per-token block's row at one SM's
    rate) per elementwise op, and a shared launch floor."""
    groups = _token_groups(tables, ELEMENTWISE_OPS)
    if not groups:
        return base

    def make(x):
        n = len(ELEMENTWISE_OPS)
        return replace(base, elementwise_floor_s=x[0], **{f"{op}_efficiency": e for op, e in zip(ELEMENTWISE_OPS, x[1:])},
                       **{f"{op}_min_tokens": float(v) for op, v in zip(ELEMENTWISE_OPS, x[1 + n:])})
    n = len(ELEMENTWISE_OPS)
    x = _solve(lambda x: _token_resid(groups, device, lambda: make(x)), [2e-6] + [0.5] * n + [1.0] * n,
               [1e-8] + [0.01] * n + [0.01] * n, [1e-3] + [1.0] * n + [1e4] * n)
    return make(x)


# ---- attention -------------------------------------------------------------------------------
def attention_shapes(tables: Iterable[ProfileTable]) -> list[AttentionShape]:
    """Every (table, TP degree) with attention or KV-write rows."""
    out = []
    for table in tables:
        by_tp: dict[int, list[ProfileRow]] = {}
        for r in table.rows:
            if r.op in ATTENTION_OPS:
                by_tp.setdefault(r.tp, []).append(r)
        out += [AttentionShape(f"{table.meta.get('model', '?')}/tp{tp}", layer_shape(table.meta, tp), tuple(rs),
                               int(table.meta.get("kv_width", 0)))
                for tp, rs in sorted(by_tp.items())]
    return out


def attention_split(rows: Sequence[ProfileRow]) -> tuple[list[ProfileRow], list[ProfileRow]]:
    """(fit rows, held-out rows): alternate points of the KV-length (decode) or chunk (prefill,
    KV write) grid; the held-out rule of a device with a single attention shape."""
    fit, held = [], []
    for op, key in (("attn_decode", "context"), ("attn_prefill", "tokens"), ("kv_write", "tokens")):
        of_op = [r for r in rows if r.op == op]
        index = {v: i for i, v in enumerate(sorted({getattr(r, key) for r in of_op}))}
        for r in of_op:
            (fit if index[getattr(r, key)] % 2 == 0 else held).append(r)
    return fit, held


def _balanced(items, device: Device, coeffs: KernelCoefficients, resid_of) -> np.ndarray:
    """Relative residuals, each shape's scaled by 1/sqrt(rows) so that every shape weighs the same."""
    out = []
    for shape, rows in items:
        lk = LayerKernels(shape, coeffs, device.peak_flops, device.mem_bw_Bps, device.sm_count)
        out.append(_resids(lk, rows, resid_of) / math.sqrt(len(rows)))
    return np.concatenate(out) if out else np.zeros(0)


def _shape_score(items, device: Device, coeffs: KernelCoefficients, resid_of) -> float:
    """The mean over shapes of the median absolute error (how a discrete choice is made)."""
    meds = []
    for shape, rows in items:
        lk = LayerKernels(shape, coeffs, device.peak_flops, device.mem_bw_Bps, device.sm_count)
        meds.append(float(np.median(np.abs(_resids(lk, rows, resid_of)))))
    return float(np.mean(meds))


def _resids(lk: LayerKernels, rows, resid_of) -> np.ndarray:
    """One shape's relative residuals: `resid_of` per row, or over all rows at once where it takes
    them so (`rows_at_once`)."""
    if getattr(resid_of, "rows_at_once", False):
        return resid_of(lk, rows)
    return np.array([resid_of(lk, r) for r in rows])


class _DecodeRows(tuple):
    """A shape's decode rows with their columns as arrays, made once per fit."""

    def __new__(cls, rows, kv_width: int = 0):
        self = super().__new__(cls, rows)
        self.kv_width = kv_width
        self.seqs = np.array([r.batch for r in rows], dtype=np.int64)
        self.context = self.seqs * np.array([r.context for r in rows], dtype=np.int64)
        self.time = np.array([r.time_s for r in rows])
        return self


def _decode_resid(lk: LayerKernels, rows: _DecodeRows) -> np.ndarray:
    return decode_blocks.rows_s(lk, rows.seqs, rows.context, rows.kv_width) / rows.time - 1.0


_decode_resid.rows_at_once = True


def _prefill_resid(lk: LayerKernels, r: ProfileRow) -> float:
    x, L = r.tokens, r.prefix
    return lk.prefill_s(x, 1, x * L + x * (x + 1) / 2, L + x) / r.time_s - 1.0


def _kv_write_resid(lk: LayerKernels, r: ProfileRow) -> float:
    return float(lk.kv_write_s(r.tokens)) / r.time_s - 1.0


def _items(shapes: Sequence[AttentionShape], op: str) -> list[tuple[LayerShape, list[ProfileRow]]]:
    return [(s.shape, rows) for s in shapes if (rows := s.of(op))]


def fit_decode(shapes: Sequence[AttentionShape], device: Device, base: KernelCoefficients) -> KernelCoefficients:
    """Floor, the kernel's FLOP efficiency, a per-block cost, the split-KV regime and, for each
    candidate of resident blocks per SM, the share of a part-empty last wave recovered. The one
    KV-read efficiency is not fitted: it is the highest fraction of peak bandwidth a measured row
    reached (`kv_read_cap`; see `KernelCoefficients.decode_kv_efficiency`)."""
    items = [(s.shape, _DecodeRows(rows, s.kv_width)) for s in shapes if (rows := s.of("attn_decode"))]
    if not items:
        return base
    cap = min(1.0, kv_read_cap(shapes, device) or 1.0)
    best = None
    for waves, count in itertools.product((0, 1, 2, 4), (0, 1) if device.sm_count else (0,)):
        def make(x, waves=waves, count=count):
            return replace(base, decode_waves=waves, decode_split_count=count, decode_floor_s=x[0],
                           decode_kv_efficiency=((1.0, cap),),
                           decode_compute_efficiency=x[1], decode_block_s=x[2], decode_half_blocks=x[3],
                           decode_split_s=x[4] if device.sm_count else 0.0,
                           decode_tail_recovery=x[5] if waves else 0.0)
        x = _solve(lambda x: _balanced(items, device, make(x), _decode_resid), [12e-6, 0.05, 1e-8, 4.0, 2e-6, 0.5],
                   [1e-7, 1e-3, 1e-12, 1e-3, 1e-9, 1e-3], [1e-3, 1.0, 1e-6, 1e4, 1e-4, 1.0])
        err = _shape_score(items, device, make(x), _decode_resid)
        if best is None or err < best[0]:
            best = (err, make(x))
    return best[1]


PREFILL_TILES = (0, 64, 128)  # candidate query rows per prefill block (0: no wave term)
# Per-block form (engine/pricing/prefill_blocks.py): FlashAttention-2's split-KV kernel (the paged
# cache's) tiles 64 query rows, one slot per SM. Both are the kernel's, not fitted choices: one shape
# cannot tell them apart (rows priced with 1 slot at 128 heads a GPU fit 2 slots as well and then
# missed 16 heads by 50%; A100's 405B chunks of 1,024 and 1,088 tokens fit 128-row tiles as well
# and then missed the 70B shape by 19%), and the 70B table shows the 64-row tile: its split-KV
# steps (a jump where L + x passes a key block) appear at 64 and 128 tokens (32 and 64 blocks, below
# 0.8 x 108 SMs) and not at 256 (128 blocks). One slot: the makespan's tail is a lone block on its
# SM, which two slots (each at half the SM's rate) would price twice as long.
PREFILL_BLOCK_FORM = (1, 64)  # (slots per SM, query rows per block)


def fit_prefill(shapes: Sequence[AttentionShape], device: Device, base: KernelCoefficients) -> KernelCoefficients:
    """With an SM count, the per-block form (`_fit_prefill_blocks`); without one, the pairs form
    (floor, efficiency of the chunk's causal pairs, half-keys and the prefix pairs' efficiency) for
    each candidate tile, the best mean per-shape median winning. The floor is bounded by twice the
    fixed cost of a one-sequence decode call (its floor and its split-KV regime): H100's shortest
    measured prefill takes 144 us, which cannot tell a launch floor from the FLOP term (unbounded,
    the fit put 69 us there)."""
    items = _items(shapes, "attn_prefill")
    if not items:
        return base
    floor_max = 2.0 * (base.decode_floor_s + base.decode_split_s)
    if device.sm_count:
        return _fit_prefill_blocks(items, device, base, floor_max)
    best = None
    for tile in PREFILL_TILES:
        def make(x, tile=tile):
            return replace(base, prefill_tile=tile, prefill_floor_s=x[0], prefill_efficiency=x[1],
                           prefill_half_keys=x[2], prefill_prefix_efficiency=x[3], prefill_slots_per_sm=0)
        x = _solve(lambda x: _balanced(items, device, make(x), _prefill_resid), [0.5 * floor_max, 0.25, 500.0, 0.25],
                   [1e-7, 0.01, 1.0, 0.01], [floor_max, 1.0, 1e6, 1.0])
        err = _shape_score(items, device, make(x), _prefill_resid)
        if best is None or err < best[0]:
            best = (err, make(x))
    return best[1]


def _fit_prefill_blocks(items, device: Device, base: KernelCoefficients, floor_max: float) -> KernelCoefficients:
    """Floor, causal and prefix tile-key efficiencies and the split-KV combine of the per-block form;
    tile and slots are `PREFILL_BLOCK_FORM`, the tail the list schedule's (`LIST_SCHEDULE_TAIL`): a
    fitted tail traded against the causal efficiency on one shape (H100's TP 8 rows span 2,048-2,176
    tokens) and TP 1 predicted from them was 16% off (10% with the schedule's). The combine is
    bounded like the floor and starts from the decode call's (the same combine kernel): rows that
    never split (H100's samples: >= 512 blocks) leave it there."""
    slots, tile = PREFILL_BLOCK_FORM

    def make(x):
        return replace(base, prefill_slots_per_sm=slots, prefill_tile=tile, prefill_floor_s=x[0],
                       prefill_efficiency=x[1], prefill_prefix_efficiency=x[2], prefill_tail=LIST_SCHEDULE_TAIL,
                       prefill_split_s=x[3])
    split0 = min(max(base.decode_split_s, 1e-9), floor_max)
    x = _solve(lambda x: _balanced(items, device, make(x), _prefill_resid), [0.5 * floor_max, 0.1, 0.3, split0],
               [1e-7, 0.005, 0.01, 1e-9], [floor_max, 1.0, 1.0, floor_max])
    return make(x)


def fit_kv_write(shapes: Sequence[AttentionShape], device: Device, base: KernelCoefficients) -> KernelCoefficients:
    """The bandwidth efficiency of the paged-cache store, where a table measured it. The store is an
    elementwise copy: its launch floor is the elementwise ops' (fitted on thousands of linear-table
    rows), not a free parameter. The tables hold 2 (A100) and 7 (H100) rows; H100's TP 8 rows all
    move ~1.1 MB, so a free floor fitted on them took the whole 6 us and priced TP 1's 5.5 MB
    stores 49% low."""
    items = _items(shapes, "kv_write")
    if not items:
        return base

    def make(x):
        return replace(base, kv_write_floor_s=base.elementwise_floor_s, kv_write_efficiency=x[0])
    x = _solve(lambda x: _balanced(items, device, make(x), _kv_write_resid), [0.05], [0.002], [1.0])
    return make(x)


def fit_attention(shapes: Sequence[AttentionShape], device: Device, base: KernelCoefficients) -> KernelCoefficients:
    return fit_kv_write(shapes, device, fit_prefill(shapes, device, fit_decode(shapes, device, base)))


def held_out_attention(shapes: Sequence[AttentionShape], device: Device,
                       base: KernelCoefficients) -> dict[str, KernelCoefficients]:
    """Leave one shape out: each shape's label -> the attention fitted on the other shapes (a GQA
    ratio no other shape has takes the nearest fitted one's efficiency: no extrapolation)."""
    if len(shapes) < 2:
        return {}
    return {s.label: fit_attention([o for o in shapes if o.label != s.label], device, base) for s in shapes}


def kv_read_cap(shapes: Sequence[AttentionShape], device: Device) -> float | None:
    """The highest fraction of peak bandwidth any measured decode row reached (KV bytes / time)."""
    fracs = [r.batch * r.context * s.shape.kv_bytes_per_token / r.time_s / device.mem_bw_Bps
             for s in shapes for r in s.of("attn_decode")]
    return max(fracs) if fracs else None


# ---- links and host ---------------------------------------------------------------------------
def link_features(r: ProfileRow) -> tuple[float, float]:
    """(latency multiplier, bytes on the slowest wire) of one collective row."""
    n = max(2, r.tp)
    if r.op == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n * r.nbytes
    return 1.0, float(r.nbytes)


def fit_link(rows: Sequence[ProfileRow]) -> LinkFit:
    """Non-negative least squares on relative error of latency x a + bytes / bandwidth."""
    feats = np.array([link_features(r) for r in rows])
    t = np.array([r.time_s for r in rows])
    from scipy.optimize import nnls

    coef, _ = nnls(feats / t[:, None], np.ones(len(rows)))
    lat, inv_bw = coef
    return LinkFit(float(lat), float(1.0 / inv_bw) if inv_bw > 0 else 1e15, len(rows))


def _line(rows: Sequence[ProfileRow]) -> tuple[float, float]:
    from scipy.optimize import nnls

    if not rows:
        return 0.0, 0.0
    t = np.array([r.time_s for r in rows])
    a = np.array([[1.0, r.batch] for r in rows]) / t[:, None]
    coef, _ = nnls(a, np.ones(len(rows)))
    return float(coef[0]), float(coef[1])


def fit_host(tables: Sequence[ProfileTable]) -> HostFit | None:
    """prepare, sample and schedule, each fixed + per sequence, over every host table (TP 1 and 2)."""
    rows = [r for t in tables for r in t.rows]
    if not rows:
        return None
    prep = _line([r for r in rows if r.op == "prepare"])
    samp = _line([r for r in rows if r.op == "sample"])
    sched = _line([r for r in rows if r.op == "schedule"])
    return HostFit(*prep, *samp, *sched, len(rows))


def fit_kernels(compute: Sequence[ProfileTable], attention: Sequence[ProfileTable], network: dict[str, ProfileTable],
                host: Sequence[ProfileTable], device: Device, *, fit_models: Sequence[str] = DEFAULT_FIT_MODELS,
                base: KernelCoefficients | None = None) -> KernelFit:
    """Fit everything the rows constrain; what they do not keeps `base`'s values (noted)."""
    base = base or KernelCoefficients()
    fit_tables = [t for t in compute if t.meta.get("model") in fit_models]
    if compute and not fit_tables:
        raise ConfigError(f"no compute table of the fit models {', '.join(fit_models)}; "
                          f"have {', '.join(sorted(t.meta.get('model', '?') for t in compute))}")
    c = fit_elementwise(fit_tables, device, fit_gemms(fit_tables, device, base))
    shapes = attention_shapes(attention)
    if len(shapes) == 1:  # one shape: alternate grid points are fitted, the others held out
        s = shapes[0]
        fitted = fit_attention([replace(s, rows=tuple(attention_split(s.rows)[0]))], device, c)
    else:
        fitted = fit_attention(shapes, device, c)
    result = KernelFit(fitted, device, attention=shapes, held_out=held_out_attention(shapes, device, c))
    result.rows_used = {"compute": sum(len(t.rows) for t in fit_tables),
                        "attention": sum(len(s.rows) for s in shapes) if len(shapes) > 1
                        else sum(len(attention_split(s.rows)[0]) for s in shapes)}
    for name, table in sorted(network.items()):
        for link in sorted({r.link for r in table.rows}):
            rows = [r for r in table.rows if r.link == link]
            result.links[f"{name}/{link}"] = fit_link(rows)
    result.host = fit_host(host)
    measured_g = sorted({s.shape.gqa for s in shapes if s.of("attn_decode")})
    if measured_g:
        result.notes.append(
            f"decode: one KV read efficiency ({fitted.decode_efficiency(1.0):.2f} of peak bandwidth, the most a "
            f"measured row reached) and one FLOP rate for every g; "
            f"measured at g = {', '.join(f'{g:g}' for g in measured_g)}")
    if not attention:
        result.notes.append("no attention table for this device: attention coefficients are the base profile's")
    if not network:
        result.notes.append("no network table for this device")
    if result.host is None:
        result.notes.append("no host-overhead table for this device")
    return result


def gqa_points_from(reference: KernelCoefficients, fitted: KernelCoefficients,
                    cap: float = 1.0) -> tuple[tuple[float, float], ...]:
    """`fitted`'s decode efficiencies at its GQA ratios, extended to `reference`'s other ratios by
    the reference's ratio to the nearest fitted point (how H100's single 405B-shape point, g=16,
    is carried to other g with A100's measured dependence on g), capped at `cap`: the highest
    fraction of peak bandwidth the device's own decode rows reached (without the cap H100's g <= 8
    came out at 0.998-1.0 of peak; the project's own paged kernel reached 0.48 on an H100)."""
    have = dict(fitted.decode_kv_efficiency)
    out = dict(have)
    for g, _ in reference.decode_kv_efficiency:
        if g in have:
            continue
        anchor = min(have, key=lambda a: abs(math.log2(a / g)))
        scaled = have[anchor] * reference.decode_efficiency(g) / reference.decode_efficiency(anchor)
        out[g] = min(1.0, scaled, max(cap, have[anchor]))
    return tuple(sorted(out.items()))
