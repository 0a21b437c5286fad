"""The simulator's FIFO path fills the time-breakdown ledger in bulk (engine/simulator/sim.py
`FifoPipeline.flush_gaps`, engine/core/trace.py typed gap columns): the breakdown must not depend
on when the gap log is flushed, and must agree with the event loop, which feeds the ledger one
span at a time."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import policies  # noqa: F401
from engine.core.breakdown import PARTS
from engine.core.trace import StageLedger
from engine.simulator import fifo_pipeline, sim
from testbed.config.spec import compose_spec
from testbed.run.runner import run_experiment

RUN = ("output.mlflow=false", "policy=sarathi", "workload=azure", "workload.num_requests=120")


def _breakdown(monkeypatch, flush: int | None = None, event_driven: bool = False) -> dict:
    with monkeypatch.context() as m:
        if flush is not None:
            m.setattr(fifo_pipeline, "GAP_LOG_FLUSH", flush)
        if event_driven:
            m.setattr(sim, "SimExecutor", functools.partial(sim.SimExecutor, event_driven=True))
        res = run_experiment(compose_spec(list(RUN)))
    assert res.error is None
    return res.breakdown


def test_flushing_the_gap_log_early_changes_nothing(monkeypatch):
    whole = _breakdown(monkeypatch)
    assert _breakdown(monkeypatch, flush=4 * 3) == whole  # three gaps a flush: every stage's first in an early one


def test_the_fifo_path_and_the_event_loop_give_one_breakdown(monkeypatch):
    fifo = _breakdown(monkeypatch)
    events = _breakdown(monkeypatch, event_driven=True)
    for a, b in zip(fifo["stages"], events["stages"], strict=True):
        assert a["idle_wait_prev"] + a["idle_wait_next"] > 0
        for p in PARTS:  # the parts are summed in another order: equal to the last bits
            assert a[p] == pytest.approx(b[p], rel=1e-9, abs=1e-12), p


def test_gap_columns_take_single_and_bulk_gaps_alike():
    one, bulk = StageLedger(max_gaps=3), StageLedger(max_gaps=3)
    rows = [(-float("inf"), 1.0, 0), (2.0, 3.0, 1), (4.0, 5.0, 2), (6.0, 7.0, 3), (8.0, 9.0, 4)]
    t1 = one.track("stage0")
    for a, b, mb in rows:
        t1.last = a
        one.gap(t1, b, mb, "prepare")
    t2 = bulk.track("stage0")
    cols = np.array(rows)
    bulk.extend_gaps(t2, cols[:2, 0], cols[:2, 1], cols[:2, 2].astype(np.int64), "prepare")
    bulk.extend_gaps(t2, cols[2:, 0], cols[2:, 1], cols[2:, 2].astype(np.int64), "prepare")
    assert t1.first == t2.first == (1.0, 0, "prepare")
    assert t1.gaps() == t2.gaps() == [(2.0, 3.0, 1, False), (4.0, 5.0, 2, False), (6.0, 7.0, 3, False)]
    assert one.overflow == bulk.overflow == 1  # past max_gaps: counted, never silent


# --- a stop signal inside an append (the fresh-clone CI, stop 63) -------------------------------------

def _stopped_run(monkeypatch, cls, method: str, cut_in):
    """Run RUN with `cls.method` replaced: its first call for which `cut_in` (part of the append)
    returns True is followed by a KeyboardInterrupt, as a stop signal arriving between two of the
    append's columns."""
    from testbed.run.result import RunInterrupted

    original = getattr(cls, method)

    def append_then_stop(self, *args, **kwargs):
        if cut_in(self, *args):
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, append_then_stop)
    with pytest.raises(RunInterrupted) as stopped:
        run_experiment(compose_spec(list(RUN)))
    return stopped.value


def test_a_stop_inside_a_bulk_gap_append_leaves_a_readable_breakdown(monkeypatch):
    monkeypatch.setattr(fifo_pipeline, "GAP_LOG_FLUSH", 4 * 3)  # many bulk appends in a small run

    def first_column_only(ledger, tl, a, b, mb, name):  # a bulk append of gaps, cut after its first column
        if tl.first is None or len(b) < 2:
            return False
        tl.gap_a.frombytes(np.ascontiguousarray(a, dtype=np.float64).tobytes())
        return True

    result = _stopped_run(monkeypatch, StageLedger, "extend_gaps", first_column_only).result
    assert result.summary["num_failed"] > 0 and "interrupted" in result.error
    for track in result.stage_tracks:
        tl = result.tracer.ledger.tracks[track]
        assert len(tl.gap_a) == len(tl.gap_b) == len(tl.gap_mb) == len(tl.gap_send)
    for row in result.breakdown["stages"]:
        assert sum(row[p] for p in PARTS) > 0


def test_a_record_cut_off_by_a_stop_is_dropped_whole():
    from engine.core.records import MicroBatchRecords

    records = MicroBatchRecords()
    for mb in range(2):
        records.append(mb, 1.0 * mb, 1.0 * mb + 0.5, "decode", 0, 4, 4, 0, 0.1, {"budget": 8})
    records.mb_id.append(2)  # a stop signal struck after the third record's first two columns
    records.scheduled_s.append(2.0)
    assert records.trim_to_whole_rows() == 2
    assert [r.mb_id for r in records] == [0, 1] and len(records.scheduled_s) == len(records.tags) == 2
    assert records.trim_to_whole_rows() == 0
