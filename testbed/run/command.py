"""`testbed run`: check, simulate (or serve), write the run folder, log to MLflow, print.

Order matters for the first-hour experience:
1. every user mistake and unusable destination (output.dir a file, an unreachable tracking
   server, a run name that escapes output.dir) is one `error:` line before anything runs;
2. two background processes (testbed/tracking/background.py) import MLflow and matplotlib and open the
   tracking run while the config is composed and the simulation runs, so on the 5,000-request benchmark the end-to-end time
   stays close to the simulation's instead of adding ~13 s after it;
3. Ctrl-C, SIGTERM and SIGHUP stop the run, and the requests so far are still written (unfinished
   ones reported failed) and logged as a KILLED MLflow run; exit code 130 / 143 / 129. Signals
   after the first are ignored: they must not cut the save short (testbed/signals.py).
"""
from __future__ import annotations

from collections import Counter

import os
import resource
import time
from pathlib import Path
from typing import Any, Sequence

from rich.markup import escape

from engine.base.settings import OutputSettings
from testbed.run import FIGURES
from testbed.run.outputs import (OutputWriteError, display_name, folder_name, plot_data,
                             prepare_output_dir, reserve_run_dir, update_run_info, write_run_dir)
from testbed.run.overload import judge
from testbed.run.timing import breakdown, process_age_s, serving_name, serving_s
from testbed.run.runner import RunInterrupted, RunResult
from testbed.tracking.background import Background
from testbed.signals import EXIT_CODES, one_stop, raise_if_stopped, saving, stopped_by


def run_command(overrides: Sequence[str], console, t_start: float | None = None,
                bg: Background | None = None) -> int:
    """`bg`: background processes the caller started before importing this module (testbed/cli.py),
    else they start here, still before the config is composed."""
    t_start = time.perf_counter() if t_start is None else t_start
    bg = Background.from_command_line(overrides, FIGURES) if bg is None else bg
    with one_stop():  # the first signal stops the run; later ones cannot interrupt the save
        return _run(overrides, console, t_start, bg)


def _run(overrides: Sequence[str], console, t_start: float, bg: Background) -> int:
    try:
        from testbed.config.spec import compose_spec
        from testbed.run.runner import prepare_experiment

        spec = compose_spec(overrides)
        out = spec.output
        base = prepare_output_dir(out.dir)
        if out.mlflow:
            from testbed.tracking.tracker import artifact_root, check_tracking_uri, tracking_uri

            uri = tracking_uri(out)
            check_tracking_uri(uri)
        bg.fit(mlflow=out.mlflow, plots=out.plots)
        progress, bar = _progress(console, enabled=out.progress)
        prepared = prepare_experiment(spec, progress=bar)
        raise_if_stopped()  # a stop whose exception was dropped while the workload was built
        run_dir = reserve_run_dir(base, folder_name(spec))
        if bg.tracker is not None:
            from testbed.tracking.tracker import run_tags

            bg.tracker.start(uri=uri, experiment=out.experiment, artifact_location=artifact_root(out),
                             journal=str(base),
                             run_name=display_name(spec, overrides),
                             tags={**run_tags(spec, source_name(overrides)),
                                   "testbed.run_dir": str(run_dir.resolve())},
                             params={k: _param(v) for k, v in spec.params().items()})
        stopped = None
        try:
            with progress:
                result = prepared.run()
        except RunInterrupted as exc:
            result, stopped = exc.result, exc.signal
        stopped = stopped or stopped_by()  # its exception dropped: the run went on, but it was stopped
    except BaseException:
        bg.close()  # an opened run is marked KILLED by its process when its input closes
        raise
    with saving():  # flushing takes about a second; a signal now must not lose it
        return _finish(console, result, run_dir, out, bg, stopped, t_start)


def source_name(overrides: Sequence[str]) -> str:
    """MLflow's Source column shows the text after the last '/': the command without output.* paths."""
    keep = [ov for ov in overrides if not ov.lstrip("+~").startswith(("output.", "data_dir"))]
    return " ".join(["testbed run", *keep])


