"""The `testbed tune` command: validate, open (or resume) the study and its MLflow run, run the
workers, then write and log what was found. `tune.trials` is the *target total* of the study,
so a resumed study only runs what is missing; trials interrupted by Ctrl-C or SIGTERM (or left
RUNNING by a killed worker on this host) are marked FAILED "interrupted" and do not count."""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from engine.base.errors import ConfigError
from testbed import signals
from testbed.cluster.ray_backend import split_backend
from testbed.cluster import identity, owners, unwritten
from testbed.cluster.reconnect import ServiceLost
from testbed.run.outputs import prepare_output_dir
from testbed.tracking.tracker import check_tracking_uri, tracking_uri
from testbed.tracking.views import study_view
from testbed.tune.display import Display, pareto_indices, print_start, values_text
from testbed.tune.figures import trials_frame, write_study_figures
from testbed.config.objectives import sig4
from testbed.tune.problem import Problem, fingerprint_of, first_difference, prepare
from testbed.tune.reclaim import end_stray_runs, kill_running_trials, reclaim, recoverer, settle
from testbed.tune.storage import (INTERRUPTED, counted, create_or_load, fail_stale, first_use_lock, heartbeat_of,
                                  make_sampler, mark_interrupted, problem_json, quiet_optuna, redact)
from testbed.tune.tracking import log_study, study_run
from testbed.tune.trial import open_tracker
from testbed.tune.workers import run_workers, worker_loop


@dataclass
class TuneOutcome:
    study: str
    storage: str
    out_dir: Path
    best: list  # FrozenTrials: the best (single objective) or the Pareto front
    baseline: Any  # the baseline FrozenTrial, if any
    trials_run: int
    wall_s: float
    counts: dict = field(default_factory=dict)
    interrupted: bool = False
    worker_errors: list = field(default_factory=list)
    figures: list = field(default_factory=list)
    objectives: tuple = ()
    exit_code: int = 0  # 130 after Ctrl-C, 143 after SIGTERM

    @property
    def trials_per_min(self) -> float:
        return 60.0 * self.trials_run / self.wall_s if self.wall_s > 0 else 0.0


def open_study(problem: Problem):
    """Create or resume the study; refuse to resume a different problem."""
    s = problem.settings
    try:
        study, storage = create_or_load(problem.study, problem.storage_url, s.directions, s.objectives,
                                        make_sampler(s.sampler, problem.seed, s.startup_trials),
                                        heartbeat_of(problem.storage_url, s))
    except ValueError as exc:  # e.g. directions differ from the stored study
        raise ConfigError(f"cannot resume study {problem.study!r}: {exc}") from None
    stored_dirs = [d.name.lower() for d in study.directions]
    if stored_dirs != list(s.directions):
        raise ConfigError(f"study {problem.study!r} exists with directions {stored_dirs}, not {list(s.directions)}; "
                          f"use another tune.study=")
    fingerprint = problem_json(fingerprint_of(problem))
    old = study.user_attrs.get("testbed.problem")
    if old is None and not study.trials:
        study.set_user_attr("testbed.problem", fingerprint)
        study.set_user_attr("testbed.policy", problem.policy_name)
    elif old is not None and old != fingerprint:
        raise ConfigError(f"study {problem.study!r} in {redact(problem.storage_url)} was created for another problem "
                          f"({first_difference(old, fingerprint)}); use another tune.study= or the same overrides")
    return study, storage


def run_tune(overrides: Sequence[str], console: Any = None) -> TuneOutcome:
    """The whole command: validate, open the study and its MLflow run, run the workers, report."""
    where = {"dir": "output.dir"}  # the folder, once the config names it
    with signals.sigterm_as_interrupt():
        try:
            return _run_tune(overrides, console, where)
        except Exception as exc:  # a full disk: one line (testbed/tune/disk.py)
            from testbed.tune.disk import disk_full, full_disk_error

            if isinstance(exc, ConfigError) or not disk_full(exc):
                raise
            raise full_disk_error(exc, where["dir"]) from None


