"""Running commands side by side against shared stores, without a server (issue 24): worker
identities that are not host names, the budget, SIGTERM touching only one's own trial runs, the
PostgreSQL driver's error line, unique comparison names, the `host` tag, artifact errors that end
the runs. The tests with real PostgreSQL and mlflow servers are in test_services.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mlflow_db import fresh_mlflow_db
from testbed.cli import main

BASE = ["policy=sarathi", "workload=synthetic", "workload.num_requests=60", "workload.arrival=offline",
        "model=llama2-13b", "hardware=a100-80g", "parallel.pp=2", "output.plots=false", "output.progress=false"]


def _sqlite_study(tmp_path: Path, name: str = "s"):
    import optuna

    return optuna.create_study(study_name=name, storage=f"sqlite:///{tmp_path}/optuna.db", direction="maximize")


def test_a_same_named_hosts_live_trial_is_not_failed(tmp_path):
    """Two hosts with one name: the other's trial (its pid not alive here) was failed as if its
    worker were a dead local process, and that worker died with UpdateFinishedTrialError."""
    from testbed.cluster import identity
    from testbed.tune.storage import fail_stale

    study = _sqlite_study(tmp_path)
    other, dead_here = study.ask(), study.ask()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    me = identity.this_worker(0)
    for t, ns, wid in ((other, "another-boot:4026531836", f"{me.host}-abc.0"),
                       (dead_here, me.namespace, f"{me.host}-def.0")):
        t.set_user_attr("worker", wid)  # the same host name on both
        study.set_user_attr(f"worker:{wid}", {"host": me.host, "pid": int(dead), "namespace": ns})
    assert len(fail_stale(study, study._storage, None)) == 1
    states = {t.number: t.state.name for t in study.get_trials()}
    assert states == {other.number: "RUNNING", dead_here.number: "FAIL"}


def test_a_trial_no_worker_claimed_is_failed_once_no_other_worker_lives(tmp_path):
    """A worker killed between Optuna's `ask` and its claim left a RUNNING trial with no owner,
    which nothing failed on SQLite (no heartbeat): a killed `tune` kept it RUNNING for good. It is
    failed once every other registered worker is gone, and left alone while one lives."""
    from testbed.cluster import identity
    from testbed.tune.storage import fail_stale

    study = _sqlite_study(tmp_path)
    me = identity.this_worker(0)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        study.set_user_attr(f"worker:{me.host}-live.0", {"host": me.host, "pid": live.pid, "namespace": me.namespace})
        unclaimed = study.ask()
        assert fail_stale(study, study._storage, None) == []  # the live worker may be about to claim it
        assert study.get_trials()[0].state.name == "RUNNING"
    finally:
        live.kill()
        live.wait()
    study.set_user_attr(f"worker:{me.host}-me.0", me.process())  # this process: never a reason to wait
    notes = fail_stale(study, study._storage, None)
    assert len(notes) == 1 and f"trial {unclaimed.number}" in notes[0]
    assert study.get_trials()[0].state.name == "FAIL"


def test_retried_and_interrupted_trials_do_not_count():
    import optuna
    from optuna.trial import TrialState

    from testbed.tune.storage import counted

    done = optuna.trial.create_trial(state=TrialState.COMPLETE, value=1.0)
    stale = optuna.trial.create_trial(state=TrialState.FAIL)
    stale.number = 1
    retry = optuna.trial.create_trial(state=TrialState.WAITING, system_attrs={"failed_trial": 1, "retry_history": [1]})
    stopped = optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={"interrupted": True})
    done.number, retry.number, stopped.number = 0, 2, 3
    assert counted([done, stale, retry, stopped]) == 1  # the retry counts once it runs, the stale one never
    retry.state = TrialState.RUNNING
    assert counted([done, stale, retry, stopped]) == 2


def test_one_trial_runs_the_enqueued_defaults(tmp_path):
    """The enqueued trial 0 (WAITING) counted toward `tune.trials`: `tune.trials=1` ran nothing."""
    import optuna

    assert main(["tune", *BASE, f"output.dir={tmp_path}", "output.mlflow=false", "tune.trials=1",
                 "tune.study=one"]) == 0
    trials = optuna.load_study(study_name="one", storage=f"sqlite:///{tmp_path}/optuna.db").trials
    assert [(t.state.name, t.user_attrs.get("baseline")) for t in trials] == [("COMPLETE", True)]


def test_sigterm_ends_only_this_sessions_trial_runs(tmp_path):
    """A stopped host ended every RUNNING trial run of the study KILLED with error=interrupted,
    the other host's live ones included (issue 24 item 3)."""
    from testbed.tracking.tracker import Tracker
    from testbed.tune.reclaim import kill_running_trials

    tracker = Tracker({}, "tune-x", uri=fresh_mlflow_db(tmp_path))
    parent = tracker.client.create_run(tracker.experiment_id).info.run_id
    runs = {s: tracker.client.create_run(tracker.experiment_id, tags={"mlflow.parentRunId": parent,
                                                                     "testbed.session": s, "worker": f"{s}.0"})
            .info.run_id for s in ("host-a-1111", "host-b-2222")}
    kill_running_trials(tracker, parent, session="host-a-1111")
    status = {s: tracker.client.get_run(r).info.status for s, r in runs.items()}
    assert status == {"host-a-1111": "KILLED", "host-b-2222": "RUNNING"}
    assert "error" not in tracker.client.get_run(runs["host-b-2222"]).data.tags


