"""testbed/signals.py: a stop noted inside `deferred_stop()` is raised by `check()` as the handler
outside would have raised it, never lost and never early; a stop whose exception Python dropped
still stops `testbed run` and `testbed compare`."""
from __future__ import annotations

import json
import os
import signal

import pytest

from testbed.signals import Terminated, deferred_stop, saving, sigterm_as_interrupt


def _send(signum: int) -> None:
    os.kill(os.getpid(), signum)
    signal.getsignal(signum)  # a bytecode boundary: Python runs the handler here


def test_a_stop_waits_for_check_and_is_raised_as_the_outer_handler_would():
    with sigterm_as_interrupt(), deferred_stop() as stop:
        _send(signal.SIGTERM)
        _send(signal.SIGINT)  # a second signal before the check: the first decides
        with pytest.raises(Terminated) as raised:
            stop.check()
        assert raised.value.signal == "SIGTERM"
        stop.check()  # raised once; nothing is pending now
    with deferred_stop() as stop:
        _send(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            stop.check()


def test_the_outer_handlers_are_back_after_the_block_and_an_ignoring_outer_handler_ignores():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with saving(), deferred_stop() as stop:  # results are being written: the stop is ignored
        _send(signal.SIGINT)
        stop.check()
    assert {s: signal.getsignal(s) for s in before} == before


def test_one_record_per_command_names_the_stop_and_an_ignored_ctrl_c_stays_ignored():
    """The record of the stop lasts as long as the command's block; a plain KeyboardInterrupt
    (Optuna re-raises one) after a SIGTERM still exits 143; where Ctrl-C was ignored (a shell's
    background job) the command does not take it back."""
    from testbed import signals

    with sigterm_as_interrupt():
        with pytest.raises(Terminated):
            _send(signal.SIGTERM)
        assert signals.stopped_by() == "SIGTERM"
        assert signals.exit_code(KeyboardInterrupt()) == 143
        assert signals.interrupted_message(KeyboardInterrupt()) == "terminated (SIGTERM)"
    assert signals.stopped_by() is None and signals.exit_code(KeyboardInterrupt()) == 130
    with sigterm_as_interrupt():
        with pytest.raises(KeyboardInterrupt):
            _send(signal.SIGINT)
        assert signals.stopped_by() == "SIGINT"
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with sigterm_as_interrupt():
            _send(signal.SIGINT)
            assert signals.stopped_by() is None
    finally:
        signal.signal(signal.SIGINT, old)


class DropsAStop:
    """Sends SIGTERM to this process when collected: the handler's Terminated is raised inside
    `__del__`, and Python drops it ("Exception ignored in ...")."""

    def __del__(self):
        _send(signal.SIGTERM)


def _main(argv: list[str], monkeypatch) -> int:
    """`testbed.cli.main(argv)`, with this process's signal handlers as they were afterwards
    (`main` ignores every signal after a `testbed run` stop)."""
    from testbed import signals
    from testbed.cli import main

    monkeypatch.setattr(signals, "_stopping", False)
    handlers = {s: signal.getsignal(s) for s in signals.ALL_SIGNALS}
    try:
        return main([*argv, "policy=sarathi", "workload=synthetic", "model=llama2-13b", "hardware=a100-80g",
                     "output.mlflow=false", "output.plots=false", "output.progress=false"])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # a dropped stop is not reported
@pytest.mark.parametrize("where", ["simulating", "preparing"])
def test_a_stop_lost_in_a_gc_callback_still_stops_testbed_run(where, tmp_path, monkeypatch, capsys):
    """Python drops an exception a signal handler raises inside `__del__` or a garbage-collector
    callback ("Exception ignored in ..."): a `tune` host ran on after SIGTERM that way, and
    `testbed run` would have ended FINISHED with exit 0. The first stop is remembered: dropped
    during the simulation, the run (which went on to its end) is saved and ends KILLED with 143;
    dropped while the workload is built, nothing runs."""
    from testbed.run import runner

    def with_a_dropped_stop(real):
        def call(*args, **kwargs):
            DropsAStop()  # collected at once
            return real(*args, **kwargs)
        return call

    if where == "simulating":
        monkeypatch.setattr(runner.PreparedRun, "run", with_a_dropped_stop(runner.PreparedRun.run))
    else:
        monkeypatch.setattr(runner, "prepare_experiment", with_a_dropped_stop(runner.prepare_experiment))
    code = _main(["run", "workload.num_requests=20", f"output.dir={tmp_path}"], monkeypatch)
    captured = capsys.readouterr()
    assert code == 143, captured.err[-2000:]
    assert "interrupted (SIGTERM)" in captured.err
    assert "Traceback" not in captured.err  # the dropped stop is on record, not printed as a crash
    summaries = list(tmp_path.rglob("summary.json"))
    if where == "simulating":  # saved: every request finished, since the run went on to its end
        assert len(summaries) == 1 and json.loads(summaries[0].read_text())["num_finished"] == 20
    else:
        assert summaries == []


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # a dropped stop is not reported
def test_a_stop_lost_in_a_gc_callback_still_stops_a_sweep(tmp_path, monkeypatch, capsys):
    """The sweeps read the same record of the stop as `testbed run`: a SIGTERM whose exception was
    dropped while a compare's first point ran lets that point end, and the grid stops before the
    next one, with the partial table written and exit 143 (it ran all three points, exit 0)."""
    from testbed import signals
    from testbed.run import runner

    real = runner.PreparedRun.run
    calls = []

    def first_run_drops_a_stop(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            DropsAStop()  # collected at once
        return real(self, *args, **kwargs)

    monkeypatch.setattr(runner.PreparedRun, "run", first_run_drops_a_stop)
    code = _main(["compare", "workload.num_requests=10", "workload.rate=1,2,3", f"output.dir={tmp_path}"], monkeypatch)
    captured = capsys.readouterr()
    assert code == 143, captured.err[-2000:]
    assert "terminated (SIGTERM)" in captured.err
    assert "Traceback" not in captured.err  # "Exception ignored in ...": read as a crash (fresh-clone CI)
    assert len(calls) == 1
    (summary,) = tmp_path.rglob("compare.json")
    assert json.loads(summary.read_text())["done"] == 1
    assert signals.stopped_by() is None  # the command's record ends with it
