"""Block tables as deltas (engine/torch_exec/wire/tables.py): the stages rebuild exactly the driver's
tables from launches that carry only what changed, through allocation, growth, frees and reuse."""
from __future__ import annotations

import random

import pytest

from engine.core.kv import BlockManager
from engine.torch_exec.wire import messages as wire
from engine.torch_exec.wire.tables import DriverTables, StageTables

SECRET = bytes(range(32))


def _launch(mb_id, dt: DriverTables, kv: BlockManager, prefills, decodes) -> wire.Launch:
    released = dt.released(kv.holds)
    pre = [wire.PrefillMeta(s, start, n, True, *dt.delta(s, kv.block_table(s), start == 0), [1] * n)
           for s, start, n in prefills]
    dec = [wire.DecodeMeta(s, pos, *dt.delta(s, kv.block_table(s)), 1) for s, pos in decodes]
    return wire.Launch(mb_id, "mixed", pre, dec, [], released)


def test_stage_tables_follow_a_random_serving_history_with_small_launches():
    rng = random.Random(0)
    kv = BlockManager(400, 4)
    dt, st = DriverTables(), StageTables()
    driver, stage = wire.Codec(SECRET, me="driver", run="r"), wire.Codec(SECRET, me="stage0", run="r")
    tokens: dict[int, int] = {}
    next_id, sent_blocks, full_blocks = 0, 0, 0
    for mb_id in range(600):
        for s in [s for s in tokens if rng.random() < 0.05]:  # finish or preempt: freed whole
            kv.free(s)
            del tokens[s]
        prefills = []
        if rng.random() < 0.3 and kv.num_free > 20:
            next_id += 1
            n = rng.randint(1, 30)
            kv.allocate(next_id, n)
            tokens[next_id] = n
            prefills.append((next_id, 0, n))
        decodes = [(s, tokens[s]) for s in tokens if not prefills or s != prefills[0][0]]
        if kv.num_free < len(decodes) + 1:
            continue
        kv.append_one_each([s for s, _ in decodes])
        for s, _ in decodes:
            tokens[s] += 1
        msg = stage.decode(driver.encode(_launch(mb_id, dt, kv, prefills, decodes)))
        sent_blocks += sum(len(p.blocks) for p in msg.prefills) + sum(len(d.blocks) for d in msg.decodes)
        got = st.resolve(msg)
        for row in got.prefills:
            assert row.block_table == kv.block_table(row.seq_id)
        for row in got.decodes:
            assert row.block_table == kv.block_table(row.seq_id)
            full_blocks += len(row.block_table)
        assert set(st.tables) <= set(tokens) | {p[0] for p in prefills}  # released tables are dropped
    assert full_blocks > 5 * sent_blocks  # deltas carry a small part of the tables


def test_a_reallocated_table_is_sent_whole_and_a_mismatch_is_named():
    dt, st = DriverTables(), StageTables()
    assert dt.delta(1, [4, 5]) == (0, [4, 5])
    assert dt.delta(1, [4, 5, 9]) == (2, [9])
    assert dt.delta(1, [7, 8, 9]) == (0, [7, 8, 9])  # its known prefix changed: whole again
    assert dt.delta(1, [7, 8, 9], reset=True) == (0, [7, 8, 9])  # a prefill from position 0
    assert st.table(1, 0, [4, 5]) == [4, 5]
    with pytest.raises(RuntimeError, match="sequence 2: a block-table delta from index 3"):
        st.table(2, 3, [1])
