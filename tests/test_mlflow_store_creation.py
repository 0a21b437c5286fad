"""A kill during the first creation of an MLflow SQLite store (its schema migrations, ~7 s) must
not break that store for good: it left a half-migrated `mlflow.db` on which every later run
failed with "duplicate column name" (issue 25, item 5)."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from signal_helpers import WAIT_S

REPO = Path(__file__).resolve().parents[1]
OPEN_STORE = "import sys; from testbed.tracking.tracker import Tracker; Tracker(None, 'x', uri=sys.argv[1])"


def _open_store(uri: str, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TESTBED_CACHE_DIR": str(cache)}  # no migrated copy cached
    return subprocess.Popen([sys.executable, "-c", OPEN_STORE, uri], env=env, stderr=subprocess.PIPE, text=True)


def _revision(db: Path) -> str | None:
    """The store's schema revision (None: no store, or no migration done yet)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            row = con.execute("select version_num from alembic_version").fetchone()
    except sqlite3.Error:
        return None
    return row[0] if row else None


def test_a_store_killed_while_first_created_still_works(tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    db = folder / "mlflow.db"
    uri = f"sqlite:///{db}"
    proc = _open_store(uri, tmp_path / "cache")
    deadline = time.monotonic() + WAIT_S
    while not any(_revision(p) for p in folder.glob("mlflow.db*") if p.is_file()):  # a first migration done
        assert proc.poll() is None and time.monotonic() < deadline, "the store was never started"
        time.sleep(0.02)
    proc.kill()  # with migrations still to run (they take seconds)
    proc.wait()
    left = _revision(db) if db.exists() else "none"

    again = _open_store(uri, tmp_path / "cache")
    _, err = again.communicate(timeout=WAIT_S)
    assert again.returncode == 0, err[-2000:]
    from testbed.tracking.tracker import Tracker

    tracker = Tracker(None, "after", uri=uri)
    run_id = tracker.start_flat({"a": 1}, "r", {})
    tracker.finish_flat(run_id, [("m", 1.0, 0)], {}, [], "FINISHED")
    assert tracker.client.get_run(run_id).info.status == "FINISHED"
    assert [p.name for p in folder.iterdir() if ".creating" in p.name] == []
    assert left in ("none", _revision(db)), f"the kill left a half-made store at revision {left}"



def test_a_call_sqlite_refused_as_locked_is_tried_again_and_other_errors_are_not(monkeypatch):
    """SQLite refuses one of two writers at once ("database is locked", no busy wait) when they
    meet inside deferred transactions; MLflow retries only "deadlock". A SIGTERMed `tune` then
    exited 1 with a traceback. Here the client's store refuses twice, then writes."""
    from mlflow.exceptions import MlflowException

    import testbed.tracking.tracker as tracker

    monkeypatch.setattr(tracker, "LOCK_RETRY_S", (0.0,) * 6)

    class Store:
        def __init__(self, locked: int) -> None:
            self.locked = locked  # refuse this many calls, then write
            self.calls = 0

        def log_metric(self, run_id: str, key: str, value: float) -> str:
            self.calls += 1
            if self.calls <= self.locked:
                raise MlflowException("(sqlite3.OperationalError) database is locked")
            return f"{run_id}:{key}={value}"

        def get_run(self, run_id: str) -> str:
            self.calls += 1
            raise MlflowException(f"Run '{run_id}' not found")

    store = Store(locked=2)
    assert tracker.LockRetryingClient(store).log_metric("r", "m", 1.0) == "r:m=1.0" and store.calls == 3
    other = Store(locked=0)
    with pytest.raises(MlflowException, match="not found"):
        tracker.LockRetryingClient(other).get_run("x")
    assert other.calls == 1  # not retried
    always = Store(locked=10**6)
    with pytest.raises(MlflowException, match="locked"):
        tracker.LockRetryingClient(always).log_metric("r", "m", 1.0)
    assert always.calls == len(tracker.LOCK_RETRY_S) + 1  # then the last refusal comes out
