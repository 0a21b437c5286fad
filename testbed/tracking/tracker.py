"""MLflow logging of runs (imported only where tracking happens: `import mlflow` costs 2-4 s).

One experiment run = one MLflow run: params are the whole resolved config flattened, metrics
the summary (lists per stage become `<key>.stage<i>`), step metrics the KV usage and tokens per
micro-batch (downsampled to at most 250 points and sent with `log_batch`, since one
`log_metric` call costs ~19 ms on SQLite). Artifacts are the run folder's small files (summary,
config, run info, figures, a sampled trace): the folder itself stays where it is and the run's
`testbed.run_dir` tag points at it (copying it doubled the disk use: 14 MB traces). The run is
opened before the experiment starts, so a crash is recorded as FAILED (KILLED when interrupted).

The default store is `sqlite:///<output.dir>/mlflow.db`, with artifacts in
`<output.dir>/mlartifacts`; with a tracking server the server's artifact store holds them
(testbed/cluster/artifacts.py), and every run is tagged with its `host`. Creating that database runs
MLflow's schema migrations (~7 s); two processes doing it at once lose a run, so creation holds a
file lock (`mlflow.db.lock`).
Optuna never shares this database (both use alembic tables).

`testbed run` does all of this in a background process (testbed/tracking/background.py) while it simulates;
`Tracker` is the same logging in-process, for `compare`, `tune` and `validate`.
"""
from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.base.errors import ConfigError
from engine.base.settings import OutputSettings
from testbed.tracking.views import (ALL_RUNS, HEADLINE_METRICS, HEADLINE_SECTION, TAG_PREFIX, View, headline_view,
                                    view_link)

if TYPE_CHECKING:
    from testbed.config.spec import RunSpec

MAX_STEP_POINTS = 250  # per series: enough for the chart's shape; log_batch cost grows with rows
MAX_ARTIFACT_BYTES = 2_000_000
SMALL_ARTIFACTS = ("summary.json", "run_info.json", "config.yaml", "timeline.png", "kv_usage.png", "trace.json",
                   "breakdown.json", "breakdown.png")
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
URI_SCHEMES = ("sqlite", "file", "http", "https", "postgresql", "mysql", "mssql", "databricks")
LOCK_RETRY_S = (0.1, 0.2, 0.4, 0.8, 1.6, 3.2)  # waits between the attempts of a call SQLite refused


class LockRetryingClient:
    """An MlflowClient whose calls are tried again when SQLite answers "database is locked".
    SQLite gives that answer at once, not after MLflow's 20 s busy timeout, to one of two writers
    that meet inside deferred transactions (each read first, then wants to write: one must yield),
    and MLflow retries only errors that say "deadlock". It happened when a SIGTERMed `tune` logged
    the study's last metrics while its workers ended their runs KILLED: exit 1 and a traceback
    instead of 143 (seen once in three full suite runs at load ~3). A refused transaction was
    rolled back, so trying it again writes it once."""

    def __init__(self, client: Any, service: Any = None) -> None:
        self._client = client
        self._service = service  # a tracking server: its calls ride out a restart (cluster/reconnect.py)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def locked(*args: Any, **kwargs: Any) -> Any:
            for wait_s in LOCK_RETRY_S:
                try:
                    return attr(*args, **kwargs)
                except Exception as exc:
                    if "database is locked" not in str(exc):
                        raise
                time.sleep(wait_s)
            return attr(*args, **kwargs)

        if self._service is None:
            return locked
        from testbed.cluster.reconnect import call as reconnecting

        return lambda *args, **kwargs: reconnecting(self._service, locked, *args, **kwargs)


# MLflow's own HTTP retries, bounded: its defaults (7 retries, backoff factor 2, 120 s timeout) hung
# a command ~4 min on a stopped server or an unwritable artifact store before any error (issue 38
# items 2 and 3); a server that is down is waited for by `reconnect` instead, with a message
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}


