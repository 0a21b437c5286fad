"""`testbed profile` and `testbed validate`: calibrate the simulator on the real engine, check it.

    testbed profile executor=torch model=tiny-llama parallel.pp=2 [--name cpu-tiny] [--quick]
    testbed profile --import tdpipe.csv --time-unit ms --name l20-qwen32b-tdpipe \
        model=qwen2.5-32b hardware=l20-48g parallel.pp=4
    testbed validate policy=sarathi workload=azure workload.num_requests=300 model=tiny-llama \
        parallel.pp=2 hardware=cpu-tiny
    testbed validate hardware=h100-80g-measured ... policy=sarathi,vllm,gllm,tdpipe parallel.pp=1,2 \
        --case "sharegpt: workload=sharegpt workload.arrival=offline" \
        --case "azure-r1: workload=azure workload.rate=1" --case "azure-r2: workload=azure workload.rate=2"

A validate matrix (comma-list axes, as in `testbed compare`, times `--case` bundles) runs each
point's real and simulated runs in turn and writes `matrix.md/json/csv` (errors of throughput,
TTFT/TPOT mean and p99, E2EL p99, and whether the issue's targets are met) after every point.

Profiles go to `$TESTBED_PROFILE_DIR` (default `runs/profiles/`): `<name>.csv` (the table) and
`<name>.yaml` (a HardwareSpec with `calibration`), which `testbed.config.composer` registers at start-up so
`hardware=<name>` works in every command. See README "Calibration and fidelity".
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from engine.pricing.profile_table import read_profile, write_profile

from testbed.calibrate.fit import calibrated_spec, fit_profile, import_tdpipe, save_hardware_profile
from engine.base.errors import ConfigError
from engine.pricing.hardware import (INTRA_BOX_LATENCY_S, PCIE_ALLREDUCE_GBS, PCIE_P2P_GBS, HardwareSpec,
                             get_hardware)
from engine.pricing.models import ModelSpec
from engine.core.request import Request
from engine.pricing.profile_grid import ProfileGrid, get_grid
from engine.torch_exec.driver.profile import device_memory_gib, device_provenance, measure_peaks, profile_engine
from engine.torch_exec.shared.timing import is_cuda
from testbed import signals
from testbed.calibrate.path_hint import fitted_on_runs, runs_fit_note
from testbed.config.spec import compose_spec
from testbed.config.overrides import merge
from testbed.run.outputs import write_run_dir
from testbed.run.runner import prepare_experiment
from testbed.config.spec import RunSpec
from testbed.tracking.tracker import Tracker
from workloads.base import build_workload

VALIDATE_METRICS = (
    ("throughput_tok_s", "throughput (tok/s)"),
    ("ttft_mean_s", "TTFT mean (s)"),
    ("ttft_p99_s", "TTFT p99 (s)"),
    ("tpot_mean_s", "TPOT mean (s)"),
    ("tpot_p99_s", "TPOT p99 (s)"),
    ("e2el_mean_s", "E2EL mean (s)"),
    ("e2el_p99_s", "E2EL p99 (s)"),
    ("bubble_ratio", "bubble ratio"),
    ("num_microbatches", "micro-batches"),
)


def profile_dir() -> Path:
    return Path(os.environ.get("TESTBED_PROFILE_DIR") or "runs/profiles")


def _override(overrides: list[str], key: str) -> str | None:
    for ov in overrides:
        k, _, v = ov.partition("=")
        if k.lstrip("+") == key:
            return v
    return None


def _with_default(overrides: list[str], key: str, value: Any) -> list[str]:
    return overrides if _override(overrides, key) is not None else overrides + [f"{key}={value}"]


# ---- profile ---------------------------------------------------------------------------------
def cmd_profile(args, console) -> int:
    if args.repeats < 1:  # 0 timed nothing and saved an empty profile
        raise ConfigError(f"invalid --repeats={args.repeats}: must be an integer >= 1 (timed launches per "
                          f"designed batch; default 3)")
    overrides = list(args.overrides)
    out_dir = Path(args.out) if args.out else profile_dir()
    if args.import_path or args.table:
        if args.import_path and not args.time_unit:
            raise ConfigError("--import needs --time-unit s|ms|us (TD-Pipe's tables do not say)")
        run = compose_spec(overrides)
        model, pp = run.settings.model, run.settings.parallel.pp
        hw = get_hardware(run.settings.hardware.name)
        if args.import_path:
            table = import_tdpipe(args.import_path, args.time_unit, prompt_len=args.prompt_len,
                                  meta={"model": model.name, "pp": str(pp), "hardware": hw.name})
        else:
            table = read_profile(args.table)
        name = args.name or f"{hw.name}-{model.name}-pp{pp}-cal"
        split = run.settings.parallel.layer_split
        fit = fit_profile(table, model, hw, pp, list(split) if split else None, classic=True)
        spec = calibrated_spec(hw, name, fit, f"{hw.description}; calibrated from {table.meta.get('source', 'a table')}")
        csv_path = write_profile(table, out_dir / f"{name}.csv")
        yaml_path = save_hardware_profile(spec, out_dir / f"{name}.yaml",
                                          {"table": str(csv_path), "model": model.name, "pp": pp,
                                           "fit_errors": fit.errors})
        _print_fit(console, name, fit)
        print(yaml_path.resolve())
        return 0
    return _profile_engine(args, overrides, out_dir, console)


def _overrides_text(overrides: list[str]) -> str:
    keep = [o for o in overrides if not o.startswith(("executor=", "output.", "hardware="))]
    return " ".join(shlex.quote(o) for o in keep) or "<your settings>"


def _print_fit(console, name, fit) -> None:
    console.print(f"[bold]hardware profile {name}[/bold]: fitted")
    for line in fit.summary_lines():
        console.print(line)


def _grid(args) -> ProfileGrid:
    name = getattr(args, "grid", None)
    if name and args.quick and name != "quick":
        raise ConfigError(f"--quick is --grid quick; it contradicts --grid {name}")
    return get_grid(name or ("quick" if args.quick else "default"))


def _profile_engine(args, overrides, out_dir: Path, console) -> int:
    grid = _grid(args)
    explicit_hw = _override(overrides, "hardware")
    overrides = _with_default(overrides, "executor", "torch")
    overrides = _with_default(overrides, "model", "tiny-llama")
    overrides = _with_default(overrides, "parallel.pp", 2)
    device = _override(overrides, "executor.device") or "cpu"
    bs = int(_override(overrides, "kv.block_size") or 16)
    cap = 32768 if is_cuda(device) else 8192
    overrides = _with_default(overrides, "kv.num_blocks", min(  # distinct blocks for the largest batch
        cap, max(grid.max_decodes() * (grid.max_context() // bs + 1),
                 grid.max_prefills() * (grid.max_context() // bs + 1)) + 4))
    overrides = _with_default(overrides, "output.mlflow", "false")
    run = compose_spec(overrides)
    if run.settings.executor.name != "torch":
        raise ConfigError("testbed profile measures the real engine: use executor=torch")
    st = run.settings.executor.settings
    device = st.device
    t0 = time.perf_counter()
    prepared = prepare_experiment(run, requests=[Request(0, 0.0, 1, 1)])
    ex = prepared.controller.executor
    cost = prepared.cost
    try:
        table = profile_engine(ex, grid, block_size=run.settings.kv.block_size, repeats=args.repeats,
                               bytes_of=lambda r: cost.activation_bytes(r.shape()))
    finally:
        ex.shutdown()
    # after the stages are gone: the device is idle, and the driver opens no CUDA context before them
    peaks = measure_peaks(threads=st.threads_per_stage, device=device)
    provenance = device_provenance(device)
    pp, model = cost.pp, cost.model
    base = _measured_base(args.name, st, device, peaks, provenance, model.name, pp,
                          get_hardware(explicit_hw) if explicit_hw else None)
    name = base.name
    table.meta.update({"model": model.name, "pp": str(pp), "layers": ",".join(map(str, cost.layers)),
                       "hardware": name, "source": "testbed profile (torch engine)", "grid": grid.name,
                       "device": provenance.get("gpu", device), "dtype": str(st.dtype),
                       "repeats": str(args.repeats), "date_utc": provenance["date_utc"]})
    fit = fit_profile(table, model, base, pp, list(cost.layers), classic=True)
    spec = calibrated_spec(base, name, fit)
    csv_path = write_profile(table, out_dir / f"{name}.csv")
    yaml_path = save_hardware_profile(spec, out_dir / f"{name}.yaml", {
        "table": csv_path.name, "command": _command_line(args, grid),  # the table lies next to the YAML
        **provenance, "model": model.name, "model_shape": model_shape(model), "pp": pp, "layers": list(cost.layers),
        "dtype": str(st.dtype), "grid": grid.name, "rows": len(table.rows),
        "peaks_from": "table " + explicit_hw if explicit_hw else "measured",
        "measured_peak_flops": peaks["peak_flops"], "measured_mem_bw_Bps": peaks["mem_bw_Bps"],
        "measured_gemm_flops": peaks["gemm_flops"], "peak_timer": peaks["timer"],
        "fitted_terms": sorted(fit.coefficients), "fit_errors": fit.errors,
        "profile_wall_s": round(time.perf_counter() - t0, 2)})
    console.print(f"profiled {len(table.rows)} rows ({grid.name} grid) in {time.perf_counter() - t0:.1f} s on "
                  f"{provenance.get('gpu', device)} (peak {peaks['peak_flops'] / 1e12:.4g} TFLOP/s "
                  f"{peaks['dtype'].replace('torch.', '')}, copy {peaks['mem_bw_Bps'] / 1e9:.4g} GB/s, "
                  f"{peaks['timer']} timing)")
    _print_fit(console, name, fit)
    print(csv_path.resolve())
    print(yaml_path.resolve())
    print(runs_fit_note(name, str(csv_path), _overrides_text(overrides)), file=sys.stderr)
    return 0


def _command_line(args, grid: ProfileGrid) -> str:
    """The profile command as run (provenance: a session with the device re-runs it)."""
    parts = ["testbed", "profile", *args.overrides, "--grid", grid.name, "--repeats", str(args.repeats)]
    if args.name:
        parts += ["--name", args.name]
    return " ".join(shlex.quote(p) for p in parts)


def model_shape(model: ModelSpec) -> dict:
    """The architecture numbers a profile was measured on (provenance: transfer to other shapes)."""
    return {k: getattr(model, k) for k in ("architecture", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                           "head_dim", "intermediate_size", "vocab_size", "dtype_bytes")}


def _measured_base(name: str | None, st: Any, device: str, peaks: dict, prov: dict, model: str, pp: int,
                   table_hw: HardwareSpec | None) -> HardwareSpec:
    """The spec the fit is relative to: a table GPU's datasheet peaks when `hardware=` names one (so
    the fitted efficiencies compare with the table's defaults), else the measured peaks."""
    if is_cuda(device):
        what = (f"{prov.get('gpu')} (driver {prov.get('driver')}, CUDA {prov.get('cuda')}, torch {prov.get('torch')}), "
                f"torch engine {st.dtype}; calibrated by testbed profile {prov['date_utc']}")
        name = name or f"gpu-{model}-pp{pp}"
    else:
        what = (f"this CPU host, torch engine ({st.threads_per_stage} thread(s)/stage, "
                f"{st.dtype}), measured peaks; calibrated by testbed profile")
        name = name or f"cpu-{model}-pp{pp}"
    if table_hw is not None:
        return replace(table_hw, name=name, description=f"{what}; peaks of {table_hw.name}", calibration=None)
    return HardwareSpec(
        name=name, description=what, peak_tflops=peaks["peak_flops"] / 1e12, mem_bw_gbs=peaks["mem_bw_Bps"] / 1e9,
        mem_gib=round(device_memory_gib(device), 1), cpu_cores_hint=os.cpu_count(),
        # links: fitted from the transfer rows when P > 1; otherwise PCIe figures on a GPU (hardware.py)
        **(dict(p2p_bw_gbs=PCIE_P2P_GBS, p2p_latency_s=INTRA_BOX_LATENCY_S, allreduce_bw_gbs=PCIE_ALLREDUCE_GBS)
           if is_cuda(device) else dict(p2p_bw_gbs=1.0, p2p_latency_s=1e-4, allreduce_bw_gbs=1.0)))


