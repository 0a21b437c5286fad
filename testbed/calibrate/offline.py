"""`testbed calibrate runs` and `testbed validate --runs`: the simulator held to real runs, offline.

    testbed calibrate runs RUN_DIR [RUN_DIR ...] --name my-engine --base h100-80g \
        [--table profile.csv] [--out engine/pricing/hardware_profiles]
    testbed calibrate runs measurements/cpu-tiny-llama/manifest.yaml --profile P --name P   (its fit runs)
    testbed validate --runs RUN_DIR [RUN_DIR ...] hardware=my-engine [--out DIR] [--errors-csv F]
    testbed validate --runs measurements/cpu-tiny-llama/manifest.yaml --profile P hardware=P [--test]

`calibrate runs` fits a hardware profile from traced real runs (testbed/calibrate/run_fit.py) and
saves it with its provenance (the runs, their commit if recorded, the command, the fit errors by
micro-batch kind). `validate --runs` replays each run's requests with the run's own settings in the
simulator on a profile and prints the same error table as `testbed validate`, without running the
engine again; runs of the same command are grouped and their own spread (max - min over the mean)
is printed beside every error, since a real engine's run-to-run noise bounds how close any
simulator can be (the H100 gllm run: 5,377 and 5,796 tok/s, 7.5%).
"""
from __future__ import annotations

import json
import math
import shlex
import sys
import time
from pathlib import Path

from engine.base.errors import ConfigError
from engine.pricing.hardware import get_hardware
from testbed.calibrate.keep import save_profile_or_keep
from testbed.run.out_checks import plain_name, writable_dir, writable_file
from testbed.calibrate.profile import TARGETS, VALIDATE_METRICS, error_table, profile_dir
from testbed.calibrate.run_fit import fitted_spec, fit_runs
from testbed.calibrate.run_checks import distinct_runs, read_table
from testbed.calibrate.shared_device import check_some_shared
from testbed.calibrate.runs import RealRun, group_by_setting, load_run
from testbed.calibrate.error_figure import error_figure, frame_of
from testbed.calibrate.rank import (CSV_METRICS, Replayed, error_by_load, format_rank, rank_table, setting_label,
                                    write_errors_csv)
from testbed.calibrate.spread_sim import check_spread, simulate_spread, spread_note
from testbed.calibrate.stall_effects import stall_latency

SPREAD_METRICS = ("throughput_tok_s", "ttft_mean_s", "tpot_mean_s", "e2el_mean_s")


