"""`testbed calibrate tables`: fit the cost model to published GPU kernel tables and report its error.

Reads `gpu-op-profiles/` through the data-directory rule (testbed/calibrate/gpu_tables.py), fits the
operator-level kernel coefficients, links and host costs per device (testbed/calibrate/kernel_fit.py), and
reports median / p90 / max error and bias by operator family, by bucket, per attention shape, GQA
ratio, model and TP degree, for the fitted profile and for the hand-set roofline it replaces, on
held-out models (compute) and held-out shapes (attention: each shape predicted by a fit of the
others; alternate grid points when a device has one shape). `--save DIR` writes the fitted hardware profiles (the shipped
defaults are regenerated with `--save engine/pricing/hardware_profiles`); `--profile CSV` reports the
same families for a profile measured on the user's own GPU against a hardware profile.
"""
from __future__ import annotations

import datetime as _dt
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
from rich.markup import escape

from engine.pricing.costmodel import BatchShape, CostModel
from engine.base.errors import ConfigError
from testbed.calibrate.gpu_tables import PublishedTables, read_published
from engine.pricing.hardware import HardwareSpec, get_hardware
from testbed.calibrate.kernel_fit import (DEFAULT_FIT_MODELS, LINEAR_OPS, AttentionShape, Device, HostFit, KernelFit,
                                          attention_split, fit_kernels, gqa_points_from, kv_read_cap, layer_shape,
                                          link_features)
from engine.pricing.kernels import KernelCoefficients, LayerKernels, LayerShape
from testbed.calibrate.borrowed import borrow_attention, weight_stream_cap
from testbed.calibrate.host_fit import SHIPPED_GROUP, fit_host_model
from testbed.calibrate.host_fit import error_rows as host_error_rows
from engine.pricing.models import ModelSpec

# The device each table was measured on, and the names its fit is shipped under.
DEVICE_HARDWARE = {"a100": "a100-80g", "h100": "h100-80g", "a40": "a40-48g"}
TOKEN_BUCKETS = [0, 16, 128, 512, 2048, 4096, 1 << 20]
CONTEXT_BUCKETS = [0, 511, 2047, 1 << 20]  # decode context: < 512, 512-2,047, >= 2,048
BATCH_BUCKETS = [0, 8, 32, 1 << 20]
FAMILY_ORDER = ["linear", "gemm", "elementwise", "decode", "prefill", "kv_write", "layer", "send_recv", "all_reduce",
                "host"]
ATTENTION_FAMILIES = ("decode", "prefill", "kv_write")
TARGETS = {"linear": "median <= 5%, p90 <= 12%", "decode": "median <= 12% per shape", "prefill": "median <= 15% per shape",
           "layer": "median <= 8%", "send_recv": ">= 1 MiB: <= 10%", "host": "median <= 15%, |bias| <= 5%"}


def device_spec(device: str) -> HardwareSpec:
    """The datasheet peaks of a table's device: its hand-set roofline entry (the "default" the
    report compares with)."""
    return get_hardware(f"{DEVICE_HARDWARE[device]}-roofline")


SM_COUNTS = {"a100": 108, "h100": 132, "a40": 84}


def as_device(device: str) -> Device:
    hw = device_spec(device)
    return Device(device, hw.peak_flops, hw.mem_bw_Bps, SM_COUNTS[device])


def spec_model(shape: LayerShape) -> ModelSpec:
    """A one-layer model of a table's shape (the cost model's unit)."""
    return ModelSpec(name="table-shape", architecture="llama", num_layers=1, hidden_size=shape.hidden,
                     num_heads=shape.q_heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                     intermediate_size=max(1, shape.intermediate), vocab_size=max(1, shape.vocab),
                     gated_mlp=shape.gated_mlp, hidden_act=shape.hidden_act)


def _cost(hw: HardwareSpec, shape: LayerShape) -> CostModel:
    return CostModel(spec_model(shape), hw, pp=1, tp=shape.tp)


