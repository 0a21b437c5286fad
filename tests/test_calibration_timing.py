"""Span timers and device peaks: the CPU fallbacks, the CUDA-event code path driven by a fake event
on CPU, and (marked gpu, skipped without CUDA) the real thing."""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from engine.torch_exec.driver.profile import device_peaks, device_provenance, measure_peaks  # noqa: E402
from engine.torch_exec.shared.timing import CudaEventTimer, WallTimer, is_cuda, timer_for  # noqa: E402

NO_CUDA = not torch.cuda.is_available()


class FakeEvent:
    """torch.cuda.Event's interface on the host clock: record, synchronize, elapsed_time (ms)."""

    log: list = []

    def __init__(self) -> None:
        self.t = None
        self.synced = False

    def record(self) -> None:
        self.t = time.perf_counter()
        FakeEvent.log.append(("record", self))

    def synchronize(self) -> None:
        self.synced = True
        FakeEvent.log.append(("sync", self))

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.t is not None and end.t is not None, "elapsed_time needs both events recorded"
        return (end.t - self.t) * 1e3


def test_wall_timer_brackets_the_work():
    timer = WallTimer()
    mark = timer.start()
    time.sleep(0.01)
    a, b = timer.stop(mark)
    assert a == mark and b - a >= 0.01


def test_cuda_event_timer_path_with_a_fake_event():
    FakeEvent.log = []
    clock = iter([100.0]).__next__  # the host time at the span's start
    timer = CudaEventTimer(event=FakeEvent, clock=clock)
    mark = timer.start()
    time.sleep(0.005)
    a, b = timer.stop(mark)
    begin, end = FakeEvent.log[0][1], FakeEvent.log[1][1]
    assert [k for k, _ in FakeEvent.log] == ["record", "record", "sync"]
    assert FakeEvent.log[2][1] is end and end.synced and not begin.synced  # only the end event is awaited
    assert a == 100.0  # start on the host clock, end = start + the events' elapsed time
    assert b - a == pytest.approx(end.t - begin.t) and b - a >= 0.005


def test_a_span_ended_on_the_stream_is_awaited_later_and_excludes_the_host_work_between():
    """`record` ends the span on the stream at once; `wait` synchronises later, so a stage can
    prepare the next micro-batch while the GPU runs this one (worker.py) without the span growing."""
    FakeEvent.log = []
    timer = CudaEventTimer(event=FakeEvent, clock=iter([5.0]).__next__)
    pending = timer.record(timer.start())
    assert [k for k, _ in FakeEvent.log] == ["record", "record"]  # not synchronised yet
    time.sleep(0.02)  # host work while the device runs
    a, b = timer.wait(pending)
    assert FakeEvent.log[-1][0] == "sync" and a == 5.0 and b - a < 0.02
    assert WallTimer().wait(WallTimer().record(1.0))[0] == 1.0


def test_timer_for_cpu_and_availability_check():
    assert isinstance(timer_for("cpu"), WallTimer) and timer_for("cpu") is timer_for("cpu")
    assert is_cuda("cuda:1") and is_cuda("cuda") and not is_cuda("cpu")
    if NO_CUDA:
        with pytest.raises(RuntimeError, match="'cuda:0': CUDA is not available"):
            timer_for("cuda:0")
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            measure_peaks(device="cuda")
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            device_provenance("cuda")


def test_cpu_peaks_and_provenance():
    p = measure_peaks(repeats=2)
    assert p["device"] == "cpu" and p["timer"] == "wall" and p["dtype"] == "torch.float32"
    assert p["peak_flops"] == max(p["gemm_flops"].values()) > 0 and p["mem_bw_Bps"] > 0
    prov = device_provenance("cpu")
    assert prov["torch"] == torch.__version__ and prov["date_utc"].endswith("Z") and "gpu" not in prov


def test_device_peaks_through_the_event_timer_on_cpu_tensors():
    """The GPU measurement's code (several GEMM shapes, a copy, event timing) on small CPU tensors."""
    FakeEvent.log = []
    p = device_peaks(torch, "cpu", torch.bfloat16, ((64, 128, 32), (128, 64, 64)), 2 ** 20,
                     CudaEventTimer(event=FakeEvent), repeats=2)
    assert set(p["gemm_flops"]) == {"64x128x32", "128x64x64"}
    assert p["timer"] == "cuda-event" and p["dtype"] == "torch.bfloat16" and p["copy_bytes"] == 2 ** 20
    assert p["mem_bw_Bps"] > 0 and p["peak_flops"] == max(p["gemm_flops"].values())
    assert sum(k == "sync" for k, _ in FakeEvent.log) == 3 * 2  # 3 benchmarks x 2 timed repeats


@pytest.mark.gpu
def test_cuda_peaks_and_event_timing_on_the_device():
    p = measure_peaks(device="cuda", repeats=3)
    assert p["timer"] == "cuda-event" and p["dtype"] == "torch.bfloat16"
    assert p["peak_flops"] > 1e13 and p["mem_bw_Bps"] > 1e11  # any datacenter GPU; a CPU never
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    timer = timer_for("cuda")
    mark = timer.start()
    for _ in range(10):
        a @ a
    t0, t1 = timer.stop(mark)
    assert t1 > t0
    prov = device_provenance("cuda")
    assert prov["gpu"] and prov["cuda"] and prov["driver"]
