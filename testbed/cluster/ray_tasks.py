"""Sweep points and tuning trials as Ray tasks (`sweep.backend=ray`, testbed/cluster/ray_backend.py).

What travels: a point is the sweep's `Job` (a frozen dataclass of plain data: the composed
config as a dict, names, paths) and comes back as its row (a dict of numbers and strings); a
trial is the study's `Problem` plus its Optuna trial id, and comes back as the trial's event.
Ray's own task transport carries them; nothing of ours is pickled onto a socket.

Paths. A Ray worker's working directory is wherever its node was started, not the driver's, so
every path a job names (`output.dir`, its run directory, `data_dir`, the table-model cache) is
made absolute here before the job leaves (`portable`): a relative `runs/` would otherwise land
beside each node's `ray start`. The data directory the CLI found (`$TESTBED_DATA_DIR`, set from
../shared/data) becomes the job's `data_dir`: workers have their node's environment, not ours.

Workload files. The driver builds each workload's request list once (`resolved_requests`) and
puts it in Ray's object store; each task runs on it, so a node needs no workload files: before,
every point placed on a host without the driver's files failed ("does not exist", issue 38
item 4). A table model's checkpoint goes to the node's own cache (`on_this_node`). Run
directories are written at the driver's absolute path on the node that ran the point: on
several hosts a shared filesystem, or an `mlflow server` that stores the artifacts, brings them
together; docs/beyond-one-machine.md says which.

Results are the same as local ones: the task runs `sweep.run_point`, the very function a local
worker runs (handed down by testbed/sweep/ray_points.py; tuning trials: testbed/tune/ray_trials.py), on the same config and seed, so a simulated point's summary is bit-identical
whatever the backend (tests/test_ray_cluster.py compares them).
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine.base.errors import TestbedError
from testbed.cluster.ray_backend import SweepBackend, connected, task_resources
from testbed.cluster.ray_head import HeadWatch, NoWatch, head_watch
from testbed.signals import deferred_stop
from workloads.base import workload_key

POLL_S = 0.5


def absolute(value: Any) -> Any:
    return os.path.abspath(os.path.expanduser(value)) if isinstance(value, str) and value else value


def portable_spec(spec: Any) -> Any:
    """The RunSpec with every path made absolute (resolved against this process's cwd), and the
    data directory the CLI found named explicitly: a Ray worker has its node's cwd and environment."""
    values: dict[str, Any] = {"output.dir": absolute(spec.output.dir)}
    if spec.data_dir:  # data_dir=, else $TESTBED_DATA_DIR here
        values["data_dir"] = absolute(spec.data_dir)
    cache = getattr(spec.settings.executor.settings, "model_cache_dir", None)
    if cache:
        values["executor.model_cache_dir"] = absolute(cache)
    return spec.with_values(values)


def portable(job: Any) -> Any:
    """A sweep job whose paths mean the same on any node of this machine's filesystem."""
    return dataclasses.replace(job, spec=portable_spec(job.spec), run_dir=absolute(job.run_dir))


def resolved_requests(spec: Any) -> tuple:
    """The point's requests, built here on the driver from the workload files it can read."""
    from workloads.base import build_workload

    return tuple(build_workload(spec.workload, spec.data_dir))


def on_this_node(spec: Any) -> Any:
    """The spec as a Ray task runs it: a table model's checkpoint (`executor=torch` on CPU) is
    written to this node's own cache (`<cache>/testbed/models`) unless `executor.model_cache_dir`
    names a folder; before, it went under the driver's `output.dir`, a path another host may not
    have. A real checkpoint (`model=/path`) must exist at the same path on every node."""
    if spec.settings.executor.name != "torch" or getattr(spec.settings.executor.settings, "model_cache_dir", None):
        return spec
    from workloads.data import cache_dir

    return spec.with_values({"executor.model_cache_dir": str(cache_dir().parent / "models")})


def remote_pool(backend: SweepBackend | None, task: Callable[[Any], dict],
                failed: Callable[[Any, str], dict]) -> Callable[[Sequence[Any]], RayPool] | None:
    """`sweep.run_jobs`'s pool for sweep.backend=ray (None: the local workers), running `task` on
    each job (the sweep hands its own down: testbed/sweep/ray_points.py). Importing this module
    imports no Ray: that happens when the pool connects."""
    if backend is None or not backend.remote:
        return None
    return lambda jobs: RayPool(jobs, backend, task, failed)


class RayPool:
    """The sweep's jobs as Ray tasks, with `WorkerPool`'s interface (`run(done)`, where `done`
    may return further jobs, as a capacity search does). Ray decides how many run at once from
    each task's resources; `stop()` cancels whatever is still queued or running. `task` runs one
    job in a Ray worker and returns its row; `failed(job, why)` is the row of a job whose task was
    lost. Both come from the sweep above (this folder does not import it back)."""

    def __init__(self, jobs: Sequence[Any], settings: SweepBackend, task: Callable[[Any], dict],
                 failed: Callable[[Any, str], dict]) -> None:
        self.jobs = list(jobs)
        self.settings = settings
        self.task = task
        self.failed = failed
        self.refs: dict[Any, Any] = {}  # ObjectRef -> job
        self.remotes: dict[tuple, Any] = {}  # resources -> the task as a Ray remote function
        self.requests: dict[str, Any] = {}  # workload_key -> ObjectRef of its request list (one copy each)
        self.ray: Any = None
        self.head: HeadWatch | NoWatch | None = None  # cluster/ray_head.py: the head probed every round
        self.backlog: list[Any] = []  # jobs that came while the head was away: submitted once it is back

    def submit(self, job: Any) -> None:
        job = portable(job)
        key = workload_key(job.spec.workload, job.spec.data_dir)  # points that share a workload share one copy
        if key not in self.requests:  # a workload that cannot be built fails its points, as locally
            try:
                self.requests[key] = self.ray.put(resolved_requests(job.spec))
            except TestbedError:
                self.requests[key] = None
        job = dataclasses.replace(job, requests=self.requests[key])
        need = task_resources(job.spec)
        key = tuple(sorted(need.items()))
        if key not in self.remotes:  # one remote function per kind of point, not one export per point
            self.remotes[key] = self.ray.remote(max_retries=self.settings.retries, **need)(self.task)
        self.refs[self.remotes[key].remote(job)] = job

    def run(self, done: Callable[[dict], Sequence[Any] | None]) -> None:
        """Never waits in Ray more than POLL_S at a time: each round the head is probed
        (`HeadLost` once it stayed away the reconnect window) and a stop is checked."""
        with connected(self.settings) as ray, deferred_stop() as stop:
            self.ray, self.head = ray, head_watch(ray, self.settings.address)
            self.backlog = list(self.jobs)
            try:
                while self.refs or self.backlog:
                    while self.backlog and not self.head.down:
                        self.submit(self.backlog.pop(0))
                    ready = self.ready()
                    self.head.check()
                    stop.check()
                    for ref in ready:
                        job = self.refs.pop(ref)
                        try:
                            row = ray.get(ref)
                        except ray.exceptions.RayError as exc:  # retries spent, or the task raised
                            row = self.failed(job, f"ray: {first_line(exc)}")
                        self.backlog.extend(done(row) or ())
            finally:
                self.stop()

    def ready(self) -> list[Any]:
        if not self.refs:  # only a backlog, waiting for the head
            time.sleep(POLL_S)
            return []
        return self.ray.wait(list(self.refs), num_returns=1, timeout=POLL_S)[0]

    def stop(self) -> None:
        """Cancel every task not yet returned (force: a running point's worker is killed; the
        sweep's summary run then ends its point runs KILLED, as after a local interrupt)."""
        lost = self.head is not None and self.head.given_up  # a head given up on: no Ray call again
        for ref in list(self.refs) if not lost else ():
            try:
                self.ray.cancel(ref, force=True)
            except Exception:  # already finished, or the cluster is gone
                pass
        self.refs.clear()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][:500] if lines else type(exc).__name__
