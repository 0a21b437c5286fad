"""testbed/signals.py: a stop noted inside `deferred_stop()` is raised by `check()` as the handler
outside would have raised it, never lost and never early."""
from __future__ import annotations

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
