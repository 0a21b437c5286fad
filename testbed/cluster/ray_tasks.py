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
worker runs, on the same config and seed, so a simulated point's summary is bit-identical
whatever the backend (tests/test_ray_cluster.py compares them).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine.base.errors import TestbedError
from testbed.cluster.ray_backend import SweepBackend, connected, task_resources
from testbed.signals import deferred_stop
from workloads.base import workload_key

POLL_S = 0.5


def _absolute(value: Any) -> Any:
    return os.path.abspath(os.path.expanduser(value)) if isinstance(value, str) and value else value


def portable_spec(spec: Any) -> Any:
    """The RunSpec with every path made absolute (resolved against this process's cwd), and the
    data directory the CLI found named explicitly: a Ray worker has its node's cwd and environment."""
    values: dict[str, Any] = {"output.dir": _absolute(spec.output.dir)}
    if spec.data_dir:  # data_dir=, else $TESTBED_DATA_DIR here
        values["data_dir"] = _absolute(spec.data_dir)
    cache = getattr(spec.settings.executor.settings, "model_cache_dir", None)
    if cache:
        values["executor.model_cache_dir"] = _absolute(cache)
    return spec.with_values(values)


def portable(job: Any) -> Any:
    """A sweep job whose paths mean the same on any node of this machine's filesystem."""
    return dataclasses.replace(job, spec=portable_spec(job.spec), run_dir=_absolute(job.run_dir))


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


def _run_point(job: Any) -> dict:
    """`sweep.run_point` in a Ray worker; its MLflow run is tagged with where it ran
    (`testbed.ray_node`: the node id, `testbed.worker`: host:pid), to trace a point to a node.
    Its requests came with the job (resolved on the driver), so the node needs no workload files."""
    import ray

    from testbed.sweep.jobs import run_point

    requests = ray.get(job.requests) if isinstance(job.requests, ray.ObjectRef) else job.requests
    here = {"testbed.backend": "ray", "testbed.ray_node": ray.get_runtime_context().get_node_id(),
            "testbed.worker": f"{socket.gethostname()}:{os.getpid()}"}
    return run_point(dataclasses.replace(job, spec=on_this_node(job.spec), requests=requests,
                                         tags={**job.tags, **here}))


def remote_pool(backend: SweepBackend | None) -> Callable[[Sequence[Any]], RayPool] | None:
    """`sweep.run_jobs`'s pool for sweep.backend=ray (None: the local workers). Importing this
    module imports no Ray: that happens when the pool connects."""
    if backend is None or not backend.remote:
        return None
    return lambda jobs: RayPool(jobs, backend)


class RayPool:
    """The sweep's jobs as Ray tasks, with `WorkerPool`'s interface (`run(done)`, where `done`
    may return further jobs, as a capacity search does). Ray decides how many run at once from
    each task's resources; `stop()` cancels whatever is still queued or running."""

    def __init__(self, jobs: Sequence[Any], settings: SweepBackend,
                 task: Callable[[Any], dict] = _run_point) -> None:
        self.jobs = list(jobs)
        self.settings = settings
        self.task = task
        self.refs: dict[Any, Any] = {}  # ObjectRef -> job
        self.remotes: dict[tuple, Any] = {}  # resources -> the task as a Ray remote function
        self.requests: dict[str, Any] = {}  # workload_key -> ObjectRef of its request list (one copy each)
        self.ray: Any = None

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
        from testbed.sweep.jobs import failed_row

        with connected(self.settings) as ray, deferred_stop() as stop:
            self.ray = ray
            try:
                for job in self.jobs:
                    self.submit(job)
                while self.refs:
                    ready, _ = ray.wait(list(self.refs), num_returns=1, timeout=POLL_S)
                    stop.check()
                    for ref in ready:
                        job = self.refs.pop(ref)
                        try:
                            row = ray.get(ref)
                        except ray.exceptions.RayError as exc:  # retries spent, or the task raised
                            row = failed_row(job, f"ray: {_first_line(exc)}")
                        for new in done(row) or ():
                            self.submit(new)
            finally:
                self.stop()

    def stop(self) -> None:
        """Cancel every task not yet returned (force: a running point's worker is killed; the
        sweep's summary run then ends its point runs KILLED, as after a local interrupt)."""
        for ref in list(self.refs):
            try:
                self.ray.cancel(ref, force=True)
            except Exception:  # already finished, or the cluster is gone
                pass
        self.refs.clear()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][:500] if lines else type(exc).__name__


# --- tuning trials ---------------------------------------------------------------------------------

