"""`testbed run`'s MLflow background process (testbed/tracking/background.py) against what it cannot control:
MLflow printing to stdout over HTTP, the process stopped or killed mid-run (issue 25, items 2
and 7). Real MLflow stores only: a real `mlflow server` and SQLite."""
from __future__ import annotations

import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from mlflow_db import fresh_mlflow_db
from signal_helpers import WAIT_S
from testbed.cli import main

REPO = Path(__file__).resolve().parents[1]
SMALL = ["policy=sarathi", "workload=azure", "workload.rate=2", "hardware=a100-80g", "model=llama2-13b",
         "parallel.pp=2", "output.progress=false", "output.plots=false"]
LONG = "workload.num_requests=15000"  # a simulation of seconds: the background process is signalled within it


@pytest.mark.services  # the session's real mlflow server (tests/services.py)
def test_run_logs_to_a_real_mlflow_server_over_http(mlflow_server, tmp_path, capsys):
    """MLflow prints "View run ..." to stdout over HTTP; that stdout was the reply channel."""
    from test_mlflow_server import rest_get, rest_post

    experiment = f"http-{secrets.token_hex(3)}"  # the session's server is shared
    code = main(["run", *SMALL, "workload.num_requests=30", f"output.dir={tmp_path / 'out'}",
                 f"output.tracking_uri={mlflow_server.base}", f"output.experiment={experiment}"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    assert "Traceback" not in cap.err and "JSONDecodeError" not in cap.err
    exp = rest_get(mlflow_server, "experiments/get-by-name", experiment_name=experiment)["experiment"]
    runs = rest_post(mlflow_server, "runs/search", {"experiment_ids": [exp["experiment_id"]]})["runs"]
    assert [r["info"]["status"] for r in runs] == ["FINISHED"]
    metrics = {m["key"]: m["value"] for m in runs[0]["data"]["metrics"]}
    assert metrics["num_requests"] == 30


def _start(tmp_path: Path, **env: str) -> subprocess.Popen:
    fresh_mlflow_db(tmp_path)
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.Popen([sys.executable, "-m", "testbed.cli", "run", *SMALL, LONG, f"output.dir={tmp_path}"],
                            cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_running_run(db: Path, proc: subprocess.Popen) -> None:
    """Until the background process has opened the MLflow run (a row RUNNING in the store)."""
    import time

    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            with sqlite3.connect(db, timeout=30) as con:
                if con.execute("select count(*) from runs where status = 'RUNNING'").fetchone()[0]:
                    return
        except sqlite3.OperationalError:
            pass
        time.sleep(0.2)
    raise AssertionError("the MLflow run was never opened")


def _logger(proc: subprocess.Popen) -> psutil.Process:
    kids = [p for p in psutil.Process(proc.pid).children(recursive=True)
            if "testbed.tracking.background" in " ".join(p.cmdline()) and "--mlflow" in p.cmdline()]
    assert len(kids) == 1, kids
    return kids[0]


def _single_run(db: Path) -> tuple[str, dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db.resolve()}")
    runs = client.search_runs([client.get_experiment_by_name("testbed").experiment_id])
    assert len(runs) == 1
    return runs[0].info.status, runs[0].data.metrics


def _check_recorded_from_main(proc: subprocess.Popen, tmp_path: Path) -> None:
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "recorded from the main process" in " ".join(err.split())
    summary = json.loads((Path(out.strip().splitlines()[-1]) / "summary.json").read_text())
    status, metrics = _single_run(tmp_path / "mlflow.db")
    assert status == "FINISHED"
    assert metrics["num_requests"] == summary["num_requests"] == 15000


def test_killed_logger_the_main_process_ends_the_run(tmp_path):
    """The logger is the largest process, the OOM killer's choice: its run stayed RUNNING."""
    proc = _start(tmp_path)
    _wait_for_running_run(tmp_path / "mlflow.db", proc)
    _logger(proc).kill()
    _check_recorded_from_main(proc, tmp_path)


def test_stopped_logger_is_not_waited_for_forever(tmp_path):
    """A stopped logger (SIGSTOP) made `testbed run` wait forever after its summary."""
    proc = _start(tmp_path, TESTBED_BACKGROUND_TIMEOUT_S="3")
    _wait_for_running_run(tmp_path / "mlflow.db", proc)
    logger = _logger(proc)
    logger.send_signal(signal.SIGSTOP)
    try:
        _check_recorded_from_main(proc, tmp_path)
    finally:
        if logger.is_running():
            logger.send_signal(signal.SIGCONT)
            logger.kill()