def _run_tune(overrides: Sequence[str], console: Any, where: dict | None = None) -> TuneOutcome:
    quiet_optuna()
    backend, overrides = split_backend(overrides)  # sweep.backend=ray: each trial a Ray task
    problem = prepare(overrides)
    prepare_output_dir(problem.base.output.dir)  # a fresh folder is made, not refused (any storage)
    if where is not None:
        where["dir"] = str(problem.base.output.dir)
    if problem.base.output.mlflow:  # a server that will refuse us is found before the study exists
        check_tracking_uri(tracking_uri(problem.base.output))
    identity.new_session()
    # one section per database, whatever the host: study, MLflow store, trial 0 and the study's
    # parent run are created once (two hosts starting together split the parent run and ran
    # trial 0 twice: issue 24 items 2 and 6)
    with first_use_lock(problem.storage_url, Path(problem.out_dir).parent.parent, tracking_uri(problem.base.output)):
        study, storage = open_study(problem)
        tracker = open_tracker(problem)  # creates the MLflow DB before any worker (and ends the runs owed to it)
        owed = unwritten.end_trials(problem.base.output.dir, problem.storage_url, study, recoverer(study, tracker, problem),
                                    lambda trial_id, reason: mark_interrupted(storage, trial_id, reason))
        stale = owed + reclaim(study, storage, tracker, problem)  # first: an interrupted baseline is enqueued again
        enqueue_baseline(problem, study)
        problem = dataclasses.replace(problem, parent_run_id=study_run(problem, study, tracker))
    try:  # from here on the study run is open: a service lost ends (or journals) it
        if tracker is not None:  # the link shows every trial (views.study_view)
            s = problem.settings
            tracker.save_view(study_view(problem.study, s.objectives[0], s.directions[0] == "maximize"))
        with owners.holding(tracker, problem.parent_run_id, heartbeat_of(problem.storage_url, problem.settings)):
            return _study_session(problem, study, storage, tracker, console, backend, stale)
    except ServiceLost as exc:  # the database or the tracking server stayed away: one error line, exit 1
        abandon(problem, study, tracker, exc)
        raise


def _study_session(problem: Problem, study: Any, storage: Any, tracker: Any, console: Any,
                   backend: Any, stale: list[str]) -> TuneOutcome:
    """Run this host's trials, settle the study's end, report (`stale`: the trials reclaimed at
    the start)."""
    stale = stale + end_stray_runs(study, tracker, problem.parent_run_id)
    Path(problem.out_dir).mkdir(parents=True, exist_ok=True)
    trials = study.get_trials(deepcopy=False)
    display = Display(console, problem.base.output.progress, problem, trials)
    if console is not None:
        print_start(console, problem, trials, stale)
        if tracker is not None:
            console.print(tracker.link, highlight=False, soft_wrap=True, markup=False)
    t0 = time.perf_counter()
    run_count, worker_errors, code = _run_trials(problem, display, counted(trials), backend)
    if not code and not worker_errors:  # other hosts' trials still RUNNING: wait for them, or reclaim them
        def run_more() -> bool:
            nonlocal run_count, worker_errors, code
            more, worker_errors, code = _run_trials(problem, display, counted(study.get_trials(deepcopy=False)),
                                                    backend)
            run_count += more
            return not code and not worker_errors

        _print_reclaimed(console, settle(problem, study, storage, tracker, run_more), "at the end")
    run_count = max(run_count, display.events)  # an interrupted loop returns no count
    study = optuna.load_study(study_name=problem.study, storage=storage)
    if code:  # trials of workers stopped before their own handler ran: FAIL (interrupted), runs KILLED
        fail_stale(study, storage, tracker)
    outcome = finish_study(problem, study, tracker, run_count, time.perf_counter() - t0, bool(code), worker_errors)
    return dataclasses.replace(outcome, exit_code=code)


def enqueue_baseline(problem: Problem, study: Any) -> None:
    """Trial 0, the defaults: enqueued once per study, and again when it was interrupted (a stop,
    a lost Ray task or database) rather than failed by its own config. Before, an interrupted
    baseline never ran again while one reclaimed through its heartbeat did (issue 38 item 5).
    Call under `first_use_lock`: once per study, whatever the hosts."""
    if not problem.settings.baseline:
        return
    trials = study.get_trials(deepcopy=False)
    baselines = [t for t in trials if t.user_attrs.get("baseline")]
    if any(t.state != TrialState.FAIL or not t.user_attrs.get(INTERRUPTED) for t in baselines):
        return  # done, running, waiting, retried through its heartbeat, or failed on its own
    if baselines and counted(trials) >= problem.settings.trials:
        return
    params = problem.baseline_params()
    if params is not None:
        study.enqueue_trial(params, user_attrs={"baseline": True})


