"""A study shared through PostgreSQL and an MLflow server, as two hosts would run it (issue 24):
real servers from tests/services.py (one PostgreSQL and one mlflow server per session), each
"host" a `testbed` process with its own working folder and TESTBED_HOST. Tiny workloads: a
trial of 60 requests takes ~0.1 s, one of 3,000 ~0.85 s; the kill tests use 10,000 (a 3,000-request
trial seen RUNNING could end before the kill landed at load ~12-16)."""
from __future__ import annotations

import json
import secrets
import shutil
import signal
import threading
import time

import pytest

from services import PASSWORD, WAIT_S, Host
from testbed.cli import main
from testbed.config.overrides import merge

pytestmark = pytest.mark.services

BASE = ["policy=sarathi", "workload=synthetic", "workload.num_requests=60", "workload.arrival=offline",
        "model=llama2-13b", "hardware=a100-80g", "parallel.pp=2", "output.plots=false", "output.progress=false"]


def _tune(storage: str, tracking: str, study: str, *extra: str) -> list[str]:
    return ["tune", *merge(BASE, ["output.dir=runs", f"tune.storage={storage}", f"output.tracking_uri={tracking}",
                                  f"tune.study={study}"], extra)]


def _runs(tracking: str, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking)
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id], max_results=1000)


def _both(hosts: list[Host]) -> None:
    codes = [h.wait() for h in hosts]
    assert codes == [0, 0], [h.output[-2000:] for h in hosts]
    for h in hosts:
        assert PASSWORD not in h.output


def test_two_hosts_start_one_study_together(postgres, mlflow_server, tmp_path):
    """On a fresh PostgreSQL database both start (was: UniqueViolation pg_type_typname_nsp_index,
    exit 2), the study has one parent run (was: two) and trial 0, the defaults, runs once (was:
    twice in 4 of 10). Both hosts carry the same host name, as two containers of one image do."""
    import optuna

    storage, name = postgres.new_database("optuna"), f"shared-{secrets.token_hex(3)}"
    hosts = [Host(tmp_path / h, "lab", *_tune(storage, mlflow_server.base, name, "tune.trials=8",
                                            "workload.num_requests=300")) for h in ("a", "b")]
    _both(hosts)
    trials = optuna.load_study(study_name=name, storage=storage).trials
    assert {t.state.name for t in trials} == {"COMPLETE"}
    assert 8 <= len(trials) <= 9  # one ask per host may race the other's count: at most one over
    assert sum(bool(t.user_attrs.get("baseline")) for t in trials) == 1
    runs = _runs(mlflow_server.base, f"tune-{name}")
    parents = [r for r in runs if r.data.tags.get("testbed.kind") == "study"]
    assert len(parents) == 1
    trial_runs = [r for r in runs if r.data.tags.get("testbed.kind") == "trial"]
    assert len(trial_runs) == len(trials) and "RUNNING" not in {r.info.status for r in runs}
    assert {r.data.tags["mlflow.parentRunId"] for r in trial_runs} == {parents[0].info.run_id}
    assert {r.data.tags["host"] for r in runs} == {"lab"}
    assert {t.user_attrs["worker"] for t in trials} <= {r.data.tags["worker"] for r in trial_runs}


def _live_trials(storage: str, name: str) -> list:
    """The study's trials RUNNING with their MLflow run open ([] before the study exists)."""
    import optuna

    try:
        trials = optuna.load_study(study_name=name, storage=storage).trials
    except KeyError:
        return []
    return [t for t in trials if t.state.name == "RUNNING" and t.user_attrs.get("mlflow_run_id")]


