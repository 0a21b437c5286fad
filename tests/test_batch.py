"""BatchBuilder.add_decodes: the one-call decode loop gives exactly what `add_decode` one by one
gives (the fast path for a fresh batch included): same decodes, same free-block count, same
returned index, the same contract errors."""
import pytest
from helpers import make_state

import policies  # noqa: F401  (registers the seed policies)
from engine.core.batch import PolicyContractError
from engine.core.policy import POLICIES


def _reference(b, seqs, limit):
    """`add_decodes` as its docstring defines it, through `add_decode`."""
    for i, seq in enumerate(seqs):
        if b.num_decode_seqs >= limit:
            return i
        if seq in b:
            continue
        if not b.add_decode(seq):
            return i
    return len(seqs)


# (generated tokens per sequence): prompt 31 + generated - 1 computed tokens, so generated = 2
# puts a sequence exactly on a block boundary (32 tokens): its next token needs a new block.
BOUNDARY, INSIDE = 2, 5


@pytest.mark.parametrize("gens,num_blocks,limit,order", [
    ([INSIDE] * 6, 1000, 100, None),  # fresh batch, everything fits
    ([BOUNDARY] * 6, 1000, 4, None),  # the limit stops it
    ([BOUNDARY, INSIDE, BOUNDARY, BOUNDARY], None, 100, None),  # KV for only one new block
    ([INSIDE] * 4, 1000, 100, [0, 1, 1, 2, 3]),  # a sequence twice: the repeat is skipped
    ([BOUNDARY] * 3, 1000, 0, None),  # no room at all
])
def test_add_decodes_equals_one_by_one(gens, num_blocks, limit, order):
    decoding = [(31, 100, g) for g in gens]
    if num_blocks is None:  # exactly the held blocks plus one free
        num_blocks = sum(-(-(31 + g - 1) // 16) for g in gens) + 1
    results = []
    for fast in (True, False):
        ctrl, seqs = make_state(POLICIES.get("sarathi")(), num_blocks=num_blocks, decoding=decoding)
        picked = [seqs[i] for i in order] if order else seqs
        b = ctrl.view.new_batch()
        taken = b.add_decodes(picked, limit) if fast else _reference(b, picked, limit)
        results.append((taken, [s.seq_id for s in b.decodes], b.free_blocks))
    assert results[0] == results[1]


def test_add_decodes_after_a_preemption_skips_the_victim():
    ctrl, seqs = make_state(POLICIES.get("sarathi")(), decoding=[(31, 100, INSIDE)] * 3)
    b = ctrl.view.new_batch()
    b.preempt(seqs[1])
    assert b.add_decodes(seqs, 10) == 3
    assert [s.seq_id for s in b.decodes] == [seqs[0].seq_id, seqs[2].seq_id]


def test_add_decodes_refuses_a_sequence_in_flight_after_taking_those_before_it():
    ctrl, seqs = make_state(POLICIES.get("sarathi")(), decoding=[(31, 100, INSIDE)] * 3)
    seqs[2].in_flight = True
    b = ctrl.view.new_batch()
    with pytest.raises(PolicyContractError):
        b.add_decodes(seqs, 10)
    assert [s.seq_id for s in b.decodes] == [seqs[0].seq_id, seqs[1].seq_id]
