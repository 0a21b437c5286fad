"""testbed/signals.py: a stop noted inside `deferred_stop()` is raised by `check()` as the handler
outside would have raised it, never lost and never early; a stop whose exception Python dropped
still stops `testbed run`."""
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


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped exception
@pytest.mark.parametrize("where", ["simulating", "preparing"])
def test_a_stop_lost_in_a_gc_callback_still_stops_testbed_run(where, tmp_path, monkeypatch, capsys):
    """Python drops an exception a signal handler raises inside `__del__` or a garbage-collector
    callback ("Exception ignored in ..."): a `tune` host ran on after SIGTERM that way, and
    `testbed run` would have ended FINISHED with exit 0. The first stop is remembered: dropped
    during the simulation, the run (which went on to its end) is saved and ends KILLED with 143;
    dropped while the workload is built, nothing runs."""
    from testbed import signals
    from testbed.cli import main
    from testbed.run import runner

    class DropsAStop:
        def __del__(self):
            _send(signal.SIGTERM)  # the handler's Terminated is raised here, in __del__, and dropped

    def with_a_dropped_stop(real):
        def call(*args, **kwargs):
            DropsAStop()  # collected at once
            return real(*args, **kwargs)
        return call

    if where == "simulating":
        monkeypatch.setattr(runner.PreparedRun, "run", with_a_dropped_stop(runner.PreparedRun.run))
    else:
        monkeypatch.setattr(runner, "prepare_experiment", with_a_dropped_stop(runner.prepare_experiment))
    monkeypatch.setattr(signals, "_stopping", False)  # back to False afterwards, for this process's next commands
    handlers = {s: signal.getsignal(s) for s in signals.ALL_SIGNALS}  # `main` ignores signals after a stop
    try:
        code = main(["run", "policy=sarathi", "workload=synthetic", "workload.num_requests=20", "model=llama2-13b",
                     "hardware=a100-80g", "output.mlflow=false", "output.plots=false", "output.progress=false",
                     f"output.dir={tmp_path}"])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    captured = capsys.readouterr()
    assert code == 143, captured.err[-2000:]
    assert "interrupted (SIGTERM)" in captured.err
    summaries = list(tmp_path.rglob("summary.json"))
    if where == "simulating":  # saved: every request finished, since the run went on to its end
        assert len(summaries) == 1 and json.loads(summaries[0].read_text())["num_finished"] == 20
    else:
        assert summaries == []
