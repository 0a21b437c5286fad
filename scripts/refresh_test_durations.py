#!/usr/bin/env python3
"""Rewrite tests/durations.csv, the per-file times the suite's header estimate reads
(tests/progress.py), from a real run's JUnit XML (issue 49 item 5: the estimate was one mean pace).

    ./tb test --junitxml=runs/suite.xml          # the fast set, as CI runs it
    python scripts/refresh_test_durations.py runs/suite.xml
    python scripts/refresh_test_durations.py part.xml --merge   # a few files: keep the other rows

A file's row is its tests' summed time (pytest's `total`: setup, call and teardown) and count; the
run's mean load and cores come from the XML's suite properties (tests/progress.py adds them), or
`--load` / `--cores`. Skipped tests count (their time is near 0), so a file's pace is what a test of
it costs on average in the run that was measured.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tests" / "durations.csv"


def test_file(classname: str, file_attr: str | None) -> str | None:
    """`tests.test_kv.TestX` -> `tests/test_kv.py`: the longest dotted prefix that is a file here."""
    if file_attr:
        return file_attr
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        candidate = "/".join(parts[:n]) + ".py"
        if (ROOT / candidate).is_file():
            return candidate
    return None


def read_junit(path: Path) -> tuple[dict[str, list[float]], dict[str, str]]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    times: dict[str, list[float]] = defaultdict(list)
    props: dict[str, str] = {}
    for suite in suites:
        for prop in suite.iter("property"):
            props[prop.get("name", "")] = prop.get("value", "")
        for case in suite.iter("testcase"):
            file = test_file(case.get("classname", ""), case.get("file"))
            if file:
                times[file].append(float(case.get("time", 0) or 0))
    return times, props


def read_table(path: Path) -> dict[str, tuple[int, float, float]]:
    rows = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line and not line.startswith("#") and not line.startswith("file,"):
                file, tests, wall, load = line.split(",")
                rows[file] = (int(tests), float(wall), float(load))
    return rows


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", type=Path, help="the run's --junitxml file")
    ap.add_argument("--load", type=float, help="the run's mean 1-minute load (default: the XML's property)")
    ap.add_argument("--cores", type=int, help="the machine's cores (default: the XML's property)")
    ap.add_argument("--merge", action="store_true", help="keep the table's rows for files the XML lacks")
    ap.add_argument("--out", type=Path, default=TABLE)
    args = ap.parse_args(argv)
    if not args.junit.is_file():
        print(f"error: no JUnit XML at {str(args.junit)!r}; valid: a file written by ./tb test --junitxml=FILE",
              file=sys.stderr)
        return 2
    try:
        times, props = read_junit(args.junit)
    except ET.ParseError as e:
        print(f"error: {args.junit} is not JUnit XML ({e}); valid: a file written by ./tb test --junitxml=FILE",
              file=sys.stderr)
        return 2
    load = args.load if args.load is not None else float(props.get("load", "nan"))
    cores = args.cores if args.cores is not None else int(props.get("cores", "0") or 0)
    if not times or load != load or cores <= 0:
        what = "no test cases" if not times else "no load or cores (give --load and --cores)"
        print(f"error: {args.junit}: {what}", file=sys.stderr)
        return 2
    rows = read_table(args.out) if args.merge else {}
    rows.update({f: (len(t), sum(t), load) for f, t in times.items()})
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    lines = ["# Per-file wall time of a real run of the suite: tests/progress.py's header estimate reads it;",
             "# scripts/refresh_test_durations.py rewrites it from that run's --junitxml.",
             "# the load column: its run's mean 1-minute load (the estimate divides it out, then applies today's)",
             f"# measured: {when}, commit {commit()}{' (merged into the earlier table)' if args.merge else ''}",
             f"# cores: {cores}", "file,tests,wall_s,load"]
    lines += [f"{f},{n},{w:.2f},{ld:.1f}" for f, (n, w, ld) in sorted(rows.items())]
    args.out.write_text("\n".join(lines) + "\n")
    total = sum(w for _, w, _ in rows.values())
    print(f"{args.out}: {len(rows)} files, {sum(n for n, _, _ in rows.values())} tests, {total:.0f} s; this run's "
          f"load {load:.1f} on {cores} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