# HTTP statuses that say the server did not do the work and may later: a server whose own store
# (PostgreSQL, in the recipe's layout) restarts answers 503 TEMPORARILY_UNAVAILABLE for the whole
# restart; that crashed one host of two with a 118-line traceback (issue 48 item 6). A 500 is the
# server's own failure (an artifact store's full disk): not waited for.
UNAVAILABLE_STATUSES = (502, 503, 504)


def server_unreachable(exc: BaseException) -> bool:
    """Whether an MLflow client error means the tracking server could not be reached (refused,
    reset, a connect timeout, a connection it closed in the middle of its answer: "Connection
    broken: IncompleteRead", seen once in a fresh-clone CI as the server was stopped mid-log_batch)
    or answered that it cannot serve now (502, 503, 504, after MLflow's own retries), not that it
    answered with an error."""
    import requests

    from testbed.cluster.reconnect import caused_by, chain

    broken = (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError, ConnectionError)
    if caused_by(exc, broken):
        return True
    return any(_unavailable(e) for e in chain(exc))


def _unavailable(exc: BaseException) -> bool:
    """A 502/503/504: MLflow's retries exhausted on one (its message "too many 503 error
    responses", a requests RetryError in the chain), or the answer itself (a RestException)."""
    import re

    import requests

    text = str(exc)
    if isinstance(exc, requests.exceptions.RetryError) or "error responses" in text:
        said = re.search(r"too many (\d{3}) error responses", text)
        return bool(said) and int(said.group(1)) in UNAVAILABLE_STATUSES
    if type(exc).__name__ == "RestException" and hasattr(exc, "get_http_status_code"):
        return exc.get_http_status_code() in UNAVAILABLE_STATUSES
    return False


def server_service(uri: str) -> Any:
    """The tracking server at `uri` as a reconnecting service; a server database (PostgreSQL,
    MySQL) too: a 10 s restart of a PostgreSQL MLflow store failed `testbed run` ("MLflow logging
    failed: ... the database system is shutting down") and crashed `tune` with a traceback (issue 48
    service probes). None for SQLite and files."""
    from testbed.cluster.reconnect import Service, connection_lost, window_s
    from testbed.config.redact import redact

    if uri.split(":", 1)[0].split("+", 1)[0].lower() in ("postgresql", "mysql", "mssql"):
        window_s()
        import logging  # MLflow logs each failed call's traceback; the waiting line says it once

        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
        return Service(f"output.tracking_uri={redact(uri)}", connection_lost)
    if not uri.startswith(("http://", "https://")):
        return None

    window_s()  # a bad TESTBED_RECONNECT_S is refused now, not at the first outage
    for key, value in HTTP_DEFAULTS.items():  # a user's own setting wins
        os.environ.setdefault(key, value)
    return Service(f"output.tracking_uri={redact(uri)}", server_unreachable)


# MLflow's chart view puts sections named by a metric's prefix ("<section>/<name>") before its
# default "Model metrics" section, and sorts charts by key inside each: these four, logged once
# more under `headline/`, are the first charts a newcomer sees (was: chart 30 of 37)
HEADLINE = (("throughput_tok_s", "throughput tok/s", "{:.0f}"), ("ttft_mean_s", "TTFT mean s", "{:.3g}"),
            ("ttft_p99_s", "TTFT p99 s", "{:.3g}"), ("tpot_mean_s", "TPOT mean s", "{:.3g}"),
            ("slo_attainment", "SLO attainment", "{:.1%}"), ("bubble_ratio", "bubble ratio", "{:.3f}"))


def tracking_uri(out: OutputSettings) -> str:
    """`output.tracking_uri`, else the SQLite store in `output.dir`."""
    if out.tracking_uri:
        return str(out.tracking_uri)
    db = Path(out.dir).expanduser().resolve() / "mlflow.db"
    return f"sqlite:///{db}"


def artifact_root(out: OutputSettings) -> str:
    return (Path(out.dir).expanduser().resolve() / "mlartifacts").as_uri()


