"""The CPU-sampling path (SiPipe's `runtime.cpu_sampling`) fitted from runs that used it.

On the shared 2-core CPU machine SiPipe ran last among the six policies on the engine and first in
the simulator (issue 47: +24% throughput, -17% TPOT at P=1). The engine was right and the simulator
wrong: its CPU-sampling path was priced with the cost model's defaults (200 us a micro-batch, on
free host cores), where on this host the last stage copies the logits to the samplers (1.2 ms
median, `to_samplers`) and the samplers, two more processes on two busy cores, wait for a core
before they sample (0.2 ms) and hand the ids to the driver: the stage's wait for its next
micro-batch went from 0.80 ms (sarathi, inline sampling) to 3.41 ms median (tiny-llama, P=1,
ShareGPT 100, load ~10 of other tenants). Host contention is not modelled as such (the simulator
does not know the load); the path's time on this host is, like every other engine term: from the
end of the last stage's logits handoff (`to_samplers`, its own term on the stage: run_fit.py) to the
completion, less the return the simulator adds after it, fitted as fixed + per row x vocab /
samplers (`CostModel.cpu_sample_s`) by non-negative least squares.
A profile fitted without such a run keeps the defaults (a GPU host's free cores).
"""
from __future__ import annotations

from collections.abc import Sequence

from testbed.calibrate.runs import RealRun, replayed_batches


def cpu_sampling_samples(runs: Sequence[RealRun]) -> list[tuple[int, int, float]]:
    """(rows sampled, sampler processes, seconds from the logits' handoff to the completion) of
    every micro-batch but the first of the runs that sampled on CPU processes."""
    out = []
    for run in runs:
        workers = int(getattr(run.spec.settings.executor.settings, "num_cpu_samplers", 1) or 1)
        for b in replayed_batches(run)[1:]:
            last = b.stages[-1]
            if last.handoff is None or last.busy_end is None or not b.shape.num_sampled:
                continue
            # from the handoff's end: the stage's copy is its own term (CostModel.cpu_handoff_s)
            out.append((b.shape.num_sampled, workers, b.completed_s - last.busy_end))
    return out


def fit_cpu_sampling(samples: list[tuple[int, int, float]], vocab: int, return_s: float) -> dict[str, float]:
    """`cpu_sample_fixed_s` and `cpu_sample_per_token_vocab_s` (empty when no run sampled on CPU)."""
    from testbed.calibrate.fit import _nnls

    if not samples:
        return {}
    fixed, per = _nnls([[1.0] * len(samples), [rows * vocab / w for rows, w, _ in samples]],
                       [max(0.0, t - return_s) for _, _, t in samples], relative=False)
    # the form has no per-row term: the default's (measured on the sampler alone) is zeroed, not added
    return {"cpu_sample_fixed_s": float(fixed), "cpu_sample_per_row_s": 0.0, "cpu_sample_per_token_vocab_s": float(per)}