# ---- validate --------------------------------------------------------------------------------
def rel_error(real: float, sim: float) -> float:
    if real == 0:
        return 0.0 if sim == 0 else math.inf
    return (sim - real) / abs(real)


def error_table(real: dict, sim: dict) -> list[dict]:
    rows = []
    for key, label in VALIDATE_METRICS:
        r, s = float(real.get(key, float("nan"))), float(sim.get(key, float("nan")))
        rows.append({"metric": key, "label": label, "real": r, "sim": s, "rel_error": rel_error(r, s)})
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'metric':<22}{'real':>14}{'sim':>14}{'rel. error':>12}", "-" * 62]
    for r in rows:
        lines.append(f"{r['label']:<22}{r['real']:>14.5g}{r['sim']:>14.5g}{100 * r['rel_error']:>11.1f}%")
    return "\n".join(lines)


def cmd_validate(args, console) -> int:
    """`testbed validate`: 0, or 130 (Ctrl-C) / 143 (SIGTERM): the torch engine's stages are
    stopped by the executor's own cleanup, the run directories written so far are kept."""
    with signals.sigterm_as_interrupt():
        try:
            return _validate(args, console)
        except KeyboardInterrupt as exc:
            print(signals.interrupted_message(exc), file=sys.stderr)
            return signals.exit_code(exc)


