"""The background process of `testbed run`: MLflow tracking and the run's figures, started before
the simulation so that its imports and the tracking database work overlap with it.

Why a process: `import mlflow` takes 2-4 s, a fresh SQLite store's migrations ~7 s, matplotlib
~1 s; on the 5,000-request benchmark (5 s of simulation) that was 7 s of MLflow and 6 s of files
and figures after the simulation. A thread would share the interpreter lock with the simulation;
a second process uses the second core, and its memory (mlflow ~170 MB) is not added to the
simulation's peak.

Protocol: JSON lines on stdin/stdout (never pickle), one reply per request, in order:

    {"op": "start", "uri", "experiment", "artifact_location", "run_name", "tags", "params"}
        -> {"ok": true, "run_id": ..., "experiment_id": ...} | {"ok": false, "error": ...}
    {"op": "plots", "run_dir", "plots": {...}}   (testbed/outputs.plot_data)
        -> {"ok": true} | {"ok": false, "error": ...}
    {"op": "finish", "run_dir", "metrics": [[k, v, step], ...], "tags": {...},
     "status": "FINISHED" | "FAILED" | "KILLED"}
        -> {"ok": true} | {"ok": false, "error": ...}

The process ignores Ctrl-C (it is in its own session) and marks a started run KILLED when its
stdin closes without a `finish`, which is what happens when `testbed run` is killed outright.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class Sidecar:
    """The `testbed run` side of the protocol."""

    def __init__(self, mlflow: bool, plots: bool) -> None:
        self.with_mlflow, self.with_plots = mlflow, plots
        self._stderr = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ)
        env.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # reachability was checked; fail fast after
        env.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(Path(__file__).resolve().parents[1]),
                                                        env.get("PYTHONPATH", "")] if p)
        flags = (["--mlflow"] if mlflow else []) + (["--plots"] if plots else [])
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "testbed.sidecar", *flags], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env,
                                     start_new_session=True)
        self._ops: list[str] = []  # requests sent, replies not read yet
        self.started = False
        self.timings: dict[str, float | None] = {}  # op -> when the sidecar was done with it (debugging)
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.start_error: str | None = None

    def _send(self, msg: dict) -> None:
        try:
            self._ops.append(msg["op"])
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the reply read reports the process's own error

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self._stderr.seek(0)
            tail = self._stderr.read().strip().splitlines()
            return {"ok": False, "error": (tail[-1] if tail else f"exited with code {self.proc.returncode}")}
        return json.loads(line)

    def start(self, **msg: Any) -> None:
        """Open the MLflow run (asynchronously: the reply is read by `finish`)."""
        self.started = True
        self._send({"op": "start", **msg})

    def render(self, run_dir: str, data: dict) -> None:
        """Render the figures into `run_dir` (asynchronously, while the run folder is written)."""
        self._send({"op": "plots", "run_dir": run_dir, "plots": data})

    def finish(self, *, run_dir: str | None, metrics: list, tags: dict, status: str) -> list[str]:
        """Log the run folder's small files, metrics and tags, close the run; wait for all replies.
        Returns error lines."""
        errors = []
        self._send({"op": "finish", "run_dir": run_dir, "metrics": metrics, "tags": tags, "status": status})
        for op in list(self._ops):
            rep = self._reply()
            self.timings[op] = rep.get("t")
            if op == "start" and rep.get("ok"):
                self.run_id, self.experiment_id = rep["run_id"], rep.get("experiment_id")
            elif op == "start":
                self.start_error = rep["error"]
                errors.append(f"MLflow run not recorded: {rep['error']}")
            elif not rep.get("ok"):
                errors.append(f"{'figures' if op == 'plots' else 'MLflow logging'} failed: {rep['error']}")
        self._ops.clear()
        self.close()
        return errors

    def close(self) -> None:
        """Stop the process; a started, unfinished run is marked KILLED by it on stdin EOF (so
        that one is waited for); one with no run is killed at once."""
        if not self.started and self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


class Background:
    """The two background processes of `testbed run`, started first thing (before the run's
    imports and config compose: ~0.5 s earlier, which is what the run waits for at its end once
    the simulation takes ~1 s): one for MLflow (import, store, run; ~170 MB), one for the figures
    (matplotlib; ~70 MB). Apart, each stays under 250 MB; together they took 259 MB.

    Which ones run is first read off the command line (`output.mlflow=false`,
    `output.plots=false`), then `fit` to the composed config."""

    def __init__(self, mlflow: bool, plots: bool) -> None:
        self.tracker = Sidecar(mlflow=True, plots=False) if mlflow else None
        self.figures = Sidecar(mlflow=False, plots=True) if plots else None

    @classmethod
    def from_command_line(cls, overrides) -> "Background":
        said = {ov.lstrip("+~").replace(" ", "").lower() for ov in overrides}
        return cls(mlflow="output.mlflow=false" not in said, plots="output.plots=false" not in said)

    def fit(self, *, mlflow: bool, plots: bool) -> None:
        """Stop the processes the config turns off; start those it turns on."""
        if not mlflow and self.tracker is not None:
            self.tracker.close()
            self.tracker = None
        elif mlflow and self.tracker is None:
            self.tracker = Sidecar(mlflow=True, plots=False)
        if not plots and self.figures is not None:
            self.figures.close()
            self.figures = None
        elif plots and self.figures is None:
            self.figures = Sidecar(mlflow=False, plots=True)

    def close(self) -> None:
        for p in (self.tracker, self.figures):
            if p is not None:
                p.close()


# --- the background process -------------------------------------------------------------------------

def _serve(mlflow: bool, plots: bool) -> None:
    t0 = time.monotonic()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import logging

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if plots:
        import testbed.plots  # noqa: F401  (import while the simulation runs)
    if mlflow:
        import mlflow as _mlflow  # noqa: F401
        from testbed.tracking import Tracker  # noqa: F401
    tracker = run_id = None
    finished = False
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "start":
                from testbed.tracking import Tracker

                tracker = Tracker(None, msg["experiment"], uri=msg["uri"],
                                  artifact_location=msg["artifact_location"])
                run_id = tracker.start_flat(msg["params"], msg["run_name"], msg["tags"])
                reply: dict = {"ok": True, "run_id": run_id, "experiment_id": tracker.experiment_id}
            elif msg["op"] == "plots":
                from testbed.plots import render_plots

                render_plots(msg["plots"], Path(msg["run_dir"]))
                reply = {"ok": True}
            elif msg["op"] == "finish":
                finished = True
                if tracker is not None and run_id is not None:
                    from testbed.tracking import small_artifacts

                    run_dir = Path(msg["run_dir"]) if msg.get("run_dir") else None
                    tracker.finish_flat(run_id, msg["metrics"], msg["tags"], small_artifacts(run_dir),
                                        msg["status"])
                reply = {"ok": True}
            else:
                reply = {"ok": False, "error": f"unknown op {msg.get('op')!r}"}
        except Exception as exc:  # reported by `testbed run` as one line
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]}
        reply["t"] = round(time.monotonic() - t0, 3)  # when it was done, on the sidecar's clock
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    if tracker is not None and run_id is not None and not finished:
        tracker.fail(run_id, "testbed run ended without finishing (killed)", status="KILLED")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: MLflow's exit hooks took ~4 s on a loaded machine


if __name__ == "__main__":
    _serve("--mlflow" in sys.argv, "--plots" in sys.argv)
