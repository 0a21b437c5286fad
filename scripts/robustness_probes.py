#!/usr/bin/env python
"""Issue 48's CLI probes, re-runnable: each probe is one `testbed` command with a bad input (or a
clean one), classified from its exit code and stderr as
  refused    exit 2 (or 1 for an environment fault) with an `error:` line and no traceback
  warned     exit 0 with a `warning:` line naming the problem
  accepted   exit 0, as a clean probe must
  silent     exit 0 with no word where a bad input was given (a silent accept)
  traceback  a Python traceback on stderr
  hang       no exit within the probe's time limit (killed)
Data loss is judged per probe where it applies (figures computed, then lost to a late write).
The services probes (PostgreSQL restart / gone, MLflow server on it, two hosts) are
tests/test_two_host_outage.py; the run-folder probes of `calibrate runs` are tests/test_run_checks.py.
Usage: python scripts/robustness_probes.py [--out table.md]  (~2-4 min on a loaded 2-core box)"""
from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = ["policy=sarathi", "workload=synthetic", "workload.num_requests=20", "model=llama2-13b",
       "hardware=a100-80g", "parallel.pp=2", "output.plots=false", "output.progress=false", "output.mlflow=false"]


def probes(tmp: Path) -> list[tuple[str, str, list[str], str, float]]:
    """(area, what, argv, expected: bad|clean|warn, time limit s)."""
    bad_utf8 = tmp / "latin1.csv"
    bad_utf8.write_bytes(b"name,\xe9\xff\n1,2\n")
    foreign = tmp / "foreign"
    foreign.mkdir()
    with sqlite3.connect(foreign / "mlflow.db") as con:
        con.execute("create table invoices (id integer)")
    out = lambda name: f"output.dir={tmp / name}"  # noqa: E731
    return [
        ("clean", "run (20 requests)", ["run", *RUN, out("clean")], "clean", 120),
        ("clean", "list policy", ["list", "policy"], "clean", 60),
        ("clean", "tune, journal storage, fresh output.dir", ["tune", *RUN, "tune.trials=2", f"output.dir={tmp / 'fresh' / 'tune'}",
                                                              f"tune.storage=journal:{tmp / 'j.log'}"], "clean", 180),
        ("small", "list ''", ["list", ""], "bad", 60),
        ("small", "parallel.layer_split=[]", ["run", *RUN, "parallel.layer_split=[]", out("ls")], "bad", 60),
        ("small", "output.experiment=", ["run", *RUN, "output.experiment=", out("ex")], "bad", 60),
        ("small", "data_dir=/nonexistent", ["run", *[a for a in RUN if a != "workload=synthetic"], "workload=azure", "data_dir=/nonexistent", out("dd")], "warn", 120),
        ("small", "a foreign mlflow.db", ["run", *[a for a in RUN if a != "output.mlflow=false"], f"output.dir={foreign}"],
         "bad", 120),
        ("bench engine", "--repeats -3", ["bench", "engine", "--repeats", "-3"], "bad", 60),
        ("bench engine", "--repeats 0", ["bench", "engine", "--repeats", "0"], "bad", 60),
        ("bench engine", "--num-blocks 0 (no --compare)", ["bench", "engine", "--num-blocks", "0"], "bad", 60),
        ("bench engine", "--block-size 0 (no --compare)", ["bench", "engine", "--block-size", "0"], "bad", 60),
        ("bench engine", "--threads-per-stage 0", ["bench", "engine", "--threads-per-stage", "0"], "bad", 60),
        ("bench engine", "--kernels --compare", ["bench", "engine", "--kernels", "--compare"], "bad", 60),
        ("bench engine", "--json /proc/nope/x.json", ["bench", "engine", "--quick", "--json", "/proc/nope/x.json"], "bad", 60),
        ("calibrate tables", "--device a40", ["calibrate", "tables", "--device", "a40", "--out", str(tmp / "a40")], "warn", 600),
        ("calibrate tables", "--out /dev/null", ["calibrate", "tables", "--out", "/dev/null"], "bad", 60),
        ("calibrate tables", "--save /proc/nope", ["calibrate", "tables", "--save", "/proc/nope"], "bad", 60),
        ("calibrate tables", "non-UTF-8 --profile", ["calibrate", "tables", "--profile", str(bad_utf8)], "bad", 60),
        ("calibrate runs", "a simulated run folder", ["calibrate", "runs", "{RUN_DIR}", "--name", "x",
                                                      "--base", "h100-80g", "--out", str(tmp / "prof")], "bad", 120),
        ("calibrate runs", "--name ../../evil", ["calibrate", "runs", "{RUN_DIR}", "--name", "../../evil",
                                                 "--base", "h100-80g", "--out", str(tmp / "prof")], "bad", 120),
        ("calibrate runs", "--out a file", ["calibrate", "runs", "{RUN_DIR}", "--name", "x", "--base", "h100-80g",
                                            "--out", str(bad_utf8)], "bad", 120),
        ("calibrate runs", "non-UTF-8 --table", ["calibrate", "runs", "{RUN_DIR}", "--name", "x", "--base",
                                                 "h100-80g", "--table", str(bad_utf8)], "bad", 120),
        ("capacity", "capacity.duration_s=1e12", ["capacity", *RUN, "capacity.duration_s=1e12", out("cap")], "bad", 120),
        ("tune", "tune.trials=0", ["tune", *RUN, "tune.trials=0", out("t0")], "bad", 60),
    ]


def classify(code: int | None, err: str, expected: str) -> str:
    if code is None:
        return "hang"
    if "Traceback" in err:
        return "traceback"
    if code != 0:
        return "refused" if "error:" in err else f"exit {code} without an error line"
    if expected == "bad":
        return "silent"
    if expected == "warn":
        return "warned" if "warning:" in err or "note:" in err else "silent"
    return "accepted"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="write the table (markdown) here too")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="probes48-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TESTBED_ALLOW_DOWNLOAD": "0"}
    rows = []
    for area, what, argv, expected, limit in probes(tmp):
        t0 = time.monotonic()
        run_dirs = sorted(p for p in (tmp / "clean").glob("*/") if (p / "summary.json").is_file())
        argv = [str(run_dirs[0]) if a == "{RUN_DIR}" and run_dirs else a for a in argv]
        try:
            p = subprocess.run([sys.executable, "-m", "testbed.cli", *argv], cwd=tmp, env=env, capture_output=True,
                               text=True, timeout=limit)
            code, err = p.returncode, p.stderr
        except subprocess.TimeoutExpired as exc:
            code, err = None, (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        verdict = classify(code, err, expected)
        line = next((ln for ln in err.splitlines() if ln.startswith(("error:", "warning:"))), "")
        ok = verdict == {"bad": "refused", "warn": "warned", "clean": "accepted"}[expected]
        rows.append((area, what, expected, verdict, "ok" if ok else "DEFECT", f"{time.monotonic() - t0:.1f}", line[:110]))
        print(" | ".join(rows[-1]), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    counts = {v: sum(r[3] == v for r in rows) for v in ("traceback", "hang", "silent")}
    table = ["| area | probe | expected | verdict | | s | first error/warning line |", "|---|---|---|---|---|---|---|"]
    table += ["| " + " | ".join(r).replace("\n", " ") + " |" for r in rows]
    table.append(f"\n{len(rows)} probes: {counts['traceback']} tracebacks, {counts['hang']} hangs, "
                 f"{counts['silent']} silent accepts, {sum(r[4] == 'DEFECT' for r in rows)} defects in all")
    print("\n".join(table))
    if args.out:
        Path(args.out).write_text("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
