"""Child processes of the engine (stages, CPU samplers) end when their parent is gone.

Two mechanisms, because either alone has a hole: Linux's PR_SET_PDEATHSIG (prctl(2)) sends
SIGKILL to the child the moment its parent dies -- also while the child sits in a blocking call
(a gloo recv) -- and the idle loops poll `parent_gone()` (the driver's pid gone, or the process
that started us replaced by a reaper) every `IDLE_POLL_S`, which also covers other systems and a
parent that died before the prctl took effect. A stage forked by the driver's fork server has the
server as its parent: the server exits when the driver dies, and the stage's death signal follows.
"""
from __future__ import annotations

import os
import signal
import sys

IDLE_POLL_S = 0.5
PR_SET_PDEATHSIG = 1


# The process that started this one: the driver itself (spawn), or the driver's fork server
# (engine/torch_exec/driver/stage_processes.py), which exits when the driver dies.
_started_by: int | None = None


def die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel to SIGKILL this process when the process that started it dies (the driver,
    or its fork server); exit at once if the driver is already gone. `parent_pid`: the driver's pid."""
    global _started_by
    if parent_pid is None:
        return
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    _started_by = os.getppid()
    if parent_gone(parent_pid):
        os._exit(0)


def parent_gone(parent_pid: int | None) -> bool:
    """True once the driver (`parent_pid`) is gone: the process that started this one has changed
    (it died and we were re-parented), or, for a stage forked by the fork server, the driver's pid
    no longer exists."""
    if parent_pid is None:
        return False
    ppid = os.getppid()
    if ppid == parent_pid:
        return False
    if _started_by is not None and ppid != _started_by:
        return True
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's process took the pid: ours is gone
        return True
    return False
