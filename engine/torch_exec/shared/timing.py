"""Span timers for the stage processes: wall clock on CPU, CUDA events on a GPU.

A stage reports each span as (start, end) on its process's `time.perf_counter()` clock
(CLOCK_MONOTONIC, shared by every process of one machine: engine/torch_exec/stage/worker.py). On a GPU
the host returns from a forward long before the kernels finish; the old code synchronised the
whole device and read the host clock, which also counted other streams' work (a pending NCCL
send) and the wake-up latency. `CudaEventTimer` records a CUDA event at the span's start and
end on the current stream, synchronises on the end event only, and reports
start + the events' elapsed time (docs/calibration.md#timing).

    timer = timer_for(device)          # cached per device string
    mark = timer.start()
    ...work...
    t_start, t_end = timer.stop(mark)  # perf_counter seconds
    pending = timer.record(mark); ...host work while the GPU runs...; timer.wait(pending)  # the same, split

`timer_for` is behind an availability check: a CUDA device without CUDA raises RuntimeError
naming the device; "cpu" never imports CUDA.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any, Protocol

__all__ = ["SpanTimer", "WallTimer", "CudaEventTimer", "timer_for", "is_cuda"]


class SpanTimer(Protocol):
    def start(self) -> Any: ...

    def stop(self, mark: Any) -> tuple[float, float]: ...

    def record(self, mark: Any) -> Any: ...

    def wait(self, pending: Any) -> tuple[float, float]: ...


class WallTimer:
    """The host clock: what a CPU stage's work takes."""

    __slots__ = ()
    kind = "wall"

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, mark: float) -> tuple[float, float]:
        return mark, time.perf_counter()

    def record(self, mark: float) -> tuple[float, float]:
        return self.stop(mark)

    def wait(self, pending: tuple[float, float]) -> tuple[float, float]:
        return pending


class CudaEventTimer:
    """CUDA events on the current stream; `event` makes one (torch.cuda.Event by default, a fake
    in CPU tests). The end event is synchronised: the span ends when the GPU work it brackets is done."""

    kind = "cuda-event"

    def __init__(self, event: Callable[[], Any] | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        if event is None:
            import torch

            def event() -> Any:
                return torch.cuda.Event(enable_timing=True)
        self._event = event
        self._clock = clock

    def start(self) -> tuple[float, Any]:
        ev = self._event()
        t = self._clock()
        ev.record()
        return t, ev

    def stop(self, mark: tuple[float, Any]) -> tuple[float, float]:
        return self.wait(self.record(mark))

    def record(self, mark: tuple[float, Any]) -> tuple[float, Any, Any]:
        """End the span on the stream now, without waiting: the host may work while the GPU runs."""
        t, begin = mark
        end = self._event()
        end.record()
        return t, begin, end

    def wait(self, pending: tuple[float, Any, Any]) -> tuple[float, float]:
        t, begin, end = pending
        end.synchronize()
        return t, t + begin.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


def is_cuda(device: str) -> bool:
    return str(device).startswith("cuda")


@lru_cache(maxsize=8)
def timer_for(device: str) -> WallTimer | CudaEventTimer:
    """The timer for spans of work on `device` ("cpu", "cuda", "cuda:N")."""
    if not is_cuda(device):
        return WallTimer()
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r}: CUDA is not available on this machine (CUDA-event timing "
                           "needs a GPU; use device cpu)")
    return CudaEventTimer()