def _wait_running(host: Host, storage: str, name: str) -> object:
    """The first trial RUNNING with its MLflow run open (fails loudly if the host ends first,
    or after WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert host.proc.poll() is None, f"exit {host.proc.poll()}: {host.output[-2000:]}"
        live = _live_trials(storage, name)
        if live:
            return live[0]
        time.sleep(0.2)
    pytest.fail(f"no trial of {name} started within {WAIT_S} s")


def _killed_in_a_trial(tmp_path, postgres, tracking: str, prefix: str, *extra: str, number: int | None = None):
    """A host SIGKILLed inside a trial whose results it had not recorded (its MLflow run still
    RUNNING; trial `number` if given): (storage, study name, args, that trial). Skips where the
    host cannot have its own pid namespace (in this one a dead worker is seen at once: marked
    interrupted). The trial is chosen after the kill, and the whole set-up tried again when the
    kill missed: under load (~12-16) a 3,000-request trial (0.85 s) seen RUNNING had finished before
    the kill landed, and the next host rightly completed it from its FINISHED run (the test read
    COMPLETE, not FAIL), or the host ended its study between two polls."""
    import optuna
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking)
    for attempt in range(4):
        storage, name = postgres.new_database("optuna"), f"{prefix}-{secrets.token_hex(3)}"
        args = _tune(storage, tracking, name, *extra)
        host = Host(tmp_path / f"a{attempt}", "lab-a", *args)
        if not host.isolated:
            host.kill()
            pytest.skip("needs unshare --pid (root) to imitate another host's process table")
        study, deadline = None, time.monotonic() + WAIT_S
        while host.proc.poll() is None and time.monotonic() < deadline:
            try:  # one storage for the whole wait: a load_study per poll took most of a trial under load
                study = study or optuna.load_study(study_name=name, storage=storage)
            except KeyError:  # not created yet
                pass
            if study and any(t.user_attrs.get("mlflow_run_id") for t in study.get_trials(states=(
                    optuna.trial.TrialState.RUNNING,))):
                break
            time.sleep(0.05)
        host.kill()
        stranded = [t for t in _live_trials(storage, name) if (number is None or t.number == number)
                    and client.get_run(t.user_attrs["mlflow_run_id"]).info.status == "RUNNING"]
        if stranded:
            return storage, name, args, stranded[0]
    pytest.fail("four kills in a row missed a trial in flight")

def test_a_killed_hosts_trial_is_failed_and_retried_by_another(postgres, mlflow_server, tmp_path):
    """A SIGKILLed host's trial stayed RUNNING for good and counted toward the budget (19
    results for 20 trials). Now its heartbeat goes stale, another host fails it, runs it again
    with the same parameters, and the budget counts finished trials."""
    import optuna

    storage, name, args, victim = _killed_in_a_trial(tmp_path, postgres, mlflow_server.base, "killed", "tune.trials=3",
                                                     "workload.num_requests=10000", "tune.heartbeat=1",
                                                     "tune.grace_period=2")
    time.sleep(3)  # past the grace period: no heartbeat can come from a killed process
    second = Host(tmp_path / "b", "lab-b", *args)
    assert second.wait() == 0, second.output[-2000:]
    trials = optuna.load_study(study_name=name, storage=storage).trials
    dead = trials[victim.number]
    assert dead.state.name == "FAIL"
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == victim.number]
    assert len(retries) == 1 and retries[0].state.name == "COMPLETE" and retries[0].params == dead.params
    assert sum(t.state.name == "COMPLETE" for t in trials) == 3
    runs = {r.info.run_id: r for r in _runs(mlflow_server.base, f"tune-{name}")}
    killed = runs[dead.user_attrs["mlflow_run_id"]]
    assert killed.info.status == "KILLED" and killed.data.tags["error"].startswith("stale: worker")


def test_artifacts_go_through_the_server_and_are_seen_from_another_host(mlflow_server, tmp_path, monkeypatch, capsys):
    """Artifacts were written to the local folder of the host that made the experiment: the
    server's store stayed empty and another host listed 0 files, without an error."""
    from mlflow.tracking import MlflowClient

    name = f"grid-{secrets.token_hex(3)}"
    a = Host(tmp_path / "a", "lab-a", "compare", *BASE, "output.dir=runs", f"output.tracking_uri={mlflow_server.base}",
             "policy.token_budget=256,512", f"compare.experiment={name}")
    assert a.wait() == 0, a.output[-2000:]
    shutil.rmtree(tmp_path / "a")  # host a's files are out of reach from here on
    client = MlflowClient(mlflow_server.base)
    exp = client.get_experiment_by_name(name)
    assert exp.artifact_location.startswith("mlflow-artifacts:")
    summary = next(r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("testbed.kind") == "compare")
    files = {f.path for f in client.list_artifacts(summary.info.run_id)}
    assert {"table.csv", "table.md", "compare.json"} <= files
    assert any(p.name == "table.csv" for p in mlflow_server.artifacts.rglob("*"))  # the server holds them
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")  # `report` reads through the server only (here, not a process: ~2 s less)
    assert main(["report", name, "--tracking-uri", mlflow_server.base, "--out", "rep"]) == 0, capsys.readouterr().err
    table = (tmp_path / "b" / "rep" / "table.csv").read_text()
    assert "host" in table.splitlines()[0] and table.count("lab-a") == 2


