"""A study's MLflow run is shared by every host running `tune` on the study (issue 48): one
host's end of it (Ctrl-C, giving up on a service, or a journaled end that its folder's next
command applied) marked it KILLED or FAILED while another host still ran the study. Now only a
run whose other holders are gone (beat older than its grace, or a dead pid of this namespace)
is ended; the last host on it ends it (testbed/cluster/owners.py)."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlflow_db import fresh_mlflow_db
from testbed.cluster import heartbeat, identity, owners, unwritten

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 120.0
RUN = ["policy=sarathi", "workload=synthetic", "workload.arrival=offline", "model=llama2-13b", "hardware=a100-80g",
       "parallel.pp=2", "output.plots=false", "output.progress=false", "output.dir=runs"]
TUNE = ["tune", *RUN, "workload.num_requests=1500", "tune.study=shared", "tune.trials=100000"]


def _client(tags: dict[str, str]):
    return SimpleNamespace(get_run=lambda run_id: SimpleNamespace(data=SimpleNamespace(tags=tags)))


def test_a_holder_is_gone_by_its_stale_beat_or_its_dead_pid():
    now = time.time()
    elsewhere = {"host": "lab-b", "pid": 1, "namespace": "another-boot:1", "grace": 60}
    dead_here = {"host": "lab-c", "pid": 2 ** 22 + 7, "namespace": identity.local_namespace(), "grace": 60, "beat": now}
    tags = {owners.tag_key("lab-b-1"): json.dumps({**elsewhere, "beat": now - 5}),  # alive: beat 5 s ago
            owners.tag_key("lab-d-2"): json.dumps({**elsewhere, "host": "lab-d", "beat": now - 61}),  # stale
            owners.tag_key("lab-c-3"): json.dumps(dead_here),  # its pid is gone here
            owners.tag_key("lab-e-4"): "not json", "mlflow.runName": "study"}
    assert owners.others_alive(_client(tags), "r", "me") == ["lab-b"]
    assert owners.others_alive(_client(tags), "r", "lab-b-1") == []


@pytest.mark.parametrize("url, interval, grace, beat", [
    ("sqlite:///o.db", None, None, (10.0, 60.0)),  # no trial heartbeats: the heartbeat's default beat
    ("postgresql://h/db", None, None, (10.0, 60.0)),  # the study's heartbeat and grace
    ("postgresql://h/db", 30, None, (30.0, 90.0)),
    ("postgresql://h/db", 10, 15, (10.0, 30.0)),  # a grace under three beats: three beats for a holder
])
def test_a_holder_beats_with_the_study_heartbeat(url, interval, grace, beat):
    assert owners.beat_of(heartbeat.default_for(url, interval, grace)) == beat


def _sessions(db: Path) -> dict[str, str]:
    """host -> session of the hosts that have a trial run in the shared store."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            rows = conn.execute("SELECT h.value, s.value FROM tags h JOIN tags s ON s.run_uuid = h.run_uuid "
                                "WHERE h.key = 'host' AND s.key = 'testbed.session'").fetchall()
    except sqlite3.Error:
        return {}
    return dict(rows)


def _study_run(db: Path) -> tuple[str, str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        rows = conn.execute("SELECT r.run_uuid, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                            "WHERE t.key = 'testbed.kind' AND t.value = 'study'").fetchall()
    assert len(rows) == 1, rows
    return rows[0]


def _wait(what, proc_list) -> None:
    deadline = time.monotonic() + WAIT_S
    while not what():
        assert time.monotonic() < deadline and all(p.poll() is None for p in proc_list), \
            [p.communicate()[1][-2000:] for p in proc_list if p.poll() is not None]
        time.sleep(0.3)


@pytest.mark.slow  # ~30 s: two `tune` hosts and two `testbed run`s
def test_one_host_ending_does_not_end_the_study_run_another_host_still_runs(tmp_path):
    shared = tmp_path / "shared"
    uri = fresh_mlflow_db(shared)
    db = shared / "mlflow.db"
    common = [f"tune.storage=sqlite:///{shared / 'optuna.db'}", f"output.tracking_uri={uri}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(identity.SESSION_ENV, None)
    hosts = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        hosts[name] = subprocess.Popen([sys.executable, "-m", "testbed.cli", *TUNE, *common], cwd=tmp_path / name,
                                       env={**env, identity.HOST_ENV: f"lab-{name}"}, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    procs = list(hosts.values())
    try:
        _wait(lambda: sorted(_sessions(db)) == ["lab-a", "lab-b"], procs)  # both hosts run trials of the study
        run_id, _ = _study_run(db)
        hosts["a"].send_signal(signal.SIGTERM)  # Ctrl-C on host a only
        assert hosts["a"].wait(WAIT_S) == 143, hosts["a"].communicate()[1][-3000:]
        assert _study_run(db)[1] == "RUNNING"  # old code: KILLED while host b runs the study
        # host a's folder owes the run an end, as when it gave up on a store: its next command applies it
        unwritten.record(tmp_path / "a" / "runs", unwritten.run_end(uri, run_id, "lost", "FAILED",
                                                                    _sessions(db)["lab-a"]))
        run = subprocess.run([sys.executable, "-m", "testbed.cli", "run", *RUN, "workload.num_requests=20",
                              f"output.tracking_uri={uri}"], cwd=tmp_path / "a", env=env,
                             capture_output=True, text=True, timeout=WAIT_S)
        assert run.returncode == 0, run.stderr[-3000:]
        assert _study_run(db)[1] == "RUNNING"  # old code: FAILED while host b runs the study
        assert unwritten.pending(tmp_path / "a" / "runs", "run", uri)  # kept for when host b has stopped
        hosts["b"].send_signal(signal.SIGTERM)  # the last host on the study ends it
        assert hosts["b"].wait(WAIT_S) == 143, hosts["b"].communicate()[1][-3000:]
        assert _study_run(db)[1] == "KILLED"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
