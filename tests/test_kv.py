"""Block manager invariants under random operations (hypothesis drives the sequences)."""
import re

import pytest
from hypothesis import given, settings, strategies as st

from engine.core.kv import BlockManager


def test_allocate_append_free_roundtrip():
    kv = BlockManager(num_blocks=10, block_size=16)
    assert kv.can_allocate(1, 33)
    kv.allocate(1, 33)  # 3 blocks
    assert kv.num_used == 3 and kv.num_free == 7
    assert kv.can_append(1, 15) and kv.extra_blocks(1, 48) == 0
    kv.append(1, 15)  # 48 tokens: still 3 blocks
    assert kv.num_used == 3
    kv.append_one(1)  # 49 tokens: a 4th block
    assert kv.num_used == 4 and kv.num_tokens(1) == 49
    assert kv.free(1) == 4 and kv.num_free == 10 and kv.usage == 0.0
    kv.check_integrity()


def test_cannot_overallocate():
    kv = BlockManager(num_blocks=2, block_size=16)
    assert not kv.can_allocate(1, 33)
    kv.allocate(1, 32)
    assert not kv.can_append(1, 1)
    with pytest.raises(MemoryError):
        kv.append(1, 1)
    with pytest.raises(MemoryError):
        kv.append_one(1)
    assert kv.num_tokens(1) == 32  # a failed append changes nothing
    kv.check_integrity()


CORRUPTIONS = {  # each broken invariant and the message that names it
    "owned by sequences": lambda kv: kv._tables[2].__setitem__(0, kv._tables[1][0]),
    "out-of-range block": lambda kv: kv._tables[1].__setitem__(0, kv.num_blocks),
    "blocks for 4 tokens": lambda kv: kv._tables[1].append(kv._free.pop()),
    "appears twice in the free list": lambda kv: kv._free.append(kv._free[0]),
    "both free and owned": lambda kv: kv._free.__setitem__(0, kv._tables[1][0]),
    "!= capacity": lambda kv: kv._free.pop(),
    "out-of-range block in the free list": lambda kv: kv._free.__setitem__(0, kv.num_blocks),
}


@pytest.mark.parametrize("message", CORRUPTIONS)
def test_integrity_names_each_broken_invariant(message):
    """Each invariant the simulator relies on, broken on purpose, is named by the check (a free
    block replaced by one past the pool passed the count check before the range was checked)."""
    kv = BlockManager(num_blocks=8, block_size=4)
    kv.allocate(1, 4)
    kv.allocate(2, 4)
    kv.check_integrity()
    CORRUPTIONS[message](kv)  # corrupt on purpose
    with pytest.raises(AssertionError, match=re.escape(message)):
        kv.check_integrity()


ops = st.lists(st.tuples(st.sampled_from(["alloc", "append", "free"]), st.integers(0, 7), st.integers(1, 40)),
               max_size=200)


def _apply(kv: BlockManager, op: str, seq: int, n: int) -> None:
    """One drawn operation, where the manager allows it."""
    if op == "alloc" and kv.can_allocate(seq, n):
        kv.allocate(seq, n)
    elif op == "append" and kv.holds(seq) and kv.can_append(seq, n):
        kv.append(seq, n)
    elif op == "free":
        kv.free(seq)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(operations):
    kv = BlockManager(num_blocks=20, block_size=8)
    for op, seq, n in operations:
        _apply(kv, op, seq, n)
        kv.check_integrity()
        owned = sum(len(kv.block_table(s)) for s in range(8))
        assert owned + kv.num_free == kv.num_blocks


def _walk_passes(kv: BlockManager) -> bool:
    try:
        kv._name_broken_invariant()
    except AssertionError:
        return False
    return True


corruptions = st.tuples(st.sampled_from(["table", "free", "free-append", "free-pop", "tokens"]),
                        st.integers(0, 10_000), st.one_of(st.integers(0, 149), st.sampled_from([-1, 150, 151])))


@settings(max_examples=300, deadline=None)
@given(ops, st.lists(corruptions, max_size=3), st.integers(0, 10_000))
def test_the_incremental_check_agrees_with_the_exhaustive_walk(operations, corrupt, corrupt_at):
    """`check_integrity` re-verifies only the tail of the free list that changed since the last
    check: after any run of operations, with blocks overwritten, added or dropped anywhere (the
    pool is larger than the 64-block window, so some land before it), it raises exactly when
    the exhaustive walk finds a broken invariant."""
    kv = BlockManager(num_blocks=150, block_size=4)
    for step, (op, seq, n) in enumerate(operations):
        _apply(kv, op, seq, n)
        if step == corrupt_at % len(operations):
            for where, index, block in corrupt:
                _corrupt(kv, where, index, block)
        expected = _walk_passes(kv)
        if expected:
            kv.check_integrity()
        else:
            with pytest.raises(AssertionError):
                kv.check_integrity()
            return


def _corrupt(kv: BlockManager, where: str, index: int, block: int) -> None:
    if where == "table" and kv._tables:
        table = list(kv._tables.values())[index % len(kv._tables)]
        if table:
            table[index % len(table)] = block
    elif where == "free" and kv._free:
        kv._free[index % len(kv._free)] = block
    elif where == "free-append":
        kv._free.append(block)
    elif where == "free-pop" and kv._free:
        kv._free.pop(index % len(kv._free))
    elif where == "tokens" and kv._tokens:
        seq = list(kv._tokens)[index % len(kv._tokens)]
        kv._tokens[seq] += block
