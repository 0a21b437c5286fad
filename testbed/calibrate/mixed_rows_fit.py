"""`testbed calibrate runs --mixed-by-rows`: the price of a step with a prefill chunk corrected by its
sampled rows (engine/pricing/mixed_rows.py says why and how it is applied).

After the forward fit, the fit runs' traced forwards of steps with a prefill chunk (the
ForwardSamples the forward fit used; a profile table's rows are not: one row a shape says nothing
about a step's spread) are priced with the fitted profile, and per stage and sampled-row count r the
term is the mean of measured minus priced over the forwards within TRIM of their price (a stall of
15x its price is not a step's cost). A row count needs MIN_SAMPLES such forwards for its own term;
between two such counts the term is interpolated linearly in r, below the smallest held at its
value, above the largest held by CostModel. A stage with no count measured enough gets [0.0].

Why additive, not a factor as for the decode-only steps: the cause the rows stand for, the lm_head
on the sampled rows, costs the same whatever the chunk's tokens (set 16, P=1 fit runs: mixed steps
of 4 rows measured 9-100 ms, their residual about +1 ms). Why a mean and MIN_SAMPLES = 20: as for
--decode-by-batch (testbed/calibrate/decode_batch_fit.py): a run's time is a sum of steps; a mixed
forward's residual scatters by 1-3 ms, so the mean of 20 is within about 0.5 ms.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from testbed.calibrate.decode_batch_fit import MIN_SAMPLES, TRIM, mean_row


def mixed_residuals(samples: Sequence[Any], cost: Any) -> dict[int, dict[int, list[float]]]:
    """Per stage, per sampled-row count: measured minus priced seconds of each forward of a step
    with a prefill chunk within TRIM of its price (`samples` are run_fit.ForwardSample; `cost` the
    fitted CostModel without the correction)."""
    out: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        if not s.shape.num_prefill_tokens or s.time_s <= 0:
            continue
        price = cost.stage_compute_s(s.stage, s.shape)
        if price > 0 and 1.0 / TRIM < s.time_s / price < TRIM:
            out[s.stage % cost.pp][s.shape.num_sampled].append(s.time_s - price)
    return out


def extra_row(by_rows: dict[int, list[float]], min_samples: int = MIN_SAMPLES) -> list[float]:
    """Terms (seconds) for 0..largest well-measured row count (module docstring); [0.0] when none is."""
    return mean_row(by_rows, 0, min_samples, 0.0, 7)


def fit_mixed_rows(samples: Sequence[Any], cost: Any, min_samples: int = MIN_SAMPLES) -> list[list[float]]:
    """`cost.mixed_row_extra_s` (lists, as a profile's YAML holds them): one row per stage."""
    return terms(mixed_residuals(samples, cost), cost.pp, min_samples)


def terms(residuals: dict[int, dict[int, list[float]]], pp: int, min_samples: int = MIN_SAMPLES) -> list[list[float]]:
    """`fit_mixed_rows` from the residuals `mixed_residuals` gave (priced once for the terms and the summary)."""
    return [extra_row(residuals.get(s, {}), min_samples) for s in range(pp)]


def summary(residuals: dict[int, dict[int, list[float]]], pp: int, min_samples: int = MIN_SAMPLES,
            counts: int = 9) -> list[str]:
    """Lines for `calibrate runs`' output from `mixed_residuals`: per stage, the first `counts` row
    counts' forwards with a prefill chunk and their mean measured minus priced (before the correction)."""
    out = [f"  mixed-step price by sampled rows (--mixed-by-rows; mean measured - priced within {TRIM:g}x, n >= "
           f"{min_samples} for its own term):"]
    for s in range(pp):
        cells = [f"{r}: {1e3 * float(np.mean(v)):+.2f} ms (n={len(v)})"
                 for r, v in sorted(residuals.get(s, {}).items()) if r < counts and v]
        out.append(f"    stage {s}: " + (", ".join(cells) or "no forwards with a prefill chunk"))
    return out
