"""Fit `KernelCoefficients`, links and host costs to operator-level profile rows, and report errors.

The rows come from testbed/calibrate/gpu_tables.py (the published tables) or from a user's own profile in
the same form. Every fit minimises relative error (a 10 us kernel matters as much, relatively, as
a 2 ms one: decode steps are made of the short ones) with bounded least squares on log-parameters.

Held out by default (`DEFAULT_FIT_MODELS`): the fit sees the Llama-2 pair's compute tables; every
other model is reported as held out. Attention data exist for few shapes, so attention rows are
split within each table instead: rows at an even index of their KV-length (decode) or chunk
(prefill) grid are fitted, the odd ones reported (`attention_split`).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from engine.profile_table import ProfileRow, ProfileTable
from engine.errors import ConfigError
from engine.kernels import ELEMENTWISE_PER_LAYER, GEMMS, KernelCoefficients, LayerKernels, LayerShape

__all__ = ["DEFAULT_FIT_MODELS", "Device", "LinkFit", "HostFit", "KernelFit", "fit_kernels", "layer_shape",
           "attention_split", "fit_link", "fit_host", "QUANTA"]

DEFAULT_FIT_MODELS = ("Llama-2-7b-hf", "Llama-2-70b-hf")
QUANTA = (1, 16, 32, 64, 128)  # candidate GEMM token quanta (cuBLAS tile heights)
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


@dataclass
class KernelFit:
    coefficients: KernelCoefficients
    device: Device
    links: dict[str, LinkFit] = field(default_factory=dict)  # "<setup>/<collective>/<link>"
    host: HostFit | None = None
    rows_used: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what was extrapolated, and from what


def layer_shape(meta: dict, tp: int) -> LayerShape:
    """A table's layer shape at TP degree `tp` (meta from engine/gpu_tables.shape_meta)."""
    h, q, kv = int(meta["hidden"]), int(meta["q_heads"]), int(meta["kv_heads"])
    return LayerShape(hidden=h, q_heads=q, kv_heads=kv, head_dim=h // q, intermediate=int(meta.get("intermediate") or 0),
                      vocab=int(meta.get("vocab") or 0), gated=meta.get("gated", "true") == "true", tp=tp)


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


def fit_gemms(tables: Sequence[ProfileTable], device: Device, base: KernelCoefficients) -> KernelCoefficients:
    """GEMM efficiencies and floor, for each candidate token quantum; the quantum with the smallest
    median error wins."""
    groups = _token_groups(tables, GEMMS)
    if not groups:
        return base
    best = None
    for q in QUANTA:
        def make(x=None, q=q):
            return replace(base, gemm_token_quantum=q, **({} if x is None else dict(
                gemm_compute_efficiency=x[0], gemm_memory_efficiency=x[1], gemm_floor_s=x[2])))
        x = _solve(lambda x: _token_resid(groups, device, lambda: make(x)), [0.7, 0.8, 5e-6],
                   [0.05, 0.05, 1e-7], [1.0, 1.0, 1e-3])
        err = float(np.median(np.abs(_token_resid(groups, device, lambda: make(x)))))
        if best is None or err < best[0]:
            best = (err, make(x))
    return best[1]


ELEMENTWISE_OPS = (*ELEMENTWISE_PER_LAYER, "emb")


def fit_elementwise(tables: Sequence[ProfileTable], device: Device, base: KernelCoefficients) -> KernelCoefficients:
    """One bandwidth efficiency per elementwise op and a shared launch floor."""
    groups = _token_groups(tables, ELEMENTWISE_OPS)
    if not groups:
        return base

    def make(x):
        return replace(base, elementwise_floor_s=x[0], **{f"{op}_efficiency": e for op, e in zip(ELEMENTWISE_OPS, x[1:])})
    n = len(ELEMENTWISE_OPS)
    x = _solve(lambda x: _token_resid(groups, device, lambda: make(x)), [2e-6] + [0.5] * n, [1e-8] + [0.01] * n,
               [1e-3] + [1.0] * n)
    return make(x)


# ---- attention -------------------------------------------------------------------------------
def attention_split(table: ProfileTable) -> tuple[list[ProfileRow], list[ProfileRow]]:
    """(fit rows, held-out rows): alternate points of each table's KV-length / chunk grid."""
    fit, held = [], []
    for op, key in (("attn_decode", "context"), ("attn_prefill", "tokens")):
        rows = [r for r in table.rows if r.op == op]
        grid = sorted({getattr(r, key) for r in rows})
        index = {v: i for i, v in enumerate(grid)}
        for r in rows:
            (fit if index[getattr(r, key)] % 2 == 0 else held).append(r)
    return fit, held


