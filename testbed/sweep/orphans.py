"""A sweep or tune worker process and its parent: the stop signals a worker obeys, the kernel's
notice that the parent died (pdeathsig plus a parent-pid poll), and the clean-up that only an
orphan can do. Moved out of jobs.py (which runs the points) when it passed 600 lines."""
from __future__ import annotations

import ctypes
import faulthandler
import gc
import multiprocessing as mp
import os
import signal
import sys
import threading
import time

from testbed import signals
from testbed.cluster import identity

PARENT_POLL_S = 0.5
PR_SET_PDEATHSIG = 1
PARENT_EXIT_WAIT_S = 10.0  # after the parent-death signal, how long its process may take to finish dying
PARENT_DEATH_SIGNAL = signal.SIGUSR1  # sent only by the kernel (pdeathsig) and the parent-pid poll
# An orphan's whole end (the 10 s wait above, then ending what the dead command held) gets this
# long, then the process exits anyway (`_bound_the_orphan`): the next command reclaims the rest.
ORPHAN_END_S = 30.0
# Set by the parent-death handler: a plain flag, no lock. It was a threading.Event, whose set()
# takes a non-reentrant lock; the kernel's pdeathsig and the parent-pid poll each send a signal,
# and the second one's handler, run inside the first one's Event.set, waited for that lock for
# ever: the orphan of a SIGKILLed `tune` never stopped (CI; 1 of 60 kills here, py-spy's stack:
# five nested `_on_parent_death` -> `Event.set` -> `Condition.__enter__`).
_parent_lost = False


# --- worker processes and signals (the handlers and the stop's record: testbed/signals.py) -------

def shield() -> None:
    """In a worker that is cleaning up after an interrupt: ignore further signals, so a second
    one cannot cut the MLflow call that ends its run (the parent SIGKILLs stragglers)."""
    if mp.parent_process() is not None:
        for s in signals.ALL_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def orphan_guard(parent: int | None = None) -> None:
    """Call first in a worker process: SIGTERM raises `Terminated`, and when its parent dies the
    worker stops as on SIGTERM (pdeathsig on Linux, else the parent-pid poll of a daemon thread),
    through a signal of its own (`PARENT_DEATH_SIGNAL`) so that `parent_died` can tell that stop
    from any other. `parent`: the spawner's pid, passed by the spawner. Read here instead, it is
    already the reaper's when the parent died while this process was still importing, and the
    worker then outlived it."""
    signals.terminate_on_stop_signals()
    signal.signal(PARENT_DEATH_SIGNAL, _on_parent_death)
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os.kill(os.getpid(), PARENT_DEATH_SIGNAL)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        _bound_the_orphan()
        os.kill(os.getpid(), PARENT_DEATH_SIGNAL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _bound_the_orphan() -> None:
    """The parent is gone: this process ends within `ORPHAN_END_S` whatever its main thread is
    doing. A Python signal handler runs only when the main thread is back in Python code: a worker
    stuck in its own parent-death handler (`_parent_lost`), or in any native call that signals do
    not cut short (SQLite's busy wait sleeps through them: up to 60 s for the study's database,
    20 s per try for MLflow's), would otherwise outlive its parent for as long. faulthandler's
    watchdog is a native thread that needs no GIL: it prints every thread's stack to stderr (so
    the next such orphan says where it sat) and exits the process (code 1)."""
    try:
        faulthandler.dump_traceback_later(ORPHAN_END_S, exit=True)
    except (RuntimeError, ValueError, AttributeError, OSError):  # no usable stderr: the clean-up is unbounded
        pass


def _on_parent_death(signum, frame) -> None:
    """The parent-death signal: noted, then passed on as the SIGTERM it was before, so that
    every block that defers or ignores a stop (`signals.deferred_stop`, `saving`) treats it so.
    It may run inside itself (a second signal at any line of it): nothing here takes a lock."""
    global _parent_lost
    _parent_lost = True
    os.kill(os.getpid(), signal.SIGTERM)


def parent_died(parent: int | None) -> bool:
    """Whether the process that spawned this worker is gone (a zombie counts as gone). The
    kernel's pdeathsig fires when the *thread* that spawned the worker exits; on a SIGKILL that
    thread can go before the rest of the process, and `os.getppid()` then still names the dying
    process: a killed `tune` left its study run and worker 0's trial RUNNING in 1 of 5 tries
    (a fresh-clone CI failure). So once that signal came, wait for the process itself to go."""
    if parent is None:
        return False
    deadline = time.monotonic() + (PARENT_EXIT_WAIT_S if _parent_lost else 0.0)
    while True:
        if os.getppid() != parent or not identity.process_alive(parent):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def release_cut_writes() -> None:
    """Close the SQLite connections a stop cut short inside a write. Such a connection keeps the
    database's write lock while anything still refers to it, and this process's own next write
    then waits on itself: an orphaned `tune` worker hung for minutes ending the dead command's
    runs, holding the lock it waited for (seen at load ~19, 1 in 6 tries). Once the stop's
    exception is gone, a garbage collection closes them (SQLAlchemy rolls a dropped connection back)."""
    gc.collect()
