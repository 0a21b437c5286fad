"""Where a study lives: an Optuna RDB (`sqlite:///<output.dir>/optuna.db` by default, never the
MLflow database: both keep an `alembic_version` table), any other RDB URL (`postgresql://...`
spreads workers over machines) or `journal:<file>` for Optuna's JournalStorage; samplers; and
creating or resuming a study safely when several commands start on one fresh directory.

First use is serialised by a file lock next to the SQLite file (`optuna.db.lock`), held while
a tune creates or opens its study and the MLflow store: Optuna and MLflow both create tables
and stamp an alembic version on first connect, and two `testbed tune` started together on a
fresh folder lost one of them to "database is locked" or alembic's "expected to match one row"
(issue 13 item 4). After that, workers open SQLite with a 60 s busy timeout. With PostgreSQL the
same section also holds the database's advisory lock (testbed/cluster/postgres.py): a file lock
serialises one host only. Heartbeats and the retry of a dead worker's trial:
testbed/cluster/heartbeat.py."""
from __future__ import annotations

import json
import sqlite3
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import optuna
from filelock import FileLock
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState
from sqlalchemy import event  # sqlalchemy comes with optuna's RDB storage

from engine.base.errors import ConfigError
from testbed.cluster import heartbeat, identity, reconnect
from testbed.cluster.postgres import advisory_lock, check_driver

SQLITE_TIMEOUT_S = 60
LOCK_TIMEOUT_S = 300  # the first process may be migrating a fresh database (seconds on 2 cores)
INTERRUPTED = "interrupted"


def sqlite_path(uri: str) -> Path | None:
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).resolve()
    return None


@contextmanager
def first_use_lock(url: str, out_root: Path, tracking_uri: str | None = None) -> Iterator[None]:
    """A cross-process lock held while a tune creates or opens its study, the MLflow store and
    the study's parent run: next to the SQLite file (`optuna.db.lock`), or in the output folder
    for other storages (the MLflow SQLite store there is created on first use too); plus the
    advisory lock of each PostgreSQL database involved, which serialises other hosts too."""
    check_driver(url, "tune.storage")
    check_driver(tracking_uri or "", "output.tracking_uri")
    path = sqlite_path(url)
    lock = Path(str(path) + ".lock") if path is not None else out_root.resolve() / ".tune.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        stack.enter_context(FileLock(str(lock), timeout=LOCK_TIMEOUT_S))
        for db, key in ((url, "tune.storage"), (tracking_uri or "", "output.tracking_uri")):
            stack.enter_context(advisory_lock(db, key=key))
        yield


def make_storage(url: str, hb: heartbeat.Heartbeat | None = None):
    """An Optuna storage from a URL: SQLite with a busy timeout, any other RDB URL (with
    heartbeats `hb`), or `journal:<file>` for Optuna's JournalStorage (file backend)."""
    if url.startswith("journal:"):
        path = Path(url[len("journal:"):])
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    check_driver(url, "tune.storage")
    kwargs: dict[str, Any] = heartbeat.storage_kwargs(hb or heartbeat.Heartbeat())
    sqlite_file = sqlite_path(url)
    if url.startswith("sqlite:"):
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
        if sqlite_file is not None:
            _sqlite_wal(sqlite_file)
    else:  # a server database: a pooled connection that a restart closed is replaced before use
        kwargs["engine_kwargs"] = {"pool_pre_ping": True}
        reconnect.window_s()  # a bad TESTBED_RECONNECT_S is refused now, not at the first outage
    try:
        if url.startswith("sqlite:"):
            storage = optuna.storages.RDBStorage(url, **kwargs)
        else:  # reachable a moment ago (the first-use lock): a restart now is waited for
            service = reconnect.Service(f"tune.storage={redact(url)}", connection_lost)
            storage = reconnect.call(service, ReconnectingStorage, url, **kwargs)
        if sqlite_file is not None:
            _sqlite_fast_commits(storage.engine)
        return storage
    except reconnect.ServiceLost:
        raise
    except ImportError as exc:
        raise ConfigError(f"tune.storage={redact(url)} needs a database driver: {exc}") from None
    except Exception as exc:  # bad URL, unreachable server
        raise ConfigError(f"cannot open tune.storage={redact(url)}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


connection_lost = reconnect.connection_lost  # the one test, shared with a PostgreSQL MLflow store


# the storage calls a tune makes; each is tried again while the database is unreachable
_RECONNECTING = ("create_new_study", "set_study_user_attr", "set_study_system_attr", "get_study_id_from_name",
                 "get_study_name_from_id", "get_study_directions", "get_study_user_attrs", "get_study_system_attrs",
                 "get_trial_user_attrs", "get_trial_system_attrs", "get_all_studies", "create_new_trial",
                 "set_trial_param", "get_trial_param", "set_trial_intermediate_value", "set_trial_user_attr",
                 "set_trial_system_attr", "get_trial_id_from_study_id_trial_number", "get_trial", "get_all_trials",
                 "get_best_trial", "record_heartbeat", "_get_stale_trial_ids")


class ReconnectingStorage(optuna.storages.RDBStorage):
    """Optuna's RDB storage for a server database whose calls ride out a restart of the server
    (testbed/cluster/reconnect.py): before, a PostgreSQL restart mid-study ended every host with
    a 118-line `StorageInternalError` and left its trials RUNNING (issue 38 item 1). Optuna
    itself retries only `create_new_trial`, five times within ~5 s, and pre-pings its pool only
    on MySQL; `make_storage` turns `pool_pre_ping` on here. Still an `RDBStorage`, so Optuna's
    cache and heartbeats treat it as theirs."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.service = reconnect.Service(f"tune.storage={redact(url)}", connection_lost)

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        """Tell a trial's end; a retry that finds it already ended by this very call (the commit
        got through, the answer did not) is a success, not Optuna's UpdateFinishedTrialError."""
        tries = [0]

        def once() -> bool:
            tries[0] += 1
            try:
                return optuna.storages.RDBStorage.set_trial_state_values(self, trial_id, state, values)
            except optuna.exceptions.UpdateFinishedTrialError:
                if tries[0] == 1 or self.get_trial(trial_id).state != state:
                    raise
                return True

        return reconnect.call(self.service, once)


