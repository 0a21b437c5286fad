"""The host a real (torch) run ran on, and how fast it was: recorded in run_info.json as `host`.

Why: a CPU profile fitted on one machine's runs did not hold on another's. Set 9's profile (fitted and
tested on the previous session's machine: 35 of 36 rows within 10%) held 13 of 36 rows on set 10's runs
of the same engine and commands, taken on this session's new machine, where the engine ran 3-7% slower
offline and its mean TPOT 8-13% higher in the median (docs/measurements/real-runs-2026-11-28f.md). Nothing
in the runs said the machine had changed. Each real run now records the host's CPU model, its logical
cores, and a probe: the median time of a fixed one-thread fp32 GEMM (16 x 2048 by 2048 x 2048, the
shape class of a decode step's linear layers), taken in the driver before the stage workers start so
that the run's own work does not slow it. `testbed validate --runs <manifest>` compares the probe of the
fit runs with that of the runs it checks (testbed/calibrate/host_check.py).

The probe costs about 0.1 s of a run's start-up; a simulated run records no host (its results do not
depend on it, and its run_info.json stays as it was).
"""
from __future__ import annotations

import os
import platform
import statistics
import time

PROBE_SHAPE = (16, 2048, 2048)  # rows x inner x columns
PROBE_REPEATS = 15


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it ('unknown' where it does not)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def gemm_probe_ms(repeats: int = PROBE_REPEATS) -> float:
    """Median milliseconds of the probe GEMM on one thread (the engine's stages run one thread each)."""
    import torch

    rows, inner, cols = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(rows, inner, generator=gen)
    b = torch.randn(inner, cols, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.mm(a, b)  # first use: allocation, dispatch caches
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times) * 1e3


def host_info() -> dict:
    """What run_info.json's `host` holds (module docstring)."""
    return {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count() or 0,
            "gemm_probe_ms": round(gemm_probe_ms(), 4),
            "gemm_probe_shape": "x".join(map(str, PROBE_SHAPE))}