def test_mlflow_store_in_fresh_postgres_two_hosts_and_no_password_shown(postgres, tmp_path, monkeypatch, capsys):
    """MLflow's own store in a fresh PostgreSQL database: two hosts starting together lost a
    run; `report` wrote the database password into report.json and its error line."""
    tracking = postgres.new_database("mlflow")
    hosts = [Host(tmp_path / h, f"lab-{h}", "tune", *BASE, "output.dir=runs", f"output.tracking_uri={tracking}",
                  "tune.trials=2", f"tune.study=pg-{h}") for h in ("a", "b")]
    _both(hosts)
    for h in ("a", "b"):
        statuses = sorted(r.info.status for r in _runs(tracking, f"tune-pg-{h}"))
        assert statuses == ["FINISHED"] * 3
    monkeypatch.chdir(tmp_path)  # the reports read the database only: run here, not as processes (~4 s less)
    code = main(["report", "tune-pg-a", "tune-pg-b", "--tracking-uri", tracking, "--out", "rep"])
    cap = capsys.readouterr()
    assert code == 0, cap.err[-2000:]
    report = (tmp_path / "rep" / "report.json").read_text()
    assert PASSWORD not in report + cap.out + cap.err and json.loads(report)["runs"] == 4
    assert main(["report", "no-such-grid", "--tracking-uri", tracking]) == 2
    cap = capsys.readouterr()
    assert PASSWORD not in cap.out + cap.err and cap.err.count("error:") == 1, cap.err


def _terminate_inside_a_trial(a: Host, b: Host, storage: str, name: str) -> int:
    """SIGTERM to host a while one of its trials runs and host b runs one too; returns the
    trial's number. A trial of 3,000 requests lasts ~0.5 s here, about what reading the study
    takes, and a signal that arrived after a's trial ended rightly interrupted none (the test
    failed 2 times in ~15). So a host with a trial open (RUNNING with its MLflow run, no result
    yet) is paused (SIGSTOP) and held there until the other host has one open too (one host
    alone had run all 6 trials before the other had started one); the study is read again
    while both are held, and the signal is handled inside host a's trial when it resumes. A
    pause of a few seconds is far inside the 10 s heartbeat by which a trial counts as dead."""
    def open_on(host: str, live: list) -> list:
        return [t for t in live if t.user_attrs["worker"].startswith(f"{host}-") and "summary" not in t.user_attrs]

    hosts = {"lab-a": a, "lab-b": b}
    held: set[str] = set()
    deadline = time.monotonic() + WAIT_S
    try:
        while time.monotonic() < deadline:
            for h in (a, b):
                assert h.proc.poll() is None, f"exit {h.proc.poll()}: {h.output[-2000:]}"
            live = _live_trials(storage, name)
            for host in set(hosts) - held:
                if open_on(host, live):
                    hosts[host].pause(True)
                    held.add(host)
            live = _live_trials(storage, name)  # the held hosts cannot move on while this is read
            for host in list(held):
                if not open_on(host, live):  # its trial ended before the pause
                    hosts[host].pause(False)
                    held.discard(host)
            if held == set(hosts):
                a.send(signal.SIGTERM)
                return open_on("lab-a", live)[0].number
            time.sleep(0.05)
        pytest.fail(f"the two hosts never ran trials of {name} at once within {WAIT_S} s")
    finally:
        for host in held:
            hosts[host].pause(False)