@dataclass(frozen=True)
class ValidateCase:
    """`--case "NAME: key=value ..."`: a named bundle of overrides (a workload at a rate, say)."""

    name: str
    overrides: tuple[str, ...]


def parse_case(text: str) -> ValidateCase:
    name, sep, rest = text.partition(":")
    name = name.strip()
    try:
        ovs = tuple(shlex.split(rest))
    except ValueError:
        ovs = ()
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name) or not ovs or any("=" not in o for o in ovs):
        raise ConfigError(f"invalid --case {text!r}: expected 'NAME: key=value ...', e.g. "
                          "'azure-r2: workload=azure workload.rate=2'")
    return ValidateCase(name, ovs)


def validate_plan(overrides: list[str], cases: list[ValidateCase]) -> list[tuple[str, list[str]]]:
    """(label, overrides) of every point: each case x the product of the comma-list axes
    (`policy=sarathi,vllm parallel.pp=1,2`, as in `testbed compare`); a case's keys win."""
    from testbed.sweep.compare import grid

    axes, points = grid(overrides)
    out = []
    for case in cases or [ValidateCase("", ())]:
        for p in points:
            label = ",".join(x for x in (case.name, p.label if axes else "") if x) or "base"
            out.append((label, merge(list(p.overrides), list(case.overrides))))
    names = [label for label, _ in out]
    if len(set(names)) != len(names):
        raise ConfigError("two --case entries have the same name")
    return out


