"""A measured correction of the decode-only step's price by batch size (`cost.decode_batch_factors`).

Why: on the CPU engine (tiny-llama, fp32, set 6 of issue 47) a decode step's time is not monotone in
its sequences (3 sequences 13.6-15.2 ms, 4 sequences 10.2-10.7 ms at P=1) and the roofline form
cannot follow it: the set-6 P=1 profile priced decode forwards of 1 sequence 12% cheap, 2-3
sequences 15-19% dear and 4-6 sequences 11-16% cheap (mean measured / priced on its fit runs).
(Much of that was the lm_head's per-row path below 4 rows, which the engine no longer takes since 14801a3:
engine/torch_exec/stage/model.py `head_layout`.) Summed over a run these cancel, but under congestion the batches grow to 4-7 sequences, where the
price is low, and the high-rate TPOT came out 10-13% fast. `testbed calibrate runs --decode-by-batch`
fits one factor per stage and batch size (testbed/calibrate/decode_batch_fit.py); this module
applies it: a decode-only step of n sequences on stage s costs factors[s][n - 1] x its price, the
last factor held above the table. Steps with a prefill chunk are not scaled (their measured /
priced ratio on those runs has no pattern by the decodes they carry: 0.95-1.04). Empty = off.
"""
from __future__ import annotations

from typing import Any

from engine.pricing.stage_tables import correct_stage_times, held


def use_decode_batch_factors(cost: Any, factors: tuple[tuple[float, ...], ...]) -> None:
    """Swap `cost`'s (a CostModel's) stage-time methods for ones that scale a decode-only step by
    its stage's factor for its sequences, per instance (a profile without the term pays no branch).
    Called last by CostModel, so the factor multiplies the whole decode price."""
    correct_stage_times(cost, "decode_batch_factors", factors,
                        lambda shape: not shape.num_prefill_tokens and shape.num_decode_seqs > 0,
                        lambda row, shape, t: t * held(row, shape.num_decode_seqs - 1))