def test_sigterm_on_one_host_leaves_the_others_trials_alone(postgres, mlflow_server, tmp_path):
    """SIGTERM on one host tagged the other host's live trial error=interrupted and ended its
    run KILLED (2 of 2); `report` then listed it as finished and interrupted."""
    import optuna

    storage, name = postgres.new_database("optuna"), f"term-{secrets.token_hex(3)}"
    args = _tune(storage, mlflow_server.base, name, "tune.trials=6", "workload.num_requests=3000")
    a, b = (Host(tmp_path / h, f"lab-{h}", *args) for h in ("a", "b"))
    stopped = _terminate_inside_a_trial(a, b, storage, name)
    assert a.wait() == 143, a.output[-2000:]
    assert b.wait() == 0, b.output[-2000:]
    trials = optuna.load_study(study_name=name, storage=storage).trials
    runs = {r.info.run_id: r for r in _runs(mlflow_server.base, f"tune-{name}")}
    b_session = next(r.data.tags["testbed.session"] for r in runs.values() if r.data.tags.get("host") == "lab-b"
                     and r.data.tags.get("testbed.kind") == "trial")
    b_runs = [runs[t.user_attrs["mlflow_run_id"]] for t in trials if t.user_attrs["worker"].startswith(b_session)]
    assert b_runs and {r.info.status for r in b_runs} == {"FINISHED"}
    assert not [r.info.run_id for r in b_runs if "error" in r.data.tags]
    a_stopped = [t for t in trials if t.user_attrs.get("interrupted")]
    seen = [(t.number, t.state.name, t.datetime_start, t.user_attrs) for t in trials]
    assert [t.number for t in a_stopped] == [stopped], f"trials: {seen}; host a: {a.output[-1500:]}"
    assert all(runs[t.user_attrs["mlflow_run_id"]].data.tags["host"] == "lab-a" for t in a_stopped)
    assert sum(t.state.name == "COMPLETE" for t in trials) >= 6


def _study_ended_clean(storage: str, name: str, tracking: str, complete: int) -> list:
    """The study's trials: `complete` of them COMPLETE, none RUNNING, and no MLflow run RUNNING."""
    import optuna

    trials = optuna.load_study(study_name=name, storage=storage).trials
    states = [t.state.name for t in trials]
    assert states.count("COMPLETE") >= complete and "RUNNING" not in states, states
    runs = _runs(tracking, f"tune-{name}")
    assert "RUNNING" not in {r.info.status for r in runs}, [(r.info.run_name, r.info.status) for r in runs]
    return trials


def test_a_postgres_restart_mid_study_is_ridden_out(postgres, mlflow_server, tmp_path):
    """A PostgreSQL restart mid-study crashed the host (exit 1, a 118-line StorageInternalError)
    and left its trial RUNNING while its MLflow run had FINISHED. Now the host says it waits,
    reconnects, and the study ends with every trial complete."""
    storage, name = postgres.new_database("optuna"), f"pgrestart-{secrets.token_hex(3)}"
    host = Host(tmp_path / "a", "lab-a", *_tune(storage, mlflow_server.base, name, "tune.trials=8",
                                                "workload.num_requests=3000"))
    _wait_running(host, storage, name)
    postgres.restart(down_s=3)
    assert host.wait() == 0, host.output[-3000:]
    out = host.output
    assert "is unreachable" in out and "reachable again" in out, out[-3000:]
    assert "Traceback" not in out and PASSWORD not in out
    trials = _study_ended_clean(storage, name, mlflow_server.base, 8)
    assert not [t.number for t in trials if t.state.name == "FAIL"]


def _gives_up(args: list[str], storage: str, name: str, tmp_path, monkeypatch, restart, down_s: float) -> Host:
    """A host whose service goes away (`restart(down_s)`, in a thread) for longer than its
    2 s reconnect window, mid-trial: it ends with exit 1 and one `error:` line, no traceback."""
    monkeypatch.setenv("TESTBED_RECONNECT_S", "2")
    host = Host(tmp_path / "a", "lab-a", *args)
    _wait_running(host, storage, name)
    away = threading.Thread(target=restart, args=(down_s,))
    away.start()
    try:
        assert host.wait() == 1, host.output[-3000:]
    finally:
        away.join()
    monkeypatch.delenv("TESTBED_RECONNECT_S")
    err = "".join(host.err)
    assert err.count("error:") == 1 and "stayed unreachable" in err and "Traceback" not in err, err[-3000:]
    assert PASSWORD not in host.output
    return host


