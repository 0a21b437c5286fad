"""The head of a Ray cluster dying under a sweep or study: one `error:` line and the runs ended,
before Ray ends the process itself.

A driver whose GCS (the head) is gone is ended by Ray's core worker after 60 s ("Failed to
connect to GCS within 60 seconds"), from C++, with exit 1: no `error:` line, and the sweep's
summary run and a point run (or the study's runs) left RUNNING (issue 48 service probes: compare
and tune, 74 s each). Ray without GCS fault tolerance does not get its head back, so there is
nothing to wait for: a thread checks that the head still accepts connections every `CHECK_S`,
and after `LOST_S` without it raises `ServiceLost` in the main thread (SIGUSR1; the main thread
polls Ray with 0.5 s timeouts, so it runs Python code often), where the command's own handling
ends its runs FAILED/KILLED, writes what it has and says one line."""
from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from testbed.cluster.reconnect import ServiceLost

CHECK_S = 2.0
LOST_S = 20.0  # well inside Ray's own 60 s


class HeadLost(ServiceLost):
    """The Ray cluster's head stopped accepting connections for `LOST_S`."""


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=CHECK_S).close()
        return True
    except OSError:
        return False


@contextmanager
def watched(gcs_address: str, shown: str) -> Iterator[dict]:
    """Watch the head at `gcs_address` ("host:port") for the block; yields a dict whose "lost"
    is set once it was given up on (then `ray.shutdown`, which waits on the head, is skipped).
    A no-op outside the main thread or for an address it cannot parse."""
    state = {"lost": False}
    host, _, port = gcs_address.rpartition(":")
    if threading.current_thread() is not threading.main_thread() or not host or not port.isdigit():
        yield state
        return
    stop = threading.Event()

    def raise_lost(_signum, _frame) -> None:
        raise HeadLost(f"the Ray cluster at ray.address={shown} stopped answering for {LOST_S:g} s (its head "
                       f"{gcs_address} is gone); the points or trials not finished were not run: start the "
                       f"cluster again and run the same command")

    def watch() -> None:
        since = None
        while not stop.wait(CHECK_S):
            if _reachable(host, int(port)):
                since = None
                continue
            since = since or time.monotonic()
            if time.monotonic() - since > LOST_S and not stop.is_set():
                state["lost"] = True
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
                return

    old = signal.signal(signal.SIGUSR1, raise_lost)
    watcher = threading.Thread(target=watch, name="ray-head-watch", daemon=True)
    watcher.start()
    try:
        yield state
    finally:
        stop.set()
        watcher.join(timeout=2 * CHECK_S + 1)
        signal.signal(signal.SIGUSR1, old)
