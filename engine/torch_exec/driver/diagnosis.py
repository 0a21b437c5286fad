"""Why a torch run failed: which stage to name, from deaths, error reports and progress.

Mixed into `TorchExecutor` (engine/torch_exec/driver/executor.py), whose state it reads: the stage
processes, the control socket, the in-flight micro-batches and which stage finished which.

- A stage process that died without a word (a signal, `os._exit`) is the root cause: its
  neighbours' communication fails next and they report errors that are only consequences.
- Stages started by hand have no process here: when a report says a peer's connection closed,
  the stages that reported nothing are pinged, and one that does not answer is named.
- Otherwise the earliest error report (stage clocks mapped onto the driver's) names the stage.
  A stage that reported its exception exits with `wire.REPORTED_EXIT`, which is not a silent death.
- No progress for `executor.stage_timeout_s` with work in flight: the first stage that has not
  finished the oldest micro-batch is hung. Stages report a micro-batch as computed before a
  send that blocks on the next stage (stage/worker.py), so a stage waiting on a hung successor is
  not blamed.
"""
from __future__ import annotations

import time

from engine.base.errors import RunFailedError
import engine.torch_exec.wire.messages as wire

# gloo's words when the stage at the other end is gone: "closed" when its socket shut cleanly,
# "reset" when the kernel tore it down (a killed process; seen in CI on a send), "Broken pipe" on a write
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
PING_S = 2.0  # how long a stage started by hand has to answer before it is taken for dead



def lost_peer(error_text: str) -> bool:
    """Whether a stage's error only says its neighbour went away (a consequence, not a cause)."""
    return any(words in error_text for words in LOST_PEER)


class FailureDiagnosis:
    """The failure paths of `TorchExecutor` (see the module docstring)."""

    def _check_processes(self) -> None:
        for s, p in enumerate(self._procs):
            if p.exitcode is not None:
                # drain a last error message the stage may have sent before dying
                self._drain_errors()
                sig = -p.exitcode if p.exitcode < 0 else None
                how = f"was killed by signal {sig}" if sig else f"exited with code {p.exitcode}"
                self._fail(f"stage {s} (pid {p.pid}) {how} while the run was in progress")

    def _drain_errors(self) -> None:
        for msg in self._drain(0.2):
            if isinstance(msg, wire.StageError):
                self._stage_error(msg)
            elif isinstance(msg, (wire.Spans, wire.Done)):
                self._handle(msg)

    def _drain(self, seconds: float):
        """Messages arriving within `seconds` (failure diagnosis only)."""
        import zmq

        deadline = time.perf_counter() + seconds
        while self._sock is not None and time.perf_counter() < deadline:
            if self._sock.poll(20, zmq.POLLIN) and (msg := self._ctl.recv()) is not None:
                yield msg
            yield from self._lanes.messages(None, self._codec, self._ctl.drop)[0]  # spawned stages' lanes (wire/lane.py)

    def _stage_error(self, err: wire.StageError) -> None:
        """A stage reported an exception. Its neighbours' communication then fails too, so the root
        cause is a stage that died without a word (a signal, os._exit) if there is one, else the
        earliest report (stage clocks mapped onto the driver's) within a second."""
        errors = {err.stage: err}
        silent: list = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not silent:
            silent = [(s, p) for s, p in enumerate(self._procs)
                      if p.exitcode not in (None, wire.REPORTED_EXIT) and s not in errors]
            for msg in self._drain(0.05):
                if isinstance(msg, wire.StageError):
                    errors.setdefault(msg.stage, msg)
        root = min(errors.values(), key=lambda e: e.clock - self._offsets[e.stage])
        if not silent and not self._procs and lost_peer(root.text):
            silent = self._unanswering(set(errors))
        if silent and isinstance(silent[0], int):  # external stages: no process to read an exit code from
            s = silent[0]
            info = self.stage_info[s] if s < len(self.stage_info) else {}
            first = root.text.strip().splitlines()[0] if root.text.strip() else "error"
            self._fail(f"stage {s} (host {info.get('host', '?')}, pid {info.get('pid', '?')}) stopped answering "
                       f"while the run was in progress (its process died or its host is unreachable); then stage "
                       f"{root.stage} lost it: {first}")
        if silent:
            s, p = silent[0]
            sig = -p.exitcode if p.exitcode < 0 else None
            how = f"was killed by signal {sig}" if sig else f"exited with code {p.exitcode}"
            first = root.text.strip().splitlines()[0] if root.text.strip() else "error"
            self._fail(f"stage {s} (pid {p.pid}) {how} while the run was in progress; "
                       f"then stage {root.stage} failed: {first}")
        self._fail(f"stage {root.stage} failed: {root.text.strip()}")

    def _unanswering(self, reported: set[int]) -> list[int]:
        """Stages started by hand that do not answer a ping within PING_S: the driver has no
        process of theirs to watch, and the neighbour that lost one reported the error first,
        so the dead stage went unnamed (issue 38 item 11)."""
        import zmq

        others = [s for s in range(self.pipeline_depth) if s not in reported]
        answered: set[int] = set()
        for s in list(others):
            try:
                self._send(s, wire.Ping())
            except zmq.ZMQError:  # its connection is gone already (the control socket is mandatory-routing)
                return [s]
        deadline = time.monotonic() + PING_S
        while time.monotonic() < deadline and len(answered) < len(others):
            answered |= {m.stage for m in self._drain(0.05) if isinstance(m, wire.Pong)}
        return [s for s in others if s not in answered]

    def _hang_message(self) -> str:
        oldest = self._inflight[0]
        stuck = next((s for s in range(self.pipeline_depth) if oldest not in self._stage_done[s]),
                     self.pipeline_depth - 1)
        pid = self.stage_info[stuck].get("pid") if stuck < len(self.stage_info) else "?"
        return (f"stage {stuck} (pid {pid}) made no progress for executor.stage_timeout_s="
                f"{self.settings.stage_timeout_s:g} s on micro-batch {oldest} (hung)")

    def _fail(self, message: str) -> None:
        if self._failed is None:
            self._failed = message
        raise RunFailedError(self._failed)

    def _check_failed(self) -> None:
        if self._failed is not None:
            raise RunFailedError(self._failed)
