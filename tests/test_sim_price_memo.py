"""SimExecutor memoises what a micro-batch costs besides its forward by the shape's four counts
(issue 51): the memo must give the cost model's own floats, and no other field of the shape may
move them (a pricing change that made one depend on, say, the context would fail here)."""
import random

import pytest

from engine.core.batch import MicroBatch
from engine.pricing.costmodel import BatchShape, CostModel
from engine.pricing.hardware import HARDWARE, get_hardware
from engine.pricing.models import get_model
from engine.simulator.sim import SimExecutor


def _shapes(rng: random.Random, n: int) -> list[BatchShape]:
    out = []
    for _ in range(n):
        dec = rng.randint(0, 64)
        chunks = rng.randint(0 if dec else 1, 3)
        ptok = sum(rng.randint(1, 512) for _ in range(chunks))
        prefix = rng.randint(0, 4000)
        seqs = dec + chunks
        ctx_max = rng.randint(1, 4000) if dec else 0
        out.append(BatchShape(
            num_prefill_tokens=ptok, num_decode_seqs=dec, decode_context_sum=dec * ctx_max,
            prefill_attention_pairs=ptok * prefix + ptok * (ptok + 1) // 2, prefill_context_sum=ptok + prefix * chunks,
            num_sampled=dec + rng.randint(0, chunks), num_seqs=seqs, decode_context_max=ctx_max))
    return out


def _vary_the_rest(rng: random.Random, s: BatchShape) -> BatchShape:
    """The same four counts, every other field different."""
    ctx_max = s.decode_context_max + rng.randint(1, 3000) if s.num_decode_seqs else 0
    extra = rng.randint(1, 5000) if s.num_prefill_tokens else 0
    return BatchShape(
        num_prefill_tokens=s.num_prefill_tokens, num_decode_seqs=s.num_decode_seqs,
        decode_context_sum=s.num_decode_seqs * ctx_max,
        prefill_attention_pairs=s.prefill_attention_pairs + extra * s.num_prefill_tokens,
        prefill_context_sum=s.prefill_context_sum + extra, num_sampled=s.num_sampled, num_seqs=s.num_seqs,
        decode_context_max=ctx_max)


@pytest.mark.parametrize("hardware", sorted(HARDWARE))
def test_price_memo_gives_the_cost_models_floats(hardware):
    cost = CostModel(get_model("llama2-13b"), get_hardware(hardware), pp=2)
    ex = SimExecutor(cost, link_bandwidth_Bps=1e10, link_latency_s=1e-5)
    rng = random.Random(hardware)
    for shape in _shapes(rng, 200):
        other = _vary_the_rest(rng, shape)
        direct = ex._price_counts(shape)
        assert ex._price_counts(other) == direct, f"{hardware}: a non-key field moved the price of {shape}"
        for s in (shape, other):
            priced = ex._price(MicroBatch(-1, (), (), shape=s))
            assert priced.forward == cost.stage_compute_all_s(s)
            assert (priced.prep, priced.sample, priced.nbytes, priced.dispatch, priced.ret, priced.recv, priced.handoff) == direct
