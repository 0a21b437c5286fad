"""How long a probe runs, whether it reached a steady state, and what one unloaded request says
before any probe.

A probe that is too short measures a burst: on llama2-70b / 4 x H100 500-request Azure probes
(40 s of arrivals) gave a capacity of 12.53 req/s, 1,000-request probes 8.125, steady-state
probes 7.6 (docs/capacity.md). So a probe's length is set by time
(`capacity.duration_s`, by default `steady_factor` (8) x the end-to-end time of the workload's
longest request served alone, at least `min_duration_s`; with 4 the main setup's capacities moved
by 18-25% when the probes doubled, with 8 by 1-9%), and every probe is checked: the queue (requests
arrived and still without their first token), sampled at each arrival of the second half of the
judged window, must not grow by more than `BACKLOG_GROWTH_LIMIT` of the arrival rate (and by more
than `MIN_QUEUE_RISE` requests over that half). A queue that still grows at the end is an overload
that a longer probe would have shown as a failure, so such a probe fails whatever its metrics say
(`capacity.steady` false in probes.csv). The first token, not the finish, marks leaving the
queue: requests being decoded fill the system for an end-to-end time after the first arrival,
which a short probe would otherwise read as growth; the client of a live probe sees it too.

On a trace this length is not used: a probe is a trace window of 4,000 contiguous requests
(testbed/capacity/windows.py), which holds the trace's own drift; replaying a window's first 500
requests in cycles, as before, measured a sample that did not (docs/capacity.md).

The unloaded request also prunes: when the workload's lightest request (shortest prompt, then
shortest output of at least 2 tokens), served alone, already misses the SLO bound the criterion
judges, no load can meet it (llama2-70b on 4 x L20: TPOT 0.223 s alone against a 0.2 s bound),
and the point is reported so without a probe.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from engine.base.errors import TestbedError
from engine.core.metrics import SLO
from engine.core.request import Request
from testbed.capacity.settings import CapacitySettings
from testbed.config.spec import RunSpec

BACKLOG_GROWTH_LIMIT = 0.05  # the queue may grow by at most 5% of the arrival rate
MIN_QUEUE_RISE = 2.0  # ... or by fewer requests than this over the second half (noise at low rates)
MIN_STEADY_SAMPLES = 8  # fewer judged arrivals in the second half: the check has nothing to say (nan)
ROUND_S = 10.0  # steady-state probe lengths are rounded up to whole 10 s


@dataclass(frozen=True)
class Unloaded:
    """One request served alone, on the point's deployment (simulated seconds)."""

    ttft_s: float  # the lightest request's TTFT
    tpot_s: float  # the lightest request's TPOT (= its time between tokens: nothing interferes)
    e2e_s: float  # the longest request's end-to-end time (most output tokens, then longest prompt)
    error: str | None = None  # why it could not run (e.g. the model does not fit)


def unloaded(run: RunSpec) -> Unloaded:
    """Simulate the workload's lightest and longest request, each alone."""
    from testbed.run.runner import run_experiment
    from workloads.base import build_workload

    quiet = run.with_values({"output.mlflow": False, "output.plots": False, "output.progress": False,
                             "output.trace": "off"})
    try:
        requests = build_workload(run.workload, run.data_dir)
        light = min(requests, key=lambda r: (r.output_len < 2, r.prompt_len, r.output_len))
        heavy = max(requests, key=lambda r: (r.output_len, r.prompt_len))
        alone = [run_experiment(quiet, requests=[Request(0, 0.0, r.prompt_len, r.output_len)]) for r in (light, heavy)]
    except TestbedError as exc:
        return Unloaded(math.nan, math.nan, math.nan, str(exc))
    bad = next((res.error for res in alone if res.error), None)
    if bad:
        return Unloaded(math.nan, math.nan, math.nan, bad)
    lite, big = (res.summary for res in alone)
    return Unloaded(lite["ttft_mean_s"], lite["tpot_mean_s"], big["e2el_mean_s"])


def probe_duration(s: CapacitySettings, u: Unloaded | None) -> float:
    """Seconds of arrivals per probe (after the warm-up): `duration_s`, else the steady-state rule."""
    if s.duration_s:
        return s.duration_s
    longest = u.e2e_s if u is not None and math.isfinite(u.e2e_s) else 0.0
    return max(s.min_duration_s, math.ceil(s.steady_factor * longest / ROUND_S) * ROUND_S)


def unloaded_miss(s: CapacitySettings, target: float, slo: SLO, u: Unloaded) -> str | None:
    """Why no load can meet the criterion, judged from the lightest request alone; None if it may."""
    if s.criterion == "attainment":
        bounds = [("TTFT", u.ttft_s, slo.ttft_s), ("TPOT", u.tpot_s, slo.tpot_s)]
    elif s.criterion == "ttft_p99":
        bounds = [("TTFT", u.ttft_s, target)]
    else:  # tpot_p99, tbt_p99, sarathi: a request alone decodes at its fastest
        bounds = [("TPOT", u.tpot_s, target)]
    for name, value, bound in bounds:
        if value > bound:
            return (f"misses the SLO unloaded: the lightest request alone has {name} {value:.3g} s > {bound:g} s, "
                    f"so no rate can meet it")
    return None


def backlog_growth(requests: pd.DataFrame, rate: float, warmup_s: float = 0.0) -> float:
    """Slope of the queue (arrived, no first token yet) over the second half of the judged
    arrivals, as a fraction of the arrival rate: ~0 in a steady state, ~(1 - served / offered) in
    an overload; 0 when it rose by fewer than MIN_QUEUE_RISE requests; nan when too few requests
    arrived to tell."""
    arrivals = np.sort(requests["arrival_s"].to_numpy(float))
    finish = requests["first_token_s"].to_numpy(float)
    finish = np.sort(np.where(np.isnan(finish), np.inf, finish))
    judged = arrivals[arrivals >= warmup_s]
    if judged.size < 2:
        return math.nan
    samples = judged[judged >= (judged[0] + judged[-1]) / 2]
    if samples.size < MIN_STEADY_SAMPLES or samples[-1] <= samples[0]:
        return math.nan
    in_system = np.searchsorted(arrivals, samples, "right") - np.searchsorted(finish, samples, "right")
    slope = np.polyfit(samples, in_system.astype(float), 1)[0]
    if slope * (samples[-1] - samples[0]) < MIN_QUEUE_RISE:
        return min(0.0, float(slope / rate))
    return float(slope / rate)


def is_steady(growth: float) -> bool:
    return not growth > BACKLOG_GROWTH_LIMIT  # nan (too few arrivals to tell) is not held against a probe
