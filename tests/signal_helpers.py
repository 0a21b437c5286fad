"""Start a `testbed` command as a child process, wait for a line it prints, signal it, and
check what it left behind: its exit code, surviving processes, MLflow runs still RUNNING."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 600  # the 2-core CI machines run several suites at once: generous, never a timing assertion


class Command:
    """`python -m testbed.cli <args>` in its own session (a terminal's Ctrl-C is a SIGINT to the
    process group: `interrupt()` sends that)."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", *args], cwd=REPO, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.err: list[str] = []
        self.out: list[str] = []
        self._seen = threading.Condition()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True).start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self._seen:
                lines.append(line)
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def wait_for(self, needle: str) -> None:
        """Block until a line containing `needle` was printed (fails if the command ends first)."""
        with self._seen:
            ok = self._seen.wait_for(lambda: any(needle in line for line in self.err + self.out)
                                     or self.proc.poll() is not None, timeout=WAIT_S)
        assert ok and any(needle in line for line in self.err + self.out), \
            f"{needle!r} never printed; exit {self.proc.poll()}; stderr:\n{''.join(self.err)[-3000:]}"

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=WAIT_S)

    def terminate_repeatedly(self, every_s: float = 0.1, for_s: float = 3.0) -> int:
        """SIGTERM, then another every `every_s` while it runs, for `for_s` (schedulers follow up;
        the cleanup's timing varies with the machine's load, so one second signal at a fixed
        delay may miss it)."""
        import time

        self.proc.send_signal(signal.SIGTERM)
        for _ in range(int(for_s / every_s)):
            time.sleep(every_s)
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=WAIT_S)

    def interrupt(self) -> int:
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(timeout=WAIT_S)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=WAIT_S)


def survivors(procs: list[psutil.Process]) -> list[str]:
    """The processes of the list still alive once they had time to notice (zombies count as gone)."""
    _, alive = psutil.wait_procs(procs, timeout=60)
    return [f"{p.pid} {p.name()}: {' '.join(p.cmdline())[:200]}" for p in alive
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def running_kinds(db: Path) -> list[tuple[str, str]]:
    """[(testbed.kind, run name)] of the runs RUNNING in an MLflow SQLite store, read with one SQL
    query: the waits poll it every 0.05-0.2 s, and `run_states` (an MlflowClient search) took
    ~90 ms of CPU per call, most of a core while a test waited."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as con:
            return con.execute("select coalesce(t.value, ''), r.name from runs r left join tags t "
                               "on t.run_uuid = r.run_uuid and t.key = 'testbed.kind' "
                               "where r.status = 'RUNNING'").fetchall()
    except sqlite3.OperationalError:  # not created yet, or being migrated
        return []


def run_states(db: Path) -> dict[str, dict]:
    """{run id: {name, status, kind, parent}} of every run in an MLflow SQLite store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db.resolve()}")
    out = {}
    for exp in client.search_experiments():
        for r in client.search_runs([exp.experiment_id]):
            out[r.info.run_id] = {"name": r.info.run_name, "status": r.info.status,
                                  "kind": r.data.tags.get("testbed.kind"),
                                  "parent": r.data.tags.get("mlflow.parentRunId") or r.data.tags.get("testbed.parent_run")}
    return out
