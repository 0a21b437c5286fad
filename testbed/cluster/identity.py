"""Who ran what: a host name for tags and table columns, and worker identities that are not
host names. Two hosts may share a name (two containers from one image, two clones imitating two
hosts): identities keyed by the host name made one host fail the other's live trial (issue 24
item 5). A worker's identity is `<session>.<index>`, the session a random token made once per
command and inherited by its spawned workers; the host name is recorded beside it, never used to
decide ownership. A pid is only compared with pids of the same pid namespace on the same boot
(`local_namespace`), where it means something."""
from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

HOST_ENV = "TESTBED_HOST"  # a host name to record instead of the machine's (containers named alike)
SESSION_ENV = "TESTBED_WORKER_SESSION"  # set by the first process, inherited by spawned workers


def host_name() -> str:
    """The host name recorded in the `host` tag of every run and the `host` column of reports."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def session_id() -> str:
    """This command's random token, shared by the workers it spawns (they inherit the environment)."""
    sid = os.environ.get(SESSION_ENV)
    if not sid:
        sid = f"{host_name()}-{secrets.token_hex(4)}"
        os.environ[SESSION_ENV] = sid
    return sid


def new_session() -> str:
    """A fresh session token for a new command run in the same process (tests call main() twice)."""
    os.environ.pop(SESSION_ENV, None)
    return session_id()


def local_namespace() -> str:
    """Where a pid means this process table: the boot id and the pid namespace. Two containers
    (or hosts) that share a host name still differ here."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = "-"
    return f"{boot}:{ns}"


@dataclass(frozen=True)
class WorkerIdentity:
    """One worker process of one command: `id` is unique across hosts, `host` is only shown."""

    session: str
    index: int
    host: str
    pid: int
    namespace: str

    @property
    def id(self) -> str:
        return f"{self.session}.{self.index}"

    def process(self) -> dict[str, object]:
        """Where this worker runs, recorded once per worker in the study (`register`)."""
        return {"host": self.host, "pid": self.pid, "namespace": self.namespace}

    def tags(self) -> dict[str, str]:
        """MLflow tags of a run this worker opens (the `host` tag comes with every run)."""
        return {"worker": self.id, "testbed.session": self.session}


def this_worker(index: int) -> WorkerIdentity:
    return WorkerIdentity(session_id(), index, host_name(), os.getpid(), local_namespace())


def register(study, worker: WorkerIdentity) -> None:
    """Record the worker's process in the study's user attributes (`worker:<id>`), once per
    worker: a trial then carries only its worker id, one commit before its run starts, as
    before (a second commit per trial widened the window in which a stop finds a trial with no
    MLflow run yet)."""
    study.set_user_attr(f"worker:{worker.id}", worker.process())


def owned_by_dead_local_process(trial_attrs: dict, study_attrs: dict) -> bool:
    """True when a trial's worker ran in this pid namespace and its process is gone: only then
    can it be failed at once, without waiting for its heartbeat to go stale."""
    return dead_local_process(study_attrs.get(f"worker:{trial_attrs.get('worker')}") or {})


def no_live_worker_but_me(study_attrs: dict) -> bool:
    """True when every worker registered in the study ran in this pid namespace and is gone,
    this process excepted. A RUNNING trial with no `worker` attribute was asked for by a worker
    that died before it claimed it (a SIGKILL or the orphan's exit between Optuna's `ask` and the
    claim's commit); with SQLite no heartbeat recovers it, so it stayed RUNNING for good (a
    fresh-clone CI failure, 1 in 3 runs). Only when no other worker can be in that window may it
    be failed; a worker of another host or namespace (or a live local one) keeps it waiting."""
    me = os.getpid()
    for key, where in study_attrs.items():
        if not key.startswith("worker:") or not isinstance(where, dict):
            continue
        if where.get("namespace") == local_namespace() and where.get("pid") == me:
            continue
        if not dead_local_process(where):
            return False
    return True


def dead_local_process(where: dict) -> bool:
    """True when `where` ({"namespace", "pid"}, as `WorkerIdentity.process` records it) names a
    process of this pid namespace that is gone."""
    if where.get("namespace") != local_namespace():
        return False
    pid = where.get("pid")
    return isinstance(pid, int) and not process_alive(pid)


def process_alive(pid: int) -> bool:
    """A zombie is dead: a SIGKILLed command stays one until its shell reaps it, and its orphaned
    workers end its runs in that window (sweep/orphans.py `orphan_guard`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
