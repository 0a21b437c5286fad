"""The suite says at once what it will do and then how far it is (issue 49 item 5): `./tb test`
printed only dots for 34 min at load ~30 before its first count.

- a header as soon as collection ends: how many tests, and an estimate of the wall time from the
  last measured fast set (1,236 tests in 12.9 min on the 2-core machine at load ~1, `.ci/run`:
  0.63 s a test) stretched by the machine's load beyond that;
- a count line every PROGRESS_EVERY_S seconds (and at each tenth of the tests): done / total,
  failures so far, elapsed, and the time left from the pace so far.
Pytest's own dots and [n/N] counts go on between them. `-p no:progress` turns it off."""
from __future__ import annotations

import os
import time

WALL_PER_TEST_S = 12.9 * 60 / 1236  # the fast set's last measured pace, 2 cores at load ~1
PROGRESS_EVERY_S = 60.0
TENTHS_FROM = 50  # smaller runs: the timed lines only


def estimate_s(count: int) -> tuple[float, float]:
    """(seconds, load): the wall time of `count` tests at this machine's 1-minute load, stretched
    as the long commands' estimates are (testbed/sweep/estimate.py)."""
    from testbed.sweep.estimate import stretch

    factor, load = stretch()
    return count * WALL_PER_TEST_S * factor * 2.0 / max(os.cpu_count() or 1, 2), load


def _minutes(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


class Progress:
    def __init__(self, config) -> None:
        self.config = config
        self.total = self.done = self.failed = 0
        self.t0 = self.last = time.monotonic()
        self.next_tenth = 1  # the next tenth of the tests that prints a line

    def _write(self, text: str) -> None:
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            if tr._tw.width_of_current_line:  # after pytest's dots: a line of its own
                tr.write("\n")
            tr.write_line(text)

    def pytest_collection_finish(self, session) -> None:
        self.total = len(session.items)
        self.t0 = self.last = time.monotonic()
        if not self.total:
            return
        est, load = estimate_s(self.total)
        self._write(f"[suite] {self.total} tests collected; estimate {_minutes(est)} of wall time at load "
                    f"{load:.1f} on {os.cpu_count()} cores (the fast set: 12.9 min at load ~1 on 2 cores); "
                    f"a count line every {PROGRESS_EVERY_S:.0f} s")

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed:
            self.failed += 1
        if report.when != "teardown" or not self.total:
            return
        self.done += 1
        now = time.monotonic()
        tenth = self.done * 10 // self.total if self.total >= TENTHS_FROM else 0
        if now - self.last < PROGRESS_EVERY_S and tenth < self.next_tenth:
            return
        self.last, self.next_tenth = now, tenth + 1
        elapsed = now - self.t0
        left = elapsed / self.done * (self.total - self.done)
        failed = f", {self.failed} failed" if self.failed else ""
        self._write(f"[suite] {self.done}/{self.total} done{failed}; {_minutes(elapsed)} elapsed, "
                    f"~{_minutes(left)} left at this pace")


def pytest_configure(config) -> None:
    config.pluginmanager.register(Progress(config), "progress-lines")
