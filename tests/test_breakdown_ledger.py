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
