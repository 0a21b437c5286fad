"""What an engine stall does to each latency figure, not only to throughput.

A stall (testbed/calibrate/offline.py `stalls`: a micro-batch far above what the profile says) holds
every request in flight: a request waiting for its first token has its TTFT lengthened, one decoding
has its TPOT lengthened. Reporting the throughput without the stalls alone (as issue 35 did) hid
that the H100 sarathi run's TTFT and TPOT errors (-43% / -39%) were its 4 stalls too. For each
request this takes the stalls' excess that falls inside its waiting time (arrival -> first token)
and inside its decoding time (first token -> finish), and gives the mean TTFT and TPOT with it
taken out, with how many requests each stall touched.
"""
from __future__ import annotations

import pandas as pd


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def stall_latency(requests_csv, intervals: list[tuple[float, float, float]]) -> dict:
    """`intervals`: (start, end, excess s) of each stall. The excess is counted at the end of its
    micro-batch (the profile's share of the step came first)."""
    out = {"ttft_touched": 0, "tpot_touched": 0}
    try:
        reqs = pd.read_csv(requests_csv, usecols=["arrival_s", "first_token_s", "finish_s", "ttft_s", "tpot_s",
                                                  "num_generated", "status"])
    except (OSError, ValueError):
        return out
    done = reqs[reqs["status"] == "finished"]
    if not intervals or done.empty:
        out.update(ttft_mean_without=float(done["ttft_s"].mean()) if not done.empty else float("nan"),
                   tpot_mean_without=float(done["tpot_s"].mean()) if not done.empty else float("nan"))
        return out
    ttfts, tpots = [], []
    for r in done.itertuples():
        wait = sum(_overlap(r.arrival_s, r.first_token_s, end - ex, end) for _, end, ex in intervals)
        dec = sum(_overlap(r.first_token_s, r.finish_s, end - ex, end) for _, end, ex in intervals)
        out["ttft_touched"] += wait > 0
        out["tpot_touched"] += dec > 0
        ttfts.append(r.ttft_s - wait)
        steps = max(1, int(r.num_generated) - 1)
        tpots.append(r.tpot_s - dec / steps if pd.notna(r.tpot_s) else float("nan"))
    out["ttft_mean_without"] = float(pd.Series(ttfts).mean())
    out["tpot_mean_without"] = float(pd.Series(tpots).mean())
    return out