def fitted_spec(base: HardwareSpec, name: str, fit: KernelFit, description: str, version: str) -> HardwareSpec:
    return replace(base, name=name, description=description, kernels=fit.coefficients.to_mapping(),
                   sm_count=fit.device.sm_count, version=version, calibration=host_calibration(fit))


def host_calibration(fit: KernelFit) -> dict | None:
    """The host tables' per-iteration costs as cost-model coefficients: input preparation = the
    scheduler + prepare_inputs (both run on the CPU before a step), sampling per sequence spread
    over a 32k vocabulary (the host tables' models). Kernel floors are priced per operator now, so
    the roofline's per-layer launch overhead goes to 0."""
    cal: dict = {"per_layer_overhead_s": 0.0}
    if fit.host is not None:
        h = fit.host
        cal.update(prep_fixed_s=h.prepare_fixed_s + h.schedule_fixed_s,
                   prep_per_seq_s=h.prepare_per_seq_s + h.schedule_per_seq_s,
                   sample_fixed_s=h.sample_fixed_s, sample_per_token_vocab_s=h.sample_per_seq_s / 32000.0)
    return cal


# ---- error rows ---------------------------------------------------------------------------------
def _bucket(value: float, edges: list[int]) -> str:
    i = int(np.searchsorted(edges, value, side="left"))
    i = min(max(i, 1), len(edges) - 1)
    return f"{edges[i - 1] + 1}-{edges[i]}" if edges[i] < 1 << 20 else f">{edges[i - 1]}"


def _ops_by_count(table) -> dict[tuple[int, int], dict[str, list[float]]]:
    """(tp, tokens) -> op -> measured times (two norms a layer; a few token counts appear twice)."""
    by: dict[tuple[int, int], dict[str, list[float]]] = {}
    for r in table.rows:
        by.setdefault((r.tp, r.tokens), {}).setdefault(r.op, []).append(r.time_s)
    return by


def _linear_sum(ops: dict[str, list[float]]) -> float | None:
    """One layer's measured linear part, or None where an op is missing."""
    if not all(op in ops for op in LINEAR_OPS):
        return None
    return sum(sum(ops[op]) for op in LINEAR_OPS) / len(ops["gemm_qkv"])


def _row_shape(r) -> BatchShape:
    if r.op == "attn_decode":
        return BatchShape.decode(r.batch, r.context)
    return BatchShape.from_parts([(r.prefix, r.tokens, True)])


def _cost_pairs(meta: dict, fitted: HardwareSpec, default: HardwareSpec):
    """tp -> (fitted, default) cost models of a table's shape, built once per TP degree."""
    cache: dict[int, tuple[CostModel, CostModel]] = {}

    def get(tp: int) -> tuple[CostModel, CostModel]:
        if tp not in cache:
            shape = layer_shape(meta, tp)
            cache[tp] = (_cost(fitted, shape), _cost(default, shape))
        return cache[tp]
    return get


def linear_rows(tables: PublishedTables, fitted: HardwareSpec, default: HardwareSpec) -> list[dict]:
    """Per (model, tp, tokens): the layer's linear part (sum of its measured ops) and per op."""
    out = []
    for model, table in tables.compute.items():
        held = model not in DEFAULT_FIT_MODELS
        costs = _cost_pairs(table.meta, fitted, default)
        for (tp, m), ops in sorted(_ops_by_count(table).items()):
            meas = _linear_sum(ops)
            if m > 4096 or meas is None:
                continue
            fit_cm, def_cm = costs(tp)
            sh = BatchShape.decode(m, 1)
            out.append(dict(family="linear", model=model, tp=tp, x=m, bucket=_bucket(m, TOKEN_BUCKETS),
                            measured=meas, fitted=fit_cm.layer_parts_s(sh)[0], default=def_cm.layer_parts_s(sh)[0],
                            held=held))
            for op in LINEAR_OPS:
                fam = "gemm" if op.startswith("gemm") else "elementwise"
                out.append(dict(family=fam, model=model, tp=tp, x=m, bucket=op, measured=ops[op][0],
                                fitted=float(fit_cm.kernels.k.op_s(op, m)), default=np.nan, held=held))
    return out


