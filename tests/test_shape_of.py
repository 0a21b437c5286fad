"""`shape_of` sets a BatchShape's fields without the validating constructor (engine/core/batch.py,
once per micro-batch on the simulator's hot path): every shape it builds must equal, field by
field and in hash, the one the validated keyword constructor builds from the same sums, and pass
that validation."""
from __future__ import annotations

import dataclasses
import random

from engine.core.batch import PrefillChunk, shape_of
from engine.core.request import Request, Sequence
from engine.pricing.costmodel import BatchShape


def _validated(prefills, decodes) -> BatchShape:
    computed = [s.num_computed for s in decodes]
    return BatchShape(
        num_prefill_tokens=sum(c.num_tokens for c in prefills), num_decode_seqs=len(decodes),
        decode_context_sum=sum(computed) + len(decodes),
        prefill_attention_pairs=sum(c.num_tokens * c.start + c.num_tokens * (c.num_tokens + 1) // 2 for c in prefills),
        prefill_context_sum=sum(c.start + c.num_tokens for c in prefills),
        num_sampled=sum(c.samples for c in prefills) + len(decodes), num_seqs=len(prefills) + len(decodes),
        decode_context_max=max(computed) + 1 if computed else 0)


def test_shape_of_equals_the_validated_shape():
    rng = random.Random(7)
    for trial in range(300):
        prefills, decodes = [], []
        for i in range(rng.randint(0, 3)):
            seq = Sequence(Request(i, 0.0, 4096, 8))
            start = rng.choice([0, rng.randint(0, 3000)])
            n = rng.randint(1, 1024)
            prefills.append(PrefillChunk(seq, start, n, rng.random() < 0.5))
        for i in range(rng.choice([0, 1, rng.randint(2, 200)])):
            seq = Sequence(Request(100 + i, 0.0, 512, 64))
            seq.num_computed = rng.randint(1, 4000)
            decodes.append(seq)
        got, want = shape_of(prefills, decodes), _validated(prefills, decodes)
        assert type(got) is BatchShape
        assert dataclasses.astuple(got) == dataclasses.astuple(want), trial
        assert got == want and hash(got) == hash(want)
        BatchShape(**dataclasses.asdict(got))  # passes the constructor's checks
