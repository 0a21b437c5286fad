"""A run predicted as the mean over a spread of machine speeds (`testbed validate --runs --spread s`).

Why: the CPU engine's same-shape forward time moved 5-13% between repeats of one command (set 7,
docs/measurements/real-runs-2026-11-28d.md, "Diagnosed after the report"), not with the one-minute
load within a campaign (between campaigns the work beside the engine moved it 5-15%: set 8). Near
saturation the figures are convex in that speed (1% of step price became 1.6-2.7% of mean TPOT), and
some settings have two states: sarathi at P=2, Azure 9 req/s gave engine TPOTs of 35.9-59.6 ms over
six repeats, while the simulator's single point sat at 51.6 ms, the top of its own range over compute
scales 0.99-1.01 (38.9-51.6 ms, mean 45.1 = the engine's six-run mean). What the mean of repeats
estimates is the figure's expectation over the machine's speed, so the prediction compared with it is
the simulator's mean over a range of speeds: `SPREAD_POINTS` runs at compute scales evenly spaced in
[1 - s, 1 + s] (`executor.compute_scale`). Deterministic: the same run, profile and s give the same
floats. s = 0 is the single simulated point.
"""
from __future__ import annotations

import math

from engine.base.errors import ConfigError
from testbed.calibrate.replay_sim import simulate_run
from testbed.calibrate.runs import RealRun

SPREAD_POINTS = 9
MAX_SPREAD = 0.5


def check_spread(value: float) -> float:
    """`--spread`'s value, or one `error:` line naming it and the valid range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= MAX_SPREAD:
        raise ConfigError(f"invalid --spread={value!r}: must be a number in [0, {MAX_SPREAD}] "
                          "(0: one simulated point; 0.05: compute scales 0.95-1.05)")
    return float(value)


def compute_scales(spread: float) -> tuple[float, ...]:
    """The compute scales the prediction averages over: (1.0,) for no spread."""
    if spread == 0.0:
        return (1.0,)
    n = SPREAD_POINTS - 1
    return tuple(1.0 + spread * (2.0 * i / n - 1.0) for i in range(SPREAD_POINTS))


def mean_summary(summaries: list[dict]) -> dict:
    """Each numeric figure's mean over the ensemble (the first summary's other fields kept)."""
    out = dict(summaries[0])
    for key, value in summaries[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            vals = [float(s.get(key, math.nan)) for s in summaries]
            out[key] = sum(vals) / len(vals)
    return out


def simulate_spread(run: RealRun, hardware: str, spread: float, out_dir=None) -> tuple[object, dict]:
    """(the simulated run at scale 1, the summary the run is compared with: the mean over
    `compute_scales(spread)`, or that run's own summary when spread is 0)."""
    point = simulate_run(run, hardware, out_dir)
    scales = compute_scales(spread)
    if len(scales) == 1:
        return point, dict(point.summary)
    summaries = [point.summary if s == 1.0 else simulate_run(run, hardware, compute_scale=s).summary for s in scales]
    return point, mean_summary(summaries)


def spread_note(spread: float) -> str:
    """The line a report carries when its predictions are ensemble means."""
    if spread == 0.0:
        return ""
    lo, hi = compute_scales(spread)[0], compute_scales(spread)[-1]
    return (f"\nsimulated figures: the mean of {SPREAD_POINTS} simulations at compute scales {lo:g}-{hi:g} "
            f"(--spread {spread:g})")
