"""The head of a real Ray cluster killed under a running `compare` (issue 48, testbed/cluster/ray_head.py).
Before: the driver polled on, and 60 s after the head died Ray's core worker ended it from C++
(exit 1, no `error:` line, the summary run and a point run left RUNNING). Now: one `error:` line
naming the Ray address once the head stayed away the reconnect window (3 s here), exit 1, the
summary run FAILED, no run RUNNING, and the points done are in the table.
The cluster is this file's own (the test kills its head): tests/ray_cluster.py, two nodes on loopback."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

pytestmark = [pytest.mark.services, pytest.mark.slow]  # ~40 s: a cluster started, a grid, the window
pytest.importorskip("ray", reason="sweep.backend=ray needs the [ray] extra (./tb installs it)")

from mlflow_db import fresh_mlflow_db  # noqa: E402
from ray_cluster import start_cluster  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 180.0  # bound of every wait (the old code ends at ~60 s after the kill)
GRID = ["compare", "policy=sarathi,gllm,vllm", "workload=synthetic", "workload.arrival=offline", "model=llama2-13b",
        "hardware=a100-80g", "parallel.pp=2", "workload.num_requests=20000", "output.plots=false",
        "output.progress=false", "output.dir=runs", "compare.experiment=grid", "sweep.backend=ray"]


def _running(db: Path) -> int:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            return conn.execute("SELECT count(*) FROM runs WHERE status = 'RUNNING'").fetchone()[0]
    except sqlite3.Error:
        return 0


def _runs(db: Path) -> list[tuple[str, str, str]]:
    """(name, status, testbed.kind) of every run in the store."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        return conn.execute("SELECT r.name, r.status, t.value FROM runs r LEFT JOIN tags t ON t.run_uuid = r.run_uuid "
                            "AND t.key = 'testbed.kind'").fetchall()


def test_a_head_killed_under_compare_ends_it_with_one_line_and_no_run_running(tmp_path):
    cluster = start_cluster()
    try:
        fresh_mlflow_db(tmp_path / "runs")
        env = {**os.environ, "PYTHONPATH": str(REPO), "TESTBED_RECONNECT_S": "3", "RAY_TMPDIR": str(cluster.root / "t")}
        env.pop("RAY_gcs_rpc_server_reconnect_timeout_s", None)
        proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", *GRID, f"ray.address={cluster.address}"],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        db = tmp_path / "runs" / "mlflow.db"
        deadline = time.monotonic() + WAIT_S
        while _running(db) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the summary run and a point run: a point is running on the cluster
        assert proc.poll() is None, proc.communicate()
        cluster.procs[0].send_signal(signal.SIGKILL)  # the head's `ray start --block`: its GCS and raylet go with it
        try:
            out, err = proc.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    finally:
        cluster.stop()
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, err[-3000:]  # old code: exit 1, no error line (Ray's own end)
    assert cluster.address in errors[0] and "Traceback" not in err, err[-3000:]
    runs = _runs(db)
    assert [r for r in runs if r[1] == "RUNNING"] == [], runs
    assert [r[1] for r in runs if r[2] == "compare"] == ["FAILED"], runs
    # the points done are kept in the table; a point still running on the surviving node when the
    # command gave up may finish later (no Ray call is made after giving up, not even a cancel):
    # its run then ends FINISHED with its results, outside the table
    table = pd.read_csv(tmp_path / "runs" / "compare" / "grid" / "table.csv")
    finished = {r[0] for r in runs if r[2] == "point" and r[1] == "FINISHED"}
    assert set(table.loc[table["status"] == "finished", "policy"]) <= finished, (runs, table)
