"""Where a simulated run's time goes, per stage: compute (forward spans), host (input preparation
and GPU sampling on the stage; CPU sampler spans separately), transfer (link busy time) and the
bubble (the rest of the run's span), from a run's full trace (`output.trace=full`).

    testbed run <config> output.trace=full output.mlflow=false
    python scripts/time_breakdown.py runs/<run>/trace.json [more traces...]

Prints one row per stage and the mean over stages, as shares of the run's span (first span start
to last span end), and the seconds per micro-batch of each part on the slowest stage. Used for
docs/reproduction.md's measured explanations (issue 46 item 5).
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def breakdown(trace: Path) -> dict:
    data = json.loads(trace.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    start = min(e["ts"] for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    span_us = end - start
    parts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    count: dict[str, int] = defaultdict(int)
    for e in spans:
        track = names.get(e["tid"], str(e["tid"]))
        name = e["name"]
        kind = ("compute" if name.startswith("forward") else "host" if name in ("prepare", "sample")
                else "transfer" if name == "send" else name)
        parts[track][kind] += e["dur"]
        if name.startswith("forward"):
            count[track] += 1
    stages = sorted(t for t in parts if t.startswith("stage") and "." not in t)
    links = sorted(t for t in parts if t.startswith("link"))
    rows = {}
    for s in stages:
        busy = parts[s]["compute"] + parts[s]["host"]
        rows[s] = {"compute": parts[s]["compute"] / span_us, "host": parts[s]["host"] / span_us,
                   "bubble": 1.0 - busy / span_us, "micro_batches": count[s],
                   "compute_ms_per_mb": parts[s]["compute"] / max(1, count[s]) / 1e3,
                   "host_ms_per_mb": parts[s]["host"] / max(1, count[s]) / 1e3}
    transfer = {link: parts[link]["transfer"] / span_us for link in links}
    return {"span_s": span_us / 1e6, "stages": rows, "links_busy": transfer}


def main(argv: list[str]) -> int:
    for arg in argv:
        b = breakdown(Path(arg))
        print(f"{arg}: span {b['span_s']:.1f} s")
        head = ("stage", "compute", "host", "bubble", "mbs", "ms/mb compute", "host")
        print("  {:8s} {:>8s} {:>6s} {:>7s} {:>6s} {:>14s} {:>6s}".format(*head))
        for s, r in b["stages"].items():
            print(f"  {s:8s} {r['compute']:8.1%} {r['host']:6.1%} {r['bubble']:7.1%} {r['micro_batches']:6d} "
                  f"{r['compute_ms_per_mb']:14.2f} {r['host_ms_per_mb']:6.2f}")
        rows = list(b["stages"].values())
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("compute", "host", "bubble")}
        print(f"  {'mean':8s} {mean['compute']:8.1%} {mean['host']:6.1%} {mean['bubble']:7.1%}")
        if b["links_busy"]:
            print("  links busy: " + ", ".join(f"{k} {v:.1%}" for k, v in b["links_busy"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
