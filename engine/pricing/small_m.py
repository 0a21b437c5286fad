"""A host BLAS that multiplies a few rows as that many matrix-vector products (`cost.gemv_rows`).

Why: on the CPU engine (tiny-llama, fp32, one thread a stage, this project's shared 2-core machine)
`F.linear` of the 32000 x 256 lm_head took 2.08 ms for 1 row, 3.78 ms for 2, 5.83 ms for 3, then
3.15 ms for 4 and 3.83 ms for 8 (SCHED_FIFO, load ~3): below 4 rows the BLAS re-reads the weights
once per row, from 4 it runs a blocked GEMM. The layers' GEMMs do the same (1376 x 256: 0.021 /
0.038 / 0.055 / 0.058 ms). The roofline prices M rows smoothly, so it charged a one-decode step
too much and a two- or three-decode step too little: on the P=1 Azure fit run, decode forwards of
1 / 2 / 3-4 sequences were priced 7.0 / 7.8 / 8.9 ms for 6.0 / 9.4 / 12.5 ms measured, and a
request's time per output token (weighted by the sequences a step carries) came out 10% short.
The engine's head has not done so since 14801a3 (it keeps the CPU head `[hidden, vocab]`: 0.89 / 1.81 /
2.83 / 2.37 ms at 1-4 rows; engine/torch_exec/stage/model.py `head_layout`); the layers still do, and
profiles fitted on runs of the engine before it carry the head's part too.

With `gemv_rows = g` > 0, a GEMM of M <= g rows costs M x its one-row time: the layers' linear part
by the step's tokens, the lm_head by its sampled rows. Fitted by `testbed calibrate runs` on a
roofline (CPU) base; a profile with fitted kernels (a GPU) ignores it, as does g = 0 (default).
"""
from __future__ import annotations

from typing import Any


def use_gemv_rows(cost: Any, rows: int) -> None:
    """Swap `cost`'s (a CostModel's, roofline-priced) stage-time methods for ones that add, for a
    step of 2..`rows` tokens or sampled rows, the difference between M one-row products and the
    roofline's M-row GEMM, per instance (a profile without the term pays no branch)."""
    if rows < 2 or cost.kernels is not None:
        return
    m_half = cost._m_half

    def linear(m: int) -> float:  # one layer's GEMMs, as CostModel._layer_s prices them
        comp = (m + m_half) * cost._lin_c
        mem = cost._lin_w + m * cost._lin_a
        return comp if comp > mem else mem

    layer_extra = {m: m * linear(1) - linear(m) for m in range(2, rows + 1)}
    stage_extra = [{m: n * x for m, x in layer_extra.items()} for n in cost.layers]
    _, _, _, lm_c, lm_w, lm_r, _, _, _ = cost._stage_consts[-1]

    def head(m: int) -> float:  # the lm_head GEMM, as CostModel._stage_total prices it
        comp = (m + m_half) * lm_c
        mem = lm_w + m * lm_r
        return comp if comp > mem else mem

    head_extra = {m: m * head(1) - head(m) for m in range(2, rows + 1)} if lm_w else {}
    last = cost.pp - 1
    plain_one, plain_all = cost.stage_compute_s, cost.stage_compute_all_s

    def extra(stage: int, shape: Any) -> float:
        tokens = shape.num_prefill_tokens + shape.num_decode_seqs
        x = stage_extra[stage].get(tokens, 0.0)
        return x + head_extra.get(shape.num_sampled, 0.0) if stage == last else x

    def one(stage: int, shape: Any) -> float:
        t = plain_one(stage, shape)
        return t + extra(stage % cost.pp, shape) if t else t

    def every(shape: Any) -> tuple[float, ...]:
        times = plain_all(shape)
        if shape.num_prefill_tokens + shape.num_decode_seqs > rows and not 2 <= shape.num_sampled <= rows:
            return times
        return tuple([t + extra(s, shape) if t else t for s, t in enumerate(times)])

    cost.stage_compute_s = one  # type: ignore[method-assign]
    cost.stage_compute_all_s = every  # type: ignore[method-assign]
