"""The discrete-event simulator: event order, one micro-batch's timeline by hand, determinism."""
import json

import pytest

from engine.core.batch import MicroBatch, PrefillChunk, shape_of
from engine.pricing.costmodel import CostModel
from engine.pricing.hardware import get_hardware
from engine.pricing.models import get_model
from engine.core.policy import RuntimeFeatures
from engine.core.request import Request, Sequence
from engine.simulator.sim import ARRIVE, COMPLETE, LINK_DONE, PREP_DONE, SAMPLE_DONE, STAGE_DONE, EventQueue, SimExecutor
from testbed.run.outputs import write_run_dir
from testbed.run.runner import run_experiment
from conftest import small_config


def test_same_time_events_pop_by_priority_then_insertion():
    q = EventQueue()
    q.push(1.0, COMPLETE, ("complete",))
    q.push(1.0, ARRIVE, ("arrive-a",))
    q.push(0.5, SAMPLE_DONE, ("early",))
    q.push(1.0, STAGE_DONE, ("stage",))
    q.push(1.0, ARRIVE, ("arrive-b",))
    q.push(1.0, PREP_DONE, ("prep",))
    q.push(1.0, LINK_DONE, ("link",))
    order = [q.pop()[3][0] for _ in range(len(q))]
    assert order == ["early", "stage", "link", "arrive-a", "arrive-b", "prep", "complete"]


def _one_batch(pp, runtime=RuntimeFeatures()):
    cost = CostModel(get_model("llama2-13b"), get_hardware("a100-80g"), pp=pp)
    seq = Sequence(Request(0, 0.0, 1000, 10))
    chunk = PrefillChunk(seq, 0, 1000, True)
    mb = MicroBatch(0, (chunk,), (), shape=shape_of([chunk], []))
    ex = SimExecutor(cost, runtime=runtime, link_bandwidth_Bps=10e9, link_latency_s=1e-3)
    ex.launch(mb)
    return cost, mb, ex, ex.next_completion()


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_single_microbatch_timeline_matches_cost_model(pp):
    cost, mb, ex, done = _one_batch(pp)
    sh = mb.shape
    expected = 0.0
    for s in range(pp):
        expected += cost.prep_s(sh) + cost.stage_compute_s(s, sh)
        if s < pp - 1:  # link: serialisation + metadata rounds, then latency
            expected += cost.activation_bytes(sh) / 10e9 + cost.coefficients.transfer_metadata_s + 1e-3
    expected += cost.sample_s(sh) + 1e-3  # inline sampling, then token ids back to the driver
    assert done.mb_id == 0
    assert done.time_s == pytest.approx(expected, rel=1e-12)


def test_runtime_features_shorten_the_critical_path():
    base = _one_batch(3)[3].time_s
    aware = _one_batch(3, RuntimeFeatures(structure_aware_transfer=True))[3].time_s
    cost = _one_batch(3)[0]
    assert base - aware == pytest.approx(2 * cost.coefficients.transfer_metadata_s)


def test_deadline_returns_none_and_advances_clock():
    cost, mb, ex, _ = _one_batch(2)
    assert ex.next_completion(deadline=5.0) is None
    assert ex.now() == 5.0


def _summary_bytes(tmp_path, *overrides):
    res = run_experiment(small_config(*overrides))
    d = write_run_dir(res, tmp_path, plots=False)
    return (d / "summary.json").read_bytes(), (d / "requests.csv").read_bytes()


def test_same_config_and_seed_give_identical_results(tmp_path):
    a = _summary_bytes(tmp_path / "a", "policy=sarathi", "seed=3", "workload.seed=3")
    b = _summary_bytes(tmp_path / "b", "policy=sarathi", "seed=3", "workload.seed=3")
    c = _summary_bytes(tmp_path / "c", "policy=sarathi", "seed=3", "workload.seed=4")
    assert a == b
    assert a != c
    summary = json.loads(a[0])
    assert summary["num_finished"] == 200


def test_pipeline_overlaps_microbatches():
    # 4 stages and many decodes: stages must work at the same time, so utilisation of every stage
    # is well above the 1/P a serial pipeline would give.
    res = run_experiment(small_config("policy=vllm", "parallel.pp=4", "workload.arrival=offline",
                                      "workload.num_requests=400"))
    assert min(res.summary["stage_utilization"]) > 0.4
    assert 0 <= res.summary["bubble_ratio"] < 0.6


def test_blocking_send_holds_the_sending_stage_until_the_activation_has_left():
    cost = CostModel(get_model("llama2-13b"), get_hardware("a100-80g"), pp=2)
    mbs = []
    for i in range(2):
        seq = Sequence(Request(i, 0.0, 1000, 10))
        chunk = PrefillChunk(seq, 0, 1000, True)
        mbs.append(MicroBatch(i, (chunk,), (), shape=shape_of([chunk], [])))
    slow = dict(link_bandwidth_Bps=1e8, link_latency_s=1e-3)  # 100 MB/s: the send outlasts the forward
    starts = {}
    for blocking in (False, True):
        ex = SimExecutor(cost, blocking_send=blocking, **slow)
        for mb in mbs:
            ex.launch(mb)
        while ex.next_completion() is not None:
            pass
        fwd = [s for s in ex.tracer.spans if s[0] == "stage0" and s[1].startswith("forward")]
        starts[blocking] = fwd[1][2]
        sends = [s for s in ex.tracer.spans if s[0] == "stage0" and s[1] == "send"]
        assert bool(sends) == blocking
    send_s = cost.activation_bytes(mbs[0].shape) / 1e8 + cost.coefficients.transfer_metadata_s
    # blocking: the second forward on stage 0 waits for the first activation to leave
    assert starts[True] - starts[False] == pytest.approx(send_s, rel=1e-9)


