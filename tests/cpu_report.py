"""`--cpu-top=N`: after the run, the N tests that used the most CPU and the suite's total. The
default set's CPU budget (8 minutes on the 2-core CI machine) is checked with it, not with timed
assertions.

What is counted: on Linux the whole machine's busy CPU time (/proc/stat), so run it on an
otherwise idle machine. This process's own rusage would miss most of the suite: stage processes
are children of the engine's fork server (engine/torch_exec/driver/stage_processes.py), which is never
reaped by pytest, and the PostgreSQL, mlflow server and Ray processes of the service fixtures
run beside the tests. Elsewhere: this process and the children it reaped."""
from __future__ import annotations

import gc
import os
import resource
import time

import pytest

_CPU: dict[str, float] = {}
_OWN: dict[str, float] = {}  # the test process's own share (in-process simulations, imports)
_GC = [0.0, 0.0]  # seconds this process spent in the cyclic garbage collector; when the current pass began


def _time_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _GC[1] = time.process_time()
    else:
        _GC[0] += time.process_time() - _GC[1]


def pytest_addoption(parser) -> None:
    parser.addoption("--cpu-top", type=int, default=0, metavar="N",
                     help="print the N tests with the most CPU time (self + reaped children)")


def pytest_configure(config) -> None:
    if config.getoption("--cpu-top"):
        gc.callbacks.append(_time_gc)


def _machine_busy() -> float | None:
    """Seconds of busy CPU (user, nice, system, irq, softirq) since boot, over every core."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_now() -> float:
    busy = _machine_busy()
    if busy is not None:
        return busy
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, own0 = _cpu_now(), _own_cpu()
    yield
    _CPU[item.nodeid] = _CPU.get(item.nodeid, 0.0) + _cpu_now() - t0
    _OWN[item.nodeid] = _OWN.get(item.nodeid, 0.0) + _own_cpu() - own0


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    top = config.getoption("--cpu-top")
    if not top or not _CPU:
        return
    tr = terminalreporter
    what = "machine CPU" if _machine_busy() is not None else "CPU (self + reaped children)"
    tr.write_sep("=", f"{what}: {sum(_CPU.values()):.0f} s over {len(_CPU)} tests "
                      f"({sum(_OWN.values()):.0f} s in the test process itself, {_GC[0]:.0f} s of it in its "
                      f"garbage collector); the {top} largest")
    tr.write_line(f"{'all':>7}   {'own':>7}")
    for nodeid, cpu in sorted(_CPU.items(), key=lambda kv: -kv[1])[:top]:
        tr.write_line(f"{cpu:7.1f} s {_OWN[nodeid]:7.1f} s  {nodeid}")
