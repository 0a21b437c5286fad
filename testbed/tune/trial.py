"""One trial in one process: suggest, build, run, log to MLflow, tell the study.

A trial whose sampled config is invalid (ConfigError from building the run), whose run fails,
or whose objective is NaN is told FAILED with its reason in the user attribute `fail_reason`
(also the `error` tag of its MLflow run), and the study goes on. A trial interrupted by Ctrl-C
or SIGTERM is marked FAILED with `fail_reason` "interrupted" (it does not count toward
`tune.trials`) and its MLflow run ends KILLED."""
from __future__ import annotations

import json
import math
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from engine.base.errors import TestbedError
from testbed.cluster import heartbeat, identity, unwritten
from testbed.cluster.artifacts import ArtifactStoreError
from testbed.cluster.reconnect import ServiceLost
from testbed.config.naming import point_name
from testbed.run.outputs import write_run_dir
from testbed.run.runner import prepare_experiment
from testbed.signals import raise_if_stopped, stop_exception, stopped_by
from testbed.config.spec import RunSpec
from testbed.tracking.tracker import Tracker, run_tags
from testbed.tune.problem import Problem, jsonable
from testbed.tune.storage import INTERRUPTED, heartbeat_of, mark_interrupted
from workloads.base import build_workload, workload_key

TRIAL_SUMMARY_KEYS = ("throughput_tok_s", "ttft_p99_s", "tpot_p99_s", "e2el_mean_s", "slo_attainment",
                      "num_finished", "num_preemptions")


class TrialFailed(Exception):
    """A trial's failure with its reason (the `fail_reason` attribute); `run_closed` when its
    MLflow run already ended (a failed or NaN run is logged as such, then the trial fails);
    `run_id` when the failure opened the trial's run itself (a config that did not validate)."""

    def __init__(self, reason: str, run_closed: bool = False, run_id: str | None = None) -> None:
        super().__init__(reason)
        self.run_closed, self.run_id = run_closed, run_id


def open_tracker(problem: Problem) -> Any:
    """The MLflow tracker of this process, or None with `output.mlflow=false` (then mlflow,
    ~2 s to import, is never loaded)."""
    if not problem.base.output.mlflow:
        return None
    return Tracker(problem.base.output, problem.experiment)


