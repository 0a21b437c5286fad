"""Fit a hardware profile from real runs: what `testbed calibrate runs` does.

Each traced micro-batch of a real run (testbed/calibrate/runs.py) gives, per stage, its forward,
prepare and (last stage) sample spans; the driver's dispatch (from the completion its launch
followed, or its launch, until stage 0 starts preparing it, taken only where stage 0 was idle);
the return (sampling's end until the driver recorded the completion); and between stages the
transfer (from when both the send and the receive had started to the receive's end). The fit:

- forward: bounded least squares on the error in seconds of `CostModel.stage_compute_s` with the
  micro-batch's rebuilt shape (seconds, not relative error: a run's throughput is a sum of times,
  and relative least squares under-predicted the H100 run's eager steps by 12% in total where
  this is unbiased). On a kernel-table base (`h100-80g`: operators priced by fitted
  kernels) the kernels stay as fitted and two engine terms around them are fitted: the GPU time
  the engine spends above the kernels (`per_layer_overhead_s`, plus `stage_overhead_s` when the
  runs have stages of different depths: the unfused small kernels, the same in a graph replay
  and eagerly, so `decode_overhead_ratio` stays 1) and an eager step's launch floor
  (`launch_floor_per_layer_s` + `launch_floor_per_seq_s` x sequences). On the H100 run this puts the 2,048-token prefill at 60.4 ms
  (measured 60.2 ms), where one additive overhead for eager steps said 78 ms. On a roofline base (a
  CPU profile) the roofline's efficiencies and overheads are fitted as `testbed profile` does, with
  `decode_overhead_ratio` kept at 1 when no run replayed CUDA graphs and `decode_padding` fitted
  where decodes of different contexts ran together (the CPU engine pads them to the longest);
- prepare, sample, dispatch, return, transfer: non-negative linear least squares (in seconds) on their
  measured forms (prepare: fixed + per sequence + per token; sample: fixed + per row x vocab,
  flat when the engine samples greedily on the device; dispatch: fixed + per sequence + a step
  with a prefill chunk; return: fixed; transfer: latency + bytes / bandwidth);
- a profile table (`testbed profile`'s CSV) may be fitted together with the runs: its forward
  rows join the forward fit;
- `own_attention` (`--own-attention`): the engine's decode attention is its own kernel, not the
  one the base's tables measured (FlashAttention-2's split-KV decode): one block per sequence x KV
  head, as this project's Triton kernel launches, with its read rate and few-blocks term fitted
  beside the engine terms. On the H100 the base's terms priced this engine's decodes 14% low at
  batch 1-16 and 13% high at 129-256; fitted, the decode forwards' p90 went 14.5% -> 7.2%.

The first micro-batch of a run pays for first use (CUDA kernels' lazy loading, allocator growth:
7.1 ms of sampling instead of 0.35 ms on the H100): it is left out of the fit and its excess
reported (`first_use_s`), since the engine should warm up before serving rather than the
simulator price it.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from engine.pricing.cost_coefficients import TABLE_FIELDS
from engine.pricing.costmodel import BatchShape, CostCoefficients, CostModel
from engine.base.errors import ConfigError, bad_value
from engine.pricing.hardware import HardwareSpec
from engine.pricing.profile_table import ProfileTable
from testbed.calibrate.cpu_sampling_fit import cpu_sampling_samples, fit_cpu_sampling
from testbed.calibrate.fit import FORWARD_PARAMS, _nnls
from testbed.calibrate.handover_fit import fit_handover
from testbed.calibrate.hop_fit import HOP_MODES, price_hops_once
from testbed.calibrate.shared_device import check_some_shared
from testbed.calibrate.runs import RealRun, ReplayedBatch, replayed_batches

# The engine terms fitted above a kernel-table base (module docstring).
KERNEL_BASE_PARAMS = ("per_layer_overhead_s", "launch_floor_per_layer_s", "launch_floor_per_seq_s",
                      "launch_overlap_exponent")
# `--own-attention`: the engine's decode attention is its own kernel, not the base tables' (module
# docstring): its launch shape is set and these two kernel terms are fitted with the engine terms.
OWN_ATTENTION_PARAMS = ("decode_kv_efficiency", "decode_half_blocks")
_BOUNDS = {"decode_half_blocks": (1e-2, 1e4), "decode_overhead_ratio": (1e-3, 10.0), "launch_overlap_exponent": (1.0, 30.0), "linear_half_tokens": (1e-3, 1e5),
           "attention_half_context": (1e-3, 1e6)}
KINDS = ("decode", "mixed", "prefill")


@dataclass(frozen=True)
class ForwardSample:
    """One stage's forward of one micro-batch."""

    kind: str
    stage: int
    shape: BatchShape
    time_s: float


