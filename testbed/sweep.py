"""One sweep runner for `testbed compare` and `testbed reproduce`: grid points as jobs, worker
processes, the sweep's summary MLflow run beside one run per point, and how a sweep ends
(FINISHED, or KILLED on Ctrl-C / SIGTERM with every point run that was still going).

The point runs are not nested under the summary run (no `mlflow.parentRunId`): MLflow's UI shows
nested runs collapsed under their parent, so the experiment page of a comparison showed one row
and its chart view charted the summary run alone. They link to it with the tag
`testbed.parent_run` instead, and the summary run holds the table, the figures and its counts as
tags (`compare.runs`, `compare.failed`, `compare.wall_s`), so every chart compares the points.

Signals. SIGTERM (what `timeout`, schedulers and `kill` send) takes the Ctrl-C path: inside
`signals()` it raises `Terminated`, a KeyboardInterrupt, so every `except KeyboardInterrupt`
cleanup runs; `exit_code` turns it into 143 (Ctrl-C: 130). The sweep then stops launching points
at once, terminates its workers, ends the point and summary runs KILLED and leaves the caller to
flush the table of the points done so far.

Workers are spawned processes (`compare.workers=N`, `--workers N`) pulling point indices from a
queue; each asks the kernel to SIGTERM it when its parent dies (Linux `PR_SET_PDEATHSIG`) and
also polls `os.getppid()` every 0.5 s, so a SIGKILLed parent leaves no orphan running points. A
worker that dies (OOM, signal) fails its point with the exit code and is replaced.
"""
from __future__ import annotations

import ctypes
import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from engine.errors import TestbedError
from testbed.outputs import write_run_dir
from testbed.runner import prepare_experiment
from testbed.tracking import Tracker, tracking_uri

EXIT_SIGINT = 130
EXIT_SIGTERM = 143
PARENT_POLL_S = 0.5
WORKER_STOP_S = 10.0  # a terminated worker ends its point's MLflow run, then exits
PR_SET_PDEATHSIG = 1


# --- signals -----------------------------------------------------------------------------------------

class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be so the same cleanup runs."""


_terminated = threading.Event()  # set by SIGTERM: code that re-raises a plain KeyboardInterrupt
# (Optuna's optimize loop does) must not turn exit 143 into 130


def _raise_terminated(signum, frame) -> None:
    _terminated.set()
    raise Terminated()


@contextmanager
def signals() -> Iterator[None]:
    """SIGTERM raises `Terminated` in the main thread while the block runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_code(exc: BaseException) -> int:
    return EXIT_SIGTERM if isinstance(exc, Terminated) or _terminated.is_set() else EXIT_SIGINT


def interrupted_message(exc: BaseException) -> str:
    return "terminated (SIGTERM)" if isinstance(exc, Terminated) or _terminated.is_set() else "interrupted"


def shield() -> None:
    """In a worker that is cleaning up after an interrupt: ignore further SIGINT/SIGTERM, so a
    second signal cannot cut the MLflow call that ends its run (the parent SIGKILLs stragglers)."""
    if mp.parent_process() is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def orphan_guard() -> None:
    """Call first in a worker process: SIGTERM raises `Terminated`, and the worker gets SIGTERM
    when its parent dies (pdeathsig on Linux, else the parent-pid poll of a daemon thread)."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# --- jobs and one point ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """One grid point to run (picklable for spawned workers)."""

    index: int
    cfg: dict
    label: str
    axes: tuple[str, ...]
    axis_values: dict
    experiment: str
    parent_run_id: str | None
    run_dir: str


_TRACKERS: dict[tuple[str, str], Any] = {}
PARENT_TAG = "testbed.parent_run"  # a point run's link to its sweep's summary run (not MLflow nesting)


def _tracker(cfg: Mapping[str, Any], experiment: str) -> Any:
    """One MLflow tracker per (store, experiment) and process (`Tracker` imports mlflow, ~2 s,
    only when the first one is made: `output.mlflow=false` sweeps never pay for it)."""
    key = (tracking_uri(cfg), experiment)
    if key not in _TRACKERS:
        _TRACKERS[key] = Tracker(cfg, experiment)
    return _TRACKERS[key]


def _open_point_run(job: Job) -> tuple[Any, str | None]:
    if not (job.cfg.get("output") or {}).get("mlflow", True):
        return None, None
    tracker = _tracker(job.cfg, job.experiment)
    tags = {"testbed.kind": "point", "testbed.compare": job.experiment, "testbed.axes": json.dumps(list(job.axes)),
            "compare.point": str(job.index), **{f"axis.{k}": str(v) for k, v in job.axis_values.items()}}
    if job.parent_run_id:
        tags[PARENT_TAG] = job.parent_run_id
    return tracker, tracker.start(job.cfg, job.label, tags=tags)


def run_point(job: Job) -> dict:
    """Run one grid point as `testbed run` would, logged beside the sweep's summary run. Never
    raises for a user-level failure (that becomes the row's error); an interrupt ends the
    point's run KILLED and propagates."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {"point": job.index, **job.axis_values, "status": "failed", "error": None,
                           "run_id": None, "run_dir": None}
    tracker, row["run_id"] = _open_point_run(job)
    try:
        result = prepare_experiment(job.cfg).run()
    except TestbedError as exc:
        row["error"] = str(exc)
    except Exception as exc:  # a policy bug at this point: one failed row, not a dead grid
        row["error"] = f"{type(exc).__name__}: {exc}"
    except KeyboardInterrupt:
        shield()
        if tracker is not None:
            tracker.client.set_tag(row["run_id"], "error", "interrupted")
            tracker.client.set_terminated(row["run_id"], "KILLED")
        raise
    else:
        _record(job, row, tracker, result)
    if row["error"] and tracker is not None and row["run_dir"] is None:
        tracker.fail(row["run_id"], row["error"])
    row["wall_s"] = time.perf_counter() - t0
    return row