def run_trial(problem: Any, trial_id: int, number: int, requests: Any = None) -> dict:
    """One trial asked by the driver, run in a Ray worker against the study's own storage (the
    same SQLite file on this machine, or PostgreSQL across hosts): suggest, run, log, tell.
    The sampler is seeded per trial (`tune.seed` + trial number), so a retried trial draws the
    same values. `requests`: the base workload's requests, resolved on the driver (a trial that
    tunes a workload key builds its own on the node)."""
    import optuna

    from testbed.tune.storage import make_sampler, make_storage, quiet_optuna
    from testbed.tune.trial import TrialRunner

    quiet_optuna()
    s = problem.settings
    study = optuna.load_study(study_name=problem.study, storage=make_storage(problem.storage_url),
                              sampler=make_sampler(s.sampler, problem.seed + number, s.startup_trials))
    study.get_trials(deepcopy=False)  # Optuna's storage cache learns the trial (else set_trial_param: KeyError)
    problem = dataclasses.replace(problem, base=on_this_node(problem.base))
    runner, trial = TrialRunner(problem), optuna.trial.Trial(study, trial_id)
    if requests is not None:
        runner.preload(problem.base, list(requests))
    runner.claim(trial)  # a task lost before this is marked interrupted by the driver (`_RayTrials`)
    return runner.run(study, trial)


def run_trials_on_ray(problem: Any, emit: Callable[[dict], None], settings: SweepBackend) -> tuple[int, list[str]]:
    """Ask trials here (count-then-ask in one process: never more than `tune.trials`), run each
    as a Ray task, at most `tune.workers` at once; (trials run, errors). A trial whose task was
    cancelled (Ctrl-C) or lost for good is marked interrupted + FAILED here, on whatever host it
    ran: it does not count toward `tune.trials`, and the same command runs it again."""
    import optuna

    from testbed.tune.storage import make_storage

    problem = dataclasses.replace(problem, base=portable_spec(problem.base),
                                  out_dir=_absolute(problem.out_dir), storage_url=_storage_url(problem.storage_url))
    study = optuna.load_study(study_name=problem.study, storage=make_storage(problem.storage_url))
    with connected(settings) as ray, deferred_stop() as stop:
        trials = _RayTrials(ray, problem, study, settings)
        try:
            while trials.fill():
                trials.collect(emit)
                stop.check()
        finally:
            trials.cancel()
    return trials.count, trials.errors


class _RayTrials:
    """The trials in flight on the cluster (ObjectRef -> Optuna trial)."""

    def __init__(self, ray: Any, problem: Any, study: Any, settings: SweepBackend) -> None:
        self.ray, self.problem, self.study = ray, problem, study
        self.remote = ray.remote(max_retries=settings.retries, **task_resources(problem.base))(run_trial)
        try:  # shipped once, so a node needs no workload files (the trials resolve it to the list)
            self.requests = ray.put(resolved_requests(problem.base))
        except TestbedError:  # the driver cannot build it: each trial fails (or builds it) on its node
            self.requests = None
        timeout = problem.settings.timeout
        self.deadline = time.monotonic() + timeout if timeout else None
        self.refs: dict[Any, Any] = {}
        self.count = 0
        self.errors: list[str] = []

    def fill(self) -> bool:
        """Ask and submit trials up to `tune.workers` in flight; False once none is left to wait for."""
        from testbed.tune.storage import counted

        s = self.problem.settings
        open_slots = self.deadline is None or time.monotonic() < self.deadline
        while open_slots and len(self.refs) < s.workers and counted(self.study.get_trials(deepcopy=False)) < s.trials:
            trial = self.study.ask()
            self.refs[self.remote.remote(self.problem, trial._trial_id, trial.number, self.requests)] = trial
        return bool(self.refs)

    def collect(self, emit: Callable[[dict], None]) -> None:
        ready, _ = self.ray.wait(list(self.refs), num_returns=1, timeout=POLL_S)
        for ref in ready:
            trial = self.refs.pop(ref)
            try:
                emit(self.ray.get(ref))
                self.count += 1
            except self.ray.exceptions.RayError as exc:  # retries spent, or a bug in the trial's process
                self.errors.append(f"trial {trial.number}: {_first_line(exc)}")
                _interrupted(self.study, [trial], "its Ray task was lost")

    def cancel(self) -> None:
        for ref in self.refs:
            self.ray.cancel(ref, force=True)
        _interrupted(self.study, list(self.refs.values()), "its Ray task was cancelled")
        self.refs.clear()


def _interrupted(study: Any, trials: Sequence[Any], why: str) -> None:
    """Mark these trials interrupted + FAILED unless they finished meanwhile."""
    from testbed.tune.storage import INTERRUPTED, mark_interrupted

    for trial in trials:
        mark_interrupted(study._storage, trial._trial_id, f"{INTERRUPTED}: {why}")


def _storage_url(url: str) -> str:
    """A relative SQLite or journal path made absolute (Ray workers start elsewhere)."""
    for prefix in ("sqlite:///", "journal:"):
        if url.startswith(prefix) and not url[len(prefix):].startswith("/"):
            return prefix + _absolute(url[len(prefix):])
    return url
