"""`sweep.backend=ray` with `ray.address` at a listener that is not Ray's GCS (issue 48 items 5, 6):
a live HTTP port passed the TCP probe, `ray.init` then retried it for 260 s deaf to SIGTERM, and
the comparison's summary run, opened before, stayed RUNNING. Now: one `error:` line, exit 2, within
the probe's 5 s, the summary run FAILED. Needs Ray (the [ray] extra), not a cluster."""
from __future__ import annotations

import http.server
import threading

import pytest

pytest.importorskip("ray", reason="sweep.backend=ray needs the [ray] extra (./tb installs it)")

from mlflow_db import fresh_mlflow_db  # noqa: E402
from signal_helpers import run_states  # noqa: E402
from testbed.cli import main  # noqa: E402

BASE = ["workload=synthetic", "workload.num_requests=40", "hardware=a100-80g", "model=llama2-13b", "parallel.pp=2",
        "output.plots=false", "output.progress=false", "policy=sarathi"]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def test_an_http_port_is_not_a_ray_cluster(tmp_path, capsys):
    """Was: `ray.init` retrying the port for 260 s, deaf to SIGTERM."""
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        code = main(["compare", *BASE, "workload.rate=2,4", f"output.dir={tmp_path}", "sweep.backend=ray",
                     f"ray.address=127.0.0.1:{web.server_address[1]}"])
    finally:
        web.shutdown()
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert err.count("error:") == 1 and "is not a Ray cluster's head" in err, err


def test_a_sweep_whose_ray_start_fails_ends_its_summary_run_failed(tmp_path, capsys, monkeypatch):
    """`ray.init` failing after the summary run opened (here: ray.address=auto, no cluster on
    this machine) left that run RUNNING."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray"))  # no cluster's address file there
    (tmp_path / "ray").mkdir()
    fresh_mlflow_db(tmp_path)
    code = main(["compare", *BASE, "workload.rate=2,4", f"output.dir={tmp_path}", "sweep.backend=ray"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "cannot reach a Ray cluster" in err, err
    summary = [r for r in run_states(tmp_path / "mlflow.db").values() if r["kind"] == "compare"]
    assert [r["status"] for r in summary] == ["FAILED"], summary
