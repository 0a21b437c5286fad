"""Real services for the `services` tests, started once per pytest session: a PostgreSQL server
(Debian's `postgresql` package when its binaries are on the machine, else the `pgserver` wheel's)
and an `mlflow server` with a proxied artifact store, both on loopback. No mocks: the tests talk
to the same servers a lab would run, only smaller.

PostgreSQL refuses to run as root: as root the data folder is given to the `postgres` user (or
`nobody`) and initdb and the server run as that user. fsync is off (a test database need not
survive a power cut): a fresh database then costs ~0.1 s instead of ~1 s on the 2-core machines.
A `testbed` command that imitates a host is `Host`: its own working folder (its `runs/` is
invisible to the other) and its own `TESTBED_HOST`."""
from __future__ import annotations

import functools
import glob
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120  # the mlflow server imports MLflow, FastAPI and uvicorn: ~15 s on a busy 2-core machine
WAIT_S = 600  # generous, never a timing assertion
PASSWORD = "pw-" + secrets.token_hex(6)  # must never appear in any output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(ready, proc: subprocess.Popen, what: str, tail) -> None:
    """Poll `ready()` until it is true; fail loudly if `proc` exits first or START_TIMEOUT_S passes."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}: {tail()}")
        if ready():
            return
        time.sleep(0.3)
    pytest.fail(f"{what} not ready after {START_TIMEOUT_S} s: {tail()}")


def _postgres_bin() -> Path | None:
    """The folder with initdb and postgres: Debian's package, else on PATH, else pgserver's."""
    for found in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(found, "initdb").is_file():
            return Path(found)
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    try:
        import pgserver  # noqa: F401  (a pip-installable server: pip install pgserver)
        from pgserver._commands import POSTGRES_BIN_PATH  # type: ignore[attr-defined]

        return Path(POSTGRES_BIN_PATH)
    except Exception:
        return None


def _run_as() -> dict:
    """subprocess arguments that drop root (PostgreSQL refuses to run as root)."""
    if os.geteuid() != 0:
        return {}
    for name in ("postgres", "nobody"):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
    pytest.skip("running as root and no unprivileged user to run PostgreSQL as")


class Postgres:
    """One PostgreSQL server in a temporary folder, superuser `testbed` with a password."""

    def __init__(self) -> None:
        pytest.importorskip("psycopg", reason="the PostgreSQL driver: pip install -e '.[postgres]'")
        bindir = _postgres_bin()
        if bindir is None:
            pytest.skip("no PostgreSQL server binaries (apt-get install postgresql, or pip install pgserver)")
        self.root = Path(tempfile.mkdtemp(prefix="testbed-pg-"))
        self.drop = _run_as()
        (self.root / "pw").write_text(PASSWORD + "\n")
        if self.drop:
            for path in (self.root, self.root / "pw"):
                os.chown(path, self.drop["user"], self.drop["group"])
        self.port = free_port()
        subprocess.run([str(bindir / "initdb"), "-D", str(self.root / "data"), "-U", "testbed",
                        f"--pwfile={self.root / 'pw'}", "--auth-local=trust", "--auth-host=scram-sha-256",
                        "-E", "UTF8", "--no-sync"], check=True, capture_output=True, **self.drop)
        self.log = open(self.root / "server.log", "wb")
        self.argv = [str(bindir / "postgres"), "-D", str(self.root / "data"), "-h", "127.0.0.1", "-p", str(self.port),
                     "-k", str(self.root), "-c", "fsync=off", "-c", "synchronous_commit=off",
                     "-c", "full_page_writes=off", "-c", "max_connections=200"]
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     **self.drop)
        self._wait()

    def restart(self, down_s: float) -> None:
        """Stop the server (fast shutdown: every client connection is closed), stay down for
        `down_s` seconds, start it again on the same port and data: what a restart looks like
        to the clients."""
        os.killpg(self.proc.pid, signal.SIGINT)
        self.proc.wait(timeout=60)
        time.sleep(down_s)
        self._start()

    def _wait(self) -> None:
        import psycopg

        def ready() -> bool:
            try:
                psycopg.connect(self.url("postgres"), connect_timeout=2).close()
                return True
            except psycopg.OperationalError:
                return False

        wait_until(ready, self.proc, "postgres", self._tail)

    def _tail(self) -> str:
        self.log.flush()
        return (self.root / "server.log").read_text(errors="replace")[-2000:]

    def url(self, db: str, driver: str = "") -> str:
        return f"postgresql{driver}://testbed:{PASSWORD}@127.0.0.1:{self.port}/{db}"

    def new_database(self, prefix: str) -> str:
        """A fresh, empty database; returns its URL (with the password)."""
        import psycopg

        name = f"{prefix}_{secrets.token_hex(4)}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGINT)  # fast shutdown
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


class MlflowServer:
    """`mlflow server` on loopback over `backend_uri`, artifacts proxied into `workdir/served`."""

    def __init__(self, backend_uri: str, workdir: Path) -> None:
        self.port = free_port()
        self.backend_uri = backend_uri
        self.base = f"http://127.0.0.1:{self.port}"
        self.artifacts = workdir / "served"
        self.workdir = workdir
        self.log = open(workdir / "mlflow-server.log", "wb")
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.backend_uri, "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1", "--artifacts-destination", str(self.artifacts)],
            cwd=self.workdir, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # docs/beyond-one-machine.md

    def restart(self, down_s: float = 0.0) -> None:
        """Stop the server (SIGKILL: it goes away at once, as a crashed or rebooted one does),
        stay down `down_s` seconds, start it again on the same port and store; returns once it answers."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        time.sleep(down_s)
        self._start()
        self.wait_healthy()

    def wait_healthy(self) -> None:
        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(healthy, self.proc, "mlflow server", self._tail)

    def _tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=5)  # holds no data of value: do not wait out uvicorn's graceful exit
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)
        finally:
            self.log.close()


