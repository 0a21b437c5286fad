"""The simulator paced by the wall clock: serving a simulated cluster in real time.

`PacedExecutor(sim, time_scale)` wraps the discrete-event simulator (engine/simulator/sim.py). Its clock
reads wall seconds since `start()` x `time_scale` (1.0 = real time, 10 = ten times faster), and
the simulator's events are applied only once that clock reaches them, so a completion is handed
to the controller at the wall time the cost model gives. Requests submitted through the
controller's online API (`Controller.submit`) are stamped with this clock; a client therefore
sees the simulated cluster's TTFT and TPOT (divided by `time_scale`).

The simulator's own clock never runs ahead of the paced one. Before a launch every event up to
the last arrival is applied (completions found on the way are kept for `next_completion`), and
the new micro-batch starts at the time of the event that let it be scheduled (the last completion
applied, or the last arrival: `arrival()` stamps a submitted request), as in `testbed run`;
measured at time_scale 1 on the loaded 2-core machine, stamping launches with the wall clock
instead stretched the simulated TPOT by 2%, and by 13% at time_scale 4.
`wake()`, from any thread, cuts a wait short (a new arrival or an abort needs the loop).

`lag_s` / `handed`: how late, summed in simulated seconds, completions reached the controller
after their simulated time, and how many did. Lateness is latency a client sees that the
simulated cluster did not cause: a host too busy to run this thread on time (measured by
`testbed capacity --base-url` through `/metrics`, testbed/capacity/live.py).
"""
from __future__ import annotations

import threading
import time
from collections import deque

from engine.core.batch import MicroBatch
from engine.core.executor import Completion, Executor


class PacedExecutor(Executor):
    def __init__(self, inner, time_scale: float = 1.0) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.inner = inner
        self.scale = float(time_scale)
        self.pipeline_depth = inner.pipeline_depth
        self.tracer = inner.tracer
        self._t0: float | None = None
        self._ready: deque[Completion] = deque()
        self._last_arrival = 0.0
        self._wake = threading.Event()
        self.lag_s = 0.0  # sum of (clock - simulated time) over the completions handed out
        self.handed = 0

    # --- clock -------------------------------------------------------------------------------------
    def now(self) -> float:
        if self._t0 is None:
            return 0.0
        return (time.perf_counter() - self._t0) * self.scale

    def wake(self) -> None:
        """Interrupt a wait in `next_completion`/`wait_until` (thread-safe)."""
        self._wake.set()

    def _sleep_until(self, t: float) -> bool:
        """Sleep until the clock reads `t`; False if woken first."""
        left = (t - self.now()) / self.scale
        if left <= 0:
            return True
        if self._wake.wait(left):
            self._wake.clear()
            return False
        return True

    def arrival(self) -> float:
        """Now, as the arrival time of a request being submitted (the next launch starts no earlier)."""
        t = self.now()
        self._last_arrival = max(self._last_arrival, t)
        return t

    def _catch_up(self, t: float) -> None:
        """Apply every simulator event up to time `t`, keeping the completions found; the
        simulator's clock stays at the last event applied."""
        while True:
            te = self.inner.peek_time()
            if te is None or te > t:
                return
            c = self.inner.next_completion(te)
            if c is not None:
                self._ready.append(c)

    # --- Executor interface ----------------------------------------------------------------------
    def start_clock(self) -> None:
        """Time 0 once the policy prepared (engine/core/executor.py `start_clock`)."""
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self.inner.start()
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def attach(self, kv) -> None:
        self.inner.attach(kv)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def launch(self, mb: MicroBatch) -> None:
        self._catch_up(self._last_arrival)
        # The simulated controller decides in zero time: a micro-batch scheduled in answer to a
        # completion (or an arrival) starts at that event's time, not when this thread got to it,
        # so the engine thread's own delays do not stretch the simulated timeline.
        self.inner.wait_until(max(self.inner.now(), self._last_arrival))
        self.inner.launch(mb)

    def _hand(self) -> Completion:
        c = self._ready.popleft()
        self.lag_s += max(0.0, self.now() - c.time_s)
        self.handed += 1
        return c

    def next_completion(self, deadline: float | None = None) -> Completion | None:
        while True:
            if self._ready:
                return self._hand()
            target = self.inner.peek_time()
            if target is None or (deadline is not None and target > deadline):
                if deadline is None:
                    return None
                target = deadline
            if not self._sleep_until(target):  # woken: apply what is due, let the caller look
                self._catch_up(self.now())
                return self._hand() if self._ready else None
            self._catch_up(target)
            if not self._ready and deadline is not None and target >= deadline:
                return None

    def wait_until(self, t: float) -> None:
        self._sleep_until(t)
        self._catch_up(min(t, self.now()))
