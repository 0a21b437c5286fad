"""What the background process of `testbed run` says for the user reaches the user: its
reconnect warnings ("... is unreachable; waiting for it") went to the process's private stderr,
so a run whose tracking server was restarting sat silent (issue 48). Now each such line is shown
on the console as it comes, once, and kept in the run's `run_info.json` (`tracking_notes`)."""
from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from test_service_outages import _Answering

REPO = Path(__file__).resolve().parents[1]
RUN = ["run", "policy=sarathi", "workload=synthetic", "workload.num_requests=20", "workload.arrival=offline",
       "output.plots=false", "output.progress=false"]


def _run(tmp_path: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed.cli", *RUN, *extra], cwd=tmp_path, text=True,
                          capture_output=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def _run_info(tmp_path: Path) -> dict:
    (info,) = (tmp_path / "runs").glob("*/run_info.json")
    return json.loads(info.read_text())


def test_the_background_processs_reconnect_warning_reaches_the_console_and_the_run(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answering)  # a server whose store is away: 503
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        done = _run(tmp_path, "output.dir=runs", f"output.tracking_uri={uri}", env={"TESTBED_RECONNECT_S": "2"})
    finally:
        server.shutdown()
    said = done.stdout + done.stderr
    waiting = [line for line in said.splitlines() if "is unreachable" in line and "waiting for it" in line]
    assert len(waiting) == 1 and waiting[0].startswith("warning: output.tracking_uri=http://127.0.0.1"), said[-3000:]
    assert "Traceback" not in said
    assert any("is unreachable" in n for n in _run_info(tmp_path)["tracking_notes"])


def test_a_run_ends_what_its_folder_owed_the_store_and_says_so(tmp_path):
    """A `testbed run` is a command that reaches the store: it writes the ends a `tune` of the same
    folder could not write when it gave up (testbed/cluster/unwritten.py)."""
    from mlflow.tracking import MlflowClient

    from testbed.cluster import unwritten

    first = _run(tmp_path, "output.dir=runs")
    assert first.returncode == 0, first.stderr[-2000:]
    uri = f"sqlite:///{(tmp_path / 'runs' / 'mlflow.db').resolve()}"
    client = MlflowClient(uri)
    stranded = client.create_run(client.get_experiment_by_name("testbed").experiment_id).info.run_id
    unwritten.record(tmp_path / "runs", unwritten.run_end(uri, stranded, "interrupted: postgres gone", "KILLED"))
    for info in (tmp_path / "runs").glob("*/run_info.json"):
        info.unlink()
    done = _run(tmp_path, "output.dir=runs")
    assert done.returncode == 0, done.stderr[-2000:]
    assert client.get_run(stranded).info.status == "KILLED"
    assert f"note: MLflow run {stranded} ended KILLED" in done.stderr
    assert not (tmp_path / "runs" / unwritten.FILE).exists()