def abandon(problem: Problem, study: Any, tracker: Any, exc: ServiceLost) -> None:
    """After giving up on the study's database or the tracking server: end what this command
    holds wherever it can still be reached (its trials completed from their recorded results, or
    interrupted + FAILED; its trial runs KILLED, the study run FAILED). What cannot be reached is
    journaled in the output folder and ended by its next command that reaches the store
    (cluster/unwritten.py), else reclaimed by another host (tune/reclaim.py); a trial whose run
    recorded its results is completed from it."""
    session = identity.session_id()
    recover = recoverer(study, tracker, problem)
    try:
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if str(t.user_attrs.get("worker", "")).startswith(session) and not recover(t):
                mark_interrupted(study._storage, t._trial_id, f"{INTERRUPTED}: {exc}")
    except Exception:  # the database is the one lost
        pass
    if tracker is None or not problem.parent_run_id:
        return
    try:
        kill_running_trials(tracker, problem.parent_run_id)
        owners.end_shared(tracker, problem.parent_run_id, "FAILED", str(exc))  # not while another host runs it
    except Exception:  # the tracking server is the one lost: journaled for this folder's next command
        unwritten.record(problem.base.output.dir, unwritten.run_end(tracker.uri, problem.parent_run_id, str(exc),
                                                                    "FAILED", session))


def _print_reclaimed(console: Any, notes: list[str], when: str) -> None:
    if console is not None:
        for note in notes:
            console.print(f"reclaimed {when}: {note}", highlight=False, markup=False)


def _run_trials(problem: Problem, display: Display, already: int, backend: Any = None) -> tuple[int, list[str], int]:
    """(trials run, worker errors, 0 or the interrupt's exit code)."""
    s = problem.settings
    try:
        with display:
            if already >= s.trials:
                return 0, [], 0
            if backend is not None and backend.remote:
                from testbed.tune.ray_trials import run_trials_on_ray

                return (*run_trials_on_ray(problem, display.event, backend), 0)
            if s.workers == 1:
                return worker_loop(problem, 0, None, display.event), [], 0
            return (*run_workers(problem, display), 0)
    except KeyboardInterrupt as exc:
        return 0, [], signals.exit_code(exc)
    except Exception as exc:
        if signals.stopped_by() is None or isinstance(exc, ServiceLost):
            raise
        # the stop, turned into a library's own error outside a trial (its trial is ended by
        # TrialRunner): the stop's exit code, not a traceback
        return 0, [], signals.EXIT_CODES[signals.stopped_by()]


