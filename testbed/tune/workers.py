"""Worker processes on one study. `tune.workers=N`: worker 0 is the parent process (its imports
are paid for already), workers 1..N-1 are spawned processes; a thread in the parent drains
their events into the display. The parent creates the study, the Optuna tables and the MLflow
database before any worker starts (the schema creation is what races, optuna issue 820); a lock
shared by the local workers makes "count the trials, then ask for one" atomic, so N workers never
run more than `tune.trials` trials and never share a trial number. On 2 cores with N=2 and
SQLite this measured close to 2x the trials per minute of one worker.

Stopping. Ctrl-C reaches every process of the group; SIGTERM (or SIGHUP) reaches the parent
only, which passes it on as SIGINT, whatever form it arrived in (inside a trial it is the run's
`RunInterrupted`). Either way each worker marks its running trial interrupted. A worker
also stops when its parent dies, SIGKILL included (`sweep.orphan_guard`: pdeathsig plus a
parent-pid poll), and checks the parent pid before asking for each trial."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import optuna

from testbed import signals
from testbed.sweep import jobs as sweep
import testbed.tune.reclaim as reclaim
from testbed.tune.problem import Problem
from testbed.cluster import heartbeat, identity, owners
from testbed.cluster.reconnect import ServiceLost
from testbed.tune.storage import counted, fail_stale, heartbeat_of, make_sampler, make_storage, quiet_optuna
from testbed.tune.trial import TrialRunner, open_tracker

START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30


def worker_loop(problem: Problem, index: int, lock: Any = None, emit: Callable[[dict], None] | None = None,
                ready: Callable[[], None] | None = None, parent_pid: int | None = None) -> int:
    """Ask for trials until the study holds `tune.trials` counted trials (or the timeout, or the
    parent is gone). `ready` is called once set up, before the first trial (the start barrier)."""
    quiet_optuna()
    s = problem.settings
    study = optuna.load_study(study_name=problem.study,
                              storage=make_storage(problem.storage_url, heartbeat_of(problem.storage_url, s)),
                              sampler=make_sampler(s.sampler, problem.seed + index, s.startup_trials))
    runner = TrialRunner(problem, index)
    identity.register(study, runner.worker)
    if ready is not None:
        ready()
    deadline = time.monotonic() + s.timeout if s.timeout else None
    done = 0
    while deadline is None or time.monotonic() < deadline:
        if parent_pid is not None and os.getppid() != parent_pid:
            break  # orphaned: never start a trial nobody will report
        signals.raise_if_stopped()  # a stop whose exception was lost in a GC callback
        with lock if lock is not None else nullcontext():
            # another host's dead worker: its trial completed from its recorded results, or failed + enqueued
            heartbeat.reap(study, runner.tracker, reclaim.recoverer(study, runner.tracker, problem))
            if counted(study.get_trials(deepcopy=False)) >= s.trials:
                break
            # a stop between the ask and the claim left a RUNNING trial that no one marked
            # interrupted and no process owned (a fresh-clone CI failure): deferred to `run`
            with signals.deferred_stop() as stop:
                trial = study.ask()
                runner.claim(trial)
        event = runner.run(study, trial, stop.check)
        done += 1
        if emit is not None:
            emit(event)
    return done


def _worker_main(problem: Problem, index: int, lock: Any, events: Any, start: Any, parent: int) -> None:
    """Entry point of a spawned worker process (`parent`: the spawner's pid, sweep.orphan_guard)."""
    sweep.orphan_guard(parent)
    signals.record_interrupts()
    code = 0

    def ready() -> None:
        events.put({"ready": index})
        start.wait(START_TIMEOUT_S)

    orphaned = False
    try:
        worker_loop(problem, index, lock, events.put, ready, parent_pid=parent)
    except KeyboardInterrupt:
        code = signals.EXIT_CODES["SIGINT"]
        orphaned = sweep.parent_died(parent)
    except ServiceLost as exc:  # its trial is ended already (TrialRunner._lost): the reason, no traceback
        events.put({"worker_error": f"worker {index}: {exc}"})
        code = 1
    except BaseException as exc:
        if isinstance(exc, Exception) and signals.stopped_by() is not None:
            # the stop, turned into a library's own error (a SIGTERM inside OmegaConf or SQLAlchemy
            # comes out as their exception): the stop, not a bug, as in the sweep's worker (c85929b)
            code = signals.EXIT_CODES["SIGINT"]
            orphaned = sweep.parent_died(parent)
        else:  # a bug: report it to the parent, then die loudly
            events.put({"worker_error": f"worker {index}: {type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()})
            code = 1
    finally:
        if orphaned:  # out of the except block: the stop's frames, and what they hold, are let go first
            _end_for_dead_parent(problem)
        events.put({"worker_done": index, "code": code})
    sys.exit(code)


def _end_for_dead_parent(problem: Problem) -> None:
    """The `tune` command (worker 0) was killed outright: this worker's trial is ended already
    (TrialRunner), and what only the dead command could end is ended here as its SIGTERM handler
    would have: worker 0's trial (completed from its recorded results, or interrupted + FAILED),
    this session's trial runs KILLED, the study run KILLED. Before, they stayed RUNNING until the
    next `tune` (issue 48). Best effort: what cannot be reached is left to that command."""
    sweep.shield()
    sweep.release_cut_writes()
    try:
        study = optuna.load_study(study_name=problem.study, storage=make_storage(problem.storage_url, None))
        tracker = open_tracker(problem)
        fail_stale(study, study._storage, tracker, reclaim.recoverer(study, tracker, problem))
        if tracker is not None and problem.parent_run_id:
            reclaim.kill_running_trials(tracker, problem.parent_run_id)
            owners.end_shared(tracker, problem.parent_run_id, "KILLED")  # not while another host runs the study
    except Exception as exc:  # noqa: BLE001 - the next `tune` reclaims what could not be ended here
        # one line, so that a run left RUNNING says why (a fresh-clone CI once found the study run
        # and worker 0's trial RUNNING after a killed tune, with no word from the orphan)
        print(f"tune worker: the killed command's runs not ended here ({type(exc).__name__}: {exc}); "
              "the next `tune` of this study ends them", file=sys.stderr, flush=True)


class _Drain:
    """The parent's reader of the workers' events: start barrier, trial events, errors, deaths."""

    def __init__(self, procs: list, events: Any, display: Any) -> None:
        self.procs, self.events, self.display = procs, events, display
        self.count = 0
        self.errors: list[str] = []
        self.done: set[int] = set()
        self.ready: set[int] = set()
        self.stop = threading.Event()
        self.all_ready = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="tune-events", daemon=True)

    def _settled(self) -> None:
        if len(self.ready | self.done) == len(self.procs):
            self.all_ready.set()

    def _loop(self) -> None:
        while True:
            try:
                msg = self.events.get(timeout=0.2)
            except queue_mod.Empty:
                self._reap()
                if self.stop.is_set() and not any(p.is_alive() for p in self.procs):
                    return
                continue
            self._handle(msg)

    def _reap(self) -> None:
        for i, p in enumerate(self.procs, start=1):  # a worker killed without a word (OOM, signal)
            if not p.is_alive() and i not in self.done and p.exitcode not in (0, None, signals.EXIT_CODES["SIGINT"]):
                self.done.add(i)
                self.errors.append(f"worker {i} died with exit code {p.exitcode}")
                self._settled()

    def _handle(self, msg: dict) -> None:
        if "ready" in msg:
            self.ready.add(msg["ready"])
            self._settled()
        elif "worker_done" in msg:
            self.done.add(msg["worker_done"])
            self._settled()
        elif "worker_error" in msg:
            self.errors.append(msg["worker_error"])
            self.display.note(f"[red]{msg['worker_error']}[/red]\n{msg.get('traceback', '')}")
        else:
            self.count += 1
            self.display.event(msg)


def run_workers(problem: Problem, display: Any) -> tuple[int, list[str]]:
    """Run the study on `tune.workers` processes; (trials run, worker errors)."""
    ctx = mp.get_context("spawn")
    lock, events, start = ctx.Lock(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_worker_main, args=(problem, i, lock, events, start, os.getpid()), name=f"tune-worker-{i}",
                         daemon=False) for i in range(1, problem.settings.workers)]
    for p in procs:
        p.start()
    drain = _Drain(procs, events, display)
    drain.thread.start()
    own = 0
    try:
        def ready() -> None:
            """Start together (the spawned workers need a few seconds of imports): every worker
            then really shares the study, and the first trials do not all land on worker 0."""
            drain.all_ready.wait(START_TIMEOUT_S)
            start.set()

        own = worker_loop(problem, 0, lock, display.event, ready)
        for p in procs:  # the others finish the trials they hold, then find the target reached
            p.join()
    except KeyboardInterrupt as exc:  # SIGTERM inside a trial arrives as RunInterrupted, not Terminated
        if signals.signal_name(exc) != "SIGINT":
            _pass_on(procs)  # only this process was told (Ctrl-C reached the whole group)
        raise
    finally:
        start.set()
        _stop(procs)
        drain.stop.set()
        drain.thread.join(timeout=10)
    return own + drain.count, drain.errors


def _pass_on(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGINT)


def _stop(procs: list) -> None:
    """Wait for the workers to mark their trials (Ctrl-C reached them too), then terminate."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
