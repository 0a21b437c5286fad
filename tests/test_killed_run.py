"""A `testbed run` killed outright (SIGKILL: nothing of it runs again) leaves no MLflow run RUNNING:
its background process (testbed/tracking/background.py) takes the end of its pipes as the signal
to end the run KILLED, from the first second (issue 48 item 1). On the old code a run killed
before the background process answered `start` (8.3 and 20.3 s in the probes; 5 and 10 s here)
stayed RUNNING for good: the reply's BrokenPipeError ended the process before it marked the run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mlflow_db import fresh_mlflow_db
from signal_helpers import REPO, WAIT_S, run_states

SMALL = ["policy=sarathi", "workload=azure", "workload.rate=2", "hardware=a100-80g", "model=llama2-13b",
         "parallel.pp=2", "output.progress=false", "output.plots=false"]


def _statuses(db: Path) -> list[str]:
    return sorted(r["status"] for r in run_states(db).values())


def _kill_run(tmp_path: Path, *, after_s: float | None, num_requests: int) -> list[str]:
    """Start `testbed run` (a run of tens of seconds), SIGKILL it `after_s` seconds in (None: as
    soon as its run folder is reserved, the step before the MLflow run is asked for), wait for its
    background processes to end; the statuses of the store's runs."""
    fresh_mlflow_db(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", "run", *SMALL, f"workload.num_requests={num_requests}",
                             f"output.dir={tmp_path}"], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + (after_s if after_s is not None else WAIT_S)
    while time.monotonic() < deadline and proc.poll() is None:
        if after_s is None and any(tmp_path.glob("sarathi_*")):
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it was killed: make it longer"
    kids = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait(timeout=WAIT_S)
    _, alive = psutil.wait_procs(kids, timeout=WAIT_S)
    assert not alive, alive
    return _statuses(tmp_path / "mlflow.db")


def test_background_process_whose_caller_is_gone_ends_the_run_killed(tmp_path):
    """The protocol itself, deterministic: `start` asked, then both pipes closed before its reply
    (the caller SIGKILLed). The old process died on the reply's BrokenPipeError: run RUNNING."""
    uri = fresh_mlflow_db(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "testbed.tracking.background", "--mlflow"], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdin.write(json.dumps({"op": "start", "uri": uri, "experiment": "testbed", "artifact_location": None,
                                 "run_name": "killed", "tags": {}, "params": {"a": 1}}) + "\n")
    proc.stdin.flush()
    proc.stdout.close()  # the caller's end of the replies: gone with it
    proc.stdin.write('{"op": "fin')  # a line cut short by the caller's death
    proc.stdin.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=WAIT_S) == 0, err
    assert "Traceback" not in err, err
    assert _statuses(tmp_path / "mlflow.db") == ["KILLED"]


def test_run_killed_as_it_asks_for_its_mlflow_run_is_marked_killed(tmp_path):
    """`testbed run` SIGKILLed the moment it reserves its run folder and asks for the MLflow run."""
    statuses = _kill_run(tmp_path, after_s=None, num_requests=6000)
    assert "RUNNING" not in statuses, statuses
    assert set(statuses) <= {"KILLED"}


@pytest.mark.slow  # ~1-2 min: four runs killed and wound down
@pytest.mark.parametrize("after_s", [1, 5, 10, 20])
def test_run_killed_at_any_second_leaves_no_run_running(tmp_path, after_s):
    """The probes' kill times: no run RUNNING; a run opened (after ~2 s unloaded, later on a busy
    machine, so none may exist yet) is KILLED."""
    statuses = _kill_run(tmp_path, after_s=after_s, num_requests=15000)
    assert statuses in ([], ["KILLED"]), statuses