@dataclass(frozen=True)
class EngineSamples:
    """Everything the runs measured, ready for the fits (module docstring)."""

    forward: list[ForwardSample]
    prepare: list[tuple[str, BatchShape, float]]
    sample: list[tuple[str, BatchShape, float]]
    dispatch: list[tuple[str, BatchShape, float]]
    ret: list[tuple[str, BatchShape, float]]
    transfer: list[tuple[str, int, float]]  # (kind, bytes, seconds)
    first: list[tuple[ReplayedBatch, int]]  # each run's first micro-batch and its P
    recv: list[tuple[str, int, float]] = field(default_factory=list)  # host runs: (kind, bytes, the receive's own s)
    handoff: list[tuple[str, BatchShape, float]] = field(default_factory=list)  # SiPipe: logits to the samplers
    # host runs, hops where the receiver was there first: (kind, bytes, send start to receive end, structure-aware)
    waited: list[tuple[str, int, float, bool]] = field(default_factory=list)


def engine_samples(runs: Sequence[RealRun], cost_for_bytes: CostModel) -> EngineSamples:
    """The measured spans of every traced run (module docstring)."""
    fw, prep, samp, disp, ret, tr, first, recv, hand, waited = [], [], [], [], [], [], [], [], [], []
    for run in runs:
        host = run.spec.settings.executor.settings.device == "cpu"
        aware = host and run.pp > 1 and _structure_aware(run)
        batches = replayed_batches(run)
        first.append((batches[0], run.pp))
        arrivals = sorted(r.arrival_s for r in run.requests)
        last = run.pp - 1
        prev: ReplayedBatch | None = None
        for b in batches[1:]:
            prev = prev or batches[0]
            for s, st in enumerate(b.stages):
                if st.forward is not None:
                    fw.append(ForwardSample(b.kind, s, b.shape, st.forward))
                if st.prepare is not None:
                    prep.append((b.kind, b.shape, st.prepare))
                nxt = b.stages[s + 1] if s < last else None
                if nxt is not None and None not in (st.send_start, nxt.recv_start, nxt.recv_end):
                    # from when both ends were ready: a receiver still busy with the previous batch
                    # is the pipeline's wait, not the link's
                    tr.append((b.kind, cost_for_bytes.activation_bytes(b.shape),
                               nxt.recv_end - max(st.send_start, nxt.recv_start)))
                    if host and st.send_start <= nxt.recv_start:  # the sender was there first: the receive itself
                        recv.append((b.kind, cost_for_bytes.activation_bytes(b.shape), nxt.recv_end - nxt.recv_start))
                    elif host:  # the receiver waited: the whole hop (hop_fit.py)
                        waited.append((b.kind, cost_for_bytes.activation_bytes(b.shape), nxt.recv_end - st.send_start, aware))
            lst = b.stages[last]
            if lst.handoff is not None and b.shape.num_sampled:
                hand.append((b.kind, b.shape, lst.handoff))
            if lst.sample is not None and b.shape.num_sampled:
                samp.append((b.kind, b.shape, lst.sample))
            if lst.sample_end is not None:
                ret.append((b.kind, b.shape, b.completed_s - lst.sample_end))
            launched = _launch_s(b, arrivals)
            s0 = b.stages[0]
            idle = prev.stages[0].busy_end is not None and prev.stages[0].busy_end <= launched
            if s0.prepare_start is not None and idle:
                disp.append((b.kind, b.shape, s0.prepare_start - launched))
            prev = b
    if not fw:
        raise ConfigError("the runs' traces hold no forward spans: rerun them with output.trace=full")
    return EngineSamples(fw, prep, samp, disp, ret, tr, first, recv, hand, waited)