def _record(job: Job, row: dict, tracker: Any, result: Any) -> None:
    run_dir = Path(job.run_dir)
    write_run_dir(result, run_dir, plots=bool((job.cfg.get("output") or {}).get("plots", True)))
    row["run_dir"] = str(run_dir)
    if tracker is not None:
        tracker.finish(row["run_id"], result, run_dir)
    row["error"] = result.error
    row["status"] = "failed" if result.error else "finished"
    for k, v in result.summary.items():
        if isinstance(v, list):
            row.update({f"{k}.stage{i}": float(x) for i, x in enumerate(v)})
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            row[k] = float(v)


def failed_row(job: Job, error: str) -> dict:
    return {"point": job.index, **job.axis_values, "status": "failed", "error": error, "run_id": None}


# --- the summary run ----------------------------------------------------------------------------------

class ParentRun:
    """The sweep's summary MLflow run (none with `output.mlflow=false`): created before any
    worker starts (which also creates the database and the experiment), ended FINISHED, or
    KILLED together with every point run (tag `testbed.parent_run`) still RUNNING."""

    def __init__(self, cfg: Mapping[str, Any], experiment: str, run_name: str, tags: Mapping[str, str]) -> None:
        self.tracker = self.run_id = None
        if (cfg.get("output") or {}).get("mlflow", True):
            self.tracker = _tracker(cfg, experiment)
            self.run_id = self.tracker.client.create_run(self.tracker.experiment_id, run_name=run_name,
                                                         tags=dict(tags)).info.run_id

    def print_link(self, console: Any) -> None:
        """The experiment's chart view (tracking.chart_link), as soon as the experiment exists."""
        if self.tracker is not None and console is not None:
            console.print(self.tracker.link, highlight=False, soft_wrap=True, markup=False)

    def log(self, metrics: Mapping[str, float], tags: Mapping[str, str] | None = None) -> None:
        if self.tracker is None:
            return
        from mlflow.entities import Metric, RunTag  # mlflow is loaded already (the tracker)

        now = int(time.time() * 1000)
        self.tracker.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                                      tags=[RunTag(k, str(v)[:5000]) for k, v in (tags or {}).items()])

    def log_files(self, folder: Path, subdirs: Sequence[str] = ()) -> None:
        """The folder's files (not its run directories) and the named subfolders."""
        if self.tracker is None:
            return
        for path in sorted(folder.iterdir()):
            if path.is_file():
                self.tracker.client.log_artifact(self.run_id, str(path))
        for sub in subdirs:
            if (folder / sub).is_dir():
                self.tracker.client.log_artifacts(self.run_id, str(folder / sub), sub)

    def end(self, status: str = "FINISHED") -> None:
        if self.tracker is None:
            return
        if status != "FINISHED":
            self._kill_children()
        self.tracker.client.set_terminated(self.run_id, status)

    def _kill_children(self) -> None:
        client = self.tracker.client
        runs = client.search_runs([self.tracker.experiment_id],
                                  filter_string=f"tags.`{PARENT_TAG}` = '{self.run_id}' "
                                                f"and attributes.status = 'RUNNING'")
        for run in runs:
            client.set_tag(run.info.run_id, "error", "interrupted")
            client.set_terminated(run.info.run_id, "KILLED")


