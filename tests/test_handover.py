"""The CPU engine's hand-over as a rendezvous (engine/simulator/handover.py, `calibrate runs
--inflight-handover`: testbed/calibrate/handover_fit.py)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from engine.base.errors import ConfigError
from engine.core.batch import MicroBatch, shape_of
from engine.core.request import Request, Sequence
from engine.pricing.costmodel import CostModel
from engine.pricing.hardware import get_hardware
from engine.pricing.models import get_model
from engine.simulator.handover import Handover, handover_for, receive_start
from engine.simulator.sim import SimExecutor
from testbed.calibrate import handover_fit
from testbed.calibrate.runs import ReplayedBatch, StageSpans

H = 3e-4  # the hand-over term (set 6 fitted 0.30 ms)


def _decodes(n: int) -> list[MicroBatch]:
    out = []
    for i in range(n):
        seq = Sequence(Request(i, 0.0, 500, 10))
        seq.num_computed = 500
        out.append(MicroBatch(i, (), (seq,), shape=shape_of([], [seq])))
    return out


def _spans(handover_s: float, split=(10, 30)):
    """Three decodes in flight at P=2 (stage 1 three times stage 0's layers), blocking sends."""
    base = CostModel(get_model("llama2-13b"), get_hardware("a100-80g"), pp=2, layer_split=list(split))
    cost = CostModel(get_model("llama2-13b"), get_hardware("a100-80g"), pp=2, layer_split=list(split),
                     coefficients=dataclasses.replace(base.coefficients, handover_rendezvous_s=handover_s))
    ex = SimExecutor(cost, blocking_send=True, link_bandwidth_Bps=1e12, link_latency_s=0.0)
    for mb in _decodes(3):
        ex.launch(mb)
    done = []
    while (c := ex.next_completion()) is not None:
        done.append(c.time_s)
    by = {(s[0], s[1], s[4]): (s[2], s[3]) for s in ex.tracer.spans}
    return by, done


def test_a_sending_stage_is_held_until_the_next_stage_takes_its_activation():
    off, done_off = _spans(0.0)
    on, done_on = _spans(H)
    # off (the default): stage 0 runs the three forwards back to back while stage 1 works
    assert off[("stage0", "prepare", 2)][0] < off[("stage1", "prepare", 1)][0]
    # on: stage 0 takes mb 2 only once stage 1 has begun receiving mb 1 (after its preparation), + H
    assert on[("stage0", "prepare", 2)][0] == pytest.approx(on[("stage1", "prepare", 1)][1] + H, rel=1e-12)
    assert on[("stage0", "send", 1)][1] == pytest.approx(on[("stage1", "prepare", 1)][1] + H, rel=1e-12)
    # the receiver sat idle for mb 0 (the engine's had posted its receive): held past the arrival by H
    assert on[("stage0", "send", 0)][1] == pytest.approx(on[("stage1", "prepare", 0)][0] + H, rel=1e-12)
    assert off[("stage0", "send", 0)][1] == pytest.approx(off[("stage1", "prepare", 0)][0], rel=1e-12)
    assert on[("stage0", "prepare", 2)][0] > off[("stage0", "prepare", 2)][0] + 0.005
    assert done_on[-1] == done_off[-1]  # stage 1 binds: the last stage's work alone sets the end here


def test_a_zero_term_is_off_and_leaves_the_simulation_as_it_was():
    assert handover_for(True, 2, 0.0, False) is None
    assert handover_for(False, 2, H, False) is None  # a GPU's asynchronous send: nothing to hold
    assert handover_for(True, 1, H, False) is None  # P = 1: no hop
    a, da = _spans(0.0)
    cost = CostModel(get_model("llama2-13b"), get_hardware("a100-80g"), pp=2, layer_split=[10, 30])
    ex = SimExecutor(cost, blocking_send=True, link_bandwidth_Bps=1e12, link_latency_s=0.0)
    assert ex._handover is None


def test_a_structure_aware_send_leaves_one_activation_pending():
    blocking, aware = handover_for(True, 2, H, False), handover_for(True, 2, H, True)
    for h in (blocking, aware):
        h.sent(0, 7)
    assert not blocking.free(0) and aware.free(0)
    aware.sent(0, 8)
    assert not aware.free(0)
    aware.hold(0, 8)
    assert aware.taken(0, 7, 2.0) == (2.0 + H, 8)  # mb 8 may stay pending: the stage goes on
    assert aware.taken(0, 8, 3.0) is None  # nothing held any more
    with pytest.raises(ValueError):
        Handover(1, -1, H)


def test_the_receive_starts_after_what_precedes_it_in_the_stages_chain():
    parts = (("schedule", 1.0), ("prepare", 0.5), ("recv", 0.25), ("forward:decode", 2.0))
    assert receive_start(10.0, parts) == 11.5
    assert receive_start(10.0, (("prepare", 0.5), ("forward:decode", 2.0))) == 10.5


def _run(device="cpu", pp=2):
    settings = SimpleNamespace(executor=SimpleNamespace(settings=SimpleNamespace(device=device)))
    return SimpleNamespace(spec=SimpleNamespace(settings=settings), pp=pp)


def _batch(send_start, send_end, recv_start):
    def st(**kw):
        base = dict(prepare_start=None, prepare=None, forward=None, sample_end=None, sample=None,
                    send_start=None, recv_start=None, recv_end=None, busy_end=None)
        return StageSpans(**dict(base, **kw))
    return ReplayedBatch(0, "decode", None, 0.0, 1.0, None,
                         (st(send_start=send_start, busy_end=send_end), st(recv_start=recv_start, recv_end=recv_start + 1e-3)))


def test_the_fit_takes_the_hops_where_the_sender_was_first(monkeypatch):
    # sender first (send began before the receive): send end - receive start; receiver first: not a sample
    batches = [_batch(0.0, 5.3e-3, 5.0e-3), _batch(0.0, 2.4e-3, 2.0e-3), _batch(1.0, 1.0006, 0.9),
               _batch(0.0, 7.35e-3, 7.0e-3)]
    monkeypatch.setattr(handover_fit, "replayed_batches", lambda run: batches)
    assert handover_fit.rendezvous_samples(_run(), False) == pytest.approx([3e-4, 4e-4, 3.5e-4])
    assert handover_fit.fit_handover([_run(), _run()], [False, False]) == (pytest.approx(3.5e-4), 6)
    assert handover_fit.rendezvous_samples(_run(), True) == []  # isend: returns at once
    assert handover_fit.rendezvous_samples(_run("cuda"), False) == []
    assert handover_fit.fit_handover([_run(pp=1)], [False]) is None  # P = 1: the option changes nothing
    with pytest.raises(ConfigError, match="--inflight-handover.*not structure-aware"):
        handover_fit.fit_handover([_run()], [True])


def test_a_run_config_turns_it_on_by_the_cost_key_and_it_changes_only_host_runs_at_p2():
    from conftest import small_config
    from testbed.run.runner import run_experiment

    def tpot(*extra):
        base = ("policy=molink", "model=tiny-llama", "workload.num_requests=40", "executor.blocking_send=true")
        return run_experiment(small_config(*base, *extra)).summary["tpot_mean_s"]

    assert tpot("parallel.pp=2", "cost.handover_rendezvous_s=0.0003") != tpot("parallel.pp=2")
    assert tpot("parallel.pp=1", "cost.handover_rendezvous_s=0.0003") == tpot("parallel.pp=1")