def _configs(overrides: list[str]) -> tuple[RunSpec, RunSpec]:
    """The real (torch) and simulated configs of one point, composed (a typo fails here)."""
    overrides = _with_default(overrides, "model", "tiny-llama")
    overrides = _with_default(overrides, "parallel.pp", 2)
    overrides = _with_default(overrides, "kv.num_blocks", 2048)
    base = [o for o in overrides if not o.startswith("executor=") and not o.startswith("executor.")]
    ex_ovs = [o for o in overrides if o.startswith("executor.")]
    real = compose_spec(base + ["executor=torch"] + ex_ovs)
    # The real engine on CPU sends with gloo's blocking send: model it (executor.blocking_send).
    blocking = "true" if real.settings.executor.settings.device == "cpu" else "false"
    sim = compose_spec(base + ["executor=sim", f"executor.blocking_send={blocking}", f"executor.host_device={blocking}"])
    return real, sim


def _validate(args, console) -> int:
    overrides = list(args.overrides)
    hw = _override(overrides, "hardware")
    if hw is None:
        raise ConfigError("testbed validate needs hardware=<calibrated profile> (see testbed profile)")
    plan = validate_plan(overrides, [parse_case(c) for c in args.case or []])
    points = [(label, *_configs(ovs)) for label, ovs in plan]  # every point composes before anything runs
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if len(points) == 1:
        _, real, sim = points[0]
        label = f"{real.policy_name}-{real.workload_name}-pp{real.settings.parallel.pp}-{hw}"
        out_dir = Path(args.out) if args.out else Path(real.output.dir) / "validate" / f"{stamp}_{label}"
        rows = _validate_point(real, sim, out_dir, label, console, args.num_mbs)
        print(format_table(rows))
        print(out_dir.resolve())
        if not fitted_on_runs(hw):
            print(runs_fit_note(hw, None, _overrides_text(overrides)), file=sys.stderr)
        return 0
    top = Path(args.out) if args.out else Path(points[0][1].output.dir) / "validate" / f"{stamp}_matrix-{hw}"
    console.print(f"validate: {len(points)} points (real then sim each), hardware={hw}")
    summary: list[dict] = []
    for i, (label, real, sim) in enumerate(points):
        console.print(f"[{i + 1}/{len(points)}] {label}")
        point_dir = top / (f"{i:03d}_" + re.sub(r"[^A-Za-z0-9_.=+-]+", "_", label)[:120])
        try:
            rows = _validate_point(real, sim, point_dir, f"{label}-{hw}", console, args.num_mbs)
            summary.append(matrix_row(label, real, rows))
        except ConfigError as exc:
            summary.append(matrix_row(label, real, None, str(exc)))
        _write_matrix(top, summary)  # after every point: an interrupted matrix keeps what it has
    print(format_matrix(summary))
    print(top.resolve())
    if not fitted_on_runs(hw):
        print(runs_fit_note(hw, None, _overrides_text(overrides)), file=sys.stderr)
    return 0 if all(r["status"] == "ok" for r in summary) else 1


