"""Riding out a restart of a shared service: the PostgreSQL server of a study, the `mlflow server`
of the runs (issue 38 items 1 and 2).

A restart takes seconds (PostgreSQL: ~1 s; `mlflow server`: ~15 s of imports on a busy 2-core
machine). Before, the first call that met it ended the command: a PostgreSQL restart crashed every
host with a 118-line `StorageInternalError` (their trials stayed RUNNING), and a stopped MLflow
server hung every host ~4 min in MLflow's own HTTP retries (7 retries, backoff factor 2) and then
crashed it. Now each call that finds its service unreachable is tried again with a growing wait
(0.5, 1, 2, 4, then every 8 s) for up to `window_s()` seconds (`TESTBED_RECONNECT_S`, 120 by
default), saying once on stderr what it waits for and once when the service answers again. A
call that fails for any other reason is not retried. After the window, `ServiceLost`: one
`error:` line, exit 1, and the caller ends what this host holds (docs/beyond-one-machine.md).

Only failures that mean "the service did not get the request" are retried (a refused or reset
connection, a connection the server closed, an `mlflow server` answering 502/503/504 because its own
store is away: tracking/tracker.py `server_unreachable`), so a write is not applied twice in practice; the
rare write whose commit reached the server just before the connection broke is handled where it
matters (a trial told twice: `storage.py`)."""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.base.errors import TestbedError

DEFAULT_WINDOW_S = 120.0
ENV = "TESTBED_RECONNECT_S"
WAITS_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # then 8 s between tries until the window ends
T = TypeVar("T")


class ServiceLost(TestbedError):
    """A service stayed unreachable for the whole reconnect window: exit 1, not a user error."""

    exit_code = 1


@dataclass(frozen=True)
class Service:
    """A shared service as its calls see it: `name` as shown (no password: e.g.
    `tune.storage=postgresql://lab:***@db/optuna`), and `lost(exc)`: whether an exception means
    that the service could not be reached (retried) rather than that the call was wrong."""

    name: str
    lost: Callable[[BaseException], bool]


def window_s() -> float:
    """How long a call waits for its service: `$TESTBED_RECONNECT_S` (seconds, >= 0) or 120."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_WINDOW_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        from engine.base.errors import ConfigError

        raise ConfigError(f"invalid {ENV}={raw!r}: seconds, a number >= 0 (default {DEFAULT_WINDOW_S:g})")
    return value


class Outages:
    """One command's outages: when it first found each service unreachable (its waiting line is said
    once, its "reachable again" line gives the time since) and which services it waited a whole
    window for, whose next calls fail at once until one gets through (the cleanup after giving up
    must not wait a window per call: `abandon` ends a study's trials and runs through other objects
    than the one that gave up, and a sweep's next points open their own trackers). Owned by the
    command (`for_command`, around each command `cli.main` runs), shared by its threads; nothing of
    it is left for the next command in the process (a test, a tune worker 0 that is the parent)."""

    def __init__(self) -> None:
        self._since: dict[str, float] = {}  # service name -> when first found unreachable
        self._given_up: set[str] = set()
        self._guard = threading.Lock()

    def given_up(self, service: Service) -> bool:
        with self._guard:
            return service.name in self._given_up

    def call(self, service: Service, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`, tried again while `service` is unreachable, for up to `window_s()`;
        at once `ServiceLost` if this command has waited a whole window for it already."""
        deadline: float | None = None
        attempt = 0
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                if not service.lost(exc):
                    raise
                now = time.monotonic()
                if deadline is None:
                    window = 0.0 if self.given_up(service) else window_s()
                    deadline = now + window
                    if window:
                        self._announce(service, exc, window)
                if now >= deadline:
                    with self._guard:
                        self._given_up.add(service.name)
                    raise ServiceLost(f"{service.name} stayed unreachable for {window_s():g} s ({first_line(exc)}); "
                                      f"run the same command again once it is back (or set {ENV})") from None
                time.sleep(min(WAITS_S[min(attempt, len(WAITS_S) - 1)], max(0.0, deadline - now)))
                attempt += 1
                continue
            if deadline is not None:
                self._recovered(service)
            return result

    def _announce(self, service: Service, exc: BaseException, window: float) -> None:
        with self._guard:
            if service.name in self._since:
                return
            self._since[service.name] = time.monotonic()
        print(f"warning: {service.name} is unreachable ({first_line(exc)}); waiting for it, up to {window:g} s "
              f"({ENV})", file=sys.stderr, flush=True)

    def _recovered(self, service: Service) -> None:
        with self._guard:
            self._given_up.discard(service.name)
            since = self._since.pop(service.name, None)
        if since is not None:
            print(f"{service.name} is reachable again after {time.monotonic() - since:.1f} s", file=sys.stderr,
                  flush=True)


_command = Outages()  # the running command's (a process outside `cli.main`: its own, for its life)


@contextmanager
def for_command() -> Iterator[Outages]:
    """A fresh `Outages` for the command run inside the block, the previous one's back after it."""
    global _command
    before, _command = _command, Outages()
    try:
        yield _command
    finally:
        _command = before


def call(service: Service, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`Outages.call` of the running command: `fn(*args, **kwargs)`, tried again while `service`
    is unreachable, for up to `window_s()`. Once the command has waited a whole window for the
    service, its next calls fail at once until one gets through."""
    return _command.call(service, fn, *args, **kwargs)


def first_line(exc: BaseException) -> str:
    """The exception's type and the first line of its innermost cause that says something (the
    driver's own words; SQLAlchemy's `InvalidatePoolError` at the end of the chain says "()")."""
    said = [e for e in chain(exc) if str(e).strip() not in ("", "()")]
    inner = said[-1] if said else exc
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0][:300]}" if text else type(inner).__name__


def chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or while handling, outermost first."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and all(cur is not e for e in out):
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def caused_by(exc: BaseException, types: tuple[type, ...]) -> bool:
    """Whether `exc` or any exception in its cause/context chain is one of `types`."""
    return any(isinstance(e, types) for e in chain(exc))


def connection_lost(exc: BaseException) -> bool:
    """Whether a database error means the database could not be reached (refused, closed by a
    restart), which is worth waiting for, rather than a wrong request."""
    from sqlalchemy import exc as sa_exc

    return any(isinstance(e, (sa_exc.OperationalError, sa_exc.InterfaceError))
               or getattr(e, "connection_invalidated", False) for e in chain(exc))