class TrialRunner:
    """Runs trials in one process: suggest, build, run, log to MLflow, tell the study."""

    def __init__(self, problem: Problem, index: int = 0) -> None:
        self.p = problem
        self.worker = identity.this_worker(index)
        self.heartbeat = heartbeat_of(problem.storage_url, problem.settings)
        self.tracker = open_tracker(problem)
        self.opened: str | None = None  # the MLflow run of the trial running now, once opened
        self._requests: dict[str, list] = {}

    def preload(self, spec: RunSpec, requests: list) -> None:
        """The requests of `spec`'s workload, built elsewhere (a Ray task's come from the driver)."""
        self._requests = {workload_key(spec.workload, spec.data_dir): requests}

    def _requests_for(self, spec: RunSpec):
        """Build the workload once per process (it is immutable) unless a trial changes it."""
        key = workload_key(spec.workload, spec.data_dir)
        if key not in self._requests:
            self._requests.clear()
            self._requests[key] = build_workload(spec.workload, spec.data_dir)
        return self._requests[key]

    def claim(self, trial: Any) -> None:
        """Record this worker as the trial's owner (one commit), so that a trial left RUNNING by a
        dead process can be traced to it (`fail_stale`)."""
        trial.set_user_attr("worker", self.worker.id)

    def run(self, study: Any, trial: Any, pending_stop: Callable[[], None] | None = None) -> dict:
        """Run a claimed trial. `pending_stop` raises a stop that arrived while the trial was
        asked for and claimed (`worker_loop` defers it there), so that it is marked interrupted."""
        t0 = time.perf_counter()
        event: dict[str, Any] = {"number": trial.number, "worker": self.worker.id}
        run_id = self.opened = None
        try:
            if pending_stop is not None:
                pending_stop()
            try:
                with heartbeat.beating(study, trial, self.heartbeat):
                    spec, run_id = self._start(trial, event)
                    values, violations = self._measure(trial, spec, run_id)
                    # a stop whose exception was lost in a GC callback while the trial ran: it
                    # still interrupts the trial, as a Ctrl-C there would (not told COMPLETE)
                    raise_if_stopped()
            except TrialFailed as exc:
                run_id = run_id or exc.run_id
                return self._fail(study, trial, None if exc.run_closed else run_id, str(exc), event, t0)
            study.tell(trial, values if self.p.settings.multi else values[0])
            event.update(state="COMPLETE", values=values, feasible=all(v <= 0 for v in violations),
                         wall_s=time.perf_counter() - t0)
            return event
        except KeyboardInterrupt:
            self._interrupted(study, trial, run_id)
            raise
        except ServiceLost as exc:
            self._lost(study, trial, run_id or self.opened or getattr(exc, "opened_run_id", None), exc)
            raise
        except Exception as exc:
            if stopped_by() is None:
                raise
            # the stop, turned into a library's own error (SQLAlchemy, OmegaConf): the trial is
            # interrupted, not left RUNNING, and the stop goes on (as the sweep's points: c85929b)
            self._interrupted(study, trial, run_id or self.opened)
            raise stop_exception(stopped_by()) from exc

    def _start(self, trial: Any, event: dict) -> tuple[RunSpec, str | None]:
        """The trial's config and its MLflow run (opened before the run, so a crash is recorded)."""
        p = self.p
        try:
            assignments = p.assign(trial)
        except TestbedError as exc:
            raise TrialFailed(f"invalid config: {exc}") from None
        event["params"] = {k: jsonable(v) for k, v in assignments.items()}
        try:
            spec = p.spec_for(assignments)
        except TestbedError as exc:  # recorded like any failed trial: its run, params and reason
            run_id = self._open_run(trial, None, {**p.base.params(), **assignments})
            raise TrialFailed(f"invalid config: {exc}", run_id=run_id) from None
        return spec, self._open_run(trial, spec)

    def _open_run(self, trial: Any, spec: RunSpec | None, params: dict | None = None) -> str | None:
        """The trial's MLflow run, opened before the run so that a crash is recorded."""
        if self.tracker is None:
            return None
        p = self.p
        tags = {"testbed.kind": "trial", "optuna.study": p.study, "optuna.trial": str(trial.number),
                "optuna.params": json.dumps(trial.params, default=str), **self.worker.tags()}
        name = point_name({"policy": p.base.policy_name}, trial=trial.number)  # the one naming style
        if spec is not None:
            run_id = self.tracker.start(spec, name, parent_run_id=p.parent_run_id, tags=tags)
        else:
            run_id = self.tracker.start_flat(params or {}, name, {**run_tags(p.base), **tags}, p.parent_run_id)
        self.opened = run_id  # for `_lost`, should the study's database be gone for the next line
        trial.set_user_attr("mlflow_run_id", run_id)
        return run_id

    def _measure(self, trial: Any, spec: RunSpec, run_id: str | None) -> tuple[list[float], list[float]]:
        """Run the config; (objective values, constraint violations), or TrialFailed."""
        result = self._simulate(spec)
        self._log(trial, spec, run_id, result)
        if result.error:
            raise TrialFailed(f"run failed: {result.error}", run_closed=True)
        s = result.summary
        objectives = self.p.settings.objectives
        values = [float(s[o]) for o in objectives]
        if any(math.isnan(v) for v in values):
            bad = [o for o, v in zip(objectives, values) if math.isnan(v)]
            if self.tracker is not None:
                self.tracker.client.set_tag(run_id, "optuna.state", "FAIL")
            raise TrialFailed(f"objective {bad[0]} is NaN ({s['num_finished']} of {s['num_requests']} "
                              f"requests finished)", run_closed=True)
        violations = [c.violation(s) for c in self.p.settings.constraints]
        for c, v in zip(self.p.settings.constraints, violations):
            trial.set_constraint(c.text, v)
        # one attribute (one commit): trials.csv expands it into columns
        trial.set_user_attr("summary", {k: finite_or_none(s.get(k)) for k in TRIAL_SUMMARY_KEYS})
        return values, violations

    def _simulate(self, spec: RunSpec):
        try:
            prepared = prepare_experiment(spec, requests=self._requests_for(spec))
        except TestbedError as exc:
            raise TrialFailed(f"invalid config: {exc}") from None
        except Exception as exc:  # a bug while building: fail the trial, keep where it happened
            _raise_if_the_stop(exc)
            raise TrialFailed(f"build error: {type(exc).__name__}: {exc} ({_where(exc)})") from None
        try:
            return prepared.run()
        except Exception as exc:  # a policy bug for these parameters: a failed trial, not a dead study
            _raise_if_the_stop(exc)
            raise TrialFailed(f"run error: {type(exc).__name__}: {exc} ({_where(exc)})") from None

    def _log(self, trial: Any, spec: RunSpec, run_id: str | None, result: Any) -> None:
        run_dir = None
        if self.p.settings.artifacts:
            run_dir = write_run_dir(result, Path(self.p.out_dir) / "trials" / f"trial-{trial.number:04d}",
                                    plots=spec.output.plots)
        if self.tracker is None:
            return
        try:
            if self.p.settings.artifacts:
                self.tracker.finish(run_id, result, run_dir)  # everything, as `testbed run` logs it
            else:
                self.tracker.finish(run_id, result, None, steps=False)
        except ArtifactStoreError as exc:  # the run ended FAILED with `artifact_error`: a failed trial
            raise TrialFailed(str(exc), run_closed=True) from None

    def _fail(self, study, trial, run_id, reason: str, event: dict, t0: float) -> dict:
        trial.set_user_attr("fail_reason", reason[:2000])
        if self.tracker is not None and run_id is not None:
            self.tracker.fail(run_id, reason)
        study.tell(trial, state=TrialState.FAIL)
        event.update(state="FAIL", fail_reason=reason, wall_s=time.perf_counter() - t0)
        return event

    def _interrupted(self, study: Any, trial: Any, run_id: str | None) -> None:
        """Mark the trial interrupted + FAILED and end its run KILLED, unless the stop came just
        after it was told."""
        if not mark_interrupted(study._storage, trial._trial_id):
            return
        if self.tracker is not None and run_id is not None:
            self.tracker.client.set_tag(run_id, "error", INTERRUPTED)
            self.tracker.client.set_terminated(run_id, "KILLED")

    def _lost(self, study: Any, trial: Any, run_id: str | None, exc: ServiceLost) -> None:
        """The study's database or the tracking server stayed unreachable (cluster/reconnect.py):
        end what this trial holds wherever it can still be reached. The trial is marked
        interrupted + FAILED (it runs again); its run ends KILLED unless it FINISHED with its
        results, which a later command then completes the trial from (tune/reclaim.py). What
        cannot be reached now is journaled in the output folder and ended by this folder's next
        command that reaches the store (cluster/unwritten.py), or reclaimed by another host."""
        reason, status, owed = f"{INTERRUPTED}: {exc}", None, []
        try:
            if self.tracker is not None and run_id is not None:
                status = self.tracker.client.get_run(run_id).info.status
                if status == "RUNNING":
                    self.tracker.fail(run_id, reason, status="KILLED")
        except Exception:  # the tracking server is the one lost: journaled (cluster/unwritten.py)
            status = None
            owed.append(unwritten.run_end(self.tracker.uri, run_id, reason, "KILLED"))
        owed_trial = unwritten.trial_end(self.p.storage_url, self.p.study, trial._trial_id, trial.number, reason)
        if status == "FINISHED":  # results recorded: the next command completes the trial from them
            owed.append(owed_trial)
        else:
            try:
                mark_interrupted(study._storage, trial._trial_id, reason)
            except Exception:  # the database is the one lost: journaled, and its heartbeat goes stale
                owed.append(owed_trial)
        unwritten.record(self.p.base.output.dir, *owed)


def _raise_if_the_stop(exc: Exception) -> None:
    """A library's error while a stop is on record is the stop (a SIGTERM inside the library came
    out as its own exception): the trial is interrupted and runs again, not told FAIL with a
    "run error" that counts against the study."""
    if stopped_by() is not None:
        raise stop_exception(stopped_by()) from exc


def _where(exc: BaseException) -> str:
    """file:line of the innermost frame, so a failed trial's reason points at the bug."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}"


def finite_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None