def _structure_aware(run: RealRun) -> bool:
    """Whether the run's hops sent the activation alone (SiPipe's runtime), as the engine ran it."""
    from testbed.run.runner import build_policy

    runtime = build_policy(run.spec).runtime.merged(asdict(run.spec.settings.runtime))
    return bool(runtime.structure_aware_transfer)


def _launch_s(b: ReplayedBatch, arrivals: Sequence[float]) -> float:
    """When the driver began to launch `b`: the completion it followed, or, when a request arrived
    after that completion and before `b` was scheduled, the latest such arrival (the controller sat
    idle until it). Without the arrival, an Azure run's first prefill after a lull (tiny-llama P=1
    on CPU, 2 req/s) counted 1.66 s of waiting for the request as its dispatch."""
    if b.after_completion_s is None:
        return b.scheduled_s
    k = bisect.bisect_right(arrivals, b.scheduled_s)
    latest = arrivals[k - 1] if k else -math.inf
    return max(b.after_completion_s, latest)


@dataclass
class RunFit:
    """The fitted coefficients, the link, and the fit's errors per span and micro-batch kind."""

    coefficients: dict[str, float]
    p2p_bw_gbs: float | None = None
    p2p_latency_s: float | None = None
    errors: list[dict] = field(default_factory=list)  # {op, kind, n, median, p90, bias}
    first_use_s: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    kernels: dict = field(default_factory=dict)  # the base's kernel terms this fit replaces (--own-attention)
    notes: list[str] = field(default_factory=list)  # extra summary lines (--decode-by-batch's ratios)

    def summary_lines(self) -> list[str]:
        out = [f"  {k} = {v:.6g}" if not isinstance(v, list) else f"  {k} = {v}" for k, v in self.coefficients.items()]
        out += self.notes
        out += [f"  kernels.{k} = {v}" for k, v in self.kernels.items()]
        if self.p2p_bw_gbs is not None:
            out.append(f"  p2p_bw_gbs = {self.p2p_bw_gbs:.6g}   p2p_latency_s = {self.p2p_latency_s:.6g}")
        out.append("  fit errors |rel| by span and micro-batch kind (median / p90, bias = mean signed):")
        for e in self.errors:
            out.append(f"    {e['op']:<9} {e['kind']:<8} n={e['n']:<5d} {100 * e['median']:5.1f}% / "
                       f"{100 * e['p90']:5.1f}%   bias {100 * e['bias']:+.1f}%")
        if self.first_use_s:
            out.append("  first micro-batch of each run above the model (first use, not fitted): "
                       + ", ".join(f"{1e3 * x:.1f} ms" for x in self.first_use_s))
        return out


def _replays_graphs(run: RealRun) -> bool:
    """Whether the run's decode steps replayed CUDA graphs (ignored off CUDA)."""
    ex = run.spec.settings.executor.settings
    return ex.device == "cuda" and ex.cuda_graphs


def _padded(shape: BatchShape) -> bool:
    """Whether padding the decodes to the longest one would read more than their contexts."""
    return shape.decode_context_max * shape.num_decode_seqs > shape.decode_context_sum


