"""SIGTERM and SIGHUP handled like Ctrl-C: what `timeout`, batch schedulers, `kill` and a closed
terminal send must end a run as cleanly as Ctrl-C does (partial results written, MLflow run
KILLED), with exit code 143 (SIGTERM) or 129 (SIGHUP).

One stop is enough: once a signal has started the stop, the results are being saved, and a
second Ctrl-C or SIGTERM (people press twice; schedulers follow up within a second) must not cut
that save short (it left an empty run folder). `one_stop()` gives that for `testbed run`;
`saving()` guards any block that writes results; under `sigterm_as_interrupt` (the sweeps, tune)
a signal that comes once a stop is on record is ignored, so the stop's cleanup (workers stopped,
tables written, runs ended KILLED) runs to its end: a second SIGTERM 0.3 s after the first left
`capacity`'s summary run and its in-flight probe's run RUNNING (issue 38 item 6). A loop still
stops after a stop whose exception was lost (`raise_if_stopped`).

One record of the stop. Every handler here notes the first stop signal of the command
(`stopped_by()`), and every command reads that one record: for its exit code and message
(`signal_name`, `exit_code`, `interrupted_message`), and to stop where a handler's exception was
lost (`raise_if_stopped`). A command's record is its outermost `sigterm_as_interrupt` or
`one_stop` block: empty at its start, cleared at its end; a worker process's, its whole life."""
from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from typing import Iterator

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143, "SIGHUP": 129}
SIGNAL_OF_EXIT_CODE = {code: name for name, code in EXIT_CODES.items()}
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))
ALL_SIGNALS = (signal.SIGINT, *STOP_SIGNALS)

# Set by the first stop of `testbed run` (`one_stop`): the process is ending, and at the end of
# `testbed.cli.main` every later signal is ignored until it exits.
_stopping = False
_first_signal: str | None = None  # the command's first stop signal ("SIGINT", ...), or None
_in_command = False  # inside the outermost block that began a command (`_command`)


class Terminated(KeyboardInterrupt):
    """Raised by the SIGTERM/SIGHUP handler in the main thread; a KeyboardInterrupt, so every place
    that stops cleanly on Ctrl-C stops cleanly on these. `signal`: the signal's name."""

    def __init__(self, name: str = "SIGTERM") -> None:
        super().__init__(name)
        self.signal = name


def signal_name(exc: BaseException) -> str:
    """The signal that stopped the command `exc` ends: the one `exc` names (a Terminated, a run's
    RunInterrupted), else a SIGTERM or SIGHUP on record (code that re-raises a plain
    KeyboardInterrupt, as Optuna's optimize loop does, must not turn exit 143 into 130), else
    SIGINT."""
    name = getattr(exc, "signal", None)
    if name in ("SIGTERM", "SIGHUP"):
        return name
    if _first_signal in ("SIGTERM", "SIGHUP"):
        return _first_signal
    return "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"


def exit_code(exc: BaseException) -> int:
    """143 for SIGTERM, 129 for SIGHUP, 130 for Ctrl-C (`signal_name`)."""
    return EXIT_CODES[signal_name(exc)]


def interrupted_message(exc: BaseException) -> str:
    return stop_message(signal_name(exc))


def stop_message(name: str) -> str:
    """What a command prints when the signal `name` stopped it."""
    return "interrupted" if name == "SIGINT" else f"terminated ({name})"


def stop_exception(name: str) -> KeyboardInterrupt:
    """What a stop by the signal `name` raises: KeyboardInterrupt for Ctrl-C, else `Terminated`."""
    return KeyboardInterrupt() if name == "SIGINT" else Terminated(name)


def _note(signum) -> str:
    """Put the signal on record if it is the command's first stop; its name."""
    global _first_signal
    name = signal.Signals(signum).name
    if _first_signal is None:
        _first_signal = name
    return name


