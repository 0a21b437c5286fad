"""Child processes of the engine (stages, CPU samplers) end when their parent is gone.

Two mechanisms, because either alone has a hole: Linux's PR_SET_PDEATHSIG (prctl(2)) sends
SIGKILL to the child the moment its parent dies -- also while the child sits in a blocking call
(a gloo recv) -- and the idle loops poll `parent_gone()` (the parent pid no longer being our
parent) every `IDLE_POLL_S`, which also covers other systems and a parent that died before the
prctl took effect.
"""
from __future__ import annotations

import os
import signal
import sys

IDLE_POLL_S = 0.5
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies; exit at once if it already has."""
    if parent_pid is None:
        return
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if parent_gone(parent_pid):
        os._exit(0)


def parent_gone(parent_pid: int | None) -> bool:
    return parent_pid is not None and os.getppid() != parent_pid