def test_postgres_gone_for_good_ends_this_hosts_runs_and_a_rerun_finishes(postgres, mlflow_server, tmp_path,
                                                                         monkeypatch):
    """PostgreSQL down for longer than the reconnect window: one `error:` line and exit 1 (was: a
    traceback), no MLflow run of the host left RUNNING; the same command run again once the
    database is back reclaims the stranded trial and completes the study."""
    storage, name = postgres.new_database("optuna"), f"pgdown-{secrets.token_hex(3)}"
    args = _tune(storage, mlflow_server.base, name, "tune.trials=6", "workload.num_requests=3000",
                 "tune.heartbeat=1", "tune.grace_period=2")
    _gives_up(args, storage, name, tmp_path, monkeypatch, postgres.restart, 15)
    runs = _runs(mlflow_server.base, f"tune-{name}")
    assert "RUNNING" not in {r.info.status for r in runs}, [(r.info.run_name, r.info.status) for r in runs]
    assert {r.info.status for r in runs if r.data.tags.get("testbed.kind") == "study"} == {"FAILED"}
    time.sleep(3)  # past the grace period of the stranded trial's last heartbeat
    second = Host(tmp_path / "a", "lab-a", *args)
    assert second.wait() == 0, second.output[-3000:]
    _study_ended_clean(storage, name, mlflow_server.base, 6)


def test_an_mlflow_server_restart_mid_study_is_ridden_out(postgres, mlflow_server, tmp_path):
    """The MLflow server going away mid-study hung the host ~4 min (MLflow's own HTTP retries)
    and then crashed it with a traceback from log_batch, trials and study run left RUNNING. Now
    the host waits for the server, says so, and the study ends complete with every run ended."""
    storage, name = postgres.new_database("optuna"), f"mlrestart-{secrets.token_hex(3)}"
    host = Host(tmp_path / "a", "lab-a", *_tune(storage, mlflow_server.base, name, "tune.trials=8",
                                                "workload.num_requests=3000"))
    _wait_running(host, storage, name)
    mlflow_server.restart()
    assert host.wait() == 0, host.output[-3000:]
    out = host.output
    assert "is unreachable" in out and "reachable again" in out, out[-3000:]
    assert "Traceback" not in out
    trials = _study_ended_clean(storage, name, mlflow_server.base, 8)
    assert not [t.number for t in trials if t.state.name == "FAIL" and not t.user_attrs.get("interrupted")]


def test_mlflow_server_gone_for_good_fails_fast_and_a_rerun_cleans_up(postgres, mlflow_server, tmp_path,
                                                                       monkeypatch):
    """The MLflow server away for longer than the reconnect window: one `error:` line and exit 1
    (was: ~4 min of silence, then a traceback from log_batch), the host's trial interrupted in
    the study (was: RUNNING); run again once the server is back, the same command ends the
    trial run left RUNNING there and completes the study, with no manual step."""
    storage, name = postgres.new_database("optuna"), f"mldown-{secrets.token_hex(3)}"
    args = _tune(storage, mlflow_server.base, name, "tune.trials=6", "workload.num_requests=3000")
    _gives_up(args, storage, name, tmp_path, monkeypatch, mlflow_server.restart, 20)
    import optuna

    assert "RUNNING" not in {t.state.name for t in optuna.load_study(study_name=name, storage=storage).trials}
    second = Host(tmp_path / "a", "lab-a", *args)
    assert second.wait() == 0, second.output[-3000:]
    _study_ended_clean(storage, name, mlflow_server.base, 6)


def test_a_dead_hosts_baseline_is_reclaimed_at_the_end_of_a_short_study(postgres, mlflow_server, tmp_path):
    """A host killed inside trial 0 (the defaults) while another finishes the study: the
    survivor exited 0 ("2 complete, 0 failed") with trial 0 RUNNING for good and no word about
    it; only a command started after the grace period reclaimed it. Now the survivor waits out
    the grace period, reclaims the trial by name and runs the defaults again."""
    import optuna

    storage, name, args, victim = _killed_in_a_trial(  # grace: longer than the second host's start
        tmp_path, postgres, mlflow_server.base, "settle", "tune.trials=2", "workload.num_requests=10000",
        "tune.heartbeat=1", "tune.grace_period=30", number=0)
    second = Host(tmp_path / "b", "lab-b", *args)  # within the grace period: trial 0 still looks alive
    assert second.wait() == 0, second.output[-3000:]
    assert victim.number == 0 and victim.user_attrs.get("baseline")
    assert f"reclaimed at the end: trial 0 (worker {victim.user_attrs['worker']}" in second.output, second.output
    trials = _study_ended_clean(storage, name, mlflow_server.base, 2)
    reruns = [t for t in trials if t.system_attrs.get("failed_trial") == 0]
    assert len(reruns) == 1 and reruns[0].state.name == "COMPLETE" and reruns[0].user_attrs.get("baseline")
    assert optuna.load_study(study_name=name, storage=storage).trials[0].state.name == "FAIL"
