"""A tracking server whose own store is away answers HTTP 503 (TEMPORARILY_UNAVAILABLE): that is
waited for like a refused connection (issue 48 item 6). In the recipe's layout
(docs/beyond-one-machine.md: the `mlflow server`'s store on the study's PostgreSQL) a 10 s
PostgreSQL restart crashed one host of two with a 118-line traceback and left runs RUNNING."""
from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from services import MlflowServer


class _Answering(http.server.BaseHTTPRequestHandler):
    """Answers every request with the class's status and MLflow's JSON error body."""

    status = 503
    code = "TEMPORARILY_UNAVAILABLE"

    def _answer(self) -> None:
        body = json.dumps({"error_code": self.code, "message": "(psycopg.OperationalError) refused"}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


def _error_of(status: int, code: str, monkeypatch) -> BaseException:
    """The exception an MlflowClient call raises against a server that answers `status`."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    handler = type("Handler", (_Answering,), {"status": status, "code": code})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        MlflowClient(f"http://127.0.0.1:{server.server_address[1]}").search_experiments()
    except Exception as exc:  # noqa: BLE001 - the exception is what is examined
        return exc
    finally:
        server.shutdown()
    raise AssertionError("the call did not fail")


@pytest.mark.parametrize("status,code,waited", [(503, "TEMPORARILY_UNAVAILABLE", True), (502, "INTERNAL_ERROR", True),
                                                (504, "INTERNAL_ERROR", True), (500, "INTERNAL_ERROR", False),
                                                (400, "INVALID_PARAMETER_VALUE", False)])
def test_a_server_that_cannot_serve_now_is_waited_for(status, code, waited, monkeypatch):
    """503/502/504 after MLflow's own retries: waited for (was not: only refused connections);
    a 500 (the server's own failure, e.g. its artifact store's full disk) and a 4xx are not."""
    from testbed.tracking.tracker import server_unreachable

    assert server_unreachable(_error_of(status, code, monkeypatch)) is waited


class _CutOff(http.server.BaseHTTPRequestHandler):
    """Promises a 2-byte body and closes the connection before sending it: a server stopped while
    it answered."""

    def _answer(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.close_connection = True

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


def test_a_server_that_closes_the_connection_mid_answer_is_waited_for(monkeypatch):
    """"Connection broken: IncompleteRead" (the server stopped while it answered) is the server
    going away, as a refused connection is: waited for (was: a traceback from log_batch)."""
    from mlflow.tracking import MlflowClient

    from testbed.tracking.tracker import server_unreachable

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutOff)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(Exception) as caught:
            MlflowClient(f"http://127.0.0.1:{server.server_address[1]}").search_experiments()
    finally:
        server.shutdown()
    assert "IncompleteRead" in str(caught.value)
    assert server_unreachable(caught.value)


@pytest.fixture(scope="module")
def pg_mlflow_server(postgres, tmp_path_factory):
    """`mlflow server` with its backend store on the session's PostgreSQL, as the recipe lays it out."""
    server = MlflowServer(postgres.new_database("mlflow"), tmp_path_factory.mktemp("pg-mlflow"))
    server.wait_healthy()
    yield server
    server.stop()


def _released_inside_an_outage(run, tmp_path, restart) -> str:
    """Once the held run's files are written (its MLflow run open), `restart(10)` its service in
    a thread and release the run 2 s into the outage; the run must end 0 without an error line.
    Returns its stderr."""
    deadline = time.monotonic() + 600
    while not any(tmp_path.glob("sarathi_*/summary.json")):
        assert run.proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    away = threading.Thread(target=restart, args=(10,))
    away.start()
    time.sleep(2)  # the service is down (PostgreSQL's fast shutdown done: a server over it answers 503)
    _, err = run.release()
    away.join()
    assert run.proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "error:" not in err, err[-3000:]
    return err


@pytest.mark.services
@pytest.mark.slow  # ~40 s: an mlflow server's start, a 10 s outage
def test_a_run_rides_out_a_postgres_restart_under_its_mlflow_server(postgres, pg_mlflow_server, tmp_path):
    """`testbed run` held at its summary (its MLflow run open on the server), PostgreSQL restarted
    for 10 s, the run released inside the outage: its end meets 503s, waits, and is recorded.
    Was: "MLflow logging failed: ... too many 503 error responses", exit 1, the run RUNNING."""
    from test_background_logger import HeldRun
    from test_mlflow_server import rest_get, rest_post

    experiment = f"pgrestart-{time.monotonic_ns() % 100000}"
    run = HeldRun(tmp_path, f"output.tracking_uri={pg_mlflow_server.base}", f"output.experiment={experiment}")
    err = _released_inside_an_outage(run, tmp_path, postgres.restart)
    exp = rest_get(pg_mlflow_server, "experiments/get-by-name", experiment_name=experiment)["experiment"]
    runs = rest_post(pg_mlflow_server, "runs/search", {"experiment_ids": [exp["experiment_id"]]})["runs"]
    assert [r["info"]["status"] for r in runs] == ["FINISHED"]


@pytest.mark.services
@pytest.mark.slow  # ~60 s: two mlflow server starts, a 10 s outage
def test_a_run_rides_out_a_restart_of_its_mlflow_server(tmp_path):
    """`testbed run` held at its summary (its MLflow run open on the server), the server killed,
    down 10 s and started again (~15-40 s until it answers on 2 busy cores), the run released
    inside the outage. Was (issue 48 service probes): the run gave up after two refused /health
    checks (~10 s) although its background process waits out the reconnect window: exit 1, the
    run RUNNING for good. Now: the waiting line once, exit 0, the run FINISHED."""
    from mlflow_db import fresh_mlflow_db
    from test_background_logger import HeldRun
    from test_mlflow_server import rest_get, rest_post

    (tmp_path / "server").mkdir()
    server = MlflowServer(fresh_mlflow_db(tmp_path / "server"), tmp_path / "server")
    server.wait_healthy()
    try:
        run = HeldRun(tmp_path, f"output.tracking_uri={server.base}", "output.experiment=restart")
        err = _released_inside_an_outage(run, tmp_path, server.restart)
        assert err.count("is unreachable") == 1, err[-3000:]  # the background process's line, shown once
        exp = rest_get(server, "experiments/get-by-name", experiment_name="restart")["experiment"]
        runs = rest_post(server, "runs/search", {"experiment_ids": [exp["experiment_id"]]})["runs"]
        assert [r["info"]["status"] for r in runs] == ["FINISHED"]
    finally:
        server.stop()


@pytest.mark.services
@pytest.mark.slow  # ~40 s: a fresh MLflow store's migrations, a 10 s outage
def test_a_run_rides_out_a_restart_of_its_postgres_mlflow_store(postgres, tmp_path):
    """The MLflow store itself on PostgreSQL (`output.tracking_uri=postgresql+psycopg://...`, no
    server), restarted for 10 s while `testbed run` holds its run open. Was (issue 48 service
    probes): "error: MLflow logging failed: ... the database system is shutting down", exit 1, the
    run RUNNING (only an HTTP server's calls were waited for). Now: waited for, exit 0, FINISHED."""
    from mlflow.tracking import MlflowClient
    from test_background_logger import HeldRun

    uri = postgres.new_database("mlflow").replace("postgresql://", "postgresql+psycopg://")
    run = HeldRun(tmp_path, f"output.tracking_uri={uri}", "output.experiment=pgstore")
    _released_inside_an_outage(run, tmp_path, postgres.restart)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("pgstore").experiment_id])
    assert [r.info.status for r in runs] == ["FINISHED"]
