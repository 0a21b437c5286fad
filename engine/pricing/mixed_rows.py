"""A measured correction of the price of a step with a prefill chunk by its sampled rows
(`cost.mixed_row_extra_s`).

Why: on the CPU engine after 14801a3 (tiny-llama, fp32, set 16 of issue 47) the steps that carry a
prefill chunk were priced off by the rows they sample, while the decode-only steps were not (their
`decode_batch_factors`, engine/pricing/decode_batch.py): on set 16's P=1 fit runs, measured minus
priced forward +0.65 / +1.00 / +1.08 ms at 3 / 4 / 5 sampled rows (+4-5% of the step), -0.73 ms at
0 rows (-7%), decode-only steps within 0.2 ms at 1-8 sequences. The lm_head is the visible cause:
its CPU GEMM is still not a roofline at a few rows (P=2 decode steps, last stage minus first: 1.09 /
2.18 / 3.24 / 2.91-3.05 ms at 1-4 rows), and the forward fit's smooth terms price it as one. Under
congestion (Azure at the higher rate) the mixed steps carry 3-8 rows, where the price was low, and
set 16's test TPOT came out 11-16% fast there.

`testbed calibrate runs --mixed-by-rows` fits one additive term per stage and sampled-row count
(testbed/calibrate/mixed_rows_fit.py); this module applies it: a step with a prefill chunk that
samples r rows costs its price + row_s[r] on stage s (the last entry held above the table), never
less than a third of its price. Additive, not a factor: the head's cost does not grow with the
chunk's tokens (a 9 ms and a 100 ms mixed step at 4 rows carry the same head). Empty = off.
"""
from __future__ import annotations

from typing import Any

from engine.pricing.stage_tables import correct_stage_times, held

FLOOR = 1.0 / 3.0  # the corrected price never falls below this share of the plain one


def use_mixed_row_extra(cost: Any, table: tuple[tuple[float, ...], ...]) -> None:
    """Swap `cost`'s (a CostModel's) stage-time methods for ones that add, to a step with a prefill
    chunk, its stage's term for the step's sampled rows, per instance (a profile without the term
    pays no branch)."""
    correct_stage_times(cost, "mixed_row_extra_s", table, lambda shape: shape.num_prefill_tokens > 0,
                        lambda row, shape, t: max(t + held(row, shape.num_sampled), t * FLOOR))