def test_trials_carry_worker_identities_and_host_tags(tmp_path, monkeypatch):
    """Workers are `<session>.<index>`, not host names; every run is tagged with its host."""
    import optuna
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("TESTBED_HOST", "lab-a")
    uri = fresh_mlflow_db(tmp_path)
    # two commands on one study (the second resumes it): two sessions
    assert main(["tune", *BASE, f"output.dir={tmp_path}", "tune.trials=2", "tune.study=ids"]) == 0
    assert main(["tune", *BASE, f"output.dir={tmp_path}", "tune.trials=3", "tune.study=ids"]) == 0
    study = optuna.load_study(study_name="ids", storage=f"sqlite:///{tmp_path}/optuna.db")
    workers = [t.user_attrs["worker"] for t in study.trials]
    assert len(workers) == 3 and len(set(workers)) == 2, workers
    assert all(w.startswith("lab-a-") and w.endswith(".0") for w in workers), workers
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("tune-ids")
    runs = client.search_runs([exp.experiment_id])
    assert {r.data.tags.get("host") for r in runs} == {"lab-a"}
    trial_runs = [r for r in runs if r.data.tags.get("testbed.kind") == "trial"]
    assert sorted(r.data.tags["worker"] for r in trial_runs) == sorted(workers)


def test_a_missing_postgres_driver_names_what_to_install(tmp_path, capsys, monkeypatch):
    """`postgresql://` needs psycopg 3 under SQLAlchemy 2.1; the error named no module and no extra."""
    for module in ("psycopg", "psycopg2"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    code = main(["tune", *BASE, f"output.dir={tmp_path}", "tune.trials=1",
                 "tune.storage=postgresql://lab:s3cret-pw@127.0.0.1:1/optuna"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "psycopg" in err and "pip install -e '.[postgres]'" in err and "s3cret-pw" not in err


def test_default_comparison_names_differ_within_one_second():
    """`compare-<UTC second>` collided across hosts; report then listed every point twice."""
    from testbed.sweep.compare import default_name

    names = {default_name() for _ in range(20)}
    assert len(names) == 20 and all(n.startswith("compare-") for n in names)


def test_an_unwritable_artifact_store_fails_compare_before_any_point(tmp_path, capsys):
    """Where the experiment's artifact store cannot be written, compare crashed with OSError and
    left its MLflow runs RUNNING (issue 24 item 1); on a server it then stalled ~4 min and printed
    a 93-line traceback (issue 38 item 3). Now it stops before any point with one `error:` line,
    exit 1, and its summary run FAILED with the reason."""
    from mlflow.tracking import MlflowClient

    uri = fresh_mlflow_db(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    client = MlflowClient(uri)
    exp_id = client.create_experiment("grid", artifact_location=(blocker / "store").as_uri())
    code = main(["compare", *BASE, f"output.dir={tmp_path}", "policy.token_budget=256,512",
                 "compare.experiment=grid"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.count("error:") == 1 and "cannot be written" in err and "Traceback" not in err, err
    runs = client.search_runs([exp_id])
    assert [r.data.tags.get("testbed.kind") for r in runs] == ["compare"]  # no point ran
    assert runs[0].info.status == "FAILED" and "artifact_error" in runs[0].data.tags


def test_bad_heartbeat_settings_are_one_line(tmp_path, capsys):
    for args, needle in ((["tune.heartbeat=5", "tune.grace_period=2"], "tune.grace_period=2 must be longer"),
                         (["tune.heartbeat=often"], "tune.heartbeat"), (["tune.grace_period=0"], "tune.grace_period")):
        code = main(["tune", *BASE, f"output.dir={tmp_path}", "output.mlflow=false", *args])
        err = capsys.readouterr().err
        assert code == 2 and err.count("error:") == 1 and needle in err, err


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip())


def test_a_stranded_trial_whose_run_recorded_results_is_completed_not_run_again(tmp_path):
    """A worker that lost the study's database after its trial's MLflow run FINISHED left the
    trial RUNNING, and the next command failed it and ran the work again (issue 38 item 1). Now
    it is completed with the values its run recorded, and reported by name."""
    from testbed.cluster import identity
    from testbed.tune.problem import prepare
    from testbed.tune.reclaim import reclaim
    from testbed.tune.storage import create_or_load, make_sampler
    from testbed.tune.trial import open_tracker

    fresh_mlflow_db(tmp_path)
    problem = prepare([*BASE, f"output.dir={tmp_path}", "tune.study=rec"])
    s = problem.settings
    study, storage = create_or_load(problem.study, problem.storage_url, s.directions, s.objectives,
                                    make_sampler("random", 0, 1))
    tracker = open_tracker(problem)
    done, lost = study.ask(), study.ask()
    me = identity.this_worker(0)
    for t, wid in ((done, f"{me.host}-aaa.0"), (lost, f"{me.host}-bbb.0")):
        t.set_user_attr("worker", wid)
        study.set_user_attr(f"worker:{wid}", {"host": me.host, "pid": _dead_pid(), "namespace": me.namespace})
        run_id = tracker.start_flat({}, f"trial-{t.number:04d}", {"optuna.trial": str(t.number)})
        t.set_user_attr("mlflow_run_id", run_id)
    tracker.finish_flat(study.trials[0].user_attrs["mlflow_run_id"], [("throughput_tok_s", 1234.5, 0), ("slo_attainment", 0.75, 0)], {}, [],
                        "FINISHED")
    notes = reclaim(study, storage, tracker, problem)
    trials = study.get_trials()
    assert trials[0].state.name == "COMPLETE" and trials[0].value == 1234.5
    assert trials[0].user_attrs["summary"]["slo_attainment"] == 0.75
    assert trials[1].state.name == "FAIL" and trials[1].user_attrs["interrupted"]  # no results: runs again
    assert notes == [f"trial 0 (worker {me.host}-aaa.0, gone): completed from its recorded results",
                     f"trial 1 (worker {me.host}-bbb.0, gone): failed (interrupted); it runs again"]


def test_an_interrupted_baseline_is_enqueued_again(tmp_path):
    """Trial 0, the defaults, interrupted (a stop, a lost Ray task) was never run again, while
    one reclaimed through its heartbeat was (issue 38 item 5)."""
    from testbed.tune.command import enqueue_baseline
    from testbed.tune.problem import prepare
    from testbed.tune.storage import create_or_load, make_sampler, mark_interrupted

    problem = prepare([*BASE, f"output.dir={tmp_path}", "tune.study=base", "tune.trials=3"])
    s = problem.settings
    study, storage = create_or_load(problem.study, problem.storage_url, s.directions, s.objectives,
                                    make_sampler("random", 0, 1))
    enqueue_baseline(problem, study)
    first = study.ask()
    assert first.user_attrs.get("baseline")
    assert mark_interrupted(storage, first._trial_id)
    enqueue_baseline(problem, study)
    again = study.ask()
    assert again.user_attrs.get("baseline") and again.params == first.params
    enqueue_baseline(problem, study)  # the rerun is running: not enqueued a third time
    assert [t.state.name for t in study.get_trials()] == ["FAIL", "RUNNING"]


def test_a_lost_service_is_waited_for_said_so_and_then_given_up(monkeypatch, capsys):
    """What a PostgreSQL or mlflow server restart meets (issue 38 items 1-2): calls that cannot
    reach the service are tried again, with one line when the wait starts and one when it ends;
    other errors are not retried; past the window, ServiceLost (exit 1), and at once after that."""
    import time

    import pytest

    from testbed.cluster import reconnect

    monkeypatch.setattr(reconnect, "WAITS_S", (0.01,))
    monkeypatch.setenv(reconnect.ENV, "0.3")
    svc = reconnect.Service(f"svc-{time.monotonic_ns()}", lambda e: isinstance(e, ConnectionRefusedError))
    calls = []

    def flaky() -> int:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError("refused")
        return 42

    assert reconnect.call(svc, flaky) == 42 and len(calls) == 3
    err = capsys.readouterr().err
    assert err.count(f"warning: {svc.name} is unreachable (ConnectionRefusedError: refused); waiting") == 1
    assert f"{svc.name} is reachable again after" in err

    def wrong() -> None:
        calls.append(1)
        raise ValueError("bad request")

    calls.clear()
    with pytest.raises(ValueError):
        reconnect.call(svc, wrong)
    assert len(calls) == 1

    def down() -> None:
        calls.append(1)
        raise ConnectionRefusedError("refused")

    calls.clear()
    with pytest.raises(reconnect.ServiceLost, match=f"{svc.name} stayed unreachable for 0.3 s") as lost:
        reconnect.call(svc, down)
    assert lost.value.exit_code == 1 and len(calls) > 1
    calls.clear()
    with pytest.raises(reconnect.ServiceLost):
        reconnect.call(svc, down)  # given up already: the cleanup that follows does not wait again
    assert len(calls) == 1
    monkeypatch.setenv(reconnect.ENV, "soon")
    with pytest.raises(Exception, match="invalid TESTBED_RECONNECT_S='soon'"):
        reconnect.window_s()


def test_what_a_command_gave_up_on_is_its_own(monkeypatch, capsys):
    """The services a command waited a whole window for are its `Outages`' (review of issue 48: a
    module-global set once made the next command in the process fail at once without waiting):
    another owner, and the next command (`for_command`, as `cli.main` runs each), wait again."""
    import pytest

    from testbed.cluster import reconnect

    monkeypatch.setattr(reconnect, "WAITS_S", (0.01,))
    monkeypatch.setenv(reconnect.ENV, "0.1")
    svc = reconnect.Service("svc", lambda e: isinstance(e, ConnectionRefusedError))
    calls = []

    def down() -> None:
        calls.append(1)
        raise ConnectionRefusedError("refused")

    def tries(call) -> int:
        calls.clear()
        with pytest.raises(reconnect.ServiceLost):
            call(svc, down)
        return len(calls)

    one, two = reconnect.Outages(), reconnect.Outages()
    assert tries(one.call) > 1 and one.given_up(svc)
    assert tries(one.call) == 1  # the same owner: at once
    assert not two.given_up(svc) and tries(two.call) > 1  # another owner: waited for again
    with reconnect.for_command() as first:
        assert tries(reconnect.call) > 1 and tries(reconnect.call) == 1 and first.given_up(svc)
    with reconnect.for_command() as second:
        assert tries(reconnect.call) > 1 and second is not first
    err = capsys.readouterr().err
    assert err.count("warning: svc is unreachable") == 4  # once per owner that waited


def test_storage_errors_that_mean_a_lost_database_are_told_apart():
    import optuna
    from sqlalchemy import exc as sa_exc

    from testbed.tune.storage import connection_lost

    def wrapped(cause: BaseException) -> BaseException:
        try:
            try:
                raise cause
            except Exception as inner:
                raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from inner
        except Exception as outer:
            return outer

    closed = sa_exc.OperationalError("SELECT 1", {}, Exception("server closed the connection unexpectedly"))
    assert connection_lost(wrapped(closed))
    assert not connection_lost(wrapped(sa_exc.IntegrityError("INSERT", {}, Exception("duplicate key"))))
    assert not connection_lost(ValueError("bad"))