def _held_split(fit: KernelFit, s: AttentionShape) -> tuple[list, list, KernelCoefficients]:
    """(in-sample rows, held-out rows, the coefficients that predict the held-out ones): every row
    twice under leave-one-shape-out, alternate grid points with one shape."""
    if s.label in fit.held_out:
        return list(s.rows), list(s.rows), fit.held_out[s.label]
    fit_rows, held = attention_split(s.rows)
    return fit_rows, held, fit.coefficients


def _attention_kind(r) -> tuple[str, int, float, str]:
    """(family, index in `layer_parts_s`, x, bucket) of an attention-table row."""
    if r.op == "attn_decode":
        return "decode", 2, r.batch * r.context, f"ctx {_bucket(r.context, CONTEXT_BUCKETS)}, batch {_bucket(r.batch, BATCH_BUCKETS)}"
    if r.op == "kv_write":
        return "kv_write", 4, r.tokens, _bucket(r.tokens, TOKEN_BUCKETS)
    return "prefill", 3, r.tokens, f"chunk {_bucket(r.tokens, TOKEN_BUCKETS)}, {'prefix' if r.prefix else 'no prefix'}"


def _attention_pricer(hw: HardwareSpec, coeffs: KernelCoefficients, s: AttentionShape, shape: LayerShape | None = None):
    """row, part index -> the cost model's price of that part of an attention row (in a layer of
    `shape`, default the attention shape's); a decode row of a table whose block tables had their
    own width is priced with it (`AttentionShape.kv_width`)."""
    shape = shape or s.shape
    cm = _cost(replace(hw, kernels=coeffs.to_mapping()), shape)
    lk = LayerKernels(shape, coeffs, hw.peak_flops, hw.mem_bw_Bps, hw.sm_count) if s.kv_width else None

    def price(r, i: int) -> float:
        if lk is not None and r.op == "attn_decode":
            return lk.decode_s(r.batch, r.batch * r.context, s.kv_width)
        return cm.layer_parts_s(_row_shape(r))[i]
    return price


def attention_rows(fit: KernelFit, fitted: HardwareSpec, default: HardwareSpec) -> list[dict]:
    """Attention and KV-write rows of every shape: in sample (the shipped fit) and held out."""
    out = []
    for s in fit.attention:
        fit_rows, held_rows, held_c = _held_split(fit, s)
        prices = {False: _attention_pricer(fitted, KernelCoefficients.from_mapping(fitted.kernels), s),
                  True: _attention_pricer(fitted, held_c, s)}
        def_cm = _cost(default, s.shape)
        for held, rows in ((False, fit_rows), (True, held_rows)):
            for r in rows:
                fam, i, x, bucket = _attention_kind(r)
                d = def_cm.layer_parts_s(_row_shape(r))[i]
                out.append(dict(family=fam, model=s.label, tp=r.tp, x=x, bucket=bucket, measured=r.time_s,
                                fitted=prices[held](r, i),
                                default=d if d else np.nan, held=held, gqa=f"{s.shape.gqa:g}"))
    return out


def layer_rows(tables: PublishedTables, fit: KernelFit, fitted: HardwareSpec, default: HardwareSpec) -> list[dict]:
    """A whole decoder layer where one model's linear ops and an attention shape agree: measured
    linear part + measured attention against the same sum predicted (the attention by the fit that
    held the shape out; the model is held out when it is not a fit model)."""
    out = []
    for s in fit.attention:
        sh0 = s.shape
        for model, ctable in tables.compute.items():
            cm = ctable.meta
            if (int(cm["hidden"]), int(cm["q_heads"]), int(cm["kv_heads"])) != (sh0.hidden, sh0.q_heads, sh0.kv_heads):
                continue
            lin = {k: v for k, ops in _ops_by_count(ctable).items() if (v := _linear_sum(ops)) is not None}
            shape = layer_shape(cm, sh0.tp)
            _, held_rows, held_c = _held_split(fit, s)
            fit_cm, def_cm = _cost(fitted, shape), _cost(default, shape)
            att_price = _attention_pricer(fitted, held_c, s, shape)
            for r in held_rows:
                m = r.batch if r.op == "attn_decode" else r.tokens
                if r.op == "kv_write" or (r.tp, m) not in lin:
                    continue
                sh = _row_shape(r)
                att = att_price(r, 2 if r.op == "attn_decode" else 3)
                def_p = def_cm.layer_parts_s(sh)
                out.append(dict(family="layer", model=model, tp=r.tp, x=m, bucket=r.op.removeprefix("attn_"),
                                measured=lin[(r.tp, m)] + r.time_s,
                                fitted=fit_cm.layer_parts_s(sh)[0] + att,
                                default=def_p[0] + def_p[2] + def_p[3], held=model not in DEFAULT_FIT_MODELS))
    return out


