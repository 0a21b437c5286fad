"""SIGTERM handled like Ctrl-C: what `timeout`, batch schedulers and `kill` send must end a run as
cleanly as Ctrl-C does (partial results written, MLflow run KILLED), with exit code 143."""
from __future__ import annotations

import signal
from contextlib import contextmanager

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


class Terminated(KeyboardInterrupt):
    """Raised by the SIGTERM handler in the main thread; a KeyboardInterrupt, so every place that
    stops cleanly on Ctrl-C stops cleanly on SIGTERM."""


def signal_name(exc: BaseException) -> str:
    name = getattr(exc, "signal", None)
    if isinstance(name, str):
        return name
    return "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"


def _raise_terminated(signum, frame):
    raise Terminated()


@contextmanager
def sigterm_as_interrupt():
    """Within the block, SIGTERM raises `Terminated` in the main thread (no-op elsewhere)."""
    try:
        old = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