# --- running the jobs ---------------------------------------------------------------------------------

def run_jobs(jobs: Sequence[Job], workers: int, console: Any, progress_on: bool, rows: list[dict]) -> list[dict]:
    """Run every job (in this process, or in `workers` spawned processes), appending each row
    to `rows` as it arrives, so an interrupted caller still holds the points done so far."""
    progress = _progress(console, len(jobs)) if console is not None and progress_on else None

    def done(row: dict) -> None:
        rows.append(row)
        if progress is not None:
            _print_row(progress, row, jobs[row["point"]].label)

    with progress if progress is not None else nullcontext():
        if workers <= 1 or len(jobs) <= 1:
            for job in jobs:
                done(run_point(job))
        else:
            WorkerPool(jobs, min(workers, len(jobs))).run(done)
    return rows


def _progress(console: Any, total: int) -> Progress:
    progress = Progress(TextColumn("runs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True)
    progress.add_task("grid", total=total)
    return progress


def _print_row(progress: Progress, row: dict, label: str) -> None:
    state = "[green]done[/green]" if row["status"] == "finished" else "[red]failed[/red]"
    tput = row.get("throughput_tok_s")
    extra = f" throughput {tput:.4g} tok/s" if isinstance(tput, float) and not math.isnan(tput) else ""
    progress.console.print(f"point {row['point']:>3} {state} {label}{extra}", highlight=False)
    progress.advance(progress.task_ids[0])


def _worker_main(jobs: Sequence[Job], tasks: Any, results: Any) -> None:
    """A spawned worker: run points from the queue until it is empty."""
    orphan_guard()
    try:
        while True:
            try:
                index = tasks.get(timeout=1.0)
            except queue_mod.Empty:
                return
            results.put(("start", index, os.getpid()))
            results.put(("row", index, run_point(jobs[index])))
    except KeyboardInterrupt:
        sys.exit(EXIT_SIGINT)


class WorkerPool:
    """`n` spawned workers over one task queue. Unlike a ProcessPoolExecutor, stopping it does
    not wait for the queued points: `stop()` terminates the workers at once."""

    def __init__(self, jobs: Sequence[Job], n: int) -> None:
        self.jobs = list(jobs)
        self.ctx = mp.get_context("spawn")
        self.tasks = self.ctx.Queue()
        self.results = self.ctx.Queue()
        self.n = n
        self.procs: list[Any] = []
        self.holding: dict[int, int] = {}  # pid -> point index
        self.finished: set[int] = set()

    def _spawn(self) -> None:
        # not daemonic: a torch point starts stage processes of its own; `stop` and the orphan guard end it
        p = self.ctx.Process(target=_worker_main, args=(self.jobs, self.tasks, self.results), daemon=False,
                             name=f"sweep-worker-{len(self.procs)}")
        p.start()
        self.procs.append(p)

    def run(self, done: Callable[[dict], None]) -> None:
        for job in self.jobs:
            self.tasks.put(job.index)
        try:
            for _ in range(self.n):
                self._spawn()
            while len(self.finished) < len(self.jobs):
                self._step(done)
        finally:
            self.stop()

    def _step(self, done: Callable[[dict], None]) -> None:
        try:
            kind, index, payload = self.results.get(timeout=PARENT_POLL_S)
        except queue_mod.Empty:
            self._reap(done)
            return
        if kind == "start":
            self.holding[payload] = index
        elif index not in self.finished:
            self.finished.add(index)
            self.holding = {pid: i for pid, i in self.holding.items() if i != index}
            done(payload)

    def _reap(self, done: Callable[[dict], None]) -> None:
        """Workers that died: fail the point each held, replace it while points remain."""
        for p in [p for p in self.procs if not p.is_alive() and p.exitcode not in (None, 0)]:
            self.procs.remove(p)
            index = self.holding.pop(p.pid, None)
            if index is not None and index not in self.finished:
                self.finished.add(index)
                done(failed_row(self.jobs[index], f"worker died with exit code {p.exitcode}"))
            if len(self.finished) < len(self.jobs):
                self._spawn()
        if not any(p.is_alive() for p in self.procs):  # queue empty, every worker gone
            for job in self.jobs:
                if job.index not in self.finished:
                    self.finished.add(job.index)
                    done(failed_row(job, "lost: its worker ended without a result"))

    def stop(self) -> None:
        """Terminate every worker still running (each ends its point's run KILLED), then kill
        the ones that do not exit within WORKER_STOP_S."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + WORKER_STOP_S
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.tasks.cancel_join_thread()
        self.results.cancel_join_thread()