def _error_rows(op: str, kinds: Sequence[str], pred: Sequence[float], meas: Sequence[float]) -> list[dict]:
    rel = np.array([p / m - 1.0 for p, m in zip(pred, meas)])
    kinds_arr = np.array(list(kinds))
    rows = []
    for kind in ("all",) + KINDS:
        sel = rel if kind == "all" else rel[kinds_arr == kind]
        if len(sel) == 0 or (kind != "all" and len(sel) == len(rel)):
            continue
        a = np.abs(sel)
        rows.append({"op": op, "kind": kind, "n": int(len(sel)), "median": float(np.median(a)),
                     "p90": float(np.quantile(a, 0.9)), "bias": float(np.mean(sel))})
    return rows


def _cost(model, hw: HardwareSpec, pp: int, layers, values: dict) -> CostModel:
    return CostModel(model, hw, pp, layer_split=list(layers) if layers else None, coefficients=CostCoefficients(**values))


def _bounds(name: str) -> tuple[float, float]:
    lo, hi = _BOUNDS.get(name, (1e-5, 1.0) if name.endswith("efficiency") else (1e-9, 1.0))
    return math.log(lo), math.log(hi)


def own_attention_terms(kv_efficiency: float, half_blocks: float) -> dict:
    """The kernel terms an engine's own decode attention replaces: one block per sequence x KV head
    (this project's Triton kernel launches its grid so, with no split of the KV), reading at
    `kv_efficiency` of the bandwidth (one rate for every GQA group), with `half_blocks` its
    few-blocks term (engine/pricing/kernels.py)."""
    return {"decode_split_count": 0, "decode_kv_efficiency": [[1.0, kv_efficiency]], "decode_half_blocks": half_blocks}


def _attention_start(hw: HardwareSpec, model) -> dict[str, float]:
    from engine.pricing.kernels import KernelCoefficients

    c = KernelCoefficients.from_mapping(hw.kernels)
    return {"decode_kv_efficiency": c.decode_efficiency(model.num_heads / model.num_kv_heads),
            "decode_half_blocks": c.decode_half_blocks or 1.0}


def fit_forward_samples(samples: Sequence[ForwardSample], model, hw: HardwareSpec, pp: int, layers,
                        base_vals: dict, names: Sequence[str], own_attention: bool = False,
                        starts: int = 5) -> dict[str, float]:
    """Least squares on the error in seconds over `names` (log-space, bounded, a few starts: the
    max() of the roofline and of the launch floor make the surface piecewise); with
    `own_attention`, also over OWN_ATTENTION_PARAMS (returned with the rest)."""
    from scipy.optimize import least_squares

    names, kernel_start = list(names), {}
    if own_attention:
        kernel_start = _attention_start(hw, model)
        names += list(OWN_ATTENTION_PARAMS)
    meas = np.array([x.time_s for x in samples])
    scale = float(np.mean(meas))
    lo = np.array([_bounds(n)[0] for n in names])
    hi = np.array([_bounds(n)[1] for n in names])
    start = {"per_layer_overhead_s": 1e-4, "decode_overhead_ratio": 1.0, "launch_floor_per_layer_s": 1e-3,
             "launch_floor_per_seq_s": 1e-5, "launch_overlap_exponent": 4.0, "stage_overhead_s": 1e-4, "linear_half_tokens": 32.0, "attention_half_context": 32.0,
             "kv_read_efficiency": base_vals["memory_efficiency"], "decode_padding": 0.5}
    start.update(_data_starts(samples, model, hw, pp, layers, base_vals))
    first = dict(base_vals, **kernel_start)
    x0 = np.clip(np.log([first[n] if first[n] > 0 else start.get(n, 1e-4) for n in names]), lo + 1e-9, hi - 1e-9)

    def values(x) -> dict:
        return dict(first, **{n: float(math.exp(v)) for n, v in zip(names, x)})

    def resid(x):
        v = values(x)
        spec = replace(hw, kernels=dict(hw.kernels, **own_attention_terms(v["decode_kv_efficiency"],
                                                                           v["decode_half_blocks"]))) \
            if own_attention else hw
        cost = _cost(model, spec, pp, layers, {k: val for k, val in v.items() if k not in OWN_ATTENTION_PARAMS})
        return (np.array([cost.stage_compute_s(s.stage, s.shape) for s in samples]) - meas) / scale

    best = None
    for k in range(starts):
        x = x0 if k == 0 else np.clip(x0 + np.log(10.0) * np.array(
            [(-1) ** (k + i) * (0.5 + 0.5 * (k % 2)) for i in range(len(names))]), lo + 1e-9, hi - 1e-9)
        res = least_squares(resid, x, bounds=(lo, hi), max_nfev=300)
        if best is None or res.cost < best.cost:
            best = res
    return {n: float(math.exp(v)) for n, v in zip(names, best.x)}


