"""One sweep runner for `testbed compare` and `testbed reproduce`: grid points as jobs, worker
processes, the sweep's summary MLflow run beside one run per point, and how a sweep ends
(FINISHED, or KILLED on Ctrl-C / SIGTERM with every point run that was still going).

The point runs are not nested under the summary run (no `mlflow.parentRunId`): MLflow's UI shows
nested runs collapsed under their parent, so the experiment page of a comparison showed one row
and its chart view charted the summary run alone. They link to it with the tag
`testbed.parent_run` instead, and the summary run holds the table, the figures and its counts as
tags (`compare.runs`, `compare.failed`, `compare.wall_s`), so every chart compares the points.

Signals. SIGTERM (what `timeout`, schedulers and `kill` send) takes the Ctrl-C path: inside
`testbed.signals.sigterm_as_interrupt()` it raises `Terminated`, a KeyboardInterrupt, so every
`except KeyboardInterrupt` cleanup runs; `testbed.signals.exit_code` turns it into 143 (Ctrl-C:
130). The sweep then stops launching points
at once, terminates its workers, ends the point and summary runs KILLED and leaves the caller to
flush the table of the points done so far.

What runs is a `Feed`: a fixed list of jobs (compare, reproduce), or jobs that follow from the
rows already in (`testbed capacity`: a search's next probe). Workers are spawned processes
(`compare.workers=N`, `--workers N`, `capacity.workers=N`) pulling jobs from a queue until handed
None; each asks the kernel to SIGTERM it when its parent dies (Linux `PR_SET_PDEATHSIG`) and
also polls `os.getppid()` every 0.5 s, so a SIGKILLed parent leaves no orphan running points. A
worker that dies (OOM, signal) fails its point with the exit code and is replaced.
"""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from engine.base.errors import TestbedError
from engine.base.settings import OutputSettings
from testbed import signals
from testbed.run.outputs import axis_name, write_run_dir
from testbed.run.runner import prepare_experiment
from testbed.config.spec import RunSpec
from testbed.cluster.artifacts import ArtifactStoreError
from testbed.cluster.reconnect import ServiceLost
from testbed.tracking.tracker import Tracker, tracking_uri
from testbed.sweep.orphans import PARENT_POLL_S, orphan_guard, parent_died, release_cut_writes, shield  # noqa: F401 - workers' side

WORKER_STOP_S = 10.0  # a terminated worker ends its point's MLflow run, then exits


# --- jobs and one point ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """One grid point to run (picklable for spawned workers)."""

    index: int
    spec: RunSpec
    label: str
    axes: tuple[str, ...]
    axis_values: dict
    experiment: str
    parent_run_id: str | None
    run_dir: str
    tags: dict = field(default_factory=dict)  # extra tags of its MLflow run (e.g. capacity.point / capacity.probe)
    requests: Any = None  # the resolved request list, shipped with a Ray task (or a Ray ObjectRef to it)
    name: str | None = None  # its MLflow run name; None: what varies (testbed/naming.point_name)
    judge: Any = None  # a picklable callable(RunResult) -> dict run where the point ran: row["judged"] (capacity)
    watch: Any = None  # picklable: .progress(controller) -> its progress callback, .settle(result) (capacity/early.py)


# A sweep point's run folder by default: summary, config, run info (~10 kB). Traces, per-request
# and per-micro-batch tables and per-run figures only when the user sets these keys: with them, one
# 32-probe capacity search of the main job wrote 330 MB (the azure trace's 2,000 requests at every
# probe), and the README tour's runs/ 638 MB.
POINT_BUDGET = ("output.trace=off", "output.requests=false", "output.plots=false")


def point_budget(user: set[str], keep: Sequence[str] = ()) -> list[str]:
    """The POINT_BUDGET overrides whose key the user did not set (`user`: the keys given) and
    that are not in `keep` (a capacity warm-up re-reads requests.csv)."""
    return [ov for ov in POINT_BUDGET if (key := ov.partition("=")[0]) not in user and key not in keep]


_TRACKERS: dict[tuple[str, str], Any] = {}
PARENT_TAG = "testbed.parent_run"  # a point run's link to its sweep's summary run (not MLflow nesting)
PID_TAG, NAMESPACE_TAG = "testbed.pid", "testbed.namespace"  # where a summary run's command runs (reclaim_stranded)