def _decode_resid(items, device: Device, coeffs: KernelCoefficients) -> np.ndarray:
    out = []
    for shape, rows in items:
        lk = LayerKernels(shape, coeffs, device.peak_flops, device.mem_bw_Bps, device.sm_count)
        out += [lk.decode_s(r.batch, r.batch * r.context) / r.time_s - 1.0 for r in rows]
    return np.array(out)


def _prefill_resid(items, device: Device, coeffs: KernelCoefficients) -> np.ndarray:
    out = []
    for shape, rows in items:
        lk = LayerKernels(shape, coeffs, device.peak_flops, device.mem_bw_Bps, device.sm_count)
        for r in rows:
            x, L = r.tokens, r.prefix
            out.append(lk.prefill_s(x, 1, x * L + x * (x + 1) / 2, L + x) / r.time_s - 1.0)
    return np.array(out)


def _by_shape(tables: Sequence[ProfileTable], op: str, fit_rows: bool = True):
    items = []
    for table in tables:
        rows = attention_split(table)[0 if fit_rows else 1]
        by_tp: dict[int, list[ProfileRow]] = {}
        for r in rows:
            if r.op == op:
                by_tp.setdefault(r.tp, []).append(r)
        items += [(layer_shape(table.meta, tp), rs) for tp, rs in sorted(by_tp.items())]
    return items


def fit_decode(tables: Sequence[ProfileTable], device: Device, base: KernelCoefficients) -> KernelCoefficients:
    """Floor, one KV-read efficiency per GQA ratio present, and whether SM waves help."""
    items = _by_shape(tables, "attn_decode")
    if not items:
        return base
    gqas = sorted({s.gqa for s, _ in items})
    best = None
    for waves in (0, 1, 2, 4):
        def make(x, waves=waves):
            return replace(base, decode_waves=waves, decode_floor_s=x[0],
                           decode_kv_efficiency=tuple((g, float(e)) for g, e in zip(gqas, x[1:])))
        x = _solve(lambda x: _decode_resid(items, device, make(x)), [12e-6] + [0.7] * len(gqas),
                   [1e-7] + [0.02] * len(gqas), [1e-3] + [1.0] * len(gqas))
        err = float(np.median(np.abs(_decode_resid(items, device, make(x)))))
        if best is None or err < best[0]:
            best = (err, make(x))
    return best[1]


def fit_prefill(tables: Sequence[ProfileTable], device: Device, base: KernelCoefficients) -> KernelCoefficients:
    items = _by_shape(tables, "attn_prefill")
    if not items:
        return base

    def make(x):
        return replace(base, prefill_floor_s=x[0], prefill_efficiency=x[1], prefill_half_keys=x[2])
    x = _solve(lambda x: _prefill_resid(items, device, make(x)), [12e-6, 0.25, 500.0], [1e-7, 0.01, 1.0],
               [1e-3, 1.0, 1e6])
    return make(x)


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
    c = fit_prefill(attention, device, fit_decode(attention, device, c))
    result = KernelFit(c, device)
    result.rows_used = {"compute": sum(len(t.rows) for t in fit_tables),
                        "attention": sum(len(attention_split(t)[0]) for t in attention)}
    for name, table in sorted(network.items()):
        for link in sorted({r.link for r in table.rows}):
            rows = [r for r in table.rows if r.link == link]
            result.links[f"{name}/{link}"] = fit_link(rows)
    result.host = fit_host(host)
    if not attention:
        result.notes.append("no attention table for this device: attention coefficients are the base profile's")
    if not network:
        result.notes.append("no network table for this device")
    if result.host is None:
        result.notes.append("no host-overhead table for this device")
    return result


def gqa_points_from(reference: KernelCoefficients, fitted: KernelCoefficients) -> tuple[tuple[float, float], ...]:
    """`fitted`'s decode efficiencies at its GQA ratios, extended to `reference`'s other ratios by
    the reference's ratio to the nearest fitted point (how H100's single 405B-shape point, g=16,
    is carried to other g with A100's measured dependence on g)."""
    have = dict(fitted.decode_kv_efficiency)
    out = dict(have)
    for g, _ in reference.decode_kv_efficiency:
        if g in have:
            continue
        anchor = min(have, key=lambda a: abs(math.log2(a / g)))
        scaled = have[anchor] * reference.decode_efficiency(g) / reference.decode_efficiency(anchor)
        out[g] = min(1.0, scaled)
    return tuple(sorted(out.items()))
