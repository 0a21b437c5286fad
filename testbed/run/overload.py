"""Is a run overloaded? Judged on the queue over the arrival window, as the capacity probes judge.

The first warning compared the tokens offered over the arrival span with the tokens served over the
whole run (first arrival to last completion): the drain tail after the last arrival counts in the
second and not in the first, so a short healthy run tripped the 1.10 margin (gLLM at 0.75 req/s,
300 Azure requests: attainment 0.90, TTFT p99 as at 0.25 req/s, ratio 1.13; issue 49 item 4).
Tokens served within the arrival window do not fix it either: requests still decoding at the last
arrival (mean end-to-end 47 s there) are ~12% of the tokens of a 300-request run.

What an overload is: a queue that keeps growing. The queue is the requests that arrived and have no
first token yet (being decoded is being served), sampled at each arrival of the second half of the
arrival window (the first half is the system filling up); its slope over that half, as a fraction
of the arrival rate, is ~0 in a steady state and ~(1 - served / offered) in an overload. Over
`GROWTH_LIMIT` (5%, the capacity probes' allowance) and by at least `MIN_QUEUE_RISE` requests, the
run is overloaded: its TTFT then measures a backlog that grows with the run's length.
Numpy only: `testbed run` imports no pandas (testbed/run/outputs.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

GROWTH_LIMIT = 0.05  # the queue may grow by at most 5% of the arrival rate (capacity's BACKLOG_GROWTH_LIMIT)
MIN_QUEUE_RISE = 2.0  # ... or by fewer requests than this over the judged half (noise at low rates)
MIN_SAMPLES = 8  # fewer arrivals in the judged half: nothing to say (nan)


def queue_growth(arrival_s: Sequence[float], first_token_s: Sequence[float], warmup_s: float = 0.0) -> float:
    """Slope of the queue (arrived, no first token yet; a missing first token never leaves) over the
    second half of the arrivals after `warmup_s`, as a fraction of their mean arrival rate; 0 when it
    rose by fewer than MIN_QUEUE_RISE requests; nan when too few arrived to tell."""
    arrivals = np.sort(np.asarray(arrival_s, dtype=float))
    first = np.asarray(first_token_s, dtype=float)
    first = np.sort(np.where(np.isnan(first), np.inf, first))
    judged = arrivals[arrivals >= warmup_s]
    if judged.size < 2 or judged[-1] <= judged[0]:
        return math.nan
    rate = (judged.size - 1) / (judged[-1] - judged[0])
    samples = judged[judged >= (judged[0] + judged[-1]) / 2]
    if samples.size < MIN_SAMPLES or samples[-1] <= samples[0]:
        return math.nan
    queued = np.searchsorted(arrivals, samples, "right") - np.searchsorted(first, samples, "right")
    slope = float(np.polyfit(samples, queued.astype(float), 1)[0])
    if slope * (samples[-1] - samples[0]) < MIN_QUEUE_RISE:
        return min(0.0, slope / rate)
    return slope / rate


@dataclass(frozen=True)
class Load:
    """What the workload offered over its arrival window and how the queue went meanwhile."""

    offered_tok_s: float
    offered_req_s: float
    growth: float  # queue_growth: fraction of the arrival rate that piles up; nan: too short to tell

    @property
    def overloaded(self) -> bool:
        return self.growth > GROWTH_LIMIT  # nan is not an overload


def judge(requests: Sequence[dict]) -> Load | None:
    """The load of a run's request rows (`arrival_s`, `first_token_s`, `prompt_len`, `output_len`);
    None for offline arrivals (every request at once: no window to judge)."""
    if len(requests) < 2:
        return None
    arrivals = [r["arrival_s"] for r in requests]
    span = max(arrivals) - min(arrivals)
    if span <= 0:
        return None
    tokens = sum(r["prompt_len"] + r["output_len"] for r in requests)
    first = [math.nan if r.get("first_token_s") is None else r["first_token_s"] for r in requests]
    return Load(tokens / span, (len(requests) - 1) / span, queue_growth(arrivals, first))


__all__ = ["GROWTH_LIMIT", "Load", "judge", "queue_growth"]