GEMV_ROWS = range(2, 9)  # the few-row thresholds tried (engine/pricing/small_m.py)


def fit_gemv_rows(samples: Sequence[ForwardSample], model, hw: HardwareSpec, pp: int, layers, values: dict,
                  names: Sequence[str]) -> dict:
    """`gemv_rows` (engine/pricing/small_m.py) and the forward terms refitted with it: each
    threshold in GEMV_ROWS refitted from `values` (the fit without it), kept where it lowers the
    squared error in seconds; 0 when none does. On the P=1 CPU fit runs: 3 (the threshold the
    lm_head micro-benchmark shows), decode forwards' bias by sequences gone (module small_m)."""
    meas = np.array([x.time_s for x in samples])

    def sq_error(v: dict) -> float:
        cost = _cost(model, hw, pp, layers, v)
        return float(np.sum((np.array([cost.stage_compute_s(s.stage, s.shape) for s in samples]) - meas) ** 2))

    best, best_err = {"gemv_rows": 0}, sq_error(dict(values, gemv_rows=0))
    for rows in GEMV_ROWS:
        start = dict(values, gemv_rows=rows)
        v = dict(start, **fit_forward_samples(samples, model, hw, pp, layers, start, names, starts=1))
        err = sq_error(v)
        if err < best_err:
            best, best_err = {**{n: v[n] for n in names}, "gemv_rows": rows}, err
    return best


def _data_starts(samples: Sequence[ForwardSample], model, hw: HardwareSpec, pp: int, layers,
                 base_vals: dict) -> dict[str, float]:
    """Starting values read off the data: the decodes' median time above the base model per layer,
    the eager steps' median time per layer (a launch floor the optimiser can grow or shrink; a
    start where the floor is inactive leaves it there, its gradient being 0)."""
    cost = _cost(model, hw, pp, layers, base_vals)
    n_layers = {s: n for s, n in enumerate(cost.layers)}
    over = [(x.time_s - cost.stage_compute_s(x.stage, x.shape)) / n_layers[x.stage] for x in samples if x.kind == "decode"]
    eager = [x.time_s / n_layers[x.stage] for x in samples if x.kind != "decode"]
    out = {}
    if over and np.median(over) > 0:
        out["per_layer_overhead_s"] = float(np.median(over))
    if eager:
        out["launch_floor_per_layer_s"] = float(np.median(eager))
    return out


def fit_runs(runs: Sequence[RealRun], base: HardwareSpec, table: ProfileTable | None = None,
             own_attention: bool = False, hop: str = "link", inflight_handover: bool = False,
             decode_by_batch: bool = False, shared_gpu: bool = False, mixed_by_rows: bool = False,
             sampler_contention: bool = False) -> RunFit:
    """`_fit_runs`, with the runs read as their own work on a shared GPU for the fit alone (`shared_gpu`)."""
    if shared_gpu:
        check_some_shared(runs)
    try:
        for run in runs:
            run.own_work = shared_gpu
        return _fit_runs(runs, base, table, own_attention, hop, inflight_handover, decode_by_batch, shared_gpu,
                         mixed_by_rows, sampler_contention)
    finally:
        for run in runs:
            run.own_work = False