def cmd_calibrate_runs(args, console) -> int:
    from testbed.config.composer import load_saved_profiles

    load_saved_profiles()
    manifest = getattr(args, "manifest", None)  # set by the CLI when it read a manifest's fit runs
    if not args.base:
        raise ConfigError("calibrate runs needs --base <hardware profile> (or one manifest.yaml naming it)")
    out = writable_dir("--out", args.out if args.out else profile_dir())  # before the fit: a minute of work
    target = out / f"{plain_name('--name', args.name)}.yaml"
    distinct_runs(args.runs)
    runs = [load_run(p, need_trace=True) for p in args.runs]
    base = get_hardware(args.base)
    table = read_table(args.table) if args.table else None
    if getattr(args, "shared_gpu", False):
        check_some_shared(runs)  # before any work
    console.print(f"calibrate runs: {len(runs)} run(s) on base {base.name}; rebuilding micro-batch shapes")
    t0 = time.perf_counter()
    hop = getattr(args, "hop", None) or "link"
    handover = bool(getattr(args, "inflight_handover", False))
    by_batch = bool(getattr(args, "decode_by_batch", False))
    by_rows = bool(getattr(args, "mixed_by_rows", False))
    contention = bool(getattr(args, "sampler_contention", False))
    shared_gpu = bool(getattr(args, "shared_gpu", False))
    fit = fit_runs(runs, base, table, own_attention=args.own_attention, hop=hop, inflight_handover=handover,
                   decode_by_batch=by_batch, shared_gpu=shared_gpu, mixed_by_rows=by_rows,
                   sampler_contention=contention)
    rc = runs[0].spec.settings
    desc = (f"{base.description.split(';')[0]}; this project's torch engine ({rc.model.name}, P={rc.parallel.pp}, "
            f"{rc.executor.settings.device}) calibrated from real runs (testbed calibrate runs)")
    spec = fitted_spec(base, args.name, fit, desc)
    provenance = {"source": "real runs (testbed calibrate runs)", "base": base.name,
                  "base_version": base.version, "command": _portable("testbed calibrate " + " ".join(map(shlex.quote, sys.argv[2:]))),
                  "date": time.strftime("%Y-%m-%d", time.gmtime()), "runs": [_run_record(r) for r in runs],
                  "model": rc.model.name, "pp": rc.parallel.pp, "device": rc.executor.settings.device,
                  "sampling": rc.executor.settings.sampling, "cuda_graphs": rc.executor.settings.cuda_graphs,
                  "engine_commit": args.commit, "table": _portable(args.table) if args.table else None,
                  "own_attention": args.own_attention, "hop": hop,
                  **({"inflight_handover": True} if handover else {}),
                  **({"decode_by_batch": True} if by_batch else {}),
                  **({"mixed_by_rows": True} if by_rows else {}),
                  **({"sampler_contention": True} if contention else {}),
                  **({"shared_gpu": True} if shared_gpu else {}),
                  **({"manifest": _portable(manifest), "split": args.profile} if manifest else {}),
                  "errors": fit.errors,
                  "first_use_s": [round(x, 6) for x in fit.first_use_s]}
    path = save_profile_or_keep(spec, target, provenance)
    console.print("\n".join(fit.summary_lines()))
    console.print(f"fitted in {time.perf_counter() - t0:.1f} s; use it as hardware={args.name}")
    print(path.resolve())
    return 0


def _portable(command: str) -> str:
    """The command as recorded: the data directory written as $TESTBED_DATA_DIR (another machine's
    absolute paths mean nothing in a shipped profile)."""
    import os

    data = os.environ.get("TESTBED_DATA_DIR")
    return command.replace(str(Path(data).resolve()), "$TESTBED_DATA_DIR") if data else command


def _run_record(run: RealRun) -> dict:
    s = run.summary
    return {"dir": run.label, "policy": run.spec.policy_name, "workload": run.spec.workload_name,
            "num_microbatches": int(s.get("num_microbatches", len(run.microbatches))),
            "throughput_tok_s": round(float(s["throughput_tok_s"]), 1)}


def spread(runs: list[RealRun]) -> dict[str, float]:
    """(max - min) / mean of each metric over repeated runs of one command (0 for a single run)."""
    out = {}
    for m in SPREAD_METRICS:
        vals = [float(r.summary[m]) for r in runs]
        mean = sum(vals) / len(vals)
        out[m] = (max(vals) - min(vals)) / mean if len(vals) > 1 and mean else float("nan")
    return out