def test_the_last_stages_next_request_waits_for_its_last_results_round_trip():
    """`last_stage_request_*` (vLLM 0.5.3's mp executor): the last stage starts a step no sooner than
    its previous result + the round trip priced for the step, a "schedule" span (host) on that stage
    alone (the first step has no result to wait for); off, no such span."""
    import dataclasses

    base = CostModel(get_model("llama2-13b"), get_hardware("a100-80g"), pp=2)
    coef = dataclasses.replace(base.coefficients, last_stage_request_fixed_s=1e-3,
                               last_stage_request_per_context_token_s=1e-7)
    on = CostModel(get_model("llama2-13b"), get_hardware("a100-80g"), pp=2, coefficients=coef)
    runs = {}
    for name, cost in (("off", base), ("on", on)):
        ex = SimExecutor(cost, link_bandwidth_Bps=10e9, link_latency_s=1e-3)
        for i in range(3):  # three 1,000-token prompts at once: the last stage is behind stage 0
            chunk = PrefillChunk(Sequence(Request(i, 0.0, 1000, 10)), 0, 1000, True)
            ex.launch(MicroBatch(i, (chunk,), (), shape=shape_of([chunk], [])))
        while ex.next_completion() is not None:
            pass
        runs[name] = ex.tracer.spans
    assert not [s for s in runs["off"] if s[1] == "schedule"]
    waits = [s for s in runs["on"] if s[1] == "schedule"]
    assert {s[0] for s in waits} == {"stage1"}
    round_trip = on.last_stage_request_s(shape_of([PrefillChunk(Sequence(Request(0, 0.0, 1000, 10)), 0, 1000, True)], []))
    assert round_trip == pytest.approx(1e-3 + 1000 * 1e-7)
    ends = [s[3] for s in runs["on"] if s[0] == "stage1" and s[1] == "sample"]
    assert [s[3] - s[2] for s in waits] == pytest.approx([round_trip] * 2)  # the 2nd and 3rd steps
    assert [s[2] for s in waits] == pytest.approx(ends[:2])


@pytest.mark.parametrize("overrides", [
    ("policy=sarathi", "parallel.pp=4"),
    ("policy=gllm", "parallel.pp=3", "link.bandwidth=1Gbps"),  # links busy: sends queue behind sends
    ("policy=vllm", "parallel.pp=1", "runtime.structure_aware_transfer=true"),
])
def test_launch_time_timeline_equals_the_event_loop(monkeypatch, overrides):
    # FIFO servers everywhere: the executor computes each batch's timeline at launch instead of
    # stepping through events; results, busy sums and every span (in order) must not change.
    import engine.simulator.sim as sim
    from engine.simulator import fifo_pipeline
    launched = []
    real = fifo_pipeline.FifoPipeline.launch
    monkeypatch.setattr(fifo_pipeline.FifoPipeline, "launch", lambda self, *a: (launched.append(a[0]), real(self, *a)))
    cfg = small_config(*overrides, "output.trace=full", "workload.arrival=offline")
    fast = run_experiment(cfg)
    assert launched, "the launch-time path was not taken"
    monkeypatch.setattr(sim, "FifoPipeline", lambda ex: None)  # force the event loop
    slow = run_experiment(cfg)
    assert fast.summary == slow.summary and fast.requests == slow.requests
    assert fast.tracer.busy == slow.tracer.busy
    assert len(fast.tracer.spans) > 100 and fast.tracer.spans == slow.tracer.spans


def test_launch_time_timeline_keeps_same_time_ties_in_event_order():
    # Two batches launched at the same instant on an idle pipeline: the second waits on every
    # stage; completions come back in launch order, after their last stage plus the return latency.
    cost = CostModel(get_model("llama2-13b"), get_hardware("a100-80g"), pp=3)
    ex = SimExecutor(cost, link_bandwidth_Bps=10e9, link_latency_s=1e-3)
    assert ex._fifo is not None
    mbs = []
    for i in range(2):
        chunk = PrefillChunk(Sequence(Request(i, 0.0, 500, 10)), 0, 500, True)
        mbs.append(MicroBatch(i, (chunk,), (), shape=shape_of([chunk], [])))
        ex.launch(mbs[-1])
    first, second = ex.next_completion(), ex.next_completion()
    assert (first.mb_id, second.mb_id) == (0, 1) and first.time_s < second.time_s
    assert ex.next_completion() is None
    last = [s for s in ex.tracer.spans if s[0] == "stage2"]
    assert second.time_s == pytest.approx(last[-1][3] + 1e-3, rel=1e-12)
    starts = [s for s in ex.tracer.spans if s[0] == "stage0" and s[1] == "prepare"]
    assert starts[1][2] == next(s[3] for s in ex.tracer.spans if s[0] == "stage0" and s[4] == 0 and s[1].startswith("forward"))