def link_rows(tables: PublishedTables, fit: KernelFit, default: HardwareSpec) -> list[dict]:
    out = []
    for name, table in tables.network.items():
        for r in table.rows:
            lf = fit.links[f"{name}/{r.link}"]
            lat_mult, wire = link_features(r)
            bw = default.allreduce_bw_Bps if r.op == "all_reduce" else default.p2p_bw_Bps
            out.append(dict(family=r.op, model=f"{name.split('/')[0]}/{r.link}", tp=r.tp, x=r.nbytes,
                            bucket=">=1MiB" if r.nbytes >= 1 << 20 else "<1MiB", measured=r.time_s,
                            fitted=lat_mult * lf.latency_s + wire / lf.bw_Bps,
                            default=lat_mult * default.p2p_latency_s + wire / bw, held=False))
    return out


def host_rows(tables: PublishedTables, fit: KernelFit) -> list[dict]:
    if fit.host_model is not None:
        lm_head = lm_head_pricer(host_table_spec(fit, tables), tables)
        return host_error_rows(tables.host, fit.host_model, _vocab_of(tables), lm_head)
    h = fit.host
    if h is None:
        return []
    line = {"prepare": (h.prepare_fixed_s, h.prepare_per_seq_s), "sample": (h.sample_fixed_s, h.sample_per_seq_s),
            "schedule": (h.schedule_fixed_s, h.schedule_per_seq_s)}
    return [dict(family="host", model=t.meta["model"], tp=r.tp, x=r.batch, bucket=r.op, measured=r.time_s,
                 fitted=line[r.op][0] + line[r.op][1] * r.batch, default=np.nan, held=False)
            for t in tables.host for r in t.rows]


def error_frame(tables: PublishedTables, fit: KernelFit, fitted: HardwareSpec, default: HardwareSpec) -> pd.DataFrame:
    rows = (linear_rows(tables, fitted, default) + attention_rows(fit, fitted, default)
            + layer_rows(tables, fit, fitted, default) + link_rows(tables, fit, default) + host_rows(tables, fit))
    df = pd.DataFrame(rows)
    df["err_fitted"] = df.fitted / df.measured - 1.0
    df["err_default"] = df.default / df.measured - 1.0
    return df


STAT_COLUMNS = ["rows"] + [f"{w}_{s}" for w in ("fitted", "default") for s in ("median", "p90", "max", "bias")]


