"""Arrival processes for the generated workloads (sharegpt, synthetic).

- `offline`: every request arrives at t=0 (throughput runs: the scheduler sees the whole queue).
- `poisson`: exponential inter-arrival gaps with mean 1/rate (memoryless traffic).
- `gamma`: gamma inter-arrival gaps with mean 1/rate and coefficient of variation `cv`
  (shape k = 1/cv^2, scale = 1/(rate*k)); cv > 1 is burstier than Poisson, cv < 1 smoother,
  cv = 1 has the same distribution as Poisson.

Arrival i is the sum of the first i+1 gaps, so the FIRST request arrives after one gap, not at 0:
the process is a renewal process started at t=0, and n / arrival[-1] is an unbiased-in-the-limit
estimate of `rate`. Gaps are drawn from the generator passed in (seeded by the workload's
`seed`); nothing is capped or clipped, so the realised rate and burstiness are those asked for.
Drawing the gaps as standard variates scaled by 1/rate means the same seed gives the same
arrival pattern, stretched, across a rate sweep.
"""
from __future__ import annotations

import numpy as np

from engine.base.errors import bad_value
from workloads.base import check_choice, key

ARRIVAL_PROCESSES = ("offline", "poisson", "gamma")
MIN_CV, MAX_CV = 1e-3, 100.0
MAX_RATE = 1e6  # requests/s: far beyond any server, and below where rescaling a trace's gaps overflows
# requests/s: one a week. Slower, arrival times grow so large (1e300 s at rate=1e-300) that a
# request's latency is lost in their float rounding and every latency reads 0
MIN_RATE = 1e-6


def check_arrival(arrival: str, rate: float | None, cv: float) -> None:
    """Validate the arrival settings of a config (`workload.arrival`, `.rate`, `.cv`)."""
    check_choice("arrival", arrival, ARRIVAL_PROCESSES)
    if arrival != "offline" and (rate is None or rate <= 0):
        raise bad_value(key("rate"), rate, f"must be > 0 for arrival={arrival} (requests per second)")
    if not MIN_CV <= cv <= MAX_CV:  # beyond these the gamma shape 1/cv^2 overflows or its gaps underflow to 0
        raise bad_value(key("cv"), cv, f"must be in [{MIN_CV:g}, {MAX_CV:g}] (coefficient of variation of the gaps)")


def arrival_times(arrival: str, n: int, rng: np.random.Generator, rate: float | None = None,
                  cv: float = 1.0) -> np.ndarray:
    """`n` non-decreasing arrival times in seconds."""
    check_arrival(arrival, rate, cv)
    if arrival == "offline":
        return np.zeros(n)
    if arrival == "poisson":
        gaps = rng.standard_exponential(n)
    else:
        shape = 1.0 / (cv * cv)
        gaps = rng.standard_gamma(shape, n) / shape  # mean 1, coefficient of variation cv
    return np.cumsum(gaps / rate)