def _finish(console, result: RunResult, run_dir: Path, out: OutputSettings, bg: Background, stopped: str | None,
            t_start: float) -> int:
    from testbed.tracking.tracker import note, run_metrics

    t_write = time.perf_counter()
    if bg.figures is not None:
        bg.figures.render(str(run_dir), plot_data(result))  # rendered while the files are written
    try:
        write_run_dir(result, run_dir, plots=False, trace=out.trace)
        unwritten = None
    except OutputWriteError as exc:  # a full disk: the run is FAILED with that reason, not a traceback
        unwritten = str(exc)
    status = "KILLED" if stopped else ("FAILED" if result.error or unwritten else "FINISHED")
    print_summary(console, result)  # while the figures are rendered
    warn_overload(console, result)
    if not stopped:
        warn_failed(console, result)
    errors = []
    if bg.figures is not None:  # before MLflow, which logs them
        errors += bg.figures.finish(run_dir=None, metrics=[], tags={}, status=status)
    times = _times(result, run_dir, t_start, t_write, unwritten is None)
    if bg.tracker is not None:
        tags = {"mlflow.note.content": note(result)}
        if result.error or unwritten:
            tags["error"] = (unwritten or result.error)[:5000]
        errors += bg.tracker.finish(run_dir=str(run_dir), metrics=run_metrics(result), tags=tags, status=status)
        if bg.tracker.said and unwritten is None:  # shown on the console as they came; kept with the run
            update_run_info(run_dir, tracking_notes=bg.tracker.said)
    for e in errors if not unwritten else ():  # a full disk fails these too: its one line says it
        console.print(f"[red]error:[/red] {escape(e)}")
    for w in (bg.tracker.warnings if bg.tracker is not None else []):
        console.print(f"[yellow]warning:[/yellow] {escape(w)}", soft_wrap=True)
    if bg.tracker is not None and bg.tracker.experiment_id is not None:
        from testbed.tracking.tracker import chart_link, tracking_uri

        console.print(chart_link(tracking_uri(result.spec.output), bg.tracker.experiment_id), highlight=False,
                      soft_wrap=True, markup=False)
    if stopped:
        console.print(f"[yellow]interrupted ({stopped}):[/yellow] {result.summary['num_finished']} of "
                      f"{result.summary['num_requests']} requests finished; the others are reported failed")
    elif result.error:
        console.print(f"[red]run failed:[/red] {escape(result.error)}")
    rss = [resource.getrusage(w).ru_maxrss / 1024 for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    name = serving_name(result.info.get("executor", "sim"))
    parts = ", ".join(f"{k} {v:.2f}" for k, v in times.items() if k != name)
    console.print(f"[dim]time: {name} {serving_s(result.info):.2f} s; end to end {result.info['end_to_end_s']:.2f} s "
                  f"({parts}); peak RSS {rss[0]:.0f} MB (largest background process {rss[1]:.0f} MB)[/dim]",
                  highlight=False)
    if os.environ.get("TESTBED_TIMING"):
        for label, p in (("MLflow", bg.tracker), ("figures", bg.figures)):
            if p is not None:
                console.print(f"[dim]{label} process: done at {p.timings} s after its start; the run ended at "
                              f"{t_write - p.t0:.2f} s[/dim]", highlight=False)
    if unwritten:
        raise OutputWriteError(unwritten)  # the one `error:` line, exit 2 (testbed/cli.py)
    print(run_dir.resolve(), flush=True)
    if stopped:
        return EXIT_CODES.get(stopped, 130)
    return 1 if (result.error or errors) else 0


def _times(result: RunResult, run_dir: Path, t_start: float, t_write: float, written: bool) -> dict[str, float]:
    """The end-to-end time, measured once the results are saved, and its parts (testbed/run/timing.py):
    into `result.info` (so MLflow logs it) and `run_info.json`."""
    end_to_end = process_age_s(t_start)
    times = breakdown(result.info, end_to_end, time.perf_counter() - t_write)
    result.info.update(end_to_end_s=end_to_end, time_parts_s=times)
    if written:
        update_run_info(run_dir, end_to_end_s=end_to_end, time_parts_s=times)
    return times


def _param(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


def warn_overload(console, result: RunResult) -> bool:
    """One yellow line when the queue of requests waiting for their first token kept growing over
    the arrival window (testbed/run/overload.py): then TTFT measures the backlog, not the policy."""
    load = judge(result.requests)
    if load is None or result.error or not load.overloaded:
        return False
    served = result.summary.get("request_throughput") or 0.0
    console.print(f"[yellow]warning: overloaded: the workload offers {load.offered_req_s:.3g} req/s "
                  f"({load.offered_tok_s:,.0f} tok/s) and the queue waiting for a first token grew by "
                  f"{load.growth:.0%} of that over the second half of the arrivals, so TTFT measures the "
                  f"backlog; lower workload.rate (e.g. workload.rate={0.8 * served:.2g}, 80% of the "
                  f"{served:.3g} req/s it completed) "
                  f"for a steady state[/yellow]", soft_wrap=True)
    return True


def warn_failed(console, result: RunResult) -> bool:
    """One yellow line when requests failed, with the commonest reason: a workload whose every
    request exceeded the KV cache ended with exit 0 and NaN latencies and nothing else said
    (issue 38 item 9)."""
    reasons = Counter(r["fail_reason"] for r in result.requests if r.get("fail_reason"))
    if result.error or not reasons:
        return False
    reason, count = reasons.most_common(1)[0]
    more = f" ({count} of them: {escape(reason)})" if len(reasons) > 1 else f": {escape(reason)}"
    console.print(f"[yellow]warning: {sum(reasons.values())} of {len(result.requests)} requests failed{more}"
                  f"[/yellow]", soft_wrap=True, highlight=False)
    return True


def _progress(console, enabled: bool):
    """A rich progress bar over finished requests, updated at most every 0.5% of them."""
    from contextlib import nullcontext

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not enabled:
        return nullcontext(), None
    progress = Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True)
    task = progress.add_task("run", total=None)
    state = {"last": -1}

    def update(done: int, total: int) -> None:
        step = max(1, total // 200)
        if done - state["last"] >= step or done == total:
            state["last"] = done
            progress.update(task, completed=done, total=total)

    return progress, update


SUMMARY_ROWS = ("num_requests", "num_finished", "num_failed", "throughput_tok_s", "output_throughput_tok_s",
                "slo_attainment", "bubble_ratio", "stage_utilization", "num_preemptions", "num_microbatches")
LATENCIES = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E latency", "e2el_s"))  # requests.csv columns
PERCENTILES = (50, 90, 99)


def latency_ms(requests: Sequence[dict]) -> dict[str, list[float]]:
    """Mean and PERCENTILES of each latency over the finished requests, in ms (as `vllm bench
    serve`, aiperf and guidellm print them); summary.json keeps seconds (mean, p50, p99)."""
    import numpy as np

    out = {}
    for label, key in LATENCIES:
        v = np.array([r[key] for r in requests if r["status"] == "finished"], dtype=float)
        v = v[~np.isnan(v)] * 1e3
        out[label] = [float(v.mean()), *(float(np.percentile(v, q)) for q in PERCENTILES)] if v.size else \
            [float("nan")] * (1 + len(PERCENTILES))
    return out


def print_summary(console, result: RunResult) -> None:
    from rich.table import Table

    s = result.summary
    t = Table(title=escape(f"{result.info.get('policy')} on {result.spec.workload_name} "
                           f"({result.info.get('executor')}, P={len(result.stage_tracks)})"))
    t.add_column("metric")
    t.add_column("value", justify="right")

    def fmt(v):
        if isinstance(v, list):
            return " ".join(f"{x:.3f}" for x in v)
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    for key in SUMMARY_ROWS:
        t.add_row(key, fmt(s[key]))
    console.print(t)
    lat = Table(title="latency (ms), finished requests")
    for col in ("", "mean", *(f"p{q}" for q in PERCENTILES)):
        lat.add_column(col, justify="right" if col else "left")
    for label, values in latency_ms(result.requests).items():
        lat.add_row(label, *(f"{v:,.1f}" for v in values))
    console.print(lat)
    if result.breakdown:  # where each stage's time went (engine/core/breakdown.py)
        from engine.core.breakdown import summary_line

        console.print(escape(summary_line(result.breakdown)), highlight=False, soft_wrap=True)


__all__ = ["run_command", "print_summary", "warn_overload"]