def _raise_terminated(signum, frame):
    if _first_signal is not None:  # the command is stopping already: its cleanup runs to the end
        return
    raise Terminated(_note(signum))


def _raise_interrupt(signum, frame):
    if _first_signal is not None:
        return
    _note(signum)
    raise KeyboardInterrupt


def _quiet_lost_stop(unraisable) -> None:
    """A stop raised while Python ran a finaliser or a weakref callback (SQLAlchemy's registry
    clean-up, say) cannot propagate: Python prints it as "Exception ignored in ... Traceback" and
    drops it. The stop is on record and `raise_if_stopped` acts on it, so that print is noise
    that reads like a crash (the fresh-clone CI caught one in `compare`'s TERM,TERM test)."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _first_signal is not None:
        return
    _other_unraisablehook(unraisable)


_other_unraisablehook = sys.unraisablehook  # whoever printed the rest before (Python's, a test runner's)


def _install(handler, signums=STOP_SIGNALS) -> dict | None:
    """Install `handler` for `signums`; the previous handlers, or None outside the main thread."""
    global _other_unraisablehook
    if sys.unraisablehook is not _quiet_lost_stop:
        _other_unraisablehook, sys.unraisablehook = sys.unraisablehook, _quiet_lost_stop
    try:
        return {s: signal.signal(s, handler) for s in signums}
    except ValueError:  # not the main thread
        return None


@contextmanager
def _command(handlers: dict | None) -> Iterator[None]:
    """The outermost of these blocks is a command: the record holds its stop from its start to its
    end, and is empty before and after (in-process callers such as the tests run many commands
    in one process). `handlers`: what the block installed, None outside the main thread (where
    nothing is cleared: the main thread's command may still be running)."""
    global _first_signal, _in_command
    outermost = handlers is not None and not _in_command
    if outermost:
        _first_signal, _in_command = None, True
    try:
        yield
    finally:
        if outermost:
            _first_signal, _in_command = None, False


def stopping_for_good() -> None:
    """The process ends after this stop (`testbed.cli.main`, once a command was stopped): every
    block then hands over to `hold_if_stopping` instead of putting default handlers back (a
    second SIGTERM in that instant killed `compare` by the raw signal, status -15: issue 38 item 6)."""
    global _stopping
    _stopping = True


def hold_if_stopping() -> None:
    """Once a stop has begun, ignore every later stop signal at the OS level for the rest of the
    process. Python's finalisation puts default handlers back in place of Python ones, and the
    kernel may hand a signal to any thread, so a signal in that last instant killed the process
    (exit -15 or -2 instead of 143/130, with the results already saved); an OS-level ignore
    survives finalisation. Called last by `testbed.cli.main`."""
    if _stopping:
        for s in ALL_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def _restore(old: dict | None) -> None:
    for s, h in (old or {}).items():
        signal.signal(s, h)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise `Terminated` in the main thread (no-op elsewhere).
    The block of `testbed.cli.main` (and of each sweep command, for callers that skip the command
    line): after a stop it hands over to `hold_if_stopping` instead of
    putting the default handlers back (a signal in between killed a saved run with -15). Ctrl-C
    raises KeyboardInterrupt as by default, and is put on record; where it was ignored (a shell's
    background job) it stays ignored."""
    old = _install(_raise_terminated)
    if old is not None and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        old.update(_install(_raise_interrupt, (signal.SIGINT,)) or {})
    try:
        with _command(old):
            yield
    finally:
        if _stopping:
            hold_if_stopping()
        else:
            _restore(old)


def _ignore(signum, frame) -> None:
    """Ignores a signal. A Python handler, not SIG_IGN: a signal already pending when the handler
    becomes SIG_IGN makes Python raise "OSError: Signal 15 ignored due to race condition"."""


def _first_stop(signum, frame):
    """The first of SIGINT/SIGTERM/SIGHUP: ignore every later one, to the end of the process, then stop."""
    global _stopping
    _stopping = True
    name = _note(signum)
    for s in ALL_SIGNALS:
        signal.signal(s, _ignore)
    raise stop_exception(name)


@contextmanager
def one_stop() -> Iterator[None]:
    """Within the block the first Ctrl-C, SIGTERM or SIGHUP stops the work (KeyboardInterrupt or
    `Terminated`) and every later one is ignored until the block ends: the stop's cleanup and the
    save of the partial results run to the end."""
    old = _install(_first_stop, ALL_SIGNALS)
    try:
        with _command(old):
            yield
    finally:
        _restore(old)


def record_interrupts() -> None:
    """For the rest of the process (a worker's), Ctrl-C raises KeyboardInterrupt as by default and
    is put on record, for `raise_if_stopped`."""
    _install(_raise_interrupt, (signal.SIGINT,))


def terminate_on_stop_signals() -> None:
    """For the rest of the process (a worker's), SIGTERM and SIGHUP raise `Terminated`, and Ctrl-C
    KeyboardInterrupt, each on record: a Ctrl-C to the process group that Python's own handler
    raised inside a worker's SQLAlchemy weakref callback was printed as "Exception ignored ...
    Traceback" and dropped (the fresh-clone CI's compare INT test)."""
    _install(_raise_terminated)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        _install(_raise_interrupt, (signal.SIGINT,))


def stopped_by() -> str | None:
    """The signal ("SIGINT", "SIGTERM", "SIGHUP") of the command's first stop, or None. Its
    exception may never have reached the work: Python drops an exception a signal handler raises
    inside a garbage-collector callback or `__del__` ("Exception ignored in ..."; SQLAlchemy's
    weakref callbacks), which let a `tune` host run on and exit 0 after SIGTERM, and would have let
    `testbed run` end FINISHED with exit 0. The caller checks it where work could go on."""
    return _first_signal


def raise_if_stopped() -> None:
    """Raise the stop `stopped_by()` names (`stop_exception`), if any: loops call it before the
    next piece of work."""
    if _first_signal is not None:
        raise stop_exception(_first_signal)


@contextmanager
def saving() -> Iterator[None]:
    """Within the block Ctrl-C, SIGTERM and SIGHUP are ignored (results are being written)."""
    old = _install(_ignore, ALL_SIGNALS)
    try:
        yield
    finally:
        _restore(old)


class DeferredStop:
    """Within `deferred_stop()`: the stop signal that arrived, if any, raised by `check()` at a
    point of the caller's choosing."""

    def __init__(self, old: dict) -> None:
        self.old = old
        self.signum: int | None = None

    def note(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def check(self) -> None:
        """Raise what the handler outside the block would have raised for the signal that arrived
        (KeyboardInterrupt, `Terminated`, or nothing if it ignores it)."""
        if self.signum is None:
            return
        signum, self.signum = self.signum, None
        outer = self.old.get(signum)
        if callable(outer):
            outer(signum, None)
        elif outer == signal.SIG_DFL:
            raise stop_exception(signal.Signals(signum).name)


@contextmanager
def deferred_stop() -> Iterator[DeferredStop]:
    """Within the block Ctrl-C, SIGTERM and SIGHUP are only noted; the block calls `check()` where
    stopping is safe. For waits in native code that mishandle an exception raised by a signal
    handler: one raised while Ray's `ray.wait` runs comes out as "SystemError: CoreWorker.wait
    returned a result with an exception set" (seen with pytest-timeout's SIGALRM), not as the
    KeyboardInterrupt every cleanup expects; a handler that only notes the signal raises nothing
    there. Outside the main thread it changes nothing and `check()` never raises."""
    stop = DeferredStop({})
    old = _install(stop.note, tuple(s for s in ALL_SIGNALS if signal.getsignal(s) != signal.SIG_IGN))
    stop.old = old or {}
    try:
        yield stop
    finally:
        _restore(old)