def _tracker(output: OutputSettings, experiment: str) -> Any:
    """One MLflow tracker per (store, experiment) and process (`Tracker` imports mlflow, ~2 s,
    only when the first one is made: `output.mlflow=false` sweeps never pay for it)."""
    key = (tracking_uri(output), experiment)
    if key not in _TRACKERS:
        _TRACKERS[key] = Tracker(output, experiment)
    return _TRACKERS[key]


def _open_point_run(job: Job) -> tuple[Any, str | None]:
    if not job.spec.output.mlflow:
        return None, None
    tracker = _tracker(job.spec.output, job.experiment)
    return tracker, tracker.start(job.spec, job.name or axis_name(job.axis_values), tags=point_tags(job))


def point_tags(job: Job) -> dict[str, str]:
    """The tags of a point's MLflow run: its axes, its link to the summary run, the job's own."""
    tags = {"testbed.kind": "point", "testbed.sweep.compare": job.experiment, "testbed.axes": json.dumps(list(job.axes)),
            "compare.point": str(job.index), **{f"axis.{k}": str(v) for k, v in job.axis_values.items()}}
    if job.parent_run_id:
        tags[PARENT_TAG] = job.parent_run_id
    tags.update({k: str(v) for k, v in job.tags.items()})
    return tags


def run_point(job: Job) -> dict:
    """Run one grid point as `testbed run` would, logged beside the sweep's summary run. Never
    raises for a user-level failure (that becomes the row's error); an interrupt ends the
    point's run KILLED and propagates. A tracking server that stayed away past the reconnect
    window (cluster/reconnect.py) fails the point, not its worker process, with a traceback."""
    t0, c0 = time.perf_counter(), time.process_time()
    row: dict[str, Any] = {"point": job.index, **job.axis_values, "status": "failed", "error": None,
                           "run_id": None, "run_dir": None}
    try:
        _run_point(job, row)
    except ServiceLost as exc:  # its run, if opened, is journaled for the folder's next command
        row["status"], row["error"] = "failed", str(exc)
        owe(job.spec.output, row["run_id"] or getattr(exc, "opened_run_id", None), str(exc))
    row["wall_s"], row["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    return row


def owe(output: OutputSettings, run_id: str | None, reason: str, status: str = "FAILED") -> None:
    """A run whose store stayed away past the reconnect window: its end is journaled in the
    output folder and written by that folder's next command reaching the store
    (cluster/unwritten.py). Before, it stayed RUNNING until a later sweep reclaimed it."""
    if run_id:
        from testbed.cluster import unwritten

        unwritten.record(output.dir, unwritten.run_end(tracking_uri(output), run_id, reason, status))


def _run_point(job: Job, row: dict) -> None:
    tracker, row["run_id"] = _open_point_run(job)
    try:
        prepared = prepare_experiment(job.spec, requests=None if job.requests is None else list(job.requests))
        if job.watch is not None:  # a capacity probe that may end once its verdict is certain
            prepared.controller.progress = job.watch.progress(prepared.controller)
        result = prepared.run() if job.watch is None else job.watch.settle(prepared.run())
    except TestbedError as exc:
        row["error"] = str(exc)
    except Exception as exc:  # a policy bug at this point: one failed row, not a dead grid
        if signals.stopped_by() is not None:  # the stop, turned into a library's own error
            _end_interrupted(tracker, row)
            raise signals.stop_exception(signals.stopped_by()) from exc
        row["error"] = f"{type(exc).__name__}: {exc}"
    except KeyboardInterrupt:
        _end_interrupted(tracker, row)
        raise
    else:
        _record(job, row, tracker, result)
    if row["error"] and tracker is not None and row["run_dir"] is None:
        tracker.fail(row["run_id"], row["error"])


def _end_interrupted(tracker: Any, row: dict) -> None:
    shield()
    if tracker is not None:
        tracker.client.set_tag(row["run_id"], "error", "interrupted")
        tracker.client.set_terminated(row["run_id"], "KILLED")


def _record(job: Job, row: dict, tracker: Any, result: Any) -> None:
    run_dir = Path(job.run_dir)
    if job.judge is not None:  # from the result in memory: the run folder need not keep requests.csv
        row["judged"] = job.judge(result)
    write_run_dir(result, run_dir, plots=job.spec.output.plots)
    row["run_dir"] = str(run_dir)
    fill_row(row, result)
    if tracker is not None:
        try:
            tracker.finish(row["run_id"], result, run_dir)
        except ArtifactStoreError as exc:  # the store cannot be written: the run ended FAILED, the grid goes on
            row["status"], row["error"] = "failed", str(exc)


def fill_row(row: dict, result: Any) -> None:
    """A point's row from its RunResult: status, error, the load the workload offered
    (`offered_tok_s`, `offered_req_s`) and the queue's growth over it (`queue_growth`: `compare`
    warns where it is an overload, testbed/run/overload.py) and the summary's numbers (per-stage
    lists as `<key>.stage<i>`)."""
    from testbed.run.overload import judge

    row["error"] = result.error
    row["status"] = "failed" if result.error else "finished"
    load = judge(result.requests)
    row["offered_tok_s"], row["offered_req_s"], row["queue_growth"] = \
        (load.offered_tok_s, load.offered_req_s, load.growth) if load is not None else (math.nan,) * 3
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

    def __init__(self, output: OutputSettings, experiment: str, run_name: str, tags: Mapping[str, str],
                 view: Any = None) -> None:
        """`view`: the saved MLflow view (testbed/tracking/views.py) the printed link opens."""
        self.tracker = self.run_id = None
        self.folder = output.dir  # its journal of unwritten ends (cluster/unwritten.py)
        if output.mlflow:
            self.tracker = _tracker(output, experiment)
            if view is not None:
                self.tracker.save_view(view)
            from testbed.cluster.identity import host_name, local_namespace

            reclaim_stranded(self.tracker)
            where = {PID_TAG: str(os.getpid()), NAMESPACE_TAG: local_namespace()}
            self.run_id = self.tracker.client.create_run(self.tracker.experiment_id, run_name=run_name,
                                                         tags={"host": host_name(), **where, **tags}).info.run_id

    def print_link(self, console: Any) -> None:
        """The experiment's chart view (tracking.chart_link), as soon as the experiment exists."""
        if self.tracker is not None and console is not None:
            console.print(self.tracker.link, highlight=False, soft_wrap=True, markup=False)

    def print_figure(self, console: Any, figure: Path) -> None:
        """The comparison figure first (one line per policy against the x axis: what a researcher
        compares), as a file and as the summary run's artifact page; the per-run bars after it."""
        if console is None or not figure.is_file():
            return
        console.print(f"comparison figure: {figure.resolve()}", highlight=False, soft_wrap=True, markup=False)
        if self.tracker is not None:
            from testbed.tracking.tracker import figure_link

            console.print(f"MLflow figure: {figure_link(self.tracker.uri, self.tracker.experiment_id, self.run_id, figure.name)}"
                          f" (after the `mlflow ui` command of the charts line)", highlight=False, soft_wrap=True,
                          markup=False)
            console.print(self.tracker.link, highlight=False, soft_wrap=True, markup=False)

    def log(self, metrics: Mapping[str, float], tags: Mapping[str, str] | None = None,
            run_id: str | None = None) -> None:
        """Metrics and tags on the summary run (or on `run_id`, one of its point runs)."""
        if self.tracker is None:
            return
        from mlflow.entities import Metric, RunTag  # mlflow is loaded already (the tracker)

        now = int(time.time() * 1000)
        self.tracker.client.log_batch(run_id or self.run_id,
                                      metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                                      tags=[RunTag(k, str(v)[:5000]) for k, v in (tags or {}).items()])

    def log_files(self, folder: Path, subdirs: Sequence[str] = ()) -> str | None:
        """The folder's files (not its run directories) and the named subfolders; None, or the
        error (the run is tagged `artifact_error` and still ends: testbed/cluster/artifacts.py)."""
        if self.tracker is None:
            return None
        from testbed.cluster.artifacts import log_files

        error = log_files(self.tracker.client, self.run_id, [p for p in sorted(folder.iterdir()) if p.is_file()],
                          [(folder / sub, sub) for sub in subdirs if (folder / sub).is_dir()])
        if error:
            print(f"warning: files of {folder} were not logged to MLflow: {error}", file=sys.stderr)
        return error

    def check_store(self, path: Path) -> None:
        """Log one file now, so that an artifact store that cannot be written fails the sweep
        before any point runs: `ArtifactStoreError`, with this run ended FAILED and tagged
        `artifact_error`. Before, `compare` on a server whose store refused files stalled ~4 min
        in MLflow's retries, printed a 93-line traceback and left this run RUNNING (issue 38 item 3)."""
        if self.tracker is None:
            return
        from testbed.cluster.artifacts import log_files

        error = log_files(self.tracker.client, self.run_id, [path])
        if error:
            self.end("FAILED")
            raise ArtifactStoreError(f"the MLflow artifact store of experiment {self.tracker.experiment_id} cannot "
                                     f"be written ({error}); nothing was run. Check the store (mlflow server "
                                     f"--artifacts-destination) or name a new experiment")

    def end(self, status: str = "FINISHED", why: str = "interrupted") -> None:
        """End this run; a run not FINISHED first ends its RUNNING points KILLED with `why`."""
        if self.tracker is None:
            return
        if status != "FINISHED":
            kill_children(self.tracker.client, [self.tracker.experiment_id], self.run_id, why)
        self.tracker.client.set_terminated(self.run_id, status)

    def end_failed(self, exc: BaseException) -> None:
        """End FAILED with the error that stopped the sweep (its Ray cluster unreachable after the
        run opened: it stayed RUNNING, issue 48 item 6); a store that fails too is let be."""
        if self.tracker is None:
            return
        try:
            self.tracker.client.set_tag(self.run_id, "error", f"{type(exc).__name__}: {exc}"[:5000])
            self.end("FAILED", f"killed: the sweep failed ({type(exc).__name__}: {str(exc)[:300]})")
        except Exception:  # noqa: BLE001 - the sweep's own error is the one to report
            self.owe(exc)

    def owe(self, exc: BaseException) -> None:
        """The store is away: this run's end is journaled for the folder's next command."""
        if self.tracker is not None:
            from testbed.cluster import unwritten

            unwritten.record(self.folder, unwritten.run_end(self.tracker.uri, self.run_id, f"{exc}", "FAILED"))

    def end_interrupted(self, exc: BaseException, console: Any, done: str, out_dir: Path) -> None:
        """End KILLED after an interrupt and say where the partial results are (`done`: what
        was written, e.g. "the table of the 3 point(s) done")."""
        self.end("KILLED")
        if console is not None:
            console.print(f"{signals.interrupted_message(exc)}: {done} is in {out_dir}", highlight=False, markup=False)


def kill_children(client: Any, experiment_ids: list[str], run_id: str, why: str = "interrupted") -> None:
    """End KILLED the point runs of the summary run `run_id` still RUNNING."""
    for run in client.search_runs(experiment_ids, filter_string=f"tags.`{PARENT_TAG}` = '{run_id}' "
                                                                f"and attributes.status = 'RUNNING'"):
        client.set_tag(run.info.run_id, "error", why)
        client.set_terminated(run.info.run_id, "KILLED")


def reclaim_stranded(tracker: Any) -> int:
    """End KILLED the summary runs (and their point runs) that a sweep command killed outright
    left RUNNING: SIGKILL or the OOM killer leave no handler to run (a second SIGTERM once did
    too: issue 38 item 6). Only runs of a process of this pid namespace that is gone
    (`identity.dead_local_process`): another host's live sweep is never touched. Said on stderr."""
    from testbed.cluster.identity import dead_local_process, local_namespace

    client = tracker.client
    ids = [e.experiment_id for e in client.search_experiments(max_results=1000)]
    found = client.search_runs(ids, max_results=200, filter_string=f"attributes.status = 'RUNNING' and "
                                                                   f"tags.`{NAMESPACE_TAG}` = '{local_namespace()}'")
    gone = [r for r in found if r.data.tags.get(PID_TAG, "").isdigit()
            and dead_local_process({"namespace": r.data.tags[NAMESPACE_TAG], "pid": int(r.data.tags[PID_TAG])})]
    why = "killed: its command ended without ending it (SIGKILL?); ended by the next sweep on this host"
    for run in gone:
        kill_children(client, ids, run.info.run_id, why)
        client.set_tag(run.info.run_id, "error", why)
        client.set_terminated(run.info.run_id, "KILLED")
    if gone:
        names = ", ".join(r.info.run_name for r in gone)
        print(f"note: ended KILLED {len(gone)} run(s) left RUNNING by a sweep that was killed: {names}", file=sys.stderr)
    return len(gone)


# --- running the jobs ---------------------------------------------------------------------------------

class Feed:
    """What a sweep runs. This base class is a fixed list (compare, reproduce); `testbed capacity`
    subclasses it, because a search's next probe follows from the last one's result: `follow`
    returns the jobs a finished row leads to, `planned` the running estimate of the total shown by
    the progress bar, and `run` how a job runs in this process (its workers always use `run_point`)."""

    unit = "runs"  # what the progress bar counts

    def __init__(self, jobs: Sequence[Job] = ()) -> None:
        self.jobs = list(jobs)

    def initial(self) -> list[Job]:
        return self.jobs

    def follow(self, row: dict) -> list[Job]:
        return []

    def planned(self) -> int:
        return len(self.jobs)

    def run(self, job: Job) -> dict:
        return run_point(job)

    def describe(self, row: dict, job: Job) -> str:
        state = "[green]done[/green]" if row["status"] == "finished" else "[red]failed[/red]"
        tput = row.get("throughput_tok_s")
        extra = f" throughput {tput:.4g} tok/s" if isinstance(tput, float) and not math.isnan(tput) else ""
        return f"point {row['point']:>3} {state} {job.label}{extra}"


def run_jobs(jobs: Sequence[Job], workers: int, console: Any, progress_on: bool, rows: list[dict],
             feed: Feed | None = None, pool: Callable[[list[Job]], Any] | None = None) -> list[dict]:
    """Run every job (in this process, in `workers` spawned processes, or in the `pool` a caller
    gives, with WorkerPool's `run(done)`: sweep.backend=ray's, testbed/sweep/ray_points.py),
    appending each row to `rows`
    as it arrives, so an interrupted caller still holds the points done so far. With a `feed`,
    its jobs run instead, and each finished row may queue further jobs."""
    feed = feed or Feed(jobs)
    first = feed.initial()
    known = {job.index: job for job in first}
    progress = _progress(console, feed.planned(), feed.unit) if console is not None and progress_on else None

    def done(row: dict) -> list[Job]:
        rows.append(row)
        new = feed.follow(row)
        known.update({job.index: job for job in new})
        if progress is not None:
            progress.console.print(feed.describe(row, known[row["point"]]), highlight=False)
            progress.update(progress.task_ids[0], advance=1, total=max(feed.planned(), len(rows)))
        return new

    with progress if progress is not None else nullcontext():
        if pool is not None:
            pool(first).run(done)
        elif workers <= 1 or len(first) <= 1:
            pending = deque(first)
            while pending:
                signals.raise_if_stopped()  # a stop whose exception was lost in a GC callback
                pending.extend(done(feed.run(pending.popleft())))
        else:
            WorkerPool(first, min(workers, len(first))).run(done)
    return rows


def _progress(console: Any, total: int, unit: str = "runs") -> Progress:
    progress = Progress(TextColumn(unit), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("left"), TimeRemainingColumn(), console=console, transient=True)
    progress.add_task("grid", total=total)
    return progress


def _worker_main(tasks: Any, results: Any, parent: int | None = None) -> None:
    """A spawned worker: run the jobs from the queue until it hands over None."""
    orphan_guard(parent)
    job = None
    try:
        while True:
            try:
                job = tasks.get(timeout=1.0)
            except queue_mod.Empty:
                # a stop whose exception was lost in a GC callback while this worker waited: without
                # this check an idle worker outlived its SIGKILLed parent (fresh-clone CI, 1 in 3)
                signals.raise_if_stopped()
                continue
            if job is None:
                return
            signals.raise_if_stopped()  # never start a point after a stop, lost exception or not
            results.put(("start", job.index, os.getpid()))
            results.put(("row", job.index, run_point(job)))
    except KeyboardInterrupt:
        orphaned = job is not None and parent_died(parent)
    except Exception:
        if signals.stopped_by() is None:
            raise  # a bug: multiprocessing prints it
        # the stop, turned into a library's own error: a SIGTERM inside OmegaConf while a job was
        # unpickled came out as ConfigKeyError and a traceback (fresh-clone CI, capacity TERM,TERM)
        orphaned = job is not None and parent_died(parent)
    if orphaned:  # out of the except block: the stop's frames, and what they hold, are let go first
        _end_for_dead_parent(job)
    sys.exit(signals.EXIT_CODES["SIGINT"])


def _end_for_dead_parent(job: Job) -> None:
    """The sweep's command was killed outright (SIGKILL, the OOM killer): this worker's point run
    is ended KILLED already (run_point), and the summary run, which only the dead command could
    end, is ended here with its other points. Before, they stayed RUNNING until the next sweep on
    this host (issue 48). Best effort: a store that cannot be reached leaves them to that sweep."""
    shield()
    release_cut_writes()
    if not job.spec.output.mlflow:
        return
    try:
        reclaim_stranded(_tracker(job.spec.output, job.experiment))
    except Exception:  # noqa: BLE001 - the next sweep reclaims what could not be ended here
        pass


class WorkerPool:
    """`n` spawned workers over one task queue of jobs; a finished row may submit more (`done`
    returns them). Unlike a ProcessPoolExecutor, stopping it does not wait for the queued jobs:
    `stop()` terminates the workers at once."""

    def __init__(self, jobs: Sequence[Job], n: int) -> None:
        self.jobs = {job.index: job for job in jobs}
        self.ctx = mp.get_context("spawn")
        self.tasks = self.ctx.Queue()
        self.results = self.ctx.Queue()
        self.n = n
        self.procs: list[Any] = []
        self.holding: dict[int, int] = {}  # pid -> job index
        self.finished: set[int] = set()

    def _spawn(self) -> None:
        # not daemonic: a torch point starts stage processes of its own; `stop` and the orphan guard end it
        p = self.ctx.Process(target=_worker_main, args=(self.tasks, self.results, os.getpid()), daemon=False,
                             name=f"sweep-worker-{len(self.procs)}")
        p.start()
        self.procs.append(p)

    def submit(self, job: Job) -> None:
        self.jobs[job.index] = job
        self.tasks.put(job)

    def run(self, done: Callable[[dict], Sequence[Job] | None]) -> None:
        for job in list(self.jobs.values()):
            self.tasks.put(job)
        try:
            for _ in range(self.n):
                self._spawn()
            while len(self.finished) < len(self.jobs):
                signals.raise_if_stopped()  # a stop whose exception was lost in a GC callback
                self._step(done)
            for _ in self.procs:
                self.tasks.put(None)
        finally:
            self.stop()

    def _finish(self, done: Callable[[dict], Sequence[Job] | None], index: int, row: dict) -> None:
        self.finished.add(index)
        for job in done(row) or ():
            self.submit(job)

    def _step(self, done: Callable[[dict], Sequence[Job] | None]) -> None:
        try:
            kind, index, payload = self.results.get(timeout=PARENT_POLL_S)
        except queue_mod.Empty:
            self._reap(done)
            return
        if kind == "start":
            self.holding[payload] = index
        elif index not in self.finished:
            self.holding = {pid: i for pid, i in self.holding.items() if i != index}
            self._finish(done, index, payload)

    def _reap(self, done: Callable[[dict], Sequence[Job] | None]) -> None:
        """Workers that died: fail the job each held, replace it while jobs remain."""
        for p in [p for p in self.procs if not p.is_alive() and p.exitcode not in (None, 0)]:
            self.procs.remove(p)
            index = self.holding.pop(p.pid, None)
            if index is not None and index not in self.finished:
                self._finish(done, index, failed_row(self.jobs[index], f"worker died with exit code {p.exitcode}"))
            if len(self.finished) < len(self.jobs):
                self._spawn()
        if not any(p.is_alive() for p in self.procs):  # every worker gone
            for index, job in list(self.jobs.items()):
                if index not in self.finished:
                    self._finish(done, index, failed_row(job, "lost: its worker ended without a result"))

    def stop(self) -> None:
        """Terminate every worker still running (each ends its point's run KILLED), then kill
        the ones that do not exit within WORKER_STOP_S. Idle workers handed None exit by themselves."""
        deadline = time.monotonic() + WORKER_STOP_S
        for p in self.procs:
            if p.is_alive() and p.exitcode is None:
                p.join(timeout=0.05)
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.tasks.cancel_join_thread()
        self.results.cancel_join_thread()
