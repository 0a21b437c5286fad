"""The CPU-sampling path (SiPipe's `runtime.cpu_sampling`) fitted from runs that used it.

On the shared 2-core CPU machine SiPipe ran last among the six policies on the engine and first in
the simulator (issue 47: +24% throughput, -17% TPOT at P=1). The engine was right and the simulator
wrong: its CPU-sampling path was priced with the cost model's defaults (200 us a micro-batch, on
free host cores), where on this host the last stage copies the logits to the samplers (1.2 ms
median, `to_samplers`) and the samplers, two more processes on two busy cores, wait for a core
before they sample (0.2 ms) and hand the ids to the driver: the stage's wait for its next
micro-batch went from 0.80 ms (sarathi, inline sampling) to 3.41 ms median (tiny-llama, P=1,
ShareGPT 100, load ~10 of other tenants). Other tenants' load is not modelled (the simulator
does not know it); the path's time on this host is, like every other engine term: from the
end of the last stage's logits handoff (`to_samplers`, its own term on the stage: run_fit.py) to the
completion, less the return the simulator adds after it, fitted as fixed + per row x vocab /
samplers (`CostModel.cpu_sample_s`) by non-negative least squares; with `--sampler-contention`,
+ a term per stage of the run's own working beside the samplers as the path starts.
A profile fitted without such a run keeps the defaults (a GPU host's free cores).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from testbed.calibrate.runs import RealRun, replayed_batches

NOT_WORK = ("wait", "recv")  # a stage's spans that hold no core: waiting for its input
AFTER_S = 1e-6  # the count is taken this long after the handoff's end: a span that ends at it is not counted


class SamplingPath(NamedTuple):
    """One micro-batch's CPU-sampling path in a real run."""

    rows: int  # rows sampled
    workers: int  # sampler processes
    seconds: float  # from the end of the logits' handoff to the completion
    busy_stages: int  # stages before the last working on a micro-batch when the path started


def cpu_sampling_samples(runs: Sequence[RealRun]) -> list[SamplingPath]:
    """The CPU-sampling path of every micro-batch but the first of the runs that sampled on CPU
    processes."""
    out = []
    for run in runs:
        workers = int(getattr(run.spec.settings.executor.settings, "num_cpu_samplers", 1) or 1)
        batches = replayed_batches(run)[1:]
        if not any(b.stages[-1].handoff is not None for b in batches):
            continue
        working = _stage_work(run)
        for b in batches:
            last = b.stages[-1]
            if last.handoff is None or last.busy_end is None or not b.shape.num_sampled:
                continue
            # from the handoff's end: the stage's copy is its own term (CostModel.cpu_handoff_s)
            at = last.busy_end + AFTER_S
            busy = sum(bool(np.any((starts <= at) & (ends > at))) for starts, ends in working[:-1])
            out.append(SamplingPath(b.shape.num_sampled, workers, b.completed_s - last.busy_end, busy))
    return out


def _stage_work(run: RealRun) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per stage, the (starts, ends) of its work on each micro-batch: its first span that holds a
    core (not a wait or a receive) to its last span's end."""
    intervals: list[list[tuple[float, float]]] = [[] for _ in range(run.pp)]
    for (_, stage), spans in (run.spans or {}).items():
        held = [(start, start + dur) for name, (start, dur) in spans.items() if name not in NOT_WORK]
        if held:
            intervals[stage].append((min(a for a, _ in held), max(b for _, b in held)))
    return [(np.array([a for a, _ in iv]), np.array([b for _, b in iv])) for iv in intervals]


def fit_cpu_sampling(samples: Sequence[SamplingPath], vocab: int, return_s: float,
                     contention: bool = False) -> dict[str, float]:
    """`cpu_sample_fixed_s` and `cpu_sample_per_token_vocab_s` (empty when no run sampled on CPU);
    with `contention` also `cpu_sample_per_busy_stage_s`, the path's growth per stage working beside
    the samplers when it starts (`calibrate runs --sampler-contention`). Over set 16's nine P=2 SiPipe
    fit and validation runs (9,141 paths) the path took 1.22 ms (median 1.00) with no stage before the
    last working as it started and 1.85 ms (1.71) with one; at P=1 there is no such stage, and the
    term fits to 0."""
    from testbed.calibrate.fit import _nnls

    if not samples:
        return {}
    cols = [[1.0] * len(samples), [p.rows * vocab / p.workers for p in samples]]
    if contention:
        cols.append([float(p.busy_stages) for p in samples])
    terms = _nnls(cols, [max(0.0, p.seconds - return_s) for p in samples], relative=False)
    # the form has no per-row term: the default's (measured on the sampler alone) is zeroed, not added
    out = {"cpu_sample_fixed_s": float(terms[0]), "cpu_sample_per_row_s": 0.0,
           "cpu_sample_per_token_vocab_s": float(terms[1])}
    if contention:
        out["cpu_sample_per_busy_stage_s"] = float(terms[2])
    return out
