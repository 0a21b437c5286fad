"""A stop that a library turns into its own error, in `tune` (issue 48): a SIGTERM whose handler
runs inside OmegaConf or SQLAlchemy comes out as their exception (OmegaConf's ConfigKeyError in
the fresh-clone CI's capacity TERM,TERM test). The sweep's worker treats such an error as the
stop since c85929b; the tune worker reported it as a bug (a traceback, exit 1), and a trial whose
run met it was told FAIL with a "run error" that counts against the study instead of being
interrupted (it runs again)."""
from __future__ import annotations

import multiprocessing as mp
import signal

import pytest

from testbed.cli import main

BASE = ["policy=sarathi", "workload=synthetic", "workload.num_requests=60", "workload.arrival=offline",
        "model=llama2-13b", "hardware=a100-80g", "parallel.pp=2", "output.plots=false", "output.progress=false",
        "output.mlflow=false", "tune.study=s"]


class LibraryError(Exception):
    """What a library raises where a signal handler's exception met its code."""


def _stop_on_record() -> None:
    from testbed import signals

    try:  # the SIGTERM handler ran; its exception became the library's
        signals._raise_terminated(signal.SIGTERM, None)
    except signals.Terminated:
        pass


def test_a_library_error_under_a_stop_interrupts_the_trial(tmp_path, monkeypatch):
    import optuna

    from testbed import signals
    from testbed.tune import prepare
    from testbed.tune import trial
    from testbed.tune.workers import worker_loop

    args = [*BASE, f"output.dir={tmp_path}"]
    assert main(["tune", *args, "tune.trials=1"]) == 0

    def build_into_a_stop(*_a, **_kw):
        _stop_on_record()
        raise LibraryError("Missing key x")

    monkeypatch.setattr(signals, "_first_signal", None)
    monkeypatch.setattr(trial, "prepare_experiment", build_into_a_stop)
    with pytest.raises(signals.Terminated):
        worker_loop(prepare([*args, "tune.trials=2"]), 0)
    monkeypatch.undo()
    trials = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path.resolve()}/optuna.db").trials
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL"]
    assert trials[1].user_attrs.get("fail_reason") == "interrupted"  # old code: "build error: LibraryError ..."


def _worker_meeting_a_library_error(problem, index, lock, events, start, parent):
    """A spawned tune worker whose loop meets a library error once the stop is on record."""
    from testbed.tune import workers

    def loop(*_a, **_kw):
        _stop_on_record()
        raise LibraryError("Missing key x")

    workers.worker_loop = loop
    workers._worker_main(problem, index, lock, events, start, parent)


def test_a_spawned_worker_ends_on_the_stop_not_as_a_bug(tmp_path):
    """Old code: {"worker_error": "worker 1: LibraryError: ...", "traceback": ...} and exit 1."""
    import os

    from testbed.tune import prepare

    ctx = mp.get_context("spawn")
    events, lock, start = ctx.Queue(), ctx.Lock(), ctx.Event()  # held here until the child has them
    problem = prepare([*BASE, f"output.dir={tmp_path}", "tune.trials=1"])
    proc = ctx.Process(target=_worker_meeting_a_library_error,
                       args=(problem, 1, lock, events, start, os.getpid()))
    proc.start()
    proc.join(120)
    said = []
    while not events.empty():
        said.append(events.get(timeout=5))
    assert proc.exitcode == 130, said
    assert not [m for m in said if "worker_error" in m], said
    assert {"worker_done": 1, "code": 130} in said
