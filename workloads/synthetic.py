"""Synthetic requests: lengths from simple distributions, no data files needed.

Length distributions (the same keys for input_* and output_*):
- `fixed`: every request has `mean` tokens (must be an integer inside [min, max]).
- `uniform`: integers uniform on [min, max] inclusive (`max` required; `mean` is not used).
- `lognormal`: exp(N(mu, sigma^2)) rounded to the nearest integer, with mu chosen so that the
  UNTRUNCATED distribution has arithmetic mean `mean`. Draws outside [min, max] are rejected and
  drawn again, never clipped: clipping would pile probability mass onto the bounds (a spike of
  requests at exactly `max`) that no real workload has. The price is that the realised mean is
  that of the truncated distribution; bounds that would reject more than 99.9% of draws are a
  config error.

Input lengths, output lengths and arrivals use three independent streams derived from `seed`,
so changing one setting does not reshuffle the others.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.base.errors import ConfigError, bad_value
from engine.core.request import Request
from engine.base.typed import setting
from workloads.arrivals import ARRIVAL_PROCESSES, MAX_RATE, MIN_RATE, arrival_times, check_arrival
from workloads.base import MAX_TOKENS, WORKLOADS, WorkloadSpec, check_min, check_range, check_types, key, make_requests

LENGTH_DISTS = ("fixed", "uniform", "lognormal")
MIN_ACCEPT = 1e-3  # lognormal bounds must keep at least this fraction of draws
MAX_REQUESTS = 10_000_000  # each request is a Python object of ~1 kB in the controller


@dataclass(frozen=True)
class SyntheticConfig:
    name: str = "synthetic"
    num_requests: int = setting(1000, min=1, max=MAX_REQUESTS)
    input_dist: str = setting("fixed", choices=LENGTH_DISTS)
    input_mean: float = setting(512, max=MAX_TOKENS)
    input_min: int = setting(1, max=MAX_TOKENS)
    input_max: int | None = setting(None, max=MAX_TOKENS)  # None = no upper bound (not allowed for uniform)
    input_sigma: float = 1.0  # lognormal only: sigma of the underlying normal
    output_dist: str = setting("fixed", choices=LENGTH_DISTS)
    output_mean: float = setting(128, max=MAX_TOKENS)
    output_min: int = setting(1, max=MAX_TOKENS)
    output_max: int | None = setting(None, max=MAX_TOKENS)
    output_sigma: float = 1.0
    arrival: str = setting("poisson", choices=ARRIVAL_PROCESSES)
    rate: float | None = setting(4.0, min=MIN_RATE, max=MAX_RATE)  # req/s; required > 0 unless offline
    cv: float = 1.0  # gamma only
    seed: int = setting(0, min=0)  # the run config's default is ${seed} (testbed/config/composer.py)

    def __post_init__(self) -> None:
        check_types(self)
        for side in ("input", "output"):
            _check_lengths(side, *(getattr(self, f"{side}_{k}") for k in ("dist", "mean", "min", "max", "sigma")))
        check_arrival(self.arrival, self.rate, self.cv)


def _check_lengths(side: str, dist: str, mean: float, lo: int, hi: int | None, sigma: float) -> None:
    check_range(f"{side}_min", lo, f"{side}_max", hi)
    if dist == "fixed":
        if not float(mean).is_integer() or mean < lo or (hi is not None and mean > hi):
            raise bad_value(key(f"{side}_mean"), mean, f"must be an integer in [{side}_min, {side}_max] "
                                                       f"= [{lo}, {hi}] for {side}_dist=fixed")
    elif dist == "uniform":
        if hi is None:
            raise bad_value(key(f"{side}_max"), hi, f"must be set for {side}_dist=uniform")
    else:
        check_min(f"{side}_mean", mean, 0, strict=True)
        check_min(f"{side}_sigma", sigma, 0, strict=True)
        p = _lognormal_accept(mean, sigma, lo, hi)
        if p < MIN_ACCEPT:
            raise ConfigError(f"invalid {key(side + '_min')}/{key(side + '_max')}=[{lo}, {hi}]: they keep only "
                              f"{p:.2e} of lognormal(mean={mean}, sigma={sigma}) draws (need >= {MIN_ACCEPT}); "
                              f"widen the bounds or move the mean")


def _mu(mean: float, sigma: float) -> float:
    return math.log(mean) - sigma * sigma / 2


def _lognormal_accept(mean: float, sigma: float, lo: int, hi: int | None) -> float:
    """P(round(X) in [lo, hi]) for X lognormal with arithmetic mean `mean`."""
    def cdf(x: float) -> float:
        return 0.5 * (1 + math.erf((math.log(x) - _mu(mean, sigma)) / (sigma * math.sqrt(2))))
    upper = 1.0 if hi is None else cdf(hi + 0.5)
    return upper - cdf(lo - 0.5)


def sample_lengths(n: int, rng: np.random.Generator, dist: str, mean: float, lo: int, hi: int | None,
                   sigma: float) -> np.ndarray:
    """`n` integer lengths; see the module docstring for each distribution."""
    if dist == "fixed":
        return np.full(n, int(mean), dtype=np.int64)
    if dist == "uniform":
        return rng.integers(lo, hi, size=n, endpoint=True)
    accept = _lognormal_accept(mean, sigma, lo, hi)
    out: list[np.ndarray] = []
    need = n
    while need > 0:  # rejection sampling: expected rounds ~1 since the batch is sized by `accept`
        draw = np.rint(rng.lognormal(_mu(mean, sigma), sigma, size=int(need / accept * 1.1) + 16))
        ok = draw[(draw >= lo) & (draw <= (np.inf if hi is None else hi))][:need]
        out.append(ok.astype(np.int64))
        need -= len(ok)
    return np.concatenate(out)


def build_synthetic(cfg: SyntheticConfig, data_dir: str | None = None) -> list[Request]:
    in_rng, out_rng, arr_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(cfg.seed).spawn(3))
    n = cfg.num_requests
    inp = sample_lengths(n, in_rng, cfg.input_dist, cfg.input_mean, cfg.input_min, cfg.input_max, cfg.input_sigma)
    out = sample_lengths(n, out_rng, cfg.output_dist, cfg.output_mean, cfg.output_min, cfg.output_max,
                         cfg.output_sigma)
    arrivals = arrival_times(cfg.arrival, n, arr_rng, cfg.rate, cfg.cv)
    return make_requests(arrivals, inp, out)


WORKLOADS.add("synthetic", WorkloadSpec(SyntheticConfig, build_synthetic))
