"""`testbed calibrate runs --decode-by-batch`: the decode-only step's price corrected by batch size.

After the forward fit, the fit runs' traced decode-only forwards (the ForwardSamples the forward fit
used; a profile table's rows are not: one row a shape says nothing about a step's spread) are
priced with the fitted profile, and per stage and batch size n (sequences) the factor is the
mean of measured / priced over the forwards within TRIM of 1 (a stall of 15x its price is not a
step's cost). A batch size needs MIN_SAMPLES such forwards for its own factor; between
two such sizes the factor is interpolated linearly in n, below the smallest held at its value,
above the largest held by CostModel (engine/pricing/decode_batch.py). A stage with no size
measured enough gets [1.0] (no correction).

Why a factor per size, not a form: the CPU engine's decode time is not monotone in the sequences
(set 6, P=1 fit runs: measured / priced 1.12 at 1 sequence, 0.85 / 0.81 at 2 / 3, 1.13-1.16 at
4-6), which no smooth form follows, and the dynamics under congestion depend on the sizes the
batches actually reach. Why a mean, not a median: a run's time is a sum of steps and the ratios
are skewed (episodes of slow steps), so the median priced the steps below their mean: on set 6
at P=1 the median's factors (0.92-0.95 at 20-60 sequences) raised the ShareGPT throughput error
of molink from +3.8% to +7.2%, the trimmed mean's kept it at +3.2% (docs/measurements/
decode-by-batch-2026-11-28d.md). Why MIN_SAMPLES = 20: a decode forward's ratio scatters by about
10% (run-to-run speed, episodes), so the mean of 20 is within about 2-3% (10% / sqrt(20)), the
per-step precision a high-rate TPOT within 10% needs (at P=1 Azure 6 a 1% step price moved TPOT
2-3%).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

MIN_SAMPLES = 20
TRIM = 3.0  # forwards above TRIM x or below 1 / TRIM x their price are left out (stalls, not costs)


def decode_ratios(samples: Sequence[Any], cost: Any) -> dict[int, dict[int, list[float]]]:
    """Per stage, per batch size: measured / priced of each decode-only forward (`samples` are
    run_fit.ForwardSample; `cost` the fitted CostModel without the correction)."""
    out: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        sh = s.shape
        if sh.num_prefill_tokens or not sh.num_decode_seqs or s.time_s <= 0:
            continue
        price = cost.stage_compute_s(s.stage, sh)
        if price > 0:
            out[s.stage % cost.pp][sh.num_decode_seqs].append(s.time_s / price)
    return out


def factor_row(by_size: dict[int, list[float]], min_samples: int = MIN_SAMPLES) -> list[float]:
    """Factors for 1..largest measured size (module docstring); [1.0] when no size has enough."""
    kept = {n: [x for x in v if 1.0 / TRIM < x < TRIM] for n, v in by_size.items()}
    return mean_row(kept, 1, min_samples, 1.0, 4)


def mean_row(by_key: dict[int, list[float]], first: int, min_samples: int, empty: float, digits: int) -> list[float]:
    """The mean of each key's values for keys first..largest with `min_samples` values, interpolated
    linearly between such keys and held below the smallest; [empty] when no key has enough."""
    keys = sorted(k for k, v in by_key.items() if len(v) >= min_samples)
    if not keys:
        return [empty]
    mean = [float(np.mean(by_key[k])) for k in keys]
    row = np.interp(np.arange(first, keys[-1] + 1), keys, mean)
    return [round(float(x), digits) for x in row]


def fit_decode_batch(samples: Sequence[Any], cost: Any, min_samples: int = MIN_SAMPLES) -> list[list[float]]:
    """`cost.decode_batch_factors` (lists, as a profile's YAML holds them): one row per stage."""
    return factors(decode_ratios(samples, cost), cost.pp, min_samples)


def factors(ratios: dict[int, dict[int, list[float]]], pp: int, min_samples: int = MIN_SAMPLES) -> list[list[float]]:
    """`fit_decode_batch` from the ratios `decode_ratios` gave (priced once for the factors and the summary)."""
    return [factor_row(ratios.get(s, {}), min_samples) for s in range(pp)]


def summary(ratios: dict[int, dict[int, list[float]]], pp: int, min_samples: int = MIN_SAMPLES,
            sizes: int = 8) -> list[str]:
    """Lines for `calibrate runs`' output from `decode_ratios`: per stage, the first `sizes` batch
    sizes' forwards and mean measured / priced within TRIM (before the correction)."""
    out = [f"  decode price by batch size (--decode-by-batch; mean measured / priced within {TRIM:g}x, n >= "
           f"{min_samples} for its own factor):"]
    for s in range(pp):
        kept = {n: [x for x in v if 1.0 / TRIM < x < TRIM] for n, v in ratios.get(s, {}).items()}
        cells = [f"{n}: {float(np.mean(v)):.3f} (n={len(v)})" for n, v in sorted(kept.items()) if n <= sizes and v]
        out.append(f"    stage {s}: " + (", ".join(cells) or "no decode-only forwards"))
    return out
