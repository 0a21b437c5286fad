"""A first-use advisory lock on a PostgreSQL database this process has already reached waits out
a restart (issue 48 service probes): `tune`'s worker 0 opens a second MLflow tracker after the
study run is open, and a 10 s restart of the MLflow store's PostgreSQL at that moment ended the
command with `error: cannot reach output.tracking_uri=...` (exit 2, the study run RUNNING). A
database never reached is still one line at once (a wrong address)."""
from __future__ import annotations

import threading
import time

import pytest

from engine.base.errors import ConfigError

pytestmark = pytest.mark.services


def _down(url: str) -> bool:
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=2).close()
        return False
    except psycopg.OperationalError:
        return True


def test_a_database_reached_before_is_waited_for_through_a_restart(postgres, capsys):
    from testbed.cluster.postgres import advisory_lock

    url = postgres.new_database("relock")
    with advisory_lock(url, key="output.tracking_uri"):
        pass
    away = threading.Thread(target=postgres.restart, args=(3,))
    away.start()
    try:
        deadline = time.monotonic() + 60
        while not _down(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        with advisory_lock(url, key="output.tracking_uri"):  # old code: ConfigError "cannot reach ..."
            pass
    finally:
        away.join()
    assert "is unreachable" in capsys.readouterr().err


def test_a_database_never_reached_is_one_line_at_once():
    from testbed.cluster.postgres import advisory_lock

    with pytest.raises(ConfigError, match="cannot reach output.tracking_uri"):
        with advisory_lock("postgresql://u:p@127.0.0.1:1/nothing", key="output.tracking_uri"):
            pass
