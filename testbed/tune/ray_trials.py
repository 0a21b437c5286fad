"""Tuning trials as Ray tasks (`sweep.backend=ray` with `testbed tune`): the driver asks Optuna
for trials and runs each as a task against the study's own storage. The cluster's part (paths made
absolute, requests resolved on the driver, a table model's cache on each node) is
testbed/cluster/ray_tasks.py; this tuning half lives here, so that folder never imports tune/."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import optuna

from engine.base.errors import TestbedError
from testbed.cluster.ray_backend import SweepBackend, connected, task_resources
from testbed.cluster.ray_head import head_watch
from testbed.cluster.ray_tasks import POLL_S, absolute, first_line, on_this_node, portable_spec, resolved_requests
from testbed.signals import deferred_stop
from testbed.tune.storage import INTERRUPTED, counted, make_sampler, make_storage, mark_interrupted, quiet_optuna
from testbed.tune.trial import TrialRunner


def run_trial(problem: Any, trial_id: int, number: int, requests: Any = None) -> dict:
    """One trial asked by the driver, run in a Ray worker against the study's own storage (the
    same SQLite file on this machine, or PostgreSQL across hosts): suggest, run, log, tell.
    The sampler is seeded per trial (`tune.seed` + trial number), so a retried trial draws the
    same values. `requests`: the base workload's requests, resolved on the driver (a trial that
    tunes a workload key builds its own on the node)."""
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
    problem = dataclasses.replace(problem, base=portable_spec(problem.base),
                                  out_dir=absolute(problem.out_dir), storage_url=_storage_url(problem.storage_url))
    study = optuna.load_study(study_name=problem.study, storage=make_storage(problem.storage_url))
    with connected(settings) as ray, deferred_stop() as stop:
        trials = _RayTrials(ray, problem, study, settings)
        head = head_watch(ray, settings.address)  # HeadLost once the head stayed away (cluster/ray_head.py)
        try:
            while trials.fill(paused=head.down):
                trials.collect(emit)
                head.check()
                stop.check()
        finally:
            trials.cancel(calls=not head.given_up)  # a head given up on: no Ray call again
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

    def fill(self, paused: bool = False) -> bool:
        """Ask and submit trials up to `tune.workers` in flight; False once none is left to wait
        for. `paused` (the head is away): nothing is submitted, and the loop goes on waiting."""
        if paused:
            return True
        s = self.problem.settings
        open_slots = self.deadline is None or time.monotonic() < self.deadline
        while open_slots and len(self.refs) < s.workers and counted(self.study.get_trials(deepcopy=False)) < s.trials:
            trial = self.study.ask()
            self.refs[self.remote.remote(self.problem, trial._trial_id, trial.number, self.requests)] = trial
        return bool(self.refs)

    def collect(self, emit: Callable[[dict], None]) -> None:
        if not self.refs:  # the head is away and nothing is in flight
            time.sleep(POLL_S)
            return
        ready, _ = self.ray.wait(list(self.refs), num_returns=1, timeout=POLL_S)
        for ref in ready:
            trial = self.refs.pop(ref)
            try:
                emit(self.ray.get(ref))
                self.count += 1
            except self.ray.exceptions.RayError as exc:  # retries spent, or a bug in the trial's process
                self.errors.append(f"trial {trial.number}: {first_line(exc)}")
                _interrupted(self.study, [trial], "its Ray task was lost")

    def cancel(self, calls: bool = True) -> None:
        """Cancel the trials in flight (`calls`: through Ray, unless its head was given up on) and
        mark them interrupted."""
        for ref in self.refs if calls else ():
            self.ray.cancel(ref, force=True)
        _interrupted(self.study, list(self.refs.values()), "its Ray task was cancelled")
        self.refs.clear()


def _interrupted(study: Any, trials: Sequence[Any], why: str) -> None:
    """Mark these trials interrupted + FAILED unless they finished meanwhile."""
    for trial in trials:
        mark_interrupted(study._storage, trial._trial_id, f"{INTERRUPTED}: {why}")


def _storage_url(url: str) -> str:
    """A relative SQLite or journal path made absolute (Ray workers start elsewhere)."""
    for prefix in ("sqlite:///", "journal:"):
        if url.startswith(prefix) and not url[len(prefix):].startswith("/"):
            return prefix + absolute(url[len(prefix):])
    return url
