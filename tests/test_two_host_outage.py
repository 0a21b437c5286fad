"""The two-host study in the recipe's own layout (docs/beyond-one-machine.md): one PostgreSQL
holding both the Optuna study and the `mlflow server`'s store, `tune` on two hosts (each its own
TESTBED_HOST, working folder and pid namespace: tests/services.py `Host`). Issue 48's targets:
a 10 s PostgreSQL restart is ridden out on every host; PostgreSQL gone for good ends each host
with one `error:` line, and no trial or run is left RUNNING and no result lost once the next
command has run. Before: the restart crashed one host of two (118-line traceback), gone for
good crashed both (2 trials and 3 runs RUNNING, 2 results lost). The figures are printed
(`scripts/two_host_outage.sh` runs this with -s)."""
from __future__ import annotations

import json
import secrets
import threading
import time

import pytest

from services import PASSWORD, Host
from test_service_outages import pg_mlflow_server  # noqa: F401 - the recipe's `mlflow server`, its store on the PostgreSQL
from test_services import BASE, _runs, _study_ended_clean, _tune, _wait_running

pytestmark = [pytest.mark.services, pytest.mark.slow]  # ~2-4 min: two studies, a restart, an outage

TRIALS = 10
REQUESTS = "workload.num_requests=3000"  # a trial of a few seconds: the outage falls inside trials


def _hosts(tmp_path, storage: str, tracking: str, name: str, *extra: str) -> list[Host]:
    return [Host(tmp_path / h, f"lab-{h}", *_tune(storage, tracking, name, f"tune.trials={TRIALS}", REQUESTS,
                                                   *extra)) for h in ("a", "b")]


def _figures(label: str, hosts: list[Host], codes: list[int], t0: float, **more) -> dict:
    errs = ["".join(h.err) for h in hosts]
    fig = {"phase": label, "exit_codes": codes, "wall_s": round(time.monotonic() - t0, 1),
           "error_lines": [e.count("error:") for e in errs], "tracebacks": [e.count("Traceback") for e in errs],
           "waited_msgs": [e.count("is unreachable") for e in errs], **more}
    print("FIGURES " + json.dumps(fig))
    for h, name in zip(hosts, "ab"):  # what each host said, for the report
        print(f"--- host {name} stderr tail ---\n" + "".join(h.err)[-6000:])
    return fig


def test_a_10s_postgres_restart_is_ridden_out_on_both_hosts(postgres, pg_mlflow_server, tmp_path):
    storage, name = postgres.new_database("optuna"), f"recipe-restart-{secrets.token_hex(3)}"
    t0 = time.monotonic()
    hosts = _hosts(tmp_path, storage, pg_mlflow_server.base, name)
    _wait_running(hosts[0], storage, name)
    postgres.restart(down_s=10)
    codes = [h.wait() for h in hosts]
    trials = _study_ended_clean(storage, name, pg_mlflow_server.base, TRIALS) if codes == [0, 0] else []
    fig = _figures("restart 10 s", hosts, codes, t0, trials=len(trials),
                   failed=sum(t.state.name == "FAIL" for t in trials))
    assert codes == [0, 0], [h.output[-3000:] for h in hosts]
    assert fig["tracebacks"] == [0, 0] and fig["error_lines"] == [0, 0]
    assert all(PASSWORD not in h.output for h in hosts)


def _journaled(hosts: list[Host], kind: str) -> set:
    """What the hosts journaled as unwritten ends of `kind` (testbed/cluster/unwritten.py)."""
    from testbed.cluster import unwritten

    ends = [e for h in hosts for e in unwritten.read(h.workdir / "runs" / unwritten.FILE) if e.kind == kind]
    return {e.trial_id if kind == "trial" else e.run_id for e in ends}


def test_postgres_gone_for_good_ends_both_hosts_with_one_line_and_loses_nothing(postgres, pg_mlflow_server, tmp_path,
                                                                                 monkeypatch):
    """Gone for good = longer than the hosts' reconnect window (5 s here, 120 s by default).
    While the database is away nothing can be written: each host journals in its folder what it
    could not end, and that folder's next command that reaches the store ends it. Here a
    `testbed run` on each host ends the runs (before: 2 runs RUNNING until another host's `tune`),
    then each host's `tune` ends its trial and completes the study, from a trial's recorded results
    rather than by running it again."""
    import optuna

    monkeypatch.setenv("TESTBED_RECONNECT_S", "5")
    storage, name = postgres.new_database("optuna"), f"recipe-gone-{secrets.token_hex(3)}"
    extra = ("tune.heartbeat=1", "tune.grace_period=2")
    t0 = time.monotonic()
    hosts = _hosts(tmp_path, storage, pg_mlflow_server.base, name, *extra)
    _wait_running(hosts[0], storage, name)
    away = threading.Thread(target=postgres.restart, args=(60,))  # back after both hosts gave up
    away.start()
    codes = [h.wait() for h in hosts]
    away.join()
    trials = optuna.load_study(study_name=name, storage=storage).trials
    runs = _runs(pg_mlflow_server.base, f"tune-{name}")
    running = {"trials": {t._trial_id for t in trials if t.state.name == "RUNNING"},
               "runs": {r.info.run_id for r in runs if r.info.status == "RUNNING"}}
    journaled = {k: _journaled(hosts, k) for k in ("trial", "run")}
    left = {"trials_running_after": len(running["trials"]), "runs_running_after": len(running["runs"]),
            "journaled": {k: len(v) for k, v in journaled.items()}}
    monkeypatch.delenv("TESTBED_RECONNECT_S")
    for h in hosts:  # any command of the host's folder that reaches the store: here a tiny `testbed run`
        Host(h.workdir, h.name, "run", *BASE, f"output.tracking_uri={pg_mlflow_server.base}",
             "output.dir=runs").wait()
    runs_after_run = [r.info.run_id for r in _runs(pg_mlflow_server.base, f"tune-{name}") if r.info.status == "RUNNING"]
    time.sleep(3)  # past the grace period of the stranded trials' last heartbeats
    again_codes = [Host(h.workdir, h.name, *_tune(storage, pg_mlflow_server.base, name, f"tune.trials={TRIALS}",
                                                  REQUESTS, *extra)).wait() for h in hosts]  # one after the other
    trials = optuna.load_study(study_name=name, storage=storage).trials
    finished = {r.info.run_id for r in _runs(pg_mlflow_server.base, f"tune-{name}") if r.info.status == "FINISHED"
                and r.data.tags.get("testbed.kind") == "trial"}
    lost = [t.number for t in trials if t.state.name == "FAIL" and t.user_attrs.get("mlflow_run_id") in finished]
    fig = _figures("gone for good", hosts, codes, t0, **left, runs_running_after_a_run=len(runs_after_run),
                   again_exits=again_codes, lost_results=lost, trials=len(trials),
                   journals_left=sum(len(_journaled(hosts, k)) for k in ("trial", "run")))
    assert codes == [1, 1], [h.output[-3000:] for h in hosts]
    assert fig["error_lines"] == [1, 1] and fig["tracebacks"] == [0, 0], [h.output[-3000:] for h in hosts]
    assert running["trials"] <= journaled["trial"] and running["runs"] <= journaled["run"], fig  # all owed is kept
    assert runs_after_run == [], fig  # before: the study run and a trial run RUNNING until another `tune`
    assert again_codes == [0, 0], fig
    _study_ended_clean(storage, name, pg_mlflow_server.base, TRIALS)
    assert lost == [] and fig["journals_left"] == 0, fig