def check_tracking_uri(uri: str, timeout_s: float = 3.0, key: str = "output.tracking_uri") -> None:
    """Refuse a tracking URI that cannot work before anything runs: an unknown scheme, a SQLite
    file in a folder that cannot be written, or an http(s) server that does not answer within
    `timeout_s` (MLflow itself retries for minutes before failing)."""
    from urllib.parse import urlsplit

    from testbed.config.redact import redact

    shown = redact(uri)
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower() if ":" in uri else ""
    if scheme not in URI_SCHEMES:
        raise ConfigError(f"invalid {key}={shown!r}: unknown scheme {scheme or '(none)'!r}; "
                          f"valid schemes: {', '.join(URI_SCHEMES)}")
    from testbed.cluster.postgres import check_driver

    check_driver(uri, key)
    if scheme == "sqlite":
        path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        folder = Path(path).expanduser().parent if path else None
        if folder is None or not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ConfigError(f"invalid {key}={shown!r}: folder {folder} is not a writable directory")
    elif scheme in ("http", "https"):
        import socket

        parts = urlsplit(uri)
        host = parts.hostname
        port = parts.port or (443 if scheme == "https" else 80)
        if not host:
            raise ConfigError(f"invalid {key}={shown!r}: no host")
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            raise ConfigError(f"MLflow tracking server {shown} is not reachable ({exc.strerror or exc}); "
                              f"start it (mlflow server) or set {key} / output.mlflow=false") from None
        _check_host_allowed(uri, shown, key, timeout_s)


def _check_host_allowed(uri: str, shown: str, key: str, timeout_s: float) -> None:
    """MLflow 3's server answers 403 "Invalid Host header" to a client that names it by a host
    name outside `--allowed-hosts` (default: localhost and private IPs); `testbed tune` found out
    from a 46-line traceback after its study was created (issue 38 item 7). Any other answer is
    left to MLflow's client (a 401 needs its credentials)."""
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    probe = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
    try:
        urllib.request.urlopen(probe, timeout=timeout_s).close()
    except urllib.error.HTTPError as exc:
        body = exc.read(2000).decode("utf-8", "replace")
        if exc.code == 403 and "Invalid Host header" in body:
            netloc = urlsplit(uri).netloc.rpartition("@")[2]
            raise ConfigError(f"MLflow tracking server {shown} refuses the host name {netloc!r} (403 Invalid Host "
                              f"header): start it with --allowed-hosts {netloc} (MLflow 3 allows only localhost "
                              f"and private IPs by default; docs/beyond-one-machine.md)") from None
    except (OSError, ValueError):
        pass  # reachable a moment ago: what fails now is MLflow's client's to report


def _lock_for(uri: str):
    """A file lock beside a SQLite tracking DB (schema creation races between processes), the
    database's advisory lock for PostgreSQL (hosts race too: testbed/cluster/postgres.py); a
    no-op context for other stores."""
    from contextlib import nullcontext

    from testbed.cluster.postgres import advisory_lock, is_postgres

    if is_postgres(uri):
        return advisory_lock(uri, key="output.tracking_uri")
    if not uri.startswith("sqlite:///"):
        return nullcontext()
    from filelock import FileLock

    return FileLock(uri[len("sqlite:///"):] + ".lock", timeout=600)


# the tags that say which system ran: a `testbed serve` lists them, `testbed bench serve` logs the server's
SETUP_TAGS = ("policy", "model", "hardware", "hardware_version", "executor", "pp")