@functools.cache
def own_pid_namespace() -> tuple[str, ...]:
    """The command prefix that gives a process its own pid namespace, as another host has
    (`unshare`, as root), or () where that is not possible."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        return ()
    probe = subprocess.run([unshare, "--pid", "--fork", "--kill-child", "true"], capture_output=True)
    return (unshare, "--pid", "--fork", "--kill-child") if probe.returncode == 0 else ()


class Host:
    """A `testbed` command run as if on its own host: own working folder, own TESTBED_HOST, and
    its own pid namespace where the machine allows it (a pid seen from elsewhere means nothing)."""

    def __init__(self, workdir: Path, host: str, *args: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir, self.name = workdir, host
        env = {**os.environ, "PYTHONPATH": str(REPO), "TESTBED_HOST": host}
        env.pop("TESTBED_WORKER_SESSION", None)
        self.isolated = bool(own_pid_namespace())
        self.proc = subprocess.Popen([*own_pid_namespace(), sys.executable, "-m", "testbed.cli", *args], cwd=workdir,
                                     env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, ls=lines: ls.extend(s), daemon=True).start()

    def wait(self) -> int:
        return self.proc.wait(timeout=WAIT_S)

    @property
    def output(self) -> str:
        return "".join(self.out) + "".join(self.err)

    def send(self, sig: int) -> None:
        """`sig` to the testbed process itself (under `unshare` it is the wrapper's child)."""
        import psutil

        target = psutil.Process(self.proc.pid)
        if self.isolated:
            target = target.children()[0]
        target.send_signal(sig)

    def pause(self, paused: bool) -> None:
        """SIGSTOP (or SIGCONT) every process of this host at once (its own process group)."""
        os.killpg(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # the whole host at once: parent and workers
        self.proc.wait(timeout=WAIT_S)


@pytest.fixture(scope="session")
def postgres():
    server = Postgres()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    from mlflow_db import fresh_mlflow_db

    workdir = tmp_path_factory.mktemp("mlflow-server")
    server = MlflowServer(fresh_mlflow_db(workdir), workdir)
    server.wait_healthy()
    yield server
    server.stop()
