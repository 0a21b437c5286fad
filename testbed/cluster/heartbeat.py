"""A dead worker's trial, found through Optuna's heartbeats and run again.

A worker on another host that dies (SIGKILL, power, network) cannot be seen from here: its trial
stayed RUNNING for good and counted toward `tune.trials` (19 results for 20 trials, issue 24
item 4). With heartbeats on, each worker records one for its running trial every
`tune.heartbeat` seconds (a thread); before asking for a trial every worker fails the trials whose
last heartbeat is older than `tune.grace_period` (`optuna.storages.fail_stale_trials`), and
`RetryHeartbeatStaleTrialCallback` (Optuna >= 4.9's name of RetryFailedTrialCallback) enqueues
each again with the same parameters. The failed one no longer counts toward the budget
(`retried_numbers`): the retry does.

Heartbeats are on by default for server databases (PostgreSQL, MySQL: the storages shared by
hosts), every 10 s with a 60 s grace period, and off for SQLite (one host: a dead local worker is
found at once by its pid, `identity.owned_by_dead_local_process`); `tune.heartbeat=N` turns them
on anywhere, `tune.heartbeat=0` off. Optuna's own `optimize` does the same; `testbed tune` uses
ask-and-tell, so it does it here."""
from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

DEFAULT_INTERVAL_S = 10
DEFAULT_GRACE_S = 60
MAX_RETRY = 3  # a trial that kills its worker (OOM) is not retried for ever


@dataclass(frozen=True)
class Heartbeat:
    """`interval` seconds between a running trial's heartbeats (0: off); a trial whose last one is
    older than `grace` seconds is failed and retried."""

    interval: int = 0
    grace: int = DEFAULT_GRACE_S

    @property
    def on(self) -> bool:
        return self.interval > 0


def default_for(url: str, interval: int | None, grace: int | None) -> Heartbeat:
    """The heartbeat of a storage URL: the user's `tune.heartbeat` / `tune.grace_period`, else
    on for server databases and off for SQLite and journal files."""
    if interval is None:
        interval = 0 if url.startswith(("sqlite:", "journal:")) else DEFAULT_INTERVAL_S
    if grace is None:
        grace = max(DEFAULT_GRACE_S, 3 * interval) if interval else DEFAULT_GRACE_S
    if interval and grace <= interval:  # every trial would look dead between two heartbeats
        from engine.base.errors import ConfigError

        raise ConfigError(f"tune.grace_period={grace} must be longer than tune.heartbeat={interval} "
                          f"(e.g. tune.grace_period={3 * interval})")
    return Heartbeat(int(interval), int(grace))


class RetryStale:
    """Optuna's stale-trial callback: enqueue the trial again (RetryHeartbeatStaleTrialCallback) and
    remember it, so the worker that found it can end its MLflow run KILLED."""

    def __init__(self) -> None:
        from optuna.storages import RetryHeartbeatStaleTrialCallback  # Optuna >= 4.9's name

        self.retry = RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)
        self.failed: list[Any] = []

    def __call__(self, study: Any, trial: Any) -> None:
        self.failed.append(trial)
        self.retry(study, trial)


def storage_kwargs(hb: Heartbeat) -> dict[str, Any]:
    """Keyword arguments of `optuna.storages.RDBStorage` for this heartbeat."""
    if not hb.on:
        return {}
    # Optuna warns on every ask that heartbeats are meant for Study.optimize: here `beating` records them
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    return {"heartbeat_interval": hb.interval, "grace_period": hb.grace,
            "heartbeat_stale_trial_callback": RetryStale()}


def retried_numbers(trials: Sequence[Any]) -> set[int]:
    """Numbers of failed trials that were enqueued again: they do not count toward the budget."""
    out: set[int] = set()
    for t in trials:
        history = t.system_attrs.get("retry_history")
        if history:
            out.update(int(n) for n in history)
    return out


def reap(study: Any, tracker: Any = None, recover: Callable[[Any], bool] | None = None) -> list[str]:
    """Fail and re-enqueue the study's stale trials (no-op without heartbeats); end their MLflow
    runs KILLED with the reason. A stale trial that `recover(trial)` completes (its results were
    recorded before its worker lost the database: tune/reclaim.py) is neither failed nor run
    again. One line per trial, naming it and its worker."""
    import optuna

    storage = study._storage  # what optuna.storages.fail_stale_trials reads as well
    callback = getattr(storage, "get_heartbeat_stale_trial_callback", lambda: None)()
    if not isinstance(callback, RetryStale):
        return []
    notes = []
    if recover is not None:
        stale = set(storage._get_stale_trial_ids(study._study_id))
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            if t._trial_id in stale and recover(t):
                notes.append(f"trial {t.number} (worker {t.user_attrs.get('worker', '?')}, no heartbeat): "
                             f"completed from its recorded results")
    before = len(callback.failed)
    optuna.storages.fail_stale_trials(study)
    for t in callback.failed[before:]:
        run_id = t.user_attrs.get("mlflow_run_id")
        why = f"stale: worker {t.user_attrs.get('worker', '?')} stopped sending heartbeats"
        if tracker is not None and run_id:
            _kill_run(tracker, run_id, f"{why}; trial {t.number} enqueued again")
        notes.append(f"trial {t.number} (worker {t.user_attrs.get('worker', '?')}, no heartbeat for "
                     f"{_grace(storage)} s): failed; enqueued again")
    return notes


def _grace(storage: Any) -> Any:
    backend = getattr(storage, "_backend", storage)
    return getattr(backend, "grace_period", None) or "?"


def _kill_run(tracker: Any, run_id: str, reason: str) -> None:
    try:
        tracker.client.set_tag(run_id, "error", reason)
        tracker.client.set_terminated(run_id, "KILLED")
    except Exception:  # the run is gone or its store unreachable: the study still goes on
        pass


@contextmanager
def beating(study: Any, trial: Any, hb: Heartbeat) -> Iterator[None]:
    """Record heartbeats of `trial` every `hb.interval` seconds while the block runs."""
    if not hb.on:
        yield
        return
    storage = study._storage
    stop = threading.Event()

    def loop() -> None:
        while True:
            try:
                storage.record_heartbeat(trial._trial_id)
            except Exception:  # a lost connection: the next beat tries again
                pass
            if stop.wait(hb.interval):
                return

    thread = threading.Thread(target=loop, name=f"heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=hb.interval + 5)
