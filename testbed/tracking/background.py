"""The background process of `testbed run`: MLflow tracking and the run's figures, started before
the simulation so that its imports and the tracking database work overlap with it.

Why a process: `import mlflow` takes 2-4 s, a fresh SQLite store's migrations ~7 s, matplotlib
~1 s; on the 5,000-request benchmark (5 s of simulation) that was 7 s of MLflow and 6 s of files
and figures after the simulation. A thread would share the interpreter lock with the simulation;
a second process uses the second core, and its memory (mlflow ~170 MB) is not added to the
simulation's peak.

Protocol: JSON lines on stdin and a reply pipe (never pickle), one reply per request, in order.
The replies go to the process's original stdout, which it moves to a private descriptor first
thing; its fd 1 then points at stderr, so nothing MLflow or a library prints ("View run ...")
can reach the reply channel (it did, and `testbed run` died on a JSONDecodeError):

    {"op": "start", "uri", "experiment", "artifact_location", "run_name", "tags", "params", "journal"}
        -> {"ok": true, "run_id": ..., "experiment_id": ...} | {"ok": false, "error": ...}
    {"op": "plots", "run_dir", "plots": {...}}   (testbed/run/outputs.plot_data; drawn by the renderer
        the caller named, `--render module:function`: testbed/run/plots.render_plots)
        -> {"ok": true} | {"ok": false, "error": ...}
    {"op": "finish", "run_dir", "metrics": [[k, v, step], ...], "tags": {...},
     "status": "FINISHED" | "FAILED" | "KILLED"}
        -> {"ok": true} | {"ok": false, "error": ...}

The process ignores Ctrl-C (it is in its own session) and marks a started run KILLED when its
stdin closes without a `finish`, which is what happens when `testbed run` is killed outright.

It is not trusted to answer: every reply is awaited at most `reply_timeout_s()` seconds (a
stopped process made `testbed run` wait forever), and no longer once an HTTP tracking server
stops answering (`store_answers`; the run's files are written, the error says the run was not
recorded); a process that is gone or silent is killed and
the run's end (metrics, tags, files, status) is recorded from the main process instead
(`testbed.tracking.tracker.record_run_end`), so its MLflow run never stays RUNNING.
"""
from __future__ import annotations

import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


DEFAULT_REPLY_TIMEOUT_S = 300.0  # the first store's migrations took ~7 s, an HTTP store's artifacts more
# While a reply is awaited, an HTTP tracking server is asked every STORE_CHECK_S whether it still
# answers (`/health`, STORE_PROBE_S at most); two silences in a row end the wait: a stopped server
# held `testbed run` for the whole reply timeout, 300 s (issue 38 item 11).
STORE_CHECK_S = 5.0
STORE_PROBE_S = 3.0


def store_state(uri: str, timeout_s: float = STORE_PROBE_S) -> str:
    """"answers" (any HTTP status counts; stores other than HTTP servers are not probed),
    "refused" (nothing listens: a server restarting) or "silent" (no answer in `timeout_s`: a
    stopped or hung server)."""
    if not uri.startswith(("http://", "https://")):
        return "answers"
    import socket
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return "answers"
    except urllib.error.URLError as exc:
        return "silent" if isinstance(exc.reason, (socket.timeout, TimeoutError)) else "refused"
    except (socket.timeout, TimeoutError):
        return "silent"
    except (OSError, ValueError):
        return "refused"
    return "answers"


def store_answers(uri: str, timeout_s: float = STORE_PROBE_S) -> bool:
    """Whether the tracking store at `uri` answers at all (`store_state`)."""
    return store_state(uri, timeout_s) == "answers"


def _restart_wait_s() -> float:
    """How long a tracking server that refuses connections is waited for: as long as the
    background process itself waits for it (its reconnect window), plus two checks. Before, two
    refused checks (~10 s) ended the wait, so a 10 s `mlflow server` restart, which the
    background process rides out, left the run RUNNING (issue 48 service probes)."""
    from testbed.cluster.reconnect import window_s

    try:
        return window_s() + 2 * STORE_CHECK_S
    except Exception:  # noqa: BLE001 - a bad TESTBED_RECONNECT_S is refused elsewhere
        return 2 * STORE_CHECK_S


def surfaced(line: str) -> bool:
    """Whether a line of the background process's stderr is meant for the user: a warning or note
    of ours (testbed/cluster/reconnect.py, cluster/unwritten.py), or a service back again."""
    return line.startswith(("warning:", "note:")) or " is reachable again after " in line