def best_trials(study: Any, directions: Sequence[str]) -> list:
    """The best feasible trial (one objective) or the feasible Pareto front (several), ordered."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if all(v <= 0 for v in t.constraints.values())]
    if not done:
        return []
    if len(directions) == 1:
        sign = -1.0 if directions[0] == "maximize" else 1.0
        return [min(done, key=lambda t: (sign * t.values[0], t.number))]
    idx = pareto_indices([t.values for t in done], directions)
    return sorted((done[i] for i in idx), key=lambda t: t.number)


def _trial_json(t: Any, problem: Problem) -> dict:
    return {"number": t.number, "values": dict(zip(problem.settings.objectives, t.values or [])),
            "params": dict(t.params), "config": {k if "." in k else f"policy.{k}": v for k, v in t.params.items()},
            "constraints": dict(t.constraints), "mlflow_run_id": t.user_attrs.get("mlflow_run_id")}


def _summary(problem: Problem, trials: list, counts: dict, best: list, baseline: Any, trials_run: int,
             wall_s: float) -> dict:
    s = problem.settings
    summary = {"study": problem.study, "storage": redact(problem.storage_url), "objectives": list(s.objectives),
               "directions": list(s.directions), "constraints": [c.text for c in s.constraints],
               "trials": counts, "target": s.trials,
               "best": [_trial_json(t, problem) for t in best],
               "baseline": _trial_json(baseline, problem) if baseline is not None else None,
               "session": {"trials_run": trials_run, "wall_s": wall_s,
                           "trials_per_min": 60.0 * trials_run / wall_s if wall_s > 0 else 0.0,
                           "workers": s.workers}}
    if baseline is not None and len(best) == 1 and len(s.objectives) == 1 and baseline.values[0]:
        summary["gain_over_baseline"] = best[0].values[0] / baseline.values[0] - 1.0
    return summary


def finish_study(problem: Problem, study: Any, tracker: Any, trials_run: int, wall_s: float,
                 interrupted: bool, worker_errors: list[str]) -> TuneOutcome:
    """Write the study directory, log it to the study's MLflow run, and say what was found."""
    s = problem.settings
    out_dir = Path(problem.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trials = study.get_trials(deepcopy=False)
    counts = {st.name.lower(): sum(1 for t in trials if t.state == st)
              for st in (TrialState.COMPLETE, TrialState.FAIL, TrialState.RUNNING, TrialState.WAITING)}
    best = best_trials(study, s.directions)
    baseline = next((t for t in trials if t.user_attrs.get("baseline") and t.state == TrialState.COMPLETE), None)
    trials_frame(study, problem).to_csv(out_dir / "trials.csv", index=False)
    summary = _summary(problem, trials, counts, best, baseline, trials_run, wall_s)
    (out_dir / "best.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    plots = problem.base.output.plots and not interrupted
    figures = write_study_figures(study, problem, out_dir) if plots else []
    if tracker is not None and problem.parent_run_id:
        artifact_error = log_study(tracker, problem, summary, best, counts, out_dir)
        if artifact_error:
            print(f"warning: the study's files were not logged to MLflow: {artifact_error}", file=sys.stderr)
        status = "KILLED" if interrupted else "FAILED" if worker_errors else "FINISHED"
        if status != "FINISHED":  # a trial run a worker opened just before it was stopped
            kill_running_trials(tracker, problem.parent_run_id)
            owners.end_shared(tracker, problem.parent_run_id, status)  # not while another host runs the study
        else:
            tracker.client.set_terminated(problem.parent_run_id, status)
    return TuneOutcome(study=problem.study, storage=problem.storage_url, out_dir=out_dir, best=best,
                       baseline=baseline, trials_run=trials_run, wall_s=wall_s, counts=counts,
                       interrupted=interrupted, worker_errors=worker_errors, figures=figures,
                       objectives=s.objectives)


def print_outcome(outcome: TuneOutcome) -> None:
    """The last lines: the best trial's value(s) and parameters (stdout), 4 significant digits."""
    objectives = outcome.objectives
    print(f"trials: {outcome.counts.get('complete', 0)} complete, {outcome.counts.get('fail', 0)} failed; "
          f"this session {outcome.trials_run} in {outcome.wall_s:.1f} s ({outcome.trials_per_min:.1f} trials/min)")
    print(f"study directory: {outcome.out_dir.resolve()}")
    if not outcome.best:
        print("no completed (feasible) trial yet")
        return
    if len(outcome.best) == 1 and len(objectives) == 1:
        b = outcome.best[0]
        gain = ""
        if outcome.baseline is not None and outcome.baseline.values[0]:
            g = b.values[0] / outcome.baseline.values[0] - 1.0
            gain = f" ({g:+.1%} vs the defaults, trial {outcome.baseline.number}: {sig4(outcome.baseline.values[0])})"
        print(f"best trial {b.number}: {values_text(objectives, b.values)}{gain}")
        print("best params: " + _config_params(b.params))
        return
    print(f"Pareto front ({len(outcome.best)} trials):")
    for t in outcome.best:
        print(f"  trial {t.number}: {values_text(objectives, t.values)}  " + _config_params(t.params))


def _config_params(params: dict) -> str:
    return " ".join(f"{k if '.' in k else f'policy.{k}'}={sig4(v)}" for k, v in params.items())


def cli_tune(overrides: Sequence[str], console: Any) -> int:
    """`testbed tune`: 0, 1 when a worker failed, 130 (Ctrl-C) / 143 (SIGTERM) / 129 (SIGHUP) when
    interrupted."""
    outcome = run_tune(overrides, console)
    print_outcome(outcome)
    if outcome.interrupted:
        what = signals.stop_message(signals.SIGNAL_OF_EXIT_CODE.get(outcome.exit_code, "SIGINT"))
        print(f"{what}: run the same command again to resume the study", file=sys.stderr)
        return outcome.exit_code or signals.EXIT_CODES["SIGINT"]
    return 1 if outcome.worker_errors else 0
