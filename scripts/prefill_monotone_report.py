#!/usr/bin/env python3
"""Prefill attention against the chunk size: the shipped profiles' steps down, the published tables'
own, and the fit's error on the tables' prefill rows (docs/measurements/attention-2026-11-28b.md).

    python scripts/prefill_monotone_report.py            # as priced now (the shorter-chunk floor)
    python scripts/prefill_monotone_report.py --form     # the per-block form alone (before the floor)

Needs the published tables under $TESTBED_DATA_DIR/gpu-op-profiles. Held out: each attention shape
predicted by the prefill fit of the device's other shapes, from the shipped decode terms.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.pricing import kernels, prefill_blocks  # noqa: E402
from engine.pricing.hardware import get_hardware  # noqa: E402
from engine.pricing.kernels import KernelCoefficients, LayerKernels  # noqa: E402


def profile_steps() -> None:
    from tests.test_attention_bounds import PROFILES, _prefill_times

    for hw in PROFILES:
        last, worst, steps, calls = {}, (1.0, None), 0, 0
        for _, (model, tp, prefix, x), t, _ in _prefill_times(hw):
            calls += 1
            prev = last.get((model, tp, prefix))
            if prev and t < prev[1]:
                steps += 1
                if t / prev[1] < worst[0]:
                    worst = (t / prev[1], f"{model} TP {tp}, {prev[0]} -> {x} tokens after {prefix}: "
                                          f"{prev[1] * 1e6:.1f} -> {t * 1e6:.1f} us")
            if not prev or t >= prev[1]:
                last[(model, tp, prefix)] = (x, t)
        print(f"{hw}: {steps} of {calls} calls below a shorter chunk"
              + (f"; largest {100 * (1 - worst[0]):.1f}%: {worst[1]}" if worst[1] else ""))


def table_steps(tables) -> None:
    for dev, published in tables.items():
        for t in published.attention:
            by = defaultdict(list)
            for r in t.rows:
                if r.op == "attn_prefill":
                    by[(r.tp, r.prefix)].append((r.tokens, r.time_s))
            pairs = drops = 0
            worst = (0.0, "")
            for (tp, prefix), rows in by.items():
                rows.sort()
                for (x0, t0), (x1, t1) in zip(rows, rows[1:]):
                    pairs += 1
                    if t1 < t0:
                        drops += 1
                        if 1 - t1 / t0 > worst[0]:
                            worst = (1 - t1 / t0, f"TP {tp}, {x0} -> {x1} after {prefix}")
            print(f"table {dev} {t.meta.get('model')}: {drops} of {pairs} adjacent chunk pairs drop"
                  + (f"; largest {100 * worst[0]:.1f}% ({worst[1]})" if drops else ""))


def _errors(c, dev, shape) -> np.ndarray:
    lk = LayerKernels(shape.shape, c, dev.peak_flops, dev.mem_bw_Bps, dev.sm_count)
    return np.array([lk.prefill_s(r.tokens, 1, r.tokens * r.prefix + r.tokens * (r.tokens + 1) / 2,
                                  r.prefix + r.tokens) / r.time_s - 1.0 for r in shape.of("attn_prefill")])


def _line(label: str, e: np.ndarray) -> str:
    return f"{label}: {len(e)} rows, median {100 * np.median(np.abs(e)):.1f}%, max {100 * np.abs(e).max():.1f}%"


def fit_errors(tables) -> None:
    from testbed.calibrate.kernel_fit import attention_shapes, fit_prefill
    from testbed.calibrate.tables import DEVICE_HARDWARE, as_device

    for dev_name, published in tables.items():
        dev = as_device(dev_name)
        c = KernelCoefficients.from_mapping(get_hardware(DEVICE_HARDWARE[dev_name]).kernels)
        shapes = [s for s in attention_shapes(published.attention) if s.of("attn_prefill")]
        ins, held = [], []
        for s in shapes:
            ins.append(_errors(c, dev, s))
            if len(shapes) > 1:
                held.append(_errors(fit_prefill([o for o in shapes if o.label != s.label], dev, c), dev, s))
                print(_line(f"{dev_name} {s.label} held out", held[-1]))
        print(_line(f"{dev_name} in sample", np.concatenate(ins)))
        if held:
            print(_line(f"{dev_name} held out", np.concatenate(held)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--form", action="store_true", help="price with the per-block form alone (no floor)")
    args = ap.parse_args(argv)
    if args.form:
        kernels.makespan_s = prefill_blocks.split_makespan_s
    from testbed.calibrate.gpu_tables import read_published
    from testbed.calibrate.tables import tables_dir

    tables = {dev: read_published(tables_dir(None), dev) for dev in ("h100", "a100")}
    profile_steps()
    table_steps(tables)
    fit_errors(tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
