"""Stranded trials: RUNNING in the study while no live worker holds them (a dead host, a worker
whose database connection stayed lost), found and ended by the workers that are left.

Three ways in (issue 38 items 1 and 5):
- at the start of a `testbed tune` and before every asked trial, as before (`storage.fail_stale`:
  a dead worker of this pid namespace; `heartbeat.reap`: a trial whose heartbeats stopped);
- at the end of a study (`settle`): the study met `tune.trials` while another host's trial was
  still RUNNING. Before, the survivor exited 0 ("5 complete, 0 failed") without a word about the
  dead host's baseline, which only a command started after the grace period reclaimed. Now it
  waits, at most the grace period plus one heartbeat, until each such trial beats again (its host
  is alive: left to it), finishes, or goes stale (reclaimed, and its retry run here);
- a trial whose MLflow run FINISHED with its results (the worker lost the study's database
  between logging and telling) is completed from that run (`recorded`) instead of being run
  again: a PostgreSQL outage longer than the reconnect window no longer costs the work.

Each reclaimed trial is reported by number, worker and what became of it."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.trial import TrialState

from testbed.cluster import heartbeat, identity
from testbed.tune.problem import Problem
from testbed.tune.storage import counted, fail_stale, heartbeat_of
from testbed.tune.trial import TRIAL_SUMMARY_KEYS, finite_or_none

POLL_S = 2.0


def recorded(tracker: Any, trial: Any, problem: Problem) -> dict[str, float] | None:
    """The metrics of the trial's MLflow run when it FINISHED with every objective finite (its
    results were recorded there), else None."""
    run_id = trial.user_attrs.get("mlflow_run_id")
    if tracker is None or not run_id:
        return None
    try:
        run = tracker.client.get_run(run_id)
    except Exception:  # the run is gone or its store unreachable: nothing to recover from
        return None
    metrics = dict(run.data.metrics)
    if run.info.status != "FINISHED" or run.data.tags.get("error"):
        return None
    if not all(math.isfinite(metrics.get(o, math.nan)) for o in problem.settings.objectives):
        return None
    return metrics


def complete_from_record(study: Any, trial: Any, metrics: dict[str, float], problem: Problem) -> bool:
    """Tell a stranded trial COMPLETE with the values its MLflow run recorded (constraints and
    summary as the worker would have set them); False when another process ended it first."""
    s = problem.settings
    values = [float(metrics[o]) for o in s.objectives]
    study.get_trials(deepcopy=False)  # Optuna's storage cache learns the trial
    live = optuna.trial.Trial(study, trial._trial_id)
    try:
        for c in s.constraints:
            live.set_constraint(c.text, c.violation(metrics))
        live.set_user_attr("summary", {k: finite_or_none(metrics.get(k)) for k in TRIAL_SUMMARY_KEYS})
        live.set_user_attr("recovered", f"from its MLflow run {trial.user_attrs.get('mlflow_run_id')}")
        study.tell(live, values if s.multi else values[0])
    except (RuntimeError, ValueError):  # UpdateFinishedTrialError and kin: someone else ended it
        return False
    return True


def reclaim(study: Any, storage: Any, tracker: Any, problem: Problem) -> list[str]:
    """End the study's stranded trials now: completed from their recorded results where there
    are some, else failed (and, through heartbeats, enqueued again). One line per trial."""
    recover = recoverer(study, tracker, problem)
    return fail_stale(study, storage, tracker, recover) + heartbeat.reap(study, tracker, recover)


def end_stray_runs(study: Any, tracker: Any, parent_run_id: str | None) -> list[str]:
    """Trial runs left RUNNING under the study's run while their trial has ended: their worker
    ended the trial but could not reach the tracking server any more (it stayed away past the
    reconnect window). Ended KILLED once the server is back, so none needs a manual step."""
    if tracker is None or not parent_run_id:
        return []
    states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    notes = []
    for run in tracker.client.search_runs([tracker.experiment_id],
                                          filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}' "
                                                        f"and attributes.status = 'RUNNING'"):
        number = run.data.tags.get("optuna.trial", "")
        state = states.get(int(number)) if number.isdigit() else None
        if state is None or state == TrialState.RUNNING:
            continue  # a live trial's run, or not a trial's
        tracker.fail(run.info.run_id, f"interrupted: trial {number} ended {state.name} while its run could "
                                      f"not be reached", status="KILLED")
        notes.append(f"trial {number}: its MLflow run {run.info.run_id} was left RUNNING; ended KILLED")
    return notes


def recoverer(study: Any, tracker: Any, problem: Problem) -> Callable[[Any], bool]:
    """`recover(trial)`: complete a stranded trial from its recorded results, if it has some."""
    def recover(trial: Any) -> bool:
        metrics = recorded(tracker, trial, problem)
        return metrics is not None and complete_from_record(study, trial, metrics, problem)

    return recover


def settle(problem: Problem, study: Any, storage: Any, tracker: Any, run_more: Callable[[], bool]) -> list[str]:
    """After this host's workers met the budget: wait for the other hosts' RUNNING trials to
    beat, finish or go stale (at most `tune.grace_period` + one heartbeat), reclaiming the stale
    ones and running their retries (`run_more`: False when they were stopped). Without heartbeats (SQLite, one host) only a
    dead local worker's trial is reclaimed, at once."""
    hb = heartbeat_of(problem.storage_url, problem.settings)
    notes = reclaim(study, storage, tracker, problem)
    if not hb.on:
        return notes
    deadline = time.monotonic() + hb.grace + hb.interval
    first = None
    while True:
        if counted(study.get_trials(deepcopy=False)) < problem.settings.trials and not run_more():
            return notes  # the retries of reclaimed trials were stopped (a signal) or failed
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        beats = last_heartbeats(storage, [t._trial_id for t in running])
        first = beats if first is None else {**beats, **first}
        silent = [t for t in running if beats.get(t._trial_id) == first.get(t._trial_id)]
        if not silent or time.monotonic() >= deadline:
            return notes
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        found = reclaim(study, storage, tracker, problem)
        notes += found


def last_heartbeats(storage: Any, trial_ids: Sequence[int]) -> dict[int, Any]:
    """trial id -> the time of its last heartbeat (Optuna's `trial_heartbeats` table), for the
    trials that have one; {} when the storage has no such table or cannot be read."""
    if not trial_ids:
        return {}
    from sqlalchemy import bindparam, text

    backend = getattr(storage, "_backend", storage)
    engine = getattr(backend, "engine", None)
    if engine is None:
        return {}
    query = text("SELECT trial_id, heartbeat FROM trial_heartbeats WHERE trial_id IN :ids").bindparams(
        bindparam("ids", expanding=True))
    try:
        with engine.connect() as conn:
            return {int(i): beat for i, beat in conn.execute(query, {"ids": list(trial_ids)})}
    except Exception:  # a lost connection: no beat seen this round
        return {}


def kill_running_trials(tracker: Any, parent_run_id: str, session: str | None = None) -> None:
    """End KILLED every trial run of this command's workers still RUNNING once they are gone (a
    worker stopped between opening its run and its own KILLED handler leaves one; seen 1 in ~3
    SIGTERMs). Only this session's: another host's live trials under the same study run are not
    ours to end (issue 24 item 3)."""
    client = tracker.client
    session = session or identity.session_id()
    for run in client.search_runs([tracker.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}' "
                                                f"and attributes.status = 'RUNNING' "
                                                f"and tags.`testbed.session` = '{session}'"):
        client.set_tag(run.info.run_id, "error", "interrupted")
        client.set_terminated(run.info.run_id, "KILLED")