def _validate_point(real: RunSpec, sim: RunSpec, out_dir: Path, label: str, console, num_mbs: int) -> list[dict]:
    """One real run and one simulated run of the same request list; their error table."""
    requests = build_workload(real.workload, real.data_dir)
    console.print(f"  {len(requests)} requests, real (torch) then sim (hardware={real.settings.hardware.name})")
    results = {}
    for kind, spec in (("real", real), ("sim", sim)):
        t = time.perf_counter()
        res = prepare_experiment(spec, requests=list(requests)).run()
        if res.error:
            raise ConfigError(f"the {kind} run failed: {res.error}")
        write_run_dir(res, out_dir / kind, plots=False)
        results[kind] = res
        console.print(f"  {kind}: {res.summary['num_finished']} finished, {time.perf_counter() - t:.1f} s wall")
    rows = error_table(results["real"].summary, results["sim"].summary)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "errors.md").write_text("```\n" + format_table(rows) + "\n```\n")
    (out_dir / "errors.json").write_text(json.dumps(rows, indent=2))
    overlay_figure(results["real"], results["sim"], out_dir / "timeline_overlay.png", num_mbs=num_mbs)
    if real.output.mlflow:
        _log_validate(real, sim, results, rows, out_dir, label)
    return rows


# ---- the matrix table ---------------------------------------------------------------------------
# The fidelity aims: throughput and mean TPOT within 10%, mean TTFT within 15%.
TARGETS = {"throughput_tok_s": 0.10, "tpot_mean_s": 0.10, "ttft_mean_s": 0.15}
MATRIX_METRICS = ("throughput_tok_s", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "tpot_p99_s", "e2el_p99_s")


def matrix_row(label: str, real: RunSpec, rows: list[dict] | None, error: str = "") -> dict:
    wl = real.workload
    out: dict[str, Any] = {"point": label, "policy": real.policy_name, "workload": real.workload_name,
                           "arrival": getattr(wl, "arrival", None), "rate": getattr(wl, "rate", None),
                           "pp": real.settings.parallel.pp,
                           "status": "ok" if rows is not None else f"failed: {error}"}
    by = {r["metric"]: r for r in rows or []}
    for m in MATRIX_METRICS:
        r = by.get(m, {})
        out.update({f"{m}.real": r.get("real"), f"{m}.sim": r.get("sim"), f"{m}.rel_error": r.get("rel_error")})
    if rows is not None:
        out["within_targets"] = all(abs(by[m]["rel_error"]) <= tol for m, tol in TARGETS.items()
                                    if math.isfinite(by[m]["rel_error"]))
    return out


def format_matrix(summary: list[dict]) -> str:
    heads = ["throughput", "TTFT mean", "TTFT p99", "TPOT mean", "TPOT p99", "E2EL p99"]
    width = max([len(r["point"]) for r in summary] + [5]) + 2
    lines = [f"{'point':<{width}}{'real tok/s':>12}" + "".join(f"{h:>11}" for h in heads) + "  targets",
             "-" * (width + 12 + 11 * len(heads) + 9)]
    for r in summary:
        if r["status"] != "ok":
            lines.append(f"{r['point']:<{width}}{r['status']}")
            continue
        errs = "".join(f"{100 * r[f'{m}.rel_error']:>10.1f}%" for m in MATRIX_METRICS)
        lines.append(f"{r['point']:<{width}}{r['throughput_tok_s.real']:>12.5g}{errs}  "
                     f"{'met' if r['within_targets'] else 'missed'}")
    lines.append("relative error sim vs real; targets: throughput and TPOT mean within 10%, TTFT mean within 15%")
    return "\n".join(lines)