def summarise(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Error statistics per group; no rows (a device without attention tables: the A40's) is an
    empty table, not a KeyError on the absent column (issue 48 item 4: `--device a40`)."""
    if df.empty or not set(by) <= set(df.columns):
        return pd.DataFrame(columns=[*by, *STAT_COLUMNS])

    def stats(g: pd.DataFrame) -> pd.Series:
        out: dict = {"rows": len(g)}
        for which in ("fitted", "default"):
            e = g[f"err_{which}"].dropna()
            a = e.abs()
            out |= {f"{which}_median": a.median(), f"{which}_p90": a.quantile(0.9), f"{which}_max": a.max(),
                    f"{which}_bias": e.median()}  # NaN when there is no prediction (no roofline per op)
        return pd.Series(out)

    return df.groupby(by, sort=False).apply(stats, include_groups=False).reset_index()


def headline(df: pd.DataFrame) -> pd.DataFrame:
    """The issue's targets: held-out rows per family (send/recv: >= 1 MiB)."""
    parts = []
    for fam in FAMILY_ORDER:
        sel = df[df.family == fam]
        if fam in ("linear", "gemm", "elementwise", "layer", "host", *ATTENTION_FAMILIES):
            sel = sel[sel.held]
        if fam == "send_recv":
            sel = sel[sel.x >= 1 << 20]
        if len(sel):
            parts.append(sel.assign(family=fam))
    if not parts:
        return pd.DataFrame()
    out = summarise(pd.concat(parts), ["family"])
    out["rows"] = out["rows"].astype(int)
    out["target"] = out.family.map(TARGETS).fillna("")
    return out


# ---- fitting every device, the shipped profiles ---------------------------------------------
SOURCE = "Vidur profiling tables (microsoft/vidur @7d47513, MIT; Agrawal et al., MLSys 2024)"
# Table-less GPUs: datasheet peaks with the A100's fitted efficiencies (and SM counts).
A100_FITTED_KIN = {"a100-40g": 108, "a800-80g": 108, "l20-48g": 92, "rtx4090": 128}


def fit_device(tables: PublishedTables, fit_models, reference: KernelFit | None) -> KernelFit:
    """One device's fit. Without attention rows (A40) the attention terms are `reference`'s; with
    too few GQA ratios (H100: only the 405B shape, g=16) the others follow `reference`'s
    dependence on g."""
    base = reference.coefficients if reference is not None else None
    fit = fit_kernels(list(tables.compute.values()), tables.attention, tables.network, tables.host,
                      as_device(tables.device), fit_models=fit_models, base=base)
    fit.stream_cap = weight_stream_cap(tables.compute.values(), fit.device.mem_bw_Bps, layer_shape)
    _fit_host(fit, tables)
    if reference is not None and tables.attention:
        cap = kv_read_cap(fit.attention, fit.device) or 1.0
        points = gqa_points_from(reference.coefficients, fit.coefficients, cap)
        if points != fit.coefficients.decode_kv_efficiency:
            fit.coefficients = replace(fit.coefficients, decode_kv_efficiency=points)
            measured = sorted({layer_shape(t.meta, 1).gqa for t in tables.attention})
            others = [g for g, _ in points if g not in measured]
            fit.notes.append(f"decode KV efficiency measured only at g={', '.join(f'{g:g}' for g in measured)}; "
                             f"g={', '.join(f'{g:g}' for g in others)} follow {reference.device.name}'s dependence on g, "
                             f"capped at {cap:.2f} of peak bandwidth (the most any measured decode row reached)")
    elif reference is not None:
        fit.notes.append(f"attention terms are {reference.device.name}'s fit (no attention table for {tables.device})")
        fit.coefficients, notes = borrow_attention(fit.coefficients, reference.device.sm_count, fit.device.sm_count,
                                                   _same_memory(reference.device, fit.device), fit.stream_cap)
        fit.notes += notes
    return fit


def _vocab_of(tables: PublishedTables):
    vocab = {name.split("/")[-1]: int(t.meta.get("vocab") or 32000) for name, t in tables.compute.items()}
    return lambda model: vocab.get(model.split("/")[-1], 32000)


# The node the host tables were measured in, for the lm_head's logits gather at TP > 1 (the
# device's own NCCL tables; the shipped A100 profile's PCIe links are the runs', not the tables').
HOST_TABLE_LINKS = {"a100": "a100_dgx", "h100": "h100_dgx", "a40": "a40_pairwise_nvlink"}


def host_table_spec(fit, tables: PublishedTables, base: HardwareSpec | None = None) -> HardwareSpec:
    """`base` (default: the fit's kernels on the device's datasheet peaks) with the links of the node
    the host tables were measured in (`fit.links`, the device's own NCCL tables)."""
    if base is None:
        base = fitted_spec(device_spec(tables.device), "host-tables", fit, "host tables' node", "fit")
    return replace(base, **_link_fields(fit, HOST_TABLE_LINKS.get(tables.device, "")))


def lm_head_pricer(hw: HardwareSpec, tables: PublishedTables):
    """(model, tp, rows) -> what the stage forward charges for the lm_head GEMM and logits gather
    (`KernelPricer.lm_head_s`) on `hw` (`host_table_spec`): the part of a host table's `sample` row
    the forward already prices (testbed/calibrate/host_fit.py)."""
    shapes = {name.split("/")[-1]: t.meta for name, t in tables.compute.items()}
    memo: dict = {}

    def price(model: str, tp: int, rows: int) -> float:
        meta = shapes.get(model.split("/")[-1])
        if meta is None:
            return 0.0
        if (model, tp) not in memo:
            memo[model, tp] = _cost(hw, layer_shape(meta, tp)).kernels
        return memo[model, tp].lm_head_s(rows)

    return price


def _fit_host(fit: KernelFit, tables: PublishedTables) -> None:
    """The host tables by code version, TP class and vocabulary (testbed/calibrate/host_fit.py); the
    shipped line is `SHIPPED_GROUP`'s (prepare and schedule per sequence, sampling per sequence x
    vocabulary entry, without the lm_head the stage forward prices)."""
    if not tables.host:
        fit.host_model = None
        return
    model = fit_host_model(tables.host, _vocab_of(tables), lm_head_pricer(host_table_spec(fit, tables), tables))
    fit.host_model = model
    if model is None:
        return
    groups = set.intersection(*(set(model.fixed.get(op, {})) for op in ("prepare", "sample", "schedule")))
    if not groups:
        return
    # the shipped group when measured, else a TP-1 group (a user's tables: their own code version)
    g = SHIPPED_GROUP if SHIPPED_GROUP in groups else min(groups, key=lambda k: (k[1] != "1", k))
    per_vocab = model.per_seq_vocab.get(g, 0.0)
    fit.host = HostFit(model.fixed["prepare"][g], model.per_seq["prepare"][g], model.fixed["sample"][g],
                       per_vocab, model.fixed["schedule"][g], model.per_seq["schedule"][g], len(model.fixed))


def _same_memory(a: Device, b: Device) -> bool:
    """Same SM count and peak bandwidth: a borrowed attention fit carries across no difference."""
    return a.sm_count == b.sm_count and a.mem_bw_Bps == b.mem_bw_Bps


def _link_fields(fit: KernelFit, setup: str) -> dict:
    """p2p (send/recv inside one node) and all-reduce (inside one node) of a fitted setup."""
    out: dict = {}
    sr = fit.links.get(f"{setup}/send_recv/node")
    ar = fit.links.get(f"{setup}/all_reduce/node")
    if sr is not None:
        out |= {"p2p_bw_gbs": sr.bw_Bps / 1e9, "p2p_latency_s": sr.latency_s}
    if ar is not None:
        out |= {"allreduce_bw_gbs": ar.bw_Bps / 1e9, "allreduce_latency_s": ar.latency_s}
    elif sr is not None:
        out |= {"allreduce_bw_gbs": sr.bw_Bps / 1e9, "allreduce_latency_s": sr.latency_s}
    return out


def shipped_specs(fits: dict[str, KernelFit], date: str) -> list[tuple[HardwareSpec, dict]]:
    """The hardware profiles shipped as defaults, each with its provenance."""
    version = f"vidur-7d47513-fit-{date}"
    out = []

    def add(base: HardwareSpec, name: str, fit: KernelFit, how: str, links: dict, extra_notes: list[str]):
        spec = replace(fitted_spec(base, name, fit, f"{base.description.split(';')[0]}; {how}", version), **links)
        notes = fit.notes + extra_notes
        out.append((spec, {"source": SOURCE, "device_tables": fit.device.name, "rows_used": fit.rows_used,
                           "fit_models": list(DEFAULT_FIT_MODELS), "date": date, "version": version,
                           "command": "testbed calibrate tables --save engine/pricing/hardware_profiles", "notes": notes}))

    if "a100" in fits:
        a = fits["a100"]
        add(get_hardware("a100-80g-roofline"), "a100-80g", a, "kernels fitted to A100 tables", {},
            ["links: TD-Pipe's measured PCIe (20.8 GB/s p2p, 14.7 GB/s all-reduce), not the tables' NVLink"])
        for name, sms in A100_FITTED_KIN.items():
            base = get_hardware(f"{name}-roofline")
            kin = replace(a.device, sm_count=sms, mem_bw_Bps=base.mem_bw_Bps)
            coeffs, notes = borrow_attention(a.coefficients, a.device.sm_count, sms, _same_memory(a.device, kin),
                                             a.stream_cap)
            add(base, name, replace(a, device=kin, coefficients=coeffs),
                "datasheet peaks with A100-fitted efficiencies (no table for this GPU)", {},
                [f"no measured table for {name}: A100-fitted efficiencies on its datasheet peaks", *notes])
    if "h100" in fits:
        h = fits["h100"]
        host = [] if h.host else ["host costs: none measured on H100 hosts; A100 host fit used"]
        hfit = replace(h, host=h.host or (fits["a100"].host if "a100" in fits else None))
        add(get_hardware("h100-80g-roofline"), "h100-80g", hfit, "kernels fitted to H100 tables (a vLLM-class engine: kernel time only; this project's torch engine on an H100 (main 1a5c8d9) is h100-80g-torch-engine-1a5c8d9)",
            _link_fields(h, "h100_dgx"), host + ["links: h100_dgx inside one node (NVSwitch)"])
    if "a40" in fits:
        f = fits["a40"]
        add(get_hardware("a40-48g-roofline"), "a40-48g", f, "kernels fitted to A40 tables", _link_fields(f, "a40_pairwise_nvlink"),
            ["links: a40_pairwise_nvlink inside one node; all-reduce from send/recv (no all-reduce table)"])
    return out


# ---- the command ------------------------------------------------------------------------------
def tables_dir(arg: str | None) -> Path:
    """DIR, else the data-directory rule (data_dir= / $TESTBED_DATA_DIR / ../shared/data / cache)."""
    if arg:
        return Path(arg)
    from workloads.data import DataNotFoundError, resolve_data_file

    try:
        return resolve_data_file("gpu-op-profiles/README.md").parent
    except DataNotFoundError as exc:
        raise ConfigError(f"no published GPU tables found: {exc}") from None


def run_tables(directory: Path, devices: list[str], fit_models, out_dir: Path, save: Path | None, console) -> dict:
    """Fit every device (A100 first: the others borrow from it), write the report, return it."""
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    order = [d for d in ("a100", "h100", "a40") if d in devices or (d == "a100" and devices != ["a100"])]
    fits, frames = {}, []
    for device in order:
        tables = read_published(directory, device)
        fit = fit_device(tables, fit_models, fits.get("a100"))
        fits[device] = fit
        if device not in devices:
            continue
        default = device_spec(device)
        fitted = fitted_spec(default, f"{DEVICE_HARDWARE[device]}-fit", fit, "fit", "fit")
        frames.append(error_frame(tables, fit, fitted, default).assign(device=device))
        console.print(f"[bold]{device}[/]: {tables.num_rows:,} rows read, fitted in the same pass; "
                      + ("; ".join(fit.notes) or "no extrapolation"))
        for note in tables.skipped:  # what was not read: said, not passed over (issue 38 item 9)
            console.print(f"[yellow]warning:[/] {device}: {escape(note)}", highlight=False, soft_wrap=True)
        for family in missing_families(frames[-1]):
            console.print(f"[yellow]warning:[/] {device}: no {family} rows in its tables; the report has no "
                          f"{family} errors for it", highlight=False, soft_wrap=True)
    df = pd.concat(frames, ignore_index=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = write_report(df, fits, out_dir)
    if save is not None:
        for spec, provenance in shipped_specs(fits, date):
            provenance["errors"] = [
                {k: (round(float(v), 4) if isinstance(v, float) else v) for k, v in row.items()
                 if k in ("family", "fitted_median", "fitted_p90", "fitted_max", "fitted_bias", "default_median",
                          "default_bias") and not (isinstance(v, float) and v != v)} | {"rows": int(row["rows"])}
                for row in report["headline"].get(provenance["device_tables"], [])]
            from testbed.calibrate.fit import save_hardware_profile

            save_hardware_profile(spec, save / f"{spec.name}.yaml", extra=provenance)
            console.print(f"saved hardware profile {spec.name} -> {save / (spec.name + '.yaml')}")
    return report


def missing_families(df: pd.DataFrame) -> list[str]:
    """The kinds of rows a device's report lacks (the A40's tables have no attention)."""
    have = set(df["family"]) if "family" in df.columns else set()
    want = {"linear": {"linear"}, "attention": set(ATTENTION_FAMILIES), "network": {"send_recv", "all_reduce"}}
    return [name for name, fams in want.items() if not have & fams]


def markdown_table(df: pd.DataFrame) -> str:
    """A pipe table; error fractions as percentages."""
    def cell(col: str, v) -> str:
        if isinstance(v, float):
            return "" if np.isnan(v) else (f"{100 * v:+.1f}%" if col.endswith("bias") else f"{100 * v:.1f}%")
        return str(v)
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(c, v) for c, v in zip(df.columns, row)) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


SHORT_COLUMNS = ["rows", "fitted_median", "fitted_p90", "fitted_max", "fitted_bias", "default_median", "default_bias"]


def breakdowns(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The errors beside the headline: held-out attention per shape and per GQA ratio (leave one
    shape out), the linear part per model family and per TP degree, every family per bucket."""
    held = df[df.held]
    att = held[held.family.isin(ATTENTION_FAMILIES)]
    lin = df[df.family == "linear"]
    out = {"shape": summarise(att, ["device", "family", "model", "gqa"]).rename(columns={"model": "shape"}),
           "gqa": summarise(att, ["device", "family", "gqa"]),
           "model": summarise(lin, ["device", "model", "held"]),
           "tp": summarise(lin[lin.held], ["device", "tp"]),
           "bucket": summarise(df[df.held | df.family.isin(["send_recv", "all_reduce", "host"])],
                               ["device", "family", "bucket"])}
    return {k: v.astype({"rows": int}).round(4) for k, v in out.items()}


def write_report(df: pd.DataFrame, fits: dict[str, KernelFit], out_dir: Path) -> dict:
    head = {d: headline(g).to_dict("records") for d, g in df.groupby("device", sort=False)}
    parts = breakdowns(df)
    for name, table in parts.items():
        table.to_csv(out_dir / f"errors_by_{name}.csv", index=False)
    coeffs = {d: f.coefficients.to_mapping() for d, f in fits.items()}
    report = {"headline": head, "coefficients": coeffs,
              "by_shape": parts["shape"].to_dict("records"), "by_gqa": parts["gqa"].to_dict("records"),
              "by_tp": parts["tp"].to_dict("records"),
              "links": {d: {k: vars(v) for k, v in f.links.items()} for d, f in fits.items()},
              "notes": {d: f.notes for d, f in fits.items()}}
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=float))
    md = ["# Cost model vs published GPU kernel tables\n"]
    for d, rows in head.items():
        md.append(f"\n## {d} (held-out rows; fitted vs roofline)\n")
        md.append(markdown_table(pd.DataFrame(rows)))
    titles = {"shape": "Attention per held-out shape (leave one shape out)", "gqa": "Attention per GQA ratio (held out)",
              "model": "Linear part per model", "tp": "Linear part per TP degree (held-out models)"}
    for name, title in titles.items():
        md += [f"\n## {title}\n", markdown_table(parts[name])]
    (out_dir / "report.md").write_text("\n".join(md) + "\n")
    from testbed.calibrate.figures import error_figures

    error_figures(df, out_dir)
    return report
