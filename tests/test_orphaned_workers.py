"""A sweep or tune command killed outright (SIGKILL, the OOM killer): its workers outlive it for
a moment (pdeathsig, sweep/orphans.py `orphan_guard`) and end what only it could have ended, the
summary or study run and worker 0's trial. Before, those stayed RUNNING until the next command on
this host reclaimed them (issue 48)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlflow_db import fresh_mlflow_db
from signal_helpers import Command, run_states, running_kinds, survivors

SETTLE_S = 120  # how long the orphans get to end the runs: generous (a loaded 2-core machine), not a timing


def _wait_until(what, timeout_s: float = SETTLE_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.2)
    return False


def _kinds(db: Path) -> set[str]:
    return {kind for kind, _ in running_kinds(db)}


def test_a_killed_compare_leaves_no_run_running(tmp_path):
    fresh_mlflow_db(tmp_path)
    grid = ["workload=synthetic", "model=llama2-13b", "hardware=a100-80g", "parallel.pp=2", "output.plots=false",
            "workload.num_requests=40,30000,30001,30002", "compare.workers=2"]
    cmd = Command("compare", *grid, f"output.dir={tmp_path}", "compare.experiment=orphan")
    cmd.wait_for("point   0 done")
    assert _wait_until(lambda: "point" in _kinds(tmp_path / "mlflow.db")), "no point run ever opened"
    workers = cmd.descendants()
    cmd.kill()  # SIGKILL the command alone: its workers learn it through pdeathsig
    _wait_until(lambda: not running_kinds(tmp_path / "mlflow.db"))
    assert survivors(workers) == []
    runs = run_states(tmp_path / "mlflow.db")
    assert "RUNNING" not in {r["status"] for r in runs.values()}, runs
    assert [r["status"] for r in runs.values() if r["kind"] == "compare"] == ["KILLED"]


def test_a_killed_tune_leaves_no_trial_or_run_running(tmp_path):
    import optuna

    base = ["policy=sarathi", "workload=synthetic", "workload.arrival=offline", "model=llama2-13b",
            "hardware=a100-80g", "parallel.pp=2", "output.plots=false", "workload.num_requests=3000",
            "tune.trials=400", "tune.workers=2", "tune.study=orphan"]
    cmd = Command("tune", *base, f"output.dir={tmp_path}")
    cmd.wait_for(" done ")
    db = tmp_path / "mlflow.db"
    # both workers inside a trial, worker 0 (the command itself) included, where the load allows
    _wait_until(lambda: sum(kind == "trial" for kind, _ in running_kinds(db)) >= 2, 60)
    workers = cmd.descendants()
    cmd.kill()
    _wait_until(lambda: not running_kinds(db))
    assert survivors(workers) == []
    runs = run_states(db)
    # the orphan's stderr says where it sat if its bounded end cut the clean-up short
    assert "RUNNING" not in {r["status"] for r in runs.values()}, (runs, "".join(cmd.err)[-6000:])
    assert [r["status"] for r in runs.values() if r["kind"] == "study"] == ["KILLED"]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name="orphan", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    assert [t.number for t in study.trials if t.state.name == "RUNNING"] == []


_PARENT = '''
import multiprocessing as mp, os, sys, threading, time
from pathlib import Path


def worker(parent, out, wait_s):
    from testbed.sweep import orphans
    orphans.orphan_guard(parent)
    orphans.PARENT_EXIT_WAIT_S = wait_s
    Path(out + ".ready").write_text("")
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        Path(out).write_text(str(orphans.parent_died(parent)))


if __name__ == "__main__":
    out, wait_s, live_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])

    def spawn():
        mp.get_context("spawn").Process(target=worker, args=(os.getpid(), out, wait_s)).start()
        while not Path(out + ".ready").exists():
            time.sleep(0.05)

    thread = threading.Thread(target=spawn)
    thread.start()
    thread.join()  # the spawning thread ends: the kernel sends the worker its parent-death signal now
    time.sleep(live_s)  # the process lives on a while, as a SIGKILLed one may while its threads exit
    os._exit(0)
'''


@pytest.mark.parametrize("wait_s, live_s, died", [(10.0, 1.0, "True"), (0.5, 4.0, "False")],
                         ids=["process-goes-after-its-thread", "process-lives-on"])
def test_a_worker_tells_its_spawning_thread_ending_from_its_parent_dying(tmp_path, wait_s, live_s, died):
    """pdeathsig fires when the *thread* that spawned a worker exits; in a SIGKILLed `tune` that
    thread can go before the rest of the process, and the worker, seeing `getppid()` unchanged,
    took its parent for alive and left the study run and worker 0's trial RUNNING (the fresh-clone
    CI failure of test_a_killed_tune_leaves_no_trial_or_run_running, 1 in 5 runs at low load). It
    now waits for the process to go; a parent that lives on is still alive to it."""
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    out = tmp_path / "parent_died"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run([sys.executable, str(script), str(out), str(wait_s), str(live_s)], env=env, timeout=120,
                   check=True)
    assert _wait_until(out.exists, 60), "the worker never stopped"
    time.sleep(0.2)
    assert out.read_text() == died


_STUCK = '''
import multiprocessing as mp, os, sqlite3, sys, time
from pathlib import Path


def worker(parent, db):
    from testbed.sweep import orphans
    orphans.ORPHAN_END_S = 2.0
    orphans.orphan_guard(parent)
    Path(db + ".pid").write_text(str(os.getpid()))
    con = sqlite3.connect(db, timeout=300, isolation_level=None)
    con.execute("BEGIN IMMEDIATE")  # waits in SQLite's busy handler: no Python signal handler runs


if __name__ == "__main__":
    mp.get_context("spawn").Process(target=worker, args=(os.getpid(), sys.argv[1])).start()
    time.sleep(600)
'''


def test_an_orphan_stuck_in_a_native_wait_still_ends(tmp_path):
    """A worker whose parent is SIGKILLed while its main thread waits in native code that signals
    do not cut short (here SQLite's busy wait on a lock another process holds) never runs its
    parent-death handler; it lived on for the whole wait (60 s and more: the CI failure of
    test_tune.py::test_workers_stop_when_the_parent_is_killed). It now ends `ORPHAN_END_S` after
    its parent-pid poll finds the parent gone."""
    import signal
    import sqlite3

    import psutil

    db = tmp_path / "locked.db"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # the write lock, held by this (live) process
    script = tmp_path / "parent.py"
    script.write_text(_STUCK)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    parent = subprocess.Popen([sys.executable, str(script), str(db)], env=env, stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        assert _wait_until(Path(str(db) + ".pid").exists, 120), "the worker never started"
        worker = psutil.Process(int(Path(str(db) + ".pid").read_text()))
        time.sleep(1.0)  # into the busy wait
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=60)
        _, alive = psutil.wait_procs([worker], timeout=45)  # old code: alive until the 300 s busy timeout
        assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    finally:
        parent.kill()
        holder.close()
        # an old-code survivor: only this test's worker (the session's PostgreSQL and MLflow
        # server are children of this process too: killing every child took them down)
        if worker is not None and worker.is_running():
            worker.kill()


_REENTER = '''
import os, sys
from testbed.sweep import orphans

os.kill = lambda pid, sig: None  # the SIGTERM it passes on: not wanted in this process
fired, inside = set(), [False]


def local(frame, event, arg):
    """At each line of the handler (and of what it calls) a second parent-death signal arrives
    once: the kernel's pdeathsig and the parent-pid poll each send one."""
    if event == "line" and not inside[0] and (frame.f_code, frame.f_lineno) not in fired:
        fired.add((frame.f_code, frame.f_lineno))
        inside[0] = True
        orphans._on_parent_death(10, None)
        inside[0] = False
    return local


sys.settrace(lambda frame, event, arg: None if inside[0] else local)
orphans._on_parent_death(10, None)
sys.settrace(None)
print("returned", len(fired))
'''


def test_the_parent_death_handler_survives_a_second_signal_inside_it(tmp_path):
    """The pdeathsig and the parent-pid poll each send the parent-death signal, so its handler can
    run inside itself. It set a threading.Event, whose lock is not reentrant: a second signal inside
    Event.set waited for that lock for ever, and the orphan of a SIGKILLed `tune` never stopped
    (the CI failure of test_tune.py::test_workers_stop_when_the_parent_is_killed; py-spy showed
    five nested handlers in `Condition.__enter__`). A second signal at each line of it, in turn."""
    script = tmp_path / "reenter.py"
    script.write_text(_REENTER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        done = subprocess.run([sys.executable, str(script)], env=env, timeout=60, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail("the parent-death handler, run inside itself, never returned")
    assert done.returncode == 0 and done.stdout.startswith("returned"), done.stderr[-2000:]
