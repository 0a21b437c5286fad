"""Where a sweep's points and a study's trials run: here (`sweep.backend=local`, the default:
this process or `compare.workers` spawned processes) or on a Ray cluster (`sweep.backend=ray`).

The project adds no scheduler of its own (DESIGN.md: existing engines do the distribution).
On Ray each grid point, capacity probe or tuning trial is one Ray task declaring what it needs
(`task_resources`: a CPU for the simulator, a CPU per stage for `executor=torch` on CPU, a GPU
for `executor=torch` on CUDA), so Ray packs them onto the cluster's nodes; a task whose worker
or node is lost is run again by Ray (`ray.retries`, Ray's `max_retries` for system failures);
Ctrl-C or SIGTERM cancels every task still queued or running (`ray.cancel(force=True)`).

    testbed compare policy=gllm,vllm workload.rate=2,4 sweep.backend=ray              # ray.address=auto
    testbed tune policy=gllm tune.trials=40 tune.workers=8 sweep.backend=ray ray.address=10.0.0.5:6379

Keys (split off before the config is composed, like `compare.*`): `sweep.backend` (local, ray),
`ray.address` (`auto`: the cluster `ray start` runs on this machine, else HOST:PORT or
ray://HOST:PORT), `ray.retries` (default 2). Ray is an optional extra (`pip install -e '.[ray]'`,
which `./tb` installs); without it `sweep.backend=ray` is one `error:` line, exit 2.
"""
from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from engine.base.errors import ConfigError
from testbed.cluster.ray_head import given_up, raise_ray_limit
from testbed.config.overrides import as_int, split_prefixed

BACKENDS = ("local", "ray")
RAY_KEYS = ("address", "retries")
PROBE_TIMEOUT_S = 5.0
INSTALL_HINT = "pip install -e '.[ray]' (or pip install 'ray>=2.40')"


@dataclass(frozen=True)
class SweepBackend:
    """Typed `sweep.backend` / `ray.*` settings of one command."""

    backend: str = "local"
    address: str = "auto"  # ray.init(address=...): auto = the cluster started on this machine by `ray start`
    retries: int = 2  # Ray re-runs a task whose worker or node died this many times

    @property
    def remote(self) -> bool:
        return self.backend == "ray"


def split_backend(overrides: Sequence[str]) -> tuple[SweepBackend, list[str]]:
    """Take `sweep.*` and `ray.*` out of a command's overrides; (settings, the rest)."""
    sweep_raw, rest = split_prefixed(overrides, "sweep")
    ray_raw, rest = split_prefixed(rest, "ray")
    for key in sweep_raw:
        if key != "backend":
            raise ConfigError(f"unknown key sweep.{key}; valid keys: sweep.backend")
    backend = sweep_raw.get("backend", "local").strip()
    if backend not in BACKENDS:
        raise ConfigError(f"invalid sweep.backend={backend!r}; valid choices: {', '.join(BACKENDS)}")
    for key in ray_raw:
        if key not in RAY_KEYS:
            raise ConfigError(f"unknown key ray.{key}; valid keys: {', '.join('ray.' + k for k in RAY_KEYS)}")
    if ray_raw and backend != "ray":
        raise ConfigError(f"ray.{next(iter(ray_raw))} is set but sweep.backend={backend}; valid choices: "
                          f"add sweep.backend=ray, or drop the ray.* keys")
    kw: dict[str, Any] = {"backend": backend}
    if "address" in ray_raw:
        address = ray_raw["address"].strip()
        if not address:
            raise ConfigError("invalid ray.address='': auto, HOST:PORT or ray://HOST:PORT")
        kw["address"] = address
    if "retries" in ray_raw:
        kw["retries"] = as_int("ray.retries", ray_raw["retries"], 0)
    settings = SweepBackend(**kw)
    if settings.remote:  # a missing Ray or a dead address is refused before anything runs
        import_ray()
        probe(settings.address)
    return settings, rest


def import_ray() -> Any:
    """The `ray` module, or one `error:` line naming what to install."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"sweep.backend=ray needs Ray, which is not installed here ({exc}); install it with "
                          f"{INSTALL_HINT}, or use sweep.backend=local") from None
    return ray


@contextmanager
def connected(settings: SweepBackend) -> Iterator[Any]:
    """Ray connected to `ray.address` for the block (left as it was if this process already is:
    a test's session cluster, a notebook). An unreachable address is one `error:` line."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    probe(settings.address)
    raise_ray_limit()  # Ray would end this process 60 s after its head died, before our own check
    try:
        ray.init(address=settings.address, log_to_driver=False, logging_level="ERROR",
                 include_dashboard=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"cannot reach a Ray cluster at ray.address={settings.address!r}: {first}; start one "
                          f"with `ray start --head` (then ray.address=auto) or name HOST:PORT") from None
    try:
        yield ray
    except BaseException as exc:
        if not given_up(exc):  # a head given up on: no Ray call again (cluster/ray_head.py)
            ray.shutdown()
        raise
    ray.shutdown()


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Refuse an address nothing listens on at once: `ray.init` retries an unreachable GCS for
    minutes (measured: still retrying after 10 min for 127.0.0.1:1)."""
    if address == "auto" or address.startswith("ray://") or address.count(":") != 1:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
            answer = _http2_answer(conn)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot reach a Ray cluster at ray.address={address!r} ({exc}); start one with "
                          f"`ray start --head` (then ray.address=auto) or name HOST:PORT of its head") from None
    if not (len(answer) >= 4 and answer[3] == HTTP2_SETTINGS):
        said = answer[:40].decode("ascii", "replace").splitlines()[0] if answer.strip() else "nothing"
        raise ConfigError(f"ray.address={address!r} is not a Ray cluster's head: it answered {said!r} (Ray's GCS "
                          f"speaks gRPC); name HOST:PORT of the head (`ray start --head --port=6379`) or ray.address=auto")


# Ray's GCS is a gRPC server: it answers any connection with an HTTP/2 SETTINGS frame (type 4, the
# frame header's 4th byte). Any other listener passed the TCP probe and `ray.init` then retried it
# for 260 s, deaf to SIGTERM (issue 48 item 5: a live HTTP port).
HTTP2_SETTINGS = 0x04
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _http2_answer(conn: socket.socket) -> bytes:
    """The first bytes a listener answers an HTTP/2 client preface with (b"" if it closes or
    stays silent for the connection's timeout)."""
    conn.sendall(HTTP2_PREFACE)
    try:
        return conn.recv(64)
    except (TimeoutError, socket.timeout, ConnectionError):
        return b""


def task_resources(spec: Any) -> dict[str, float]:
    """What one point or trial (a RunSpec) asks the cluster for: the simulator is one process on
    one CPU; the real engine on CPU runs P stage processes (`executor.threads_per_stage` threads
    each); on CUDA one GPU, which its P stages share (over gloo: NCCL refuses two ranks on one GPU)."""
    ex = spec.settings.executor
    if ex.name != "torch":
        return {"num_cpus": 1}
    if ex.settings.device == "cuda":
        return {"num_cpus": 1, "num_gpus": 1}
    return {"num_cpus": spec.settings.parallel.pp * ex.settings.threads_per_stage}