def reply_timeout_s() -> float:
    """How long one reply is awaited (`TESTBED_BACKGROUND_TIMEOUT_S` overrides the default)."""
    try:
        return max(0.1, float(os.environ.get("TESTBED_BACKGROUND_TIMEOUT_S", DEFAULT_REPLY_TIMEOUT_S)))
    except ValueError:
        return DEFAULT_REPLY_TIMEOUT_S


class Sidecar:
    """The `testbed run` side of the protocol."""

    def __init__(self, mlflow: bool, render: str | None) -> None:
        """`render`: the figure renderer as "module:function" (None: no figures), named by the
        caller (`testbed run`), so that this folder imports nothing of the command above it."""
        self.with_mlflow, self.with_plots = mlflow, render is not None
        self._stderr = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ)
        env.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # reachability was checked; fail fast after
        env.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(Path(__file__).resolve().parents[1]),
                                                        env.get("PYTHONPATH", "")] if p)
        flags = (["--mlflow"] if mlflow else []) + (["--render", render] if render else [])
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "testbed.tracking.background", *flags], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        self.said: list[str] = []  # its lines meant for the user (`surfaced`), shown as they came
        self._err_reader = threading.Thread(target=self._read_stderr, name="sidecar-stderr", daemon=True)
        self._err_reader.start()
        self._ops: list[str] = []  # requests sent, replies not read yet
        self.started = False
        self.timings: dict[str, float | None] = {}  # op -> when the sidecar was done with it (debugging)
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.start_error: str | None = None
        self.warnings: list[str] = []
        self.start_msg: dict | None = None  # what `start` asked for: the main process's fallback needs it
        self.lost: str | None = None  # why the process stopped answering, once it did
        self.store_down = False  # the HTTP tracking store stopped answering: no second try from here
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_lines, name="sidecar-replies", daemon=True).start()

    def _read_lines(self) -> None:
        """Replies, read by a thread so that awaiting one can time out; None at end of file."""
        try:
            for line in self.proc.stdout:
                self._lines.put(line)
        except (OSError, ValueError):
            pass
        self._lines.put(None)

    def _read_stderr(self) -> None:
        """Keep the process's stderr (for `_exit_reason`) and pass on at once, one line each, what
        it says for the user: the reconnect logic's "waiting for" and "reachable again" lines and
        the ends it wrote for a command that gave up. Before, they stayed in this private file,
        and a `testbed run` whose tracking server was restarting sat silent (issue 48)."""
        try:
            for line in self.proc.stderr:
                self._stderr.write(line)
                if surfaced(line):
                    self.said.append(line.strip())
                    print(line.rstrip(), file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass

    def _drain_stderr(self) -> None:
        self._err_reader.join(timeout=10)

    def _send(self, msg: dict) -> None:
        try:
            self._ops.append(msg["op"])
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the reply read reports the process's own error

    def _reply(self) -> dict:
        """The next reply; after a silence of `reply_timeout_s()`, an exit or an unreadable line,
        the process is killed and `lost` says why."""
        if self.lost is None:
            line, why = self._next_line()
            if line:
                try:
                    return json.loads(line)
                except ValueError:
                    why = f"background process sent an unreadable reply {line[:80]!r}; stopped it"
            self.lost = why or self._exit_reason()
            self._kill()
        return {"ok": False, "error": self.lost}

    def _next_line(self) -> tuple[str | None, str | None]:
        """(the next reply line or None at its end, or (None, why) when the wait was given up:
        after `reply_timeout_s()`, or at once when the HTTP tracking store stopped answering)."""
        timeout = reply_timeout_s()
        deadline = time.monotonic() + timeout
        uri = (self.start_msg or {}).get("uri") or ""
        silent, refused_since = 0, None
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, min(STORE_CHECK_S, deadline - time.monotonic())))
                return line, None if line is None else ""
            except queue.Empty:
                pass
            if time.monotonic() >= deadline:
                return None, f"background process did not answer within {timeout:g} s; stopped it"
            state = store_state(uri)
            silent = silent + 1 if state == "silent" else 0
            refused_since = (refused_since or time.monotonic()) if state == "refused" else None
            if silent >= 2 or (refused_since is not None and time.monotonic() - refused_since > _restart_wait_s()):
                from testbed.config.redact import redact

                self.store_down = True
                return None, f"the tracking store {redact(uri)} stopped answering; stopped the background process"

    def _journal_end(self, run_dir: str | None) -> None:
        """The run's end could not reach the store: journaled in the run's output folder, so that
        its next command reaching the store ends it FAILED (cluster/unwritten.py) rather than
        leaving it RUNNING for good; its results are in the run folder."""
        folder = (self.start_msg or {}).get("journal")
        if not folder or not self.run_id:
            return
        from testbed.cluster import unwritten

        unwritten.record(folder, unwritten.run_end(self.start_msg["uri"], self.run_id,
                                                   f"the tracking store was away when the run ended ({self.lost}); "
                                                   f"its results are in {run_dir}", "FAILED"))

    def _exit_reason(self) -> str:
        try:
            self.proc.wait(timeout=reply_timeout_s())
        except subprocess.TimeoutExpired:
            return "background process closed its replies but did not exit; stopped it"
        self._drain_stderr()
        self._stderr.seek(0)
        tail = self._stderr.read().strip().splitlines()
        return tail[-1] if tail else f"background process exited with code {self.proc.returncode}"

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def start(self, **msg: Any) -> None:
        """Open the MLflow run (asynchronously: the reply is read by `finish`)."""
        self.started = True
        self.start_msg = dict(msg)
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
            if self.lost is not None:
                break
            if op == "start" and rep.get("ok"):
                self.run_id, self.experiment_id = rep["run_id"], rep.get("experiment_id")
            elif op == "start":
                self.start_error = rep["error"]
                errors.append(f"MLflow run not recorded: {rep['error']}")
            elif not rep.get("ok"):
                errors.append(f"{'figures' if op == 'plots' else 'MLflow logging'} failed: {rep['error']}")
        self._ops.clear()
        self.close()
        if self.lost is not None:
            errors += self._record_here(run_dir, metrics, tags, status)
        return errors

    def _record_here(self, run_dir: str | None, metrics: list, tags: dict, status: str) -> list[str]:
        """The process is gone: record the run's end from this process (figures: only say so)."""
        if not self.with_mlflow:
            return [f"figures failed: {self.lost}"]
        if self.start_msg is None:  # no run was asked for: nothing to record
            return [f"MLflow logging failed: {self.lost}"]
        if self.store_down:  # nowhere to record it now: trying again here would wait as long
            self._journal_end(run_dir)
            return [f"MLflow run not recorded: {self.lost}"]
        from testbed.tracking.tracker import record_run_end

        try:
            self.run_id, self.experiment_id = record_run_end(self.start_msg, self.run_id, run_dir, metrics, tags, status)
        except Exception as exc:  # noqa: BLE001 - one line for the user, never a traceback
            self._journal_end(run_dir)
            return [f"MLflow run not recorded: {self.lost}; recording it here failed too: "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"]
        self.warnings.append(f"MLflow: {self.lost}; the run was recorded from the main process")
        return []

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
            self.proc.wait(timeout=reply_timeout_s())
        except subprocess.TimeoutExpired:
            self._kill()
        self._drain_stderr()
        self._stderr.close()


class Background:
    """The two background processes of `testbed run`, started first thing (before the run's
    imports and config compose: ~0.5 s earlier, which is what the run waits for at its end once
    the simulation takes ~1 s): one for MLflow (import, store, run; ~170 MB), one for the figures
    (matplotlib; ~70 MB). Apart, each stays under 250 MB; together they took 259 MB.

    Which ones run is first read off the command line (`output.mlflow=false`,
    `output.plots=false`), then `fit` to the composed config. `render`: the figure renderer,
    "module:function" (testbed.run.FIGURES), handed down by the command."""

    def __init__(self, mlflow: bool, render: str | None) -> None:
        self.render = render
        self.tracker = Sidecar(mlflow=True, render=None) if mlflow else None
        self.figures = Sidecar(mlflow=False, render=render) if render else None

    @classmethod
    def from_command_line(cls, overrides, render: str | None) -> "Background":
        said = {ov.lstrip("+~").replace(" ", "").lower() for ov in overrides}
        return cls(mlflow="output.mlflow=false" not in said, render=None if "output.plots=false" in said else render)

    def fit(self, *, mlflow: bool, plots: bool) -> None:
        """Stop the processes the config turns off; start those it turns on."""
        if not mlflow and self.tracker is not None:
            self.tracker.close()
            self.tracker = None
        elif mlflow and self.tracker is None:
            self.tracker = Sidecar(mlflow=True, render=None)
        if not plots and self.figures is not None:
            self.figures.close()
            self.figures = None
        elif plots and self.figures is None and self.render:
            self.figures = Sidecar(mlflow=False, render=self.render)

    def close(self) -> None:
        for p in (self.tracker, self.figures):
            if p is not None:
                p.close()


# --- the background process -------------------------------------------------------------------------

def _reply_channel():
    """The original stdout, moved to a private descriptor; fd 1 (and `sys.stdout`) now write to
    stderr, where MLflow's "View run ..." lines cannot corrupt a reply."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    return os.fdopen(fd, "w")


def _renderer(name: str):
    """The function "module:function" names (imported here, while the simulation runs)."""
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def _answer(replies, reply: dict) -> bool:
    """Write one reply; False when the reply pipe is closed. A `testbed run` killed in its first
    seconds closes it before the run's `start` is answered: the write's BrokenPipeError, outside
    any `try`, ended this process before it marked the run, which stayed RUNNING for good (issue
    48: killed at 8 and 20 s). The pipe's end is the signal to end the run KILLED, not an error."""
    try:
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    except (BrokenPipeError, OSError, ValueError):
        return False
    return True


def _open_tracker(msg: dict):
    """The run's tracker. `testbed run` checked the store before it started this process, so a
    store that refuses now is restarting: waited for like any call (cluster/reconnect.py). Before,
    a tracking server or PostgreSQL store restarted in the run's first seconds (while this process
    still imported MLflow) was "MLflow run not recorded: ... not reachable", exit 1 (issue 48)."""
    from engine.base.errors import ConfigError
    from testbed.cluster import reconnect
    from testbed.config.redact import redact
    from testbed.tracking.tracker import Tracker

    def away(exc: BaseException) -> bool:
        return isinstance(exc, ConfigError) and ("not reachable" in str(exc) or "cannot reach" in str(exc))

    service = reconnect.Service(f"output.tracking_uri={redact(msg['uri'])}", away)
    return reconnect.call(service, Tracker, None, msg["experiment"], uri=msg["uri"],
                          artifact_location=msg["artifact_location"], journal=msg.get("journal"))


def _owe(start: dict, run_id: str, reason: str, status: str, exc: BaseException) -> None:
    """A run whose end its store did not take because the store stayed away (ServiceLost):
    journaled in the run's output folder for its next command (cluster/unwritten.py)."""
    from testbed.cluster.reconnect import ServiceLost

    if isinstance(exc, ServiceLost) and start.get("journal"):
        from testbed.cluster import unwritten

        unwritten.record(start["journal"], unwritten.run_end(start["uri"], run_id, reason, status))


def _serve(mlflow: bool, render: str | None) -> None:
    t0 = time.monotonic()
    replies = _reply_channel()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGHUP"):  # a closed terminal: `testbed run` itself ends the run
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    import logging

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    draw = _renderer(render) if render else None
    if mlflow:
        import mlflow as _mlflow  # noqa: F401
        from testbed.tracking.tracker import Tracker  # noqa: F401
    tracker = run_id = None
    finished = False
    start: dict = {}
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except ValueError:  # a line cut short by the caller's death: its end, not an error
            break
        try:
            if msg["op"] == "start":
                from testbed.tracking.tracker import Tracker

                start = msg
                tracker = _open_tracker(msg)
                run_id = tracker.start_flat(msg["params"], msg["run_name"], msg["tags"])
                reply: dict = {"ok": True, "run_id": run_id, "experiment_id": tracker.experiment_id}
            elif msg["op"] == "plots":
                if draw is None:
                    raise RuntimeError("this process was started without a figure renderer")
                draw(msg["plots"], Path(msg["run_dir"]))
                reply = {"ok": True}
            elif msg["op"] == "finish":
                finished = True
                if tracker is not None and run_id is not None:
                    from testbed.tracking.tracker import small_artifacts

                    run_dir = Path(msg["run_dir"]) if msg.get("run_dir") else None
                    try:
                        tracker.finish_flat(run_id, msg["metrics"], msg["tags"], small_artifacts(run_dir),
                                            msg["status"])
                    except Exception as exc:
                        _owe(start, run_id, f"the tracking store was away when the run ended ({exc}); its results "
                                            f"are in {run_dir}", "FAILED", exc)
                        raise
                reply = {"ok": True}
            else:
                reply = {"ok": False, "error": f"unknown op {msg.get('op')!r}"}
        except Exception as exc:  # reported by `testbed run` as one line
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]}
        reply["t"] = round(time.monotonic() - t0, 3)  # when it was done, on the sidecar's clock
        if not _answer(replies, reply):
            break  # the caller is gone: its run ends here, below
    if tracker is not None and run_id is not None and not finished:
        try:
            tracker.fail(run_id, "testbed run ended without finishing (killed)", status="KILLED")
        except Exception as exc:  # noqa: BLE001 - its store is away: the folder's next command ends it
            _owe(start, run_id, "testbed run ended without finishing (killed)", "KILLED", exc)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: MLflow's exit hooks took ~4 s on a loaded machine


if __name__ == "__main__":
    _serve("--mlflow" in sys.argv, sys.argv[sys.argv.index("--render") + 1] if "--render" in sys.argv else None)