def cmd_validate_runs(args, console) -> int:
    from testbed.calibrate.profile import _override
    from testbed.config.composer import load_saved_profiles

    load_saved_profiles()
    # `--runs A B hardware=x`: argparse hands the override to --runs; a run directory has no '='
    overrides = list(args.overrides) + [r for r in args.runs if "=" in r]
    paths = [r for r in args.runs if "=" not in r]
    bad = [o for o in overrides if o.partition("=")[0] != "hardware"]
    hardware = _override(overrides, "hardware")
    if hardware is None or bad:
        raise ConfigError("testbed validate --runs takes hardware=<profile> and nothing else (each run keeps its "
                          f"own settings); got {' '.join(overrides) or 'nothing'}")
    spread_s = check_spread(getattr(args, "spread", 0.0))
    get_hardware(hardware)
    out = Path(args.out) if args.out else Path("runs") / "validate" / f"{time.strftime('%Y%m%d-%H%M%S')}_runs-{hardware}"
    writable_dir("--out", out)  # before the replays
    if getattr(args, "errors_csv", None):
        writable_file("--errors-csv", args.errors_csv)
    distinct_runs(paths)
    runs = [load_run(p) for p in paths]
    rows, replays = [], []
    for group in group_by_setting(runs).values():
        sp, sims = spread(group), []
        for run in group:
            t = time.perf_counter()
            _, predicted = simulate_spread(run, hardware, spread_s, out / run.label / "sim")
            sims.append(predicted)
            errs = error_table(run.summary, predicted)
            st = stalls_against(run, hardware, predicted)
            rows.append({"run": run.label, "repeats": len(group), "spread": sp, "errors": errs, "stalls": st})
            replays.append(replayed(run, predicted, st))
            console.print(f"  {run.label}: simulated in {time.perf_counter() - t:.1f} s")
        if len(group) > 1:
            rows.append(mean_row(group, sims, sp))
    text = format_runs_table(rows, hardware) + spread_note(spread_s)
    if rank_table(replays):  # two policies or more on one setting
        text += "\n" + format_rank(rank_table(replays), error_by_load(replays))
    if getattr(args, "errors_csv", None):
        write_errors_csv(replays, Path(args.errors_csv), CSV_METRICS)
    out.mkdir(parents=True, exist_ok=True)
    (out / "errors.md").write_text("```\n" + text + "\n```\n")
    (out / "errors.json").write_text(json.dumps(rows, indent=2, default=float))
    error_figure(frame_of(replays), out / "errors.png", f"{len(runs)} runs simulated on {hardware} vs the engine")
    print(text)
    print(out.resolve())
    return 0


def replayed(run: RealRun, sim: dict, st: dict, which: str = "") -> Replayed:
    setting, offered = setting_label(run.spec)
    return Replayed(run.label, which, run.spec.policy_name, setting, offered, dict(run.summary), dict(sim),
                    int(st["count"]), float(st["excess_s"]))


def mean_row(group: list[RealRun], sims: list[dict], sp: dict[str, float]) -> dict:
    """The simulator against the mean of repeated runs of one command. It is deterministic and the
    engine is not: two CPU runs of one Azure command differed by 28-45% in mean TPOT (gllm forms
    its batches from timings that differ by milliseconds), so no single run is the engine's figure;
    their mean is the one to predict, and each run's own error is shown beside it."""
    def mean(summaries: list[dict]) -> dict:
        return {key: sum(float(x.get(key, float("nan"))) for x in summaries) / len(summaries)
                for key, _ in VALIDATE_METRICS}

    return {"run": f"mean of the {len(group)} runs above", "repeats": len(group), "spread": sp,
            "errors": error_table(mean([r.summary for r in group]), mean(sims)), "runs": [r.label for r in group]}


# A micro-batch that took this much longer than the profile says, and this many times as long, is
# an engine stall, not a cost: on the H100 the engine stalled 0.48-0.98 s in eager mixed steps (a
# new Triton specialisation compiling on first use when its cache is cold: the same micro-batches
# ran without it in a repeat), 4 of them 16% of the sarathi run.
STALL_MIN_S = 0.25
STALL_RATIO = 5.0


def stalls(run: RealRun, hardware: str) -> dict:
    """The real run's micro-batches far above the profile's prediction of them (engine stalls), and
    the throughput the run would have had without that excess."""
    from engine.pricing.costmodel import CostCoefficients, CostModel
    from testbed.calibrate.runs import replay_shapes

    rc, hw = run.spec.settings, get_hardware(hardware)
    cost = CostModel(rc.model, hw, rc.parallel.pp, layer_split=rc.parallel.layer_split,
                     coefficients=CostCoefficients(**(hw.calibration or {})))
    shapes = replay_shapes(run)
    excess, where, intervals = 0.0, [], []
    own = own_times(run.microbatches)
    for row in run.microbatches.itertuples():
        shape = shapes[int(row.mb_id)][0]
        pred = (cost.dispatch_s(shape) + sum(cost.prep_s(shape) for _ in range(cost.pp))
                + sum(cost.stage_compute_all_s(shape)) + cost.sample_s(shape) + cost.return_s(shape))
        took = own[int(row.mb_id)]
        if took - pred > STALL_MIN_S and took > STALL_RATIO * pred:
            excess += took - pred
            where.append(f"mb {int(row.mb_id)} {row.kind} {took:.2f} s")
            intervals.append((float(row.scheduled_s), float(row.completed_s), took - pred))
    s = run.summary
    tokens = float(s["throughput_tok_s"]) * float(s["duration_s"])
    without = tokens / (float(s["duration_s"]) - excess) if excess else float(s["throughput_tok_s"])
    return {"count": len(where), "excess_s": excess, "where": where[:6], "throughput_without": without,
            **stall_latency(run.path / "requests.csv", intervals)}


