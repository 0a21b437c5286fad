"""The head of a Ray cluster dying under a sweep or a study (issue 48): one `error:` line, the
runs ended and the finished points kept, within the reconnect window, instead of Ray ending the
process on its own terms.

Measured (Ray 2.60, a two-node loopback cluster, the head's `ray start --block` SIGKILLed under
`compare` and under a plain driver):
- the driver's `ray.wait(timeout=0.5)` keeps returning, nothing finishes, and 60 s after the head
  went Ray's core worker ends the process from C++ ("Failed to connect to GCS within 60
  seconds", exit 1, no `error:` line, the summary run and a point run left RUNNING);
- `ray.put` then blocks holding the GIL: no Python thread runs again before Ray ends the process
  (why a watch thread that raised in the main thread, e5da737, changed nothing);
- `ray.cancel` and `ray.get(timeout=1)` return at once, `ray.shutdown` in ~5 s; a process that
  exits without `ray.shutdown` once the head is gone dies of SIGSEGV in Ray's teardown;
- `RAY_gcs_rpc_server_reconnect_timeout_s` (Ray's GCS fault-tolerance setting, read by the
  driver's core worker when it starts) moves Ray's end: set to 200, the driver lived 200 s.

So Ray's own limit is put above ours before `ray.init` (`raise_ray_limit`; a value the user set
is left alone, and our window is kept inside it), and the loops that drive the tasks, which
never wait in Ray more than `ray_tasks.POLL_S` at a time, call `HeadWatch.check()` every round:
at most once a second it opens a TCP connection to the head's GCS port (1 s timeout); while that
fails it says once that it waits and nothing new is submitted (`down`); after the reconnect
window (`TESTBED_RECONNECT_S`, 120 s) it raises `HeadLost`, a `ServiceLost`: the command writes
what it has, ends its runs FAILED or KILLED and says one line, exit 1.

That the command gave up is the watch's own state (`HeadWatch.given_up`, asked by the loop that
holds it before any Ray call) and, past that loop, the `HeadLost` itself (`given_up(exc)`: the
error the command ends with, or one it was raised while handling): nothing of it is left in the
process for its next command (a test, the tune worker 0 that is the parent process)."""
from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

from testbed.cluster.reconnect import ENV, ServiceLost, window_s

RAY_LIMIT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
RAY_DEFAULT_S = 60.0  # Ray's own default
MARGIN_S = 60.0  # Ray's limit above ours: the cleanup after giving up (tables, runs, ray.shutdown ~5 s)
CLEANUP_S = 15.0  # kept for that cleanup inside a lower limit the user set
CHECK_S = 1.0


class HeadLost(ServiceLost):
    """The Ray cluster's head (its GCS) stayed unreachable for the reconnect window."""


def raise_ray_limit() -> None:
    """Before `ray.init`: Ray's own reconnect limit above this process's window, unless set."""
    if RAY_LIMIT_ENV not in os.environ:
        os.environ[RAY_LIMIT_ENV] = str(int(window_s() + MARGIN_S))


def head_window() -> float:
    """How long the head may stay away: the reconnect window, inside Ray's own limit."""
    try:
        ray_s = float(os.environ.get(RAY_LIMIT_ENV, RAY_DEFAULT_S))
    except ValueError:
        ray_s = RAY_DEFAULT_S
    return max(0.0, min(window_s(), ray_s - CLEANUP_S))


def given_up(exc: BaseException | None) -> bool:
    """Whether the command whose error is `exc` gave up on its Ray head: `exc` is a `HeadLost`,
    or was raised while one was handled (a run's end that failed after it). Then no Ray call is
    made again: the service probes saw `ray.shutdown` (or the interpreter's teardown of Ray,
    without it) end the process with SIGSEGV once the head was gone, after the command had ended
    its runs but before it said its line; the command ends the process itself (`exit_now`)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, HeadLost):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def exit_now(code: int) -> None:
    """End this process with `code`, skipping Ray's teardown (`given_up`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class HeadWatch:
    """The head's GCS at `address` ("host:port"), probed from the loop that drives the tasks.
    `shown`: the `ray.address` the user gave, for the messages."""

    def __init__(self, address: str, shown: str, window: float | None = None) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port, self.shown = host.strip("[]"), int(port), shown
        self.window = head_window() if window is None else window
        self.probed = -float("inf")
        self.since: float | None = None  # when the head was first found away
        self.error = ""
        self.given_up = False  # the head stayed away the window: no Ray call again (`given_up`)

    @property
    def down(self) -> bool:
        """The last probe failed: submit nothing (a `ray.put` would block holding the GIL)."""
        return self.since is not None

    def check(self) -> None:
        """Probe the head if a second has passed; `HeadLost` once it has been away the window."""
        now = time.monotonic()
        if now - self.probed >= CHECK_S:
            self.probed = now
            self._probe(now)
        if self.since is not None and now - self.since >= self.window:
            self.given_up = True
            raise HeadLost(f"the Ray cluster at ray.address={self.shown!r} stayed unreachable for "
                           f"{self.window:g} s (its head {self.host}:{self.port}: {self.error}); the points "
                           f"or trials it was running were not finished, what finished is kept: start the "
                           f"cluster again (`ray start --head`) and run the same command")

    def _probe(self, now: float) -> None:
        try:
            socket.create_connection((self.host, self.port), timeout=CHECK_S).close()
        except OSError as exc:
            if self.since is None:
                self.since, self.error = now, str(exc) or type(exc).__name__
                print(f"warning: the Ray cluster's head {self.host}:{self.port} (ray.address={self.shown}) is "
                      f"unreachable ({self.error}); waiting for it, up to {self.window:g} s ({ENV})",
                      file=sys.stderr, flush=True)
            return
        if self.since is not None:
            print(f"the Ray cluster's head {self.host}:{self.port} is reachable again after {now - self.since:.1f} s",
                  file=sys.stderr, flush=True)
            self.since = None


class NoWatch:
    """Where the head's address is unknown (Ray Client, an odd address): nothing is probed."""

    down = False
    given_up = False

    def check(self) -> None:
        return None


def head_watch(ray: Any, shown: str) -> HeadWatch | NoWatch:
    """The watch of the cluster this process is connected to."""
    try:
        address = ray.get_runtime_context().gcs_address
        return HeadWatch(address, shown)
    except Exception:  # noqa: BLE001 - Ray Client, or an address that is not host:port
        return NoWatch()
