"""The real MLflow server, on loopback, over the runs database that `testbed tune` wrote: the
study run, its nested trial runs, their params and metrics read back through the REST API
(the session's server, tests/services.py)."""
from __future__ import annotations

import json
import secrets
import urllib.parse
import urllib.request

import pytest

from services import MlflowServer
from testbed.cli import main

pytestmark = pytest.mark.services  # a real mlflow server (tests/services.py)


def rest_get(server: MlflowServer, path: str, **query) -> dict:
    url = f"{server.base}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def rest_post(server: MlflowServer, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"{server.base}/api/2.0/mlflow/{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_server_serves_the_study_and_its_trials(mlflow_server, tmp_path):
    """`testbed tune` writes the SQLite store itself; the session's server, started over that
    very file, serves what it wrote."""
    import optuna

    name = f"served-{secrets.token_hex(3)}"
    assert main(["tune", "policy=sarathi", "workload=synthetic", "workload.num_requests=60", "workload.arrival=offline",
                 "model=llama2-13b", "hardware=a100-80g", "parallel.pp=2", "output.plots=false",
                 "output.progress=false", f"output.dir={tmp_path}", f"output.tracking_uri={mlflow_server.backend_uri}",
                 "tune.trials=3", f"tune.study={name}"]) == 0
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path.resolve()}/optuna.db")
    exp = rest_get(mlflow_server, "experiments/get-by-name", experiment_name=f"tune-{name}")["experiment"]
    runs = rest_post(mlflow_server, "runs/search", {"experiment_ids": [exp["experiment_id"]], "max_results": 100})["runs"]

    def tags(run):
        return {t["key"]: t["value"] for t in run["data"].get("tags", [])}

    parents = [r for r in runs if tags(r).get("testbed.kind") == "study"]
    trials = [r for r in runs if tags(r).get("testbed.kind") == "trial"]
    assert len(parents) == 1 and len(trials) == 3
    parent_id = parents[0]["info"]["run_id"]
    assert parents[0]["info"]["status"] == "FINISHED"
    for run in trials:
        t = study.trials[int(tags(run)["optuna.trial"])]
        assert tags(run)["mlflow.parentRunId"] == parent_id
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        assert params["policy.name"] == "sarathi"
        assert params["policy.token_budget"] == str(t.params["token_budget"])
        assert params["policy.max_num_seqs"] == str(t.params["max_num_seqs"])
        assert metrics["throughput_tok_s"] == pytest.approx(t.value)
        assert metrics["num_finished"] == 60
    hist = rest_get(mlflow_server, "metrics/get-history", run_id=parent_id, metric_key="best.throughput_tok_s")["metrics"]
    assert hist[-1]["value"] == pytest.approx(study.best_value)
    run = rest_get(mlflow_server, "runs/get", run_id=parent_id)["run"]
    assert json.loads({t["key"]: t["value"] for t in run["data"]["tags"]}["best.params"]) == study.best_params
