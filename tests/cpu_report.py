"""`--cpu-top=N`: after the run, the N tests that used the most CPU (this process and the
children it reaped: stage processes, CLI subprocesses) and the suite's total. The default set's
CPU budget (8 minutes on the 2-core CI machine) is checked with it, not with timed assertions."""
from __future__ import annotations

import resource

import pytest

_CPU: dict[str, float] = {}


def pytest_addoption(parser) -> None:
    parser.addoption("--cpu-top", type=int, default=0, metavar="N",
                     help="print the N tests with the most CPU time (self + reaped children)")


def _cpu_now() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0 = _cpu_now()
    yield
    _CPU[item.nodeid] = _CPU.get(item.nodeid, 0.0) + _cpu_now() - t0


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    top = config.getoption("--cpu-top")
    if not top or not _CPU:
        return
    tr = terminalreporter
    tr.write_sep("=", f"CPU time: {sum(_CPU.values()):.0f} s over {len(_CPU)} tests; the {top} largest")
    for nodeid, cpu in sorted(_CPU.items(), key=lambda kv: -kv[1])[:top]:
        tr.write_line(f"{cpu:7.1f} s  {nodeid}")
