"""What lies between a micro-batch's last forward and the next forward of its sequences, in one simulated
run's full trace: the round trip a decode pipeline pays once per round, and what the stages wait for.

    testbed run <overrides> output.trace=full output.mlflow=false output.dir=D output.run_name=R
    python scripts/loop_latency.py D/R/trace.json

With P micro-batches in flight on P stages, a micro-batch's next round can start on stage 0 only after its
tokens are sampled and its next input is prepared; no other micro-batch's forward is left to hide that
behind, so stage 0 idles for it each round (docs/measurements/sipipe-loop-2026-11-29.md). Prints, in the
run's middle half (no fill, no drain): micro-batches in flight, the median stage-0 forward, sampling (the
slowest CPU sampler or the last stage's GPU sampling), preparation on stage 0's CPU track, and stage 0's idle
gap before a forward, with the share of gaps that end when that micro-batch's preparation ends.
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def spans(path: str) -> dict[str, list[tuple[float, float, str, int]]]:
    data = json.load(open(path, encoding="utf-8"))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    tracks: dict[str, list] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "mb" in e.get("args", {}):
            tracks[names.get(e["tid"], str(e["tid"]))].append((e["ts"] / 1e3, e["dur"] / 1e3, e["name"], e["args"]["mb"]))
    for spans_ in tracks.values():
        spans_.sort()
    return tracks


def main(path: str) -> None:
    tracks = spans(path)
    fwd0 = [s for s in tracks["stage0"] if s[2].startswith("forward")]
    lo, hi = fwd0[len(fwd0) // 4][0], fwd0[3 * len(fwd0) // 4][0]
    mid = [s for s in fwd0 if lo <= s[0] <= hi]
    last = max(int(t[5:]) for t in tracks if t.startswith("stage") and t[5:].isdigit())
    start0 = {s[3]: s[0] for s in fwd0}
    end_last = {s[3]: s[0] + s[1] for s in tracks[f"stage{last}"] if s[2].startswith("forward")}
    in_flight = [sum(1 for m, t in start0.items() if t <= s[0] and end_last.get(m, 1e18) > s[0]) for s in mid]
    sample: dict[int, float] = defaultdict(float)
    for name, ss in tracks.items():
        if name.startswith("sampler") or name == f"stage{last}":
            for t, d, kind, mb in ss:
                if kind == "sample":
                    sample[mb] = max(sample[mb], d)
    prep_end = {s[3]: s[0] + s[1] for s in tracks.get("stage0.cpu", []) if s[2] == "prepare"}
    prep = [s[1] for s in tracks.get("stage0.cpu", []) if s[2] == "prepare" and lo <= s[0] <= hi]
    gaps, on_prep = [], 0
    for prev, cur in zip(fwd0, fwd0[1:]):
        if lo <= cur[0] <= hi and cur[0] - (prev[0] + prev[1]) > 1e-6:
            gaps.append(cur[0] - (prev[0] + prev[1]))
            on_prep += abs(prep_end.get(cur[3], -1.0) - cur[0]) < 1e-3
    med = statistics.median
    print(f"micro-batches in flight (median) {med(in_flight):g}; stage-0 forward {med(s[1] for s in mid):.2f} ms; "
          f"sampling {med(sample[s[3]] for s in mid if s[3] in sample) if sample else 0:.2f} ms; "
          f"preparation {med(prep) if prep else 0:.2f} ms")
    idle = sum(gaps) / (hi - lo) if hi > lo else 0.0
    print(f"stage 0 idle {100 * idle:.1f}% of the middle half: {len(gaps)} gaps of {len(mid)} forwards, "
          f"median {med(gaps) if gaps else 0:.2f} ms; {on_prep} end as that micro-batch's preparation ends")


if __name__ == "__main__":
    main(sys.argv[1])