def run_tags(spec: RunSpec, command: str | None = None) -> dict[str, str]:
    """Tags shown in MLflow's run table and usable as filters (`tags.policy = 'gllm'`)."""
    rc, wl = spec.settings, spec.workload
    tags = {"policy": spec.policy_name, "workload": spec.workload_name, "executor": rc.executor.name,
            "model": str(getattr(rc.model, "name", None)), "hardware": str(getattr(rc.hardware, "name", None)),
            "hardware_version": str(getattr(rc.hardware, "version", None)), "pp": str(rc.parallel.pp)}
    if getattr(wl, "rate", None) is not None and getattr(wl, "arrival", "poisson") != "offline":
        tags["rate"] = str(spec.value_at("workload.rate"))  # as given: `workload.rate=2` is "2", not "2.0"
    from testbed.cluster.identity import host_name

    tags["host"] = host_name()  # which host ran it: report's `host` column (issue 24 item 7)
    if command:
        tags["mlflow.source.name"] = command
        tags["mlflow.source.type"] = "LOCAL"
    return tags


def run_metrics(result, steps: bool = True) -> list[tuple[str, float, int]]:
    """(key, value, step) of a result: the summary, `run.*` timings and, with `steps`, the
    downsampled step series; the HEADLINE_METRICS again under `headline/` (see there)."""
    out: list[tuple[str, float, int]] = []
    for k, v in result.summary.items():
        if isinstance(v, list):
            out += [(f"{k}.stage{i}", float(x), 0) for i, x in enumerate(v)]
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append((k, float(v), 0))
            if k in HEADLINE_METRICS:
                out.append((f"{HEADLINE_SECTION}/{k}", float(v), 0))
    if getattr(result, "breakdown", None):  # where each stage's time went (engine/core/breakdown.py)
        from engine.core.breakdown import flat_metrics

        out += [(k, v, 0) for k, v in flat_metrics(result.breakdown).items()]
    for k in ("simulation_s", "engine_s", "end_to_end_s"):  # one name per time (testbed/run/timing.py)
        if k in result.info:
            out.append((f"time.{k}", float(result.info[k]), 0))
    if "microbatches_per_wall_s" in result.info:
        out.append(("run.microbatches_per_wall_s", float(result.info["microbatches_per_wall_s"]), 0))
    mbs = result.microbatches if steps else []
    stride = max(1, math.ceil(len(mbs) / MAX_STEP_POINTS))
    for m in mbs[::stride]:
        out.append(("step.kv_usage", float(m["kv_usage"]), int(m["mb_id"])))
        out.append(("step.tokens_per_microbatch", float(m["num_tokens"]), int(m["mb_id"])))
    return out


# 2 processes instead of 15 (4 uvicorn workers, a job runner and its huey consumers, each importing
# MLflow's server): the first page after 27 s instead of 102 s, 5 s of CPU instead of 14 (2-core
# machine at load ~20; docs/tuning-and-comparing.md#looking-at-the-results)
MLFLOW_UI = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false {mlflow} ui --workers 1"
LOCAL_UI = "http://127.0.0.1:5000"


def mlflow_ui() -> str:
    """The command that starts MLflow's UI with the `mlflow` of this Python's environment by
    absolute path: the printed line works from any shell, not only an activated venv (`mlflow:
    command not found` in a fresh one, issue 49 item 8)."""
    import shlex
    import shutil

    beside = Path(sys.executable).with_name("mlflow")  # the venv's bin/, symlinks not followed
    exe = str(beside) if beside.is_file() else (shutil.which("mlflow") or "mlflow")
    return MLFLOW_UI.format(mlflow=shlex.quote(exe))


def chart_link(uri: str, experiment_id: str, view: str = ALL_RUNS) -> str:
    """The line that opens this experiment's runs as charts in MLflow's UI, in the saved `view`
    (testbed/tracking/views.py: every run shown, headline section first, two charts a row)."""
    from testbed.config.redact import redact

    if uri.startswith(("http://", "https://")):  # the tracking server serves the UI itself
        return f"MLflow charts: {view_link(redact(uri.rstrip('/')), experiment_id, view)}"
    return (f"MLflow charts: {mlflow_ui()} --backend-store-uri {redact(uri)}, then open "
            f"{view_link(LOCAL_UI, experiment_id, view)}")