def _fit_runs(runs: Sequence[RealRun], base: HardwareSpec, table: ProfileTable | None,
              own_attention: bool, hop: str, inflight_handover: bool, decode_by_batch: bool,
              shared_gpu: bool, mixed_by_rows: bool = False, sampler_contention: bool = False) -> RunFit:
    """Fit `base`'s engine terms (or, on a roofline base, its coefficients) to the runs (module
    docstring), and with `own_attention` its decode attention's read rate and few-blocks term;
    `hop="receive"`: a host hop and the return priced once (testbed/calibrate/hop_fit.py);
    `inflight_handover`: the blocking send held until the receive (testbed/calibrate/handover_fit.py);
    `decode_by_batch`: the decode-only price corrected by batch size (testbed/calibrate/decode_batch_fit.py);
    `mixed_by_rows`: a mixed step's price corrected by its sampled rows (testbed/calibrate/mixed_rows_fit.py);
    `sampler_contention`: the CPU-sampling path with a term per stage working as it starts (cpu_sampling_fit.py);
    `shared_gpu`: forwards fitted as their own work where the stages shared a GPU (testbed/calibrate/shared_device.py).
    Every run must use the same model, P and layer split."""
    if hop not in HOP_MODES:
        raise bad_value("--hop", hop, f"choose one of {', '.join(HOP_MODES)}")
    if own_attention and base.kernels is None:
        raise ConfigError(f"--own-attention refits a kernel-table base's decode attention; {base.name} has no "
                          "kernel terms (a roofline base fits its attention efficiency already)")
    first = runs[0].spec
    model, pp, split = first.settings.model, first.settings.parallel.pp, first.settings.parallel.layer_split
    for run in runs[1:]:
        rc = run.spec.settings
        if (rc.model.name, rc.parallel.pp, rc.parallel.layer_split) != (model.name, pp, split):
            raise ConfigError(f"run {run.path} has model={rc.model.name} parallel.pp={rc.parallel.pp}; "
                              f"{runs[0].path} has model={model.name} parallel.pp={pp}: fit one setting at a time")
    base_vals = asdict(CostCoefficients(**(base.calibration or {})))
    for name in TABLE_FIELDS:  # a base's own corrections are refitted (--decode-by-batch, --mixed-by-rows), never compounded
        base_vals[name] = ()
    probe = _cost(model, base, pp, split, base_vals)
    data = engine_samples(runs, probe)
    fwd = list(data.forward)
    if table is not None:
        fwd += [ForwardSample(r.kind, r.stage if r.stage is not None else pp - 1, r.shape(), r.time_s)
                for r in table.select("forward") if r.kind in KINDS]
    if base.kernels is not None:
        names = list(KERNEL_BASE_PARAMS)
        if len(set(probe.layers)) > 1:  # stages of different depths separate a stage's fixed cost from a layer's
            names.append("stage_overhead_s")
        else:
            base_vals["stage_overhead_s"] = 0.0
        if not any(s.kind != "decode" for s in fwd):
            names = [n for n in names if not n.startswith("launch_floor")]
    else:
        names = [n for n in FORWARD_PARAMS if n != "decode_overhead_ratio"] + ["decode_overhead_ratio"]
        if not any(s.kind == "decode" for s in fwd):
            names = ["linear_efficiency", "attention_efficiency", "stage_overhead_s"]
        if not any(_replays_graphs(run) for run in runs):
            # no CUDA graphs: a decode step is as eager as any other, so its fixed cost is the same
            # (fitted freely, one offline run put 76-108 ms on every step with a prefill and none on
            # decodes; a 32-token prefill then cost 122 ms where the engine took 12 ms, on CPU)
            names.remove("decode_overhead_ratio")
            base_vals["decode_overhead_ratio"] = 1.0
        if any(_padded(s.shape) for s in fwd):
            names.append("decode_padding")
    fitted = {k: v for k, v in (base.calibration or {}).items() if k not in TABLE_FIELDS}
    if base.kernels is not None:
        fitted["stage_overhead_s"] = base_vals["stage_overhead_s"]
    elif "decode_overhead_ratio" not in names:
        fitted["decode_overhead_ratio"] = 1.0
    fitted.update(fit_forward_samples(fwd, model, base, pp, split, base_vals, names, own_attention))
    if base.kernels is None:
        fitted.update(fit_gemv_rows(fwd, model, base, pp, split, dict(base_vals, **fitted), names))
    kernels = own_attention_terms(*(fitted.pop(n) for n in OWN_ATTENTION_PARAMS)) if own_attention else {}
    if kernels:
        base = replace(base, kernels=dict(base.kernels, **kernels))
    if shared_gpu:
        fitted["shared_device_fit"] = 1
    result = RunFit(fitted, counts={"forward": len(fwd), "runs": len(runs)}, kernels=kernels)
    if decode_by_batch:  # after the forward fit, from the runs' own decode forwards (not the table's rows)
        from testbed.calibrate import decode_batch_fit

        plain = _cost(model, base, pp, split, {**base_vals, **fitted, "decode_batch_factors": ()})
        ratios = decode_batch_fit.decode_ratios(data.forward, plain)
        fitted["decode_batch_factors"] = decode_batch_fit.factors(ratios, pp)
        result.notes = decode_batch_fit.summary(ratios, pp)
    if mixed_by_rows:  # the same, for the steps with a prefill chunk (the decode factors do not touch them)
        from testbed.calibrate import mixed_rows_fit

        plain = _cost(model, base, pp, split, {**base_vals, **fitted, "mixed_row_extra_s": ()})
        residuals = mixed_rows_fit.mixed_residuals(data.forward, plain)
        fitted["mixed_row_extra_s"] = mixed_rows_fit.terms(residuals, pp)
        result.notes += mixed_rows_fit.summary(residuals, pp)
    _fit_linear_terms(result, data, model.vocab_size)
    before_return = 0.0  # what the simulator adds before the return term (`hop="receive"`: its latency)
    if hop == "receive":
        before_return = price_hops_once(result, data.waited, [t for _, _, t in data.ret], base.p2p_latency_s)
    if inflight_handover:
        aware = [run.pp > 1 and _structure_aware(run) for run in runs]
        handover = fit_handover(runs, aware)
        if handover is not None:
            result.coefficients["handover_rendezvous_s"], result.counts["handover"] = handover
    result.coefficients.update(fit_cpu_sampling(cpu_sampling_samples(runs), model.vocab_size,
                                                result.coefficients.get("return_fixed_s", 0.0) + before_return,
                                                contention=sampler_contention))
    cost = _cost(model, base, pp, split, dict(base_vals, **result.coefficients))
    result.errors = _error_rows("forward", [s.kind for s in fwd],
                                [cost.stage_compute_s(s.stage, s.shape) for s in fwd], [s.time_s for s in fwd])
    result.errors += _linear_errors(result, data, cost)
    result.first_use_s = [_first_use(b, P, cost) for b, P in data.first]
    return result