def _write_matrix(top: Path, summary: list[dict]) -> None:
    import pandas as pd

    top.mkdir(parents=True, exist_ok=True)
    (top / "matrix.md").write_text("```\n" + format_matrix(summary) + "\n```\n")
    (top / "matrix.json").write_text(json.dumps(summary, indent=2, default=str))
    pd.DataFrame(summary).to_csv(top / "matrix.csv", index=False)


def _log_validate(real: RunSpec, sim: RunSpec, results, rows, out_dir: Path, label: str) -> None:
    from mlflow.entities import Metric  # lazy: ~2 s to import, and output.mlflow=false never needs it


    tr = Tracker(real.output, experiment=real.output.experiment or "validate")
    parent = tr.start(real, f"validate-{label}", tags={"testbed.kind": "validate"})
    for kind, spec in (("real", real), ("sim", sim)):
        rid = tr.start(spec, f"{kind}-{label}", parent_run_id=parent, tags={"validate.side": kind})
        tr.finish(rid, results[kind], out_dir / kind)
    now = int(time.time() * 1000)
    ms = []
    for r in rows:
        for k in ("real", "sim", "rel_error"):
            v = r[k]
            if math.isfinite(v):
                ms.append(Metric(f"{r['metric']}.{k}", float(v), now, 0))
    tr.client.log_batch(parent, metrics=ms)
    for f in ("errors.md", "errors.json", "timeline_overlay.png"):
        if (out_dir / f).exists():
            tr.client.log_artifact(parent, str(out_dir / f))
    tr.client.set_terminated(parent, "FINISHED")


def overlay_figure(real, sim, path: Path, num_mbs: int = 24):
    """Per-stage timelines of the first `num_mbs` micro-batches: real (top row of each stage)
    against simulated (bottom row), each from its own first launch; same colour = same mb id."""
    import matplotlib  # lazy: ~0.5 s to import, only the overlay figure needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def spans(res):
        ids = sorted({s[4] for s in res.tracer.spans if s[0].startswith("stage") and s[4] is not None})[:num_mbs]
        keep = set(ids)
        out = [s for s in res.tracer.spans if s[4] in keep and s[0].startswith("stage") and "." not in s[0]
               and s[1].split(":")[0] in ("prepare", "forward", "sample", "recv", "send")]
        t0 = min((s[2] for s in out), default=0.0)
        return [(s[0], s[1].split(":")[0], s[2] - t0, s[3] - t0, s[4]) for s in out], ids

    r_sp, r_ids = spans(real)
    s_sp, s_ids = spans(sim)
    tracks = real.stage_tracks
    cmap = plt.get_cmap("tab20")
    colour = {mb: cmap(i % 20) for i, mb in enumerate(r_ids)}
    colour.update({mb: cmap(i % 20) for i, mb in enumerate(s_ids) if mb not in colour})
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.1 * len(tracks)))
    yt, yl = [], []
    for i, tr in enumerate(tracks):
        for j, (name, sp) in enumerate((("real", r_sp), ("sim", s_sp))):
            y = (len(tracks) - 1 - i) * 2.5 + (1 - j) * 1.1
            yt.append(y + 0.45)
            yl.append(f"{tr} {name}")
            for track, op, a, b, mb in sp:
                if track != tr:
                    continue
                if op == "forward":
                    ax.broken_barh([(a, b - a)], (y, 0.9), facecolors=colour.get(mb, "grey"), edgecolor="black",
                                   linewidth=0.3)
                elif op in ("prepare", "sample", "send"):
                    ax.broken_barh([(a, b - a)], (y + 0.3, 0.3), facecolors="black" if op != "sample" else "red")
                elif op == "recv":
                    ax.broken_barh([(a, b - a)], (y + 0.4, 0.1), facecolors="lightgrey")
    ax.set_yticks(yt)
    ax.set_yticklabels(yl)
    ax.set_xlabel("seconds since the first span (each run on its own clock)")
    ax.set_title(f"real vs simulated per-stage timelines, first {num_mbs} micro-batches "
                 "(colour = mb id; black = prepare/send, red = sample, grey = recv)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


_ = asdict