def figure_link(uri: str, experiment_id: str, run_id: str, path: str) -> str:
    """The page of one logged figure (MLflow's artifact view of the run), for the same UI as `chart_link`."""
    from testbed.config.redact import redact

    base = redact(uri.rstrip("/")) if uri.startswith(("http://", "https://")) else LOCAL_UI
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}/artifactPath/{path}?workflowType=machine_learning"


def note(result) -> str:
    """The run's description (tag mlflow.note.content, shown on the run page): one line of what
    ran and the headline numbers."""
    s, spec = result.summary, result.spec
    rc, wl = spec.settings, spec.workload
    given = getattr(wl, "rate", None) is not None and getattr(wl, "arrival", None) != "offline"
    rate = f", {spec.value_at('workload.rate')} req/s" if given else ""
    head = (f"**{spec.policy_name}** on {spec.workload_name}{rate}, {s['num_requests']} requests; "
            f"{getattr(rc.model, 'name', None)} on {rc.parallel.pp} x "
            f"{getattr(rc.hardware, 'name', None)} ({result.info.get('executor', 'sim')})")
    cells = [(label, fmt.format(s[k])) for k, label, fmt in HEADLINE
             if isinstance(s.get(k), (int, float)) and not math.isnan(s[k])]
    table = "| " + " | ".join(c[0] for c in cells) + " |\n|" + "---|" * len(cells) + "\n| " + \
            " | ".join(c[1] for c in cells) + " |"
    err = f"\n\n**failed:** {result.error}" if result.error else ""
    return f"{head}\n\n{table}{err}"


def small_artifacts(run_dir: Path | None) -> list[Path]:
    if run_dir is None:
        return []
    return [run_dir / n for n in SMALL_ARTIFACTS
            if (run_dir / n).is_file() and (run_dir / n).stat().st_size <= MAX_ARTIFACT_BYTES]


def _seed_sqlite_store(uri: str) -> None:
    """A new SQLite store appears complete or not at all. It starts as a copy of an empty,
    migrated one kept in the cache (`<cache>/mlflow/empty-<mlflow version>.db`): MLflow's
    migrations take ~7 s, a copy milliseconds. Without that copy the store is migrated in a
    temporary file beside it, renamed into place when done (and saved as the copy): migrated in
    place, a kill during the first migrations left a half-made store that failed every later run
    with "duplicate column name". Called under the store's file lock, so any temporary file left
    beside it belongs to a process that was killed, and is removed."""
    if not uri.startswith("sqlite:///"):
        return
    import shutil

    import mlflow
    from workloads.data import cache_dir

    db = Path(uri[len("sqlite:///"):])
    if db.exists() and db.stat().st_size > 0:
        _check_is_mlflow(db)
        return
    for stale in db.parent.glob(f"{db.name}.*.creating*"):
        stale.unlink(missing_ok=True)
    template = cache_dir() / "mlflow" / f"empty-{mlflow.__version__}.db"
    tmp = db.with_name(f"{db.name}.{os.getpid()}.creating")
    try:
        shutil.copyfile(template, tmp)
    except OSError:  # no copy yet (or no cache): migrate one
        _migrate(tmp)
        _save_template(tmp, template)
    os.replace(tmp, db)