def _fit_linear_terms(result: RunFit, data: EngineSamples, vocab: int) -> None:
    """prepare, sample, dispatch, return and transfer by non-negative least squares."""
    c = result.coefficients
    if data.prepare:
        shapes = [sh for _, sh, _ in data.prepare]
        c["prep_fixed_s"], c["prep_per_seq_s"], c["prep_per_token_s"] = _nnls(
            [[1.0] * len(shapes), [float(s.num_seqs) for s in shapes], [float(s.num_tokens) for s in shapes]],
            [t for _, _, t in data.prepare], relative=False)
    if data.sample:
        c["sample_fixed_s"], c["sample_per_token_vocab_s"] = _nnls(
            [[1.0] * len(data.sample), [float(sh.num_sampled * vocab) for _, sh, _ in data.sample]],
            [t for _, _, t in data.sample], relative=False)
    if data.dispatch:
        shapes = [sh for _, sh, _ in data.dispatch]
        c["dispatch_fixed_s"], c["dispatch_per_seq_s"], c["dispatch_prefill_s"] = _nnls(
            [[1.0] * len(shapes), [float(s.num_seqs) for s in shapes],
             [1.0 if s.num_prefill_tokens else 0.0 for s in shapes]], [t for _, _, t in data.dispatch], relative=False)
    if data.ret:
        c["return_fixed_s"] = float(np.mean([t for _, _, t in data.ret]))
    if data.recv:  # a host device's receive, on the receiving stage (CostModel.recv_s; issue 47)
        c["recv_fixed_s"], c["recv_per_byte_s"] = _nnls(
            [[1.0] * len(data.recv), [float(b) for _, b, _ in data.recv]], [t for _, _, t in data.recv], relative=False)
    if data.handoff:  # SiPipe's logits to the CPU samplers, on the last stage (CostModel.cpu_handoff_s)
        c["cpu_handoff_fixed_s"], c["cpu_handoff_per_token_vocab_s"] = _nnls(
            [[1.0] * len(data.handoff), [float(sh.num_sampled * vocab) for _, sh, _ in data.handoff]],
            [t for _, _, t in data.handoff], relative=False)
    if data.transfer:
        lat, per_byte = _nnls([[1.0] * len(data.transfer), [float(b) for _, b, _ in data.transfer]],
                              [t for _, _, t in data.transfer], relative=False)
        result.p2p_latency_s = lat
        result.p2p_bw_gbs = 1.0 / per_byte / 1e9 if per_byte > 0 else 1e3


