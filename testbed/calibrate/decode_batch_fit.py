"""`testbed calibrate runs --decode-by-batch`: the decode-only step's price corrected by batch size.

After the forward fit, the fit runs' traced decode-only forwards (the ForwardSamples the forward fit
used; a profile table's rows are not: one row a shape says nothing about a step's spread) are
priced with the fitted profile, and per stage and batch size n (sequences) the factor is the
median of measured / priced. A batch size needs MIN_SAMPLES forwards for its own factor; between
two such sizes the factor is interpolated linearly in n, below the smallest held at its value,
above the largest held by CostModel (engine/pricing/decode_batch.py). A stage with no size
measured enough gets [1.0] (no correction).

Why a median per size, not a form: the CPU engine's decode time is not monotone in the sequences
(set 6, P=1 fit runs: measured / priced 1.11 at 1 sequence, 0.83 / 0.79 at 2 / 3, 1.12-1.15 at
4-6, 0.93-0.99 at 16-60), which no smooth form follows, and the dynamics under congestion depend
on the sizes the batches actually reach. Why MIN_SAMPLES = 20: a decode forward's ratio scatters
by about 10% (run-to-run speed, episodes), so the median of 20 is within about 3% (1.25 x 10% /
sqrt(20)), the per-step precision a high-rate TPOT within 10% needs (diag47g: at P=1 Azure 6 a
1% step price moved TPOT 2-3%).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

MIN_SAMPLES = 20


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
    sizes = sorted(n for n, v in by_size.items() if len(v) >= min_samples)
    if not sizes:
        return [1.0]
    med = [float(np.median(by_size[n])) for n in sizes]
    row = np.interp(np.arange(1, sizes[-1] + 1), sizes, med)  # held below the smallest size
    return [round(float(x), 4) for x in row]


def fit_decode_batch(samples: Sequence[Any], cost: Any, min_samples: int = MIN_SAMPLES) -> list[list[float]]:
    """`cost.decode_batch_factors` (lists, as a profile's YAML holds them): one row per stage."""
    ratios = decode_ratios(samples, cost)
    return [factor_row(ratios.get(s, {}), min_samples) for s in range(cost.pp)]


def summary(samples: Sequence[Any], cost: Any, min_samples: int = MIN_SAMPLES, sizes: int = 8) -> list[str]:
    """Lines for `calibrate runs`' output: per stage, the first `sizes` batch sizes' forwards and
    median measured / priced (before the correction)."""
    ratios = decode_ratios(samples, cost)
    out = [f"  decode price by batch size (--decode-by-batch; median measured / priced, n >= {min_samples} "
           "for its own factor):"]
    for s in range(cost.pp):
        cells = [f"{n}: {float(np.median(v)):.3f} (n={len(v)})" for n, v in sorted(ratios.get(s, {}).items())
                 if n <= sizes]
        out.append(f"    stage {s}: " + (", ".join(cells) or "no decode-only forwards"))
    return out
