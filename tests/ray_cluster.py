"""A real two-node Ray cluster on this machine for the `services` tests: `ray start --head` and a
second `ray start --address=...` node, each a `--block` process this helper owns (terminating it
stops that node), each started in its own empty folder so that a task writing to a relative
path would show up there. Small on purpose: one CPU and a 100 MB object store per node, no
dashboard, node addresses on loopback."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

READY_TIMEOUT_S = 90.0
STORE_BYTES = 100_000_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalCluster:
    """The cluster: its GCS address, the folders its nodes started in, the processes."""

    address: str
    root: Path
    node_dirs: list[Path]
    procs: list[subprocess.Popen] = field(default_factory=list)
    hidden: Path | None = None  # a folder the driver sees and no node does (None: not possible here)

    def stop(self) -> None:
        for p in reversed(self.procs):  # the second node first, then the head
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        _kill_leftovers(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _kill_leftovers(root: Path) -> None:
    """Processes of this cluster only (their command line names its private temp folder)."""
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (pid_dir / "cmdline").read_bytes()
        except OSError:
            continue
        if str(root).encode() in cmd and int(pid_dir.name) != os.getpid():
            try:
                os.kill(int(pid_dir.name), signal.SIGKILL)
            except OSError:
                pass


def start_cluster() -> LocalCluster:
    # Ray's unix sockets live under RAY_TMPDIR: a short path (a 107-byte limit), private to this cluster
    root = Path(tempfile.mkdtemp(prefix="rayt", dir="/tmp"))
    env = {**os.environ, "RAY_TMPDIR": str(root / "t"), "RAY_USAGE_STATS_ENABLED": "0"}
    (root / "t").mkdir()
    port = _free_port()
    common = ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", f"--object-store-memory={STORE_BYTES}",
              "--disable-usage-stats"]
    cluster = LocalCluster(f"127.0.0.1:{port}", root, [root / "head", root / "node2"])
    for d in cluster.node_dirs:
        d.mkdir()
    wrap = _hiding(root / "driver-only")
    if wrap:
        cluster.hidden = root / "driver-only"
    log = open(root / "ray.log", "ab")
    cluster.procs.append(subprocess.Popen([*wrap, _ray_cli(), "start", "--head", f"--port={port}", "--include-dashboard=false",
                                           *common], cwd=cluster.node_dirs[0], env=env, stdout=log, stderr=log))
    try:
        _wait_for_port(cluster)
        cluster.procs.append(subprocess.Popen([*wrap, _ray_cli(), "start", f"--address={cluster.address}", *common],
                                              cwd=cluster.node_dirs[1], env=env, stdout=log, stderr=log))
        _wait_for(cluster, 2)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _hiding(folder: Path) -> list[str]:
    """The command prefix that starts a node in a private mount namespace where `folder` is an
    empty tmpfs, as on a host without the driver's filesystem ([] where the machine cannot:
    not root, or no `unshare`). `folder` is made here; its processes (raylet, workers) inherit
    the namespace."""
    folder.mkdir()
    if not shutil.which("unshare") or os.geteuid() != 0:
        return []
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs none '{folder}'"], capture_output=True)
    if probe.returncode:
        return []
    return ["unshare", "-m", "sh", "-c", f"mount -t tmpfs none '{folder}' && exec \"$@\"", "sh"]


def _wait_for_port(cluster: LocalCluster) -> None:
    """Until the head's GCS port accepts connections: the second node can join from then on
    (`ray start --address` waits for the rest itself), so one probe process (≈1.5 s of CPU, a
    Ray driver) checks both nodes instead of one per node."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if cluster.procs[0].poll() is not None:
            raise RuntimeError(f"the ray head exited: {(cluster.root / 'ray.log').read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", int(cluster.address.rsplit(':', 1)[1])), timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the ray head did not listen within {READY_TIMEOUT_S:.0f} s")


def _wait_for(cluster: LocalCluster, nodes: int) -> None:
    """Until the cluster lists `nodes` live nodes (checked by a short-lived client process, so this
    one never holds a Ray connection the tests would then share)."""
    probe = ("import ray,sys,time; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n"
             "end = time.monotonic() + 30\n"  # a joining node shows up in ~1 s; one driver waits for it
             "while sum(1 for n in ray.nodes() if n['Alive']) < int(sys.argv[2]) and time.monotonic() < end:\n"
             "    time.sleep(0.2)\n"
             "print(sum(1 for n in ray.nodes() if n['Alive']))")
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in cluster.procs):
            raise RuntimeError(f"a ray node exited: {(cluster.root / 'ray.log').read_text()[-2000:]}")
        try:  # the head listens (`_wait_for_port`); the probe waits for the nodes itself
            out = subprocess.run([sys.executable, "-c", probe, cluster.address, str(nodes)], capture_output=True, text=True,
                                 timeout=60, env={**os.environ, "RAY_TMPDIR": str(cluster.root / "t")})
            if out.stdout.strip().isdigit() and int(out.stdout.strip()) >= nodes:
                return
        except (OSError, subprocess.TimeoutExpired):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the ray cluster did not show {nodes} node(s) within {READY_TIMEOUT_S:.0f} s")
