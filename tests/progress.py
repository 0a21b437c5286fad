"""The suite says at once what it will do and then how far it is (issue 49 item 5): `./tb test`
printed only dots for 34 min at load ~30 before its first count.

- a header as soon as collection ends: how many tests, and an estimate of the wall time: each
  collected test at its file's measured pace (tests/durations.csv: a real run's per-file wall
  time and that run's load, written by scripts/refresh_test_durations.py from `--junitxml`), a
  file not in the table at the last measured fast set's mean pace (1,236 tests in 12.9 min on the
  2-core machine at load ~1, `.ci/run`: 0.63 s a test), stretched by this machine's load;
- a count line every PROGRESS_EVERY_S seconds (and at each tenth of the tests): done / total,
  failures so far, elapsed, and the time left from the pace so far.
Pytest's own dots and [n/N] counts go on between them. `-p no:progress` turns it off."""
from __future__ import annotations

import csv
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

FAST_SET_TESTS, FAST_SET_WALL_S = 1236, 12.9 * 60  # the last measured fast set, 2 cores at load ~1
WALL_PER_TEST_S = FAST_SET_WALL_S / FAST_SET_TESTS
DURATIONS = Path(__file__).with_name("durations.csv")
PROGRESS_EVERY_S = 60.0
TENTHS_FROM = 50  # smaller runs: the timed lines only


@dataclass(frozen=True)
class Paces:
    """Seconds a test of each file took at an unloaded machine's speed (its run's wall time divided
    by that run's load stretch), and when they were measured."""
    per_file: dict[str, float]
    measured: str
    rest: float = WALL_PER_TEST_S  # a test of a file not in the table


def stretch_at(load: float, cores: int) -> float:
    """Wall seconds per CPU second at a 1-minute load, as the long commands estimate it."""
    from testbed.sweep.estimate import LOAD_SHARE

    return max(1.0, LOAD_SHARE * (load + 1) / max(cores, 1))


def read_paces(path: Path = DURATIONS) -> Paces:
    """tests/durations.csv: `# key: value` lines (measured, cores), then file,tests,wall_s,load."""
    meta: dict[str, str] = {}
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return Paces({}, "")
    for line in lines:
        if line.startswith("#"):
            key, _, value = line[1:].partition(":")
            meta[key.strip()] = value.strip()
        elif line.strip():
            rows.append(line)
    try:
        cores = int(meta.get("cores", 2))
        per_file = {r["file"]: float(r["wall_s"]) / int(r["tests"]) / stretch_at(float(r["load"]), cores)
                    for r in csv.DictReader(rows) if int(r["tests"]) > 0}
        counts = {r["file"]: int(r["tests"]) for r in csv.DictReader(rows)}
    except (KeyError, ValueError, ZeroDivisionError):
        return Paces({}, "")  # a table that does not parse: the mean pace for every test
    return Paces(per_file, meta.get("measured", ""), rest_pace(per_file, counts))


def rest_pace(per_file: dict[str, float], counts: dict[str, int]) -> float:
    """A table of a whole run: its own mean pace. A partial one (a few files measured): what the
    fast set's total leaves for the other tests, so that light files measured alone do not pull
    the whole suite's estimate down."""
    known_n = sum(counts.get(f, 0) for f in per_file)
    known_s = sum(pace * counts.get(f, 0) for f, pace in per_file.items())
    if known_n >= 0.9 * FAST_SET_TESTS:
        return known_s / known_n
    return max((FAST_SET_WALL_S - known_s) / (FAST_SET_TESTS - known_n), 0.05)


def estimate_s(files: list[str], paces: Paces | None = None) -> tuple[float, float]:
    """(seconds, load): the wall time of tests of these files (one entry a test) at this machine's
    1-minute load, stretched as the long commands' estimates are (testbed/sweep/estimate.py)."""
    from testbed.sweep.estimate import stretch

    paces = read_paces() if paces is None else paces
    factor, load = stretch()
    unloaded = sum(paces.per_file.get(f, paces.rest) for f in files)
    return unloaded * factor * 2.0 / max(os.cpu_count() or 1, 2), load


def _minutes(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


class Progress:
    def __init__(self, config) -> None:
        self.config = config
        self.total = self.done = self.failed = 0
        self.t0 = self.last = time.monotonic()
        self.next_tenth = 1  # the next tenth of the tests that prints a line
        self.loads: list[float] = []  # the 1-minute load after each test

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
        paces = read_paces()
        files = [item.nodeid.split("::")[0] for item in session.items]
        est, load = estimate_s(files, paces)
        known = sum(f in paces.per_file for f in files)
        self._write(f"[suite] {self.total} tests collected; estimate {_minutes(est)} of wall time at load "
                    f"{load:.1f} on {os.cpu_count()} cores ({known} at their file's pace in tests/durations.csv, "
                    f"the rest at the fast set's); a count line every {PROGRESS_EVERY_S:.0f} s")

    @pytest.hookimpl(tryfirst=True)  # before junitxml writes its file
    def pytest_sessionfinish(self, session) -> None:
        """With `--junitxml`, the run's mean load and cores go in as suite properties: the refresh
        script (scripts/refresh_test_durations.py) needs them to turn wall times into paces."""
        from _pytest.junitxml import xml_key  # where pytest keeps its LogXML (as Hypothesis reads it)

        xml = self.config.stash.get(xml_key, None)
        if xml is not None and self.loads:
            xml.add_global_property("load", f"{sum(self.loads) / len(self.loads):.2f}")
            xml.add_global_property("cores", str(os.cpu_count() or 1))

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "teardown":
            try:
                self.loads.append(os.getloadavg()[0])
            except OSError:
                pass
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