def _reconnecting(name: str) -> Any:
    method = getattr(optuna.storages.RDBStorage, name)

    def call(self: ReconnectingStorage, *args: Any, **kwargs: Any) -> Any:
        return reconnect.call(self.service, method, self, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = method.__doc__
    return call


for _name in _RECONNECTING:
    if hasattr(optuna.storages.RDBStorage, _name):
        setattr(ReconnectingStorage, _name, _reconnecting(_name))


def _sqlite_wal(path: Path) -> None:
    """Write-ahead logging (persistent in the file): readers (a second worker, optuna-dashboard)
    no longer block the writer. Measured: 139 -> 31 ms of storage time per trial together with
    `synchronous=NORMAL` (one fsync per checkpoint instead of per commit). Not for SQLite files
    on network filesystems (WAL needs shared memory): use PostgreSQL or `journal:` there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        con = sqlite3.connect(str(path), timeout=SQLITE_TIMEOUT_S)
        try:
            con.execute("PRAGMA journal_mode=WAL")
        finally:
            con.close()
    except sqlite3.Error:
        pass  # busy or read-only: the default rollback journal still works, only slower


def _sqlite_fast_commits(engine: Any) -> None:
    def on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.execute("PRAGMA synchronous=NORMAL")

    event.listen(engine, "connect", on_connect)
    engine.dispose()  # pooled connections made before the listener get replaced


def redact(url: str) -> str:
    """The storage URL without a password (it goes into tags and logs; testbed/config/redact.py)."""
    from testbed.config.redact import redact as hide

    return hide(url)


def heartbeat_of(url: str, settings: Any) -> heartbeat.Heartbeat:
    """The heartbeat of a study: `tune.heartbeat` / `tune.grace_period`, or the storage's default."""
    return heartbeat.default_for(url, settings.heartbeat, settings.grace_period)


def make_sampler(sampler: str, seed: int, startup_trials: int):
    if sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials)


def quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def create_or_load(name: str, url: str, directions: Sequence[str], metric_names: Sequence[str], sampler: Any,
                   hb: heartbeat.Heartbeat | None = None):
    """(study, storage), the study with its metric names set so optuna-dashboard labels the
    axes (`throughput_tok_s`, not "Objective 0"). Call under `first_use_lock`."""
    storage = make_storage(url, hb)
    study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True,
                                directions=list(directions), sampler=sampler)
    if study.metric_names is None:
        study.set_metric_names(list(metric_names))
    return study, storage


def counted(trials: Sequence[Any]) -> int:
    """Trials that count toward `tune.trials`: finished and running ones, but neither those
    interrupted nor those failed stale and enqueued again (the retry counts once it runs).
    Enqueued (WAITING) trials count when a worker takes them: counted before, the enqueued
    trial 0 met `tune.trials=1` and nothing ran, and a retry that met the budget never ran."""
    retried = heartbeat.retried_numbers(trials)
    return sum(1 for t in trials if t.state != TrialState.WAITING and not t.user_attrs.get(INTERRUPTED)
               and t.number not in retried)


def mark_interrupted(storage: Any, trial_id: int, reason: str = INTERRUPTED) -> bool:
    """Mark a RUNNING trial interrupted + FAILED with `reason` (it does not count toward
    `tune.trials`). False, and nothing changed, when it finished meanwhile: setting an attribute
    of a finished trial raises, and that error took the place of the stop being handled."""
    if storage.get_trial(trial_id).state != TrialState.RUNNING:
        return False
    storage.set_trial_user_attr(trial_id, INTERRUPTED, True)
    storage.set_trial_user_attr(trial_id, "fail_reason", reason)
    storage.set_trial_state_values(trial_id, TrialState.FAIL)
    return True


def fail_stale(study: Any, storage: Any, tracker: Any, recover: Callable[[Any], bool] | None = None) -> list[str]:
    """RUNNING trials of dead worker processes in this pid namespace (never another host's,
    whatever its name: issue 24 item 5): completed by `recover(trial)` when it can (its results
    were recorded: tune/reclaim.py), else marked interrupted + FAILED with their MLflow runs
    KILLED. Other hosts' dead workers are found by their heartbeats (cluster/heartbeat.py).
    A trial no worker claimed is failed too once no other worker lives (`no_live_worker_but_me`).
    One line per trial, naming it and its worker."""
    notes = []
    workers = study.user_attrs
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        ownerless = "worker" not in t.user_attrs and identity.no_live_worker_but_me(workers)
        if not (ownerless or identity.owned_by_dead_local_process(t.user_attrs, workers)):
            continue
        who = f"trial {t.number} (worker {t.user_attrs.get('worker')}, gone)"
        if recover is not None and recover(t):
            notes.append(f"{who}: completed from its recorded results")
            continue
        if not mark_interrupted(storage, t._trial_id, f"{INTERRUPTED}: worker {t.user_attrs.get('worker')} is gone"):
            continue
        run_id = t.user_attrs.get("mlflow_run_id")
        if tracker is not None and run_id:
            try:
                tracker.client.set_terminated(run_id, "KILLED")
            except Exception:
                pass
        notes.append(f"{who}: failed (interrupted); it runs again")
    return notes


def problem_json(fingerprint: dict) -> dict:
    return json.loads(json.dumps(fingerprint, default=str))