def own_times(microbatches) -> dict[int, float]:
    """mb_id -> its completion less the later of its launch and the completion before it: with two
    or more micro-batches in flight, one launched behind a large prefill waits for it, and that wait
    is the prefill's time, not its own. On P=2 Azure 9 req/s (2026-11-28) every "stall" of 8 checked
    was a 5-20-sequence decode launched behind a 1,236-1,984-token prefill that took 0.29-0.45 s,
    within -4..+7% of its price (docs/measurements/diag-cpu-2026-11-28b.md). One micro-batch in
    flight (P=1): the completion before is before the launch, and this is completion - launch."""
    rows = sorted(zip(microbatches["completed_s"], microbatches["scheduled_s"], microbatches["mb_id"]))
    out, before = {}, float("-inf")
    for done, sched, mb in rows:
        out[int(mb)] = float(done) - max(float(sched), before)
        before = float(done)
    return out


def stalls_against(run: RealRun, hardware: str, sim: dict) -> dict:
    """The run's stalls and the simulator's error on each figure they touch, with them taken out."""
    st = stalls(run, hardware)
    for key, without in (("throughput", "throughput_without"), ("ttft", "ttft_mean_without"),
                         ("tpot", "tpot_mean_without")):
        metric = "throughput_tok_s" if key == "throughput" else f"{key}_mean_s"
        st[f"{key}_error_without"] = float(sim[metric]) / st[without] - 1.0 if st.get(without) else float("nan")
    return st


def format_runs_table(rows: list[dict], hardware: str) -> str:
    """One block per run: real, simulated, error, and the engine's own spread where measured."""
    lines = [f"simulated (hardware={hardware}) vs real, each run replayed with its own requests and settings"]
    for r in rows:
        lines.append(f"\n{r['run']}  ({r['repeats']} run(s) of this command)")
        lines.append(f"  {'metric':<20}{'real':>12}{'sim':>12}{'error':>9}{'spread':>9}  target")
        for e in r["errors"]:
            m = e["metric"]
            sp = r["spread"].get(m, float("nan"))
            tol = TARGETS.get(m)
            verdict = "" if tol is None or not math.isfinite(e["rel_error"]) else (
                f"<= {100 * tol:.0f}%: {'met' if abs(e['rel_error']) <= tol else 'missed'}")
            lines.append(f"  {_label(m):<20}{e['real']:>12.5g}{e['sim']:>12.5g}{100 * e['rel_error']:>8.1f}%"
                         f"{'' if not math.isfinite(sp) else f'{100 * sp:8.1f}%':>9}  {verdict}")
        st = r.get("stalls")  # a run's own; the mean of repeats has none
        if st and st["count"]:
            lines.append(f"  engine stalls: {st['count']} micro-batch(es) took {st['excess_s']:.2f} s more than the "
                         f"profile says ({', '.join(st['where'])}); without them the real run's throughput is "
                         f"{st['throughput_without']:.5g} tok/s, the simulator's error "
                         f"{100 * st['throughput_error_without']:+.1f}%; they lengthen the TTFT of "
                         f"{st['ttft_touched']} request(s) and the TPOT of {st['tpot_touched']}: without them "
                         f"TTFT mean error {100 * st['ttft_error_without']:+.1f}%, TPOT mean "
                         f"{100 * st['tpot_error_without']:+.1f}%")
    lines.append("\nerror = sim / real - 1; spread = (max - min) / mean of the real runs of one command; "
                 "\"mean of the runs\": the simulator against the mean of the runs of one command")
    return "\n".join(lines)


def _label(metric: str) -> str:
    return dict(VALIDATE_METRICS).get(metric, metric)