def _check_is_mlflow(db: Path) -> None:
    """An existing SQLite file with tables but none of MLflow's belongs to another application:
    MLflow added its tables to it without a word (issue 48 item 7). Refused, naming its tables."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as con:
            tables = {r[0] for r in con.execute("select name from sqlite_master where type = 'table'")}
    except sqlite3.Error:
        return  # MLflow's own error says what the file is
    if tables and not tables & {"experiments", "alembic_version"}:
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        raise ConfigError(f"{db} is not an MLflow database (its tables: {shown}): it belongs to another "
                          f"application; name another output.dir or output.tracking_uri")


def _migrate(path: Path) -> None:
    from mlflow.tracking import MlflowClient

    path.unlink(missing_ok=True)
    MlflowClient(f"sqlite:///{path}").search_experiments()  # creates and migrates


def _save_template(db: Path, template: Path) -> None:
    """Keep a migrated empty store in the cache for the next new store (skipped if the cache
    cannot be written)."""
    import shutil

    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        tmp = template.with_name(f"{template.name}.{os.getpid()}.tmp")
        shutil.copyfile(db, tmp)
        os.replace(tmp, template)
    except OSError:
        pass


class Tracker:
    """Thin wrapper over MlflowClient: explicit run ids, no thread-local active-run stack
    (MLflow's active run is thread-local since mlflow PR 13456), so nested runs work from any worker."""

    def __init__(self, output: OutputSettings | None = None, experiment: str | None = None, *,
                 uri: str | None = None, artifact_location: str | None = None, journal: str | None = None) -> None:
        """`output`: the run's `output.*` (tracking URI, experiment, artifact folder); None with
        `uri` given. `journal`: the folder whose unwritten run ends this store is owed
        (cluster/unwritten.py; by default `output.dir`)."""
        import mlflow
        from mlflow.tracking import MlflowClient

        from testbed.cluster.postgres import check_driver

        folder = journal or (getattr(output, "dir", None) if output else None)  # its journal of unwritten ends
        output = output or OutputSettings()
        self.uri = uri or tracking_uri(output)
        check_driver(self.uri, "output.tracking_uri")
        if self.uri.startswith(("http://", "https://")):  # one line now, not MLflow's minutes of retries
            check_tracking_uri(self.uri)
        if self.uri.startswith("sqlite:///"):
            Path(self.uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        mlflow.set_tracking_uri(self.uri)
        name = experiment or output.experiment or "testbed"
        with _lock_for(self.uri):
            _seed_sqlite_store(self.uri)
            self.client = LockRetryingClient(MlflowClient(self.uri), server_service(self.uri))
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                try:
                    from testbed.cluster.artifacts import experiment_location

                    loc = experiment_location(self.uri, artifact_location or artifact_root(output))
                    self.experiment_id = self.client.create_experiment(name, artifact_location=loc)
                except Exception:  # created concurrently by a process on another store lock (http)
                    self.experiment_id = self.client.get_experiment_by_name(name).experiment_id
            else:
                self.experiment_id = exp.experiment_id
            if exp is None or EXPERIMENT_KIND[0] not in (exp.tags or {}):
                # marks the experiment as model training, not GenAI. (MLflow 3.17's UI still opens
                # in its GenAI mode, "Traces 0", until "Model training" is picked once or the link
                # carries ?workflowType=machine_learning, as `testbed run` prints it.)
                self.client.set_experiment_tag(self.experiment_id, *EXPERIMENT_KIND)
            self.view = ALL_RUNS
            if exp is None or TAG_PREFIX + ALL_RUNS not in (exp.tags or {}):
                self.client.set_experiment_tag(self.experiment_id, *headline_view(HEADLINE_METRICS).tag())
        from testbed.cluster.unwritten import end_runs

        for line in end_runs(folder, self):  # what a command of this folder could not end when it gave up
            print(f"note: {line}", file=sys.stderr, flush=True)

    def save_view(self, view: View) -> None:
        """Write `view` on the experiment; `link` opens it from now on."""
        self.client.set_experiment_tag(self.experiment_id, *view.tag())
        self.view = view.key

    @property
    def link(self) -> str:
        return chart_link(self.uri, self.experiment_id, self.view)

    def start(self, spec: RunSpec, run_name: str, parent_run_id: str | None = None,
              tags: Mapping[str, str] | None = None) -> str:
        """A run with the spec's params and tags."""
        return self.start_flat(spec.params(), run_name, {**run_tags(spec), **(tags or {})}, parent_run_id)

    def start_flat(self, params: Mapping[str, Any], run_name: str, tags: Mapping[str, str],
                   parent_run_id: str | None = None) -> str:
        from mlflow.entities import Param

        all_tags = dict(tags)
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        run_id = run.info.run_id
        plist = [Param(k, _param_value(v)) for k, v in sorted(params.items())]
        try:
            for i in range(0, len(plist), 100):
                self.client.log_batch(run_id, params=plist[i:i + 100])
        except Exception as exc:  # the caller ends (or journals) the run it could not be told of
            exc.opened_run_id = run_id  # type: ignore[attr-defined]
            raise
        return run_id

    def finish(self, run_id: str, result, run_dir: Path | None, steps: bool = True,
               status: str | None = None) -> None:
        """Log the summary (and, with `steps`, the step series; with `run_dir`, its small files)
        and close the run. Tuning trials skip steps and artifacts: they cost ~0.6 s a trial."""
        tags = {"mlflow.note.content": note(result)}
        if run_dir is not None:
            tags["testbed.run_dir"] = str(Path(run_dir).resolve())
        if result.error:
            tags["error"] = result.error[:5000]
        self.finish_flat(run_id, run_metrics(result, steps), tags, small_artifacts(run_dir),
                         status or ("FAILED" if result.error else "FINISHED"))

    def finish_flat(self, run_id: str, metrics: list, tags: Mapping[str, str], artifacts: list,
                    status: str) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        ms = [Metric(k, float(v), now, int(step)) for k, v, step in metrics]
        tag_list = [RunTag(k, str(v)) for k, v in tags.items()]
        for i in range(0, max(len(ms), 1), 1000):
            self.client.log_batch(run_id, metrics=ms[i:i + 1000], tags=tag_list if i == 0 else [])
        from testbed.cluster.artifacts import log_files

        error = log_files(self.client, run_id, artifacts)  # tags the run `artifact_error`
        if error:  # e.g. a full disk under the artifact store, a server's HTTP 500: the run still ends, FAILED
            self.client.set_terminated(run_id, "FAILED")
            from testbed.cluster.artifacts import ArtifactStoreError

            raise ArtifactStoreError(f"the files of MLflow run {run_id} were not logged: {error}")
        self.client.set_terminated(run_id, status)

    def running_run_with_tag(self, key: str, value: str) -> str | None:
        """The id of this experiment's RUNNING run whose tag `key` is `value` (None if none)."""
        runs = self.client.search_runs([self.experiment_id], filter_string="attributes.status = 'RUNNING'",
                                       max_results=1000)
        return next((r.info.run_id for r in runs if r.data.tags.get(key) == value), None)

    def fail(self, run_id: str, error: BaseException | str, status: str = "FAILED") -> None:
        self.client.set_tag(run_id, "error", str(error)[:5000])
        self.client.set_terminated(run_id, status)


def _param_value(v: Any) -> str:
    s = "null" if v is None else str(v)
    return s if len(s) <= 6000 else s[:5997] + "..."


def record_run_end(start: Mapping[str, Any], run_id: str | None, run_dir: str | None, metrics: list,
                   tags: Mapping[str, str], status: str) -> tuple[str, str]:
    """`testbed run`'s fallback when its MLflow background process died or stopped answering:
    record the run's end from the main process, so the run never stays RUNNING. `start` is what
    the background process was asked to open; the run is found by id, else by its
    `testbed.run_dir` tag, else opened here. Returns (run id, experiment id)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # bounded, like the background process
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    tracker = Tracker(None, start["experiment"], uri=start["uri"], artifact_location=start.get("artifact_location"))
    if run_id is None:
        run_id = tracker.running_run_with_tag("testbed.run_dir", str((start.get("tags") or {}).get("testbed.run_dir")))
    if run_id is None:
        run_id = tracker.start_flat(start.get("params") or {}, start["run_name"], start.get("tags") or {})
    tracker.finish_flat(run_id, metrics, tags, small_artifacts(Path(run_dir) if run_dir else None), status)
    return run_id, tracker.experiment_id