def _linear_errors(result: RunFit, data: EngineSamples, cost: CostModel) -> list[dict]:
    rows = []
    for op, items, pred in (("prepare", data.prepare, cost.prep_s), ("sample", data.sample, cost.sample_s),
                            ("dispatch", data.dispatch, cost.dispatch_s), ("return", data.ret, cost.return_s),
                            ("to_samplers", data.handoff, cost.cpu_handoff_s)):
        items = [x for x in items if x[2] > 0]
        if items:
            rows += _error_rows(op, [k for k, _, _ in items], [pred(sh) for _, sh, _ in items], [t for _, _, t in items])
    if data.recv:
        c = result.coefficients
        rows += _error_rows("recv", [k for k, _, _ in data.recv],
                            [c["recv_fixed_s"] + c["recv_per_byte_s"] * b for _, b, _ in data.recv], [t for _, _, t in data.recv])
    if data.transfer and result.p2p_bw_gbs:
        bw = result.p2p_bw_gbs * 1e9
        rows += _error_rows("transfer", [k for k, _, _ in data.transfer],
                            [result.p2p_latency_s + b / bw for _, b, _ in data.transfer], [t for _, _, t in data.transfer])
    return rows


def _first_use(b: ReplayedBatch, pp: int, cost: CostModel) -> float:
    """How much longer the run's first micro-batch took than the fitted model says."""
    model = sum(cost.stage_compute_s(s, b.shape) + cost.prep_s(b.shape) for s in range(pp)) + cost.sample_s(b.shape)
    spans = sum((st.forward or 0.0) + (st.prepare or 0.0) for st in b.stages) + (b.stages[-1].sample or 0.0)
    return spans - model


def fitted_spec(base: HardwareSpec, name: str, fit: RunFit, description: str) -> HardwareSpec:
    """`base` (its kernels kept, but for those the fit replaced) with the fitted coefficients and
    link, under `name`."""
    import datetime as _dt

    kw = {"name": name, "description": description, "calibration": dict(fit.coefficients),
          "version": f"runs-{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d}"}
    if fit.kernels:
        kw["kernels"] = dict(base.kernels, **fit.kernels)
    if fit.p2p_bw_gbs is not None:
        kw.update(p2p_bw_gbs=max(fit.p2p_bw_gbs, 1e-6), p2p_latency_s=fit.p2p_latency_s)
    return replace(base, **kw)
