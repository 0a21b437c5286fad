"""PostgreSQL for studies and tracking stores shared by several hosts: the driver check and the
lock that serialises first starts.

Driver. SQLAlchemy 2.1 opens `postgresql://` with psycopg 3 (`postgresql+psycopg2://` picks the
old driver); without it, the error was a bare "No module named 'psycopg'" from deep inside
SQLAlchemy (issue 24 item 8). `check_driver` names the module and the extra that installs it:
`pip install -e '.[postgres]'`.

First start. Optuna and MLflow create their tables (and MLflow runs its migrations) on first
connect. Two hosts doing it at once on a fresh database lost one of them to `UniqueViolation
pg_type_typname_nsp_index` (3 of 4 tries with Optuna; with MLflow's store, one run was lost;
issue 24 item 2). `first_start_lock` holds a session-level advisory lock of that database
(`pg_advisory_lock`, released with the connection, so a killed holder never leaves it taken)
while a command creates or opens its study, its experiment and the study's parent run; the lock is
re-entrant within a thread, so nested users (the tracker inside `testbed tune`) never wait on
themselves. An advisory lock needs no table, so it works on an empty database."""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from engine.base.errors import ConfigError
from testbed.config.redact import redact

EXTRA = "pip install -e '.[postgres]'"
LOCK_NAME = "testbed:first-start"
# (database with its password hidden, thread) -> nesting depth: re-entrant per thread, so that
# two threads of one process are serialised by the database like two hosts
_held: dict[tuple[str, int], int] = {}
_held_guard = threading.Lock()


def is_postgres(url: str) -> bool:
    return url.split(":", 1)[0].split("+", 1)[0].lower() in ("postgresql", "postgres")


def check_driver(url: str, key: str) -> None:
    """Refuse a PostgreSQL URL whose driver is not installed, naming the module and the extra."""
    if not is_postgres(url):
        return
    from sqlalchemy.engine import make_url

    try:
        make_url(url).get_dialect().import_dbapi()
    except ImportError as exc:
        module = getattr(exc, "name", None) or str(exc)
        raise ConfigError(f"{key}={redact(url)} needs the PostgreSQL driver module {module!r}, which is not "
                          f"installed; install it with: {EXTRA}") from None
    except Exception as exc:  # a malformed URL
        raise ConfigError(f"invalid {key}={redact(url)}: {type(exc).__name__}: {exc}") from None


def lock_key(name: str = LOCK_NAME) -> int:
    """A signed 64-bit advisory lock key from a name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


CONNECT_TIMEOUT_S = 10  # an unroutable host otherwise waits for the kernel's TCP timeout (minutes)


def unreachable(key: str, url: str, exc: BaseException) -> ConfigError:
    """One line for a database that cannot be reached (wrong port, unknown or unroutable host, no
    local socket): it was a 40-line traceback from the first-use lock (issue 38 item 7)."""
    cause = getattr(exc, "orig", None) or exc
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return ConfigError(f"cannot reach {key}={redact(url)}: {first}; is the server running, and are host, port "
                       f"and database right?")


@contextmanager
def advisory_lock(url: str, name: str = LOCK_NAME, key: str = "database") -> Iterator[None]:
    """Hold `pg_advisory_lock(name)` of the database at `url` for the block (re-entrant in
    this process). A no-op for other databases. A database that cannot be reached is a
    ConfigError naming `key` (the setting that holds the URL)."""
    if not is_postgres(url):
        yield
        return
    db = (redact(url), threading.get_ident())
    with _held_guard:
        depth = _held.get(db, 0)
        _held[db] = depth + 1
    if depth:
        try:
            yield
        finally:
            _release(db)
        return
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError
    from sqlalchemy.pool import NullPool

    engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
    try:
        from testbed.cluster import reconnect

        waited = reconnect.Service(f"{key}={redact(url)}", lambda e: isinstance(e, OperationalError))
        try:
            conn = engine.connect()
        except OperationalError as exc:
            if db[0] not in _reached:  # never reached from this process: a wrong address, one line
                raise unreachable(key, url, exc) from None
            # reached before (a second tracker of `tune`'s worker 0): a restart, waited for (issue 48 probes)
            conn = reconnect.call(waited, _connect_and_lock, engine, name)
        else:
            try:
                _lock(conn, name)
            except OperationalError:  # reachable a moment ago: a restart closed it, which is waited for
                conn.close()
                conn = reconnect.call(waited, _connect_and_lock, engine, name)
        _reached.add(db[0])
        with conn:
            try:
                yield
            finally:
                try:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": lock_key(name)})
                    conn.commit()
                except OperationalError:  # the connection a restart closed: its lock went with it
                    pass
    finally:
        engine.dispose()
        _release(db)


_reached: set[str] = set()  # databases (redacted URLs) this process has held a lock of


def _lock(conn, name: str) -> None:
    from sqlalchemy import text

    conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": lock_key(name)})
    conn.commit()


def _connect_and_lock(engine, name: str):
    """A new connection holding the lock (a 10 s PostgreSQL restart while a host opened its
    study: a traceback from the unlock, issue 48 two-host study)."""
    conn = engine.connect()
    try:
        _lock(conn, name)
    except Exception:
        conn.close()
        raise
    return conn


def _release(db: tuple[str, int]) -> None:
    with _held_guard:
        _held[db] -= 1
        if not _held[db]:
            del _held[db]
