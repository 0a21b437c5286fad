"""The controller's online API (submit, abort, finish_early, step), the paced simulator and the
engine thread's stop handling, without HTTP."""
from __future__ import annotations

import time

import pytest

import policies  # noqa: F401  (registers every policy)
from engine.core.controller import Controller
from engine.pricing.costmodel import CostModel
from engine.pricing.hardware import get_hardware
from engine.core.kv import BlockManager
from engine.pricing.models import get_model
from engine.simulator.paced import PacedExecutor
from engine.core.policy import POLICIES
from engine.core.request import Request, SamplingParams, SeqStatus
from engine.simulator.sim import SimExecutor
from testbed.serve.codec import Codec
from testbed.serve.engine_loop import Generation
from testbed.serve.protocol import GenerateSpec


def _online(policy="sarathi", num_blocks=400, scale=None):
    cost = CostModel(get_model("llama2-13b"), get_hardware("a100-80g"), pp=2)
    ex = SimExecutor(cost, link_bandwidth_Bps=25e9, link_latency_s=1e-5)
    if scale is not None:
        ex = PacedExecutor(ex, scale)
    ctrl = Controller([], POLICIES.get(policy)(), ex, BlockManager(num_blocks, 16), cost_model=cost,
                      check_integrity=True)
    ctrl.start()
    return ctrl


def _drive(ctrl, steps=10_000):
    for _ in range(steps):
        if not (ctrl.waiting or ctrl.running or ctrl.inflight):
            return
        ctrl.step(0.5)
    raise AssertionError("did not drain")


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "gllm"])
def test_submitted_requests_finish_and_free_kv(policy):
    ctrl = _online(policy)
    for i in range(6):
        ctrl.submit(Request(i, ctrl.executor.now(), 40 + 7 * i, 5 + i))
    _drive(ctrl)
    assert ctrl.num_finished == 6 and ctrl.kv.num_used == 0
    assert all(s.num_generated == s.output_len for s in ctrl.sequences.values())


def test_submit_refuses_duplicates_and_fails_what_never_fits():
    ctrl = _online(num_blocks=4)
    ctrl.submit(Request(0, 0.0, 10, 5))
    with pytest.raises(ValueError):
        ctrl.submit(Request(0, 0.0, 10, 5))
    seq = ctrl.submit(Request(1, 0.0, 100, 5))
    assert seq.status is SeqStatus.FAILED and "KV blocks" in seq.fail_reason


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "gllm"])
def test_abort_waiting_running_and_in_flight(policy):
    ctrl = _online(policy)
    for i in range(8):
        ctrl.submit(Request(i, 0.0, 64, 50))
    assert ctrl.abort(7, "aborted: test")  # still waiting: dropped at once
    assert ctrl.sequences[7].status is SeqStatus.FAILED and ctrl.sequences[7] not in ctrl.waiting
    marked = []

    def inspect(mb, completion):  # the micro-batch has completed but is not applied yet
        if not marked:
            seq = mb.sequences()[0]
            assert seq.in_flight and ctrl.abort(seq.seq_id, "aborted: in flight")
            assert seq.status is not SeqStatus.FAILED  # only marked: dropped when applied
            marked.append(seq)

    while not marked:
        ctrl.step(0.5, inspect=inspect)
    inflight = marked[0]
    assert inflight.status is SeqStatus.FAILED and not ctrl.kv.holds(inflight.seq_id)
    idle = [s for s in ctrl.running.values() if not s.in_flight]
    if idle:
        ctrl.abort(idle[0].seq_id, "aborted: idle")
        assert not ctrl.kv.holds(idle[0].seq_id)
    _drive(ctrl)
    assert inflight.status is SeqStatus.FAILED and inflight.fail_reason == "aborted: in flight"
    assert ctrl.kv.num_used == 0 and not ctrl._aborting
    assert ctrl.num_finished + ctrl.num_failed == 8
    assert not ctrl.abort(inflight.seq_id, "again")


def test_finish_early_ends_with_the_inspected_token():
    ctrl = _online()
    ctrl.submit(Request(0, 0.0, 32, 100))

    def inspect(mb, completion):
        for seq in mb.sampled_sequences():
            if seq.num_generated == 3:  # the 4th token is the last
                ctrl.finish_early(seq)

    while ctrl.num_done == 0:
        ctrl.step(0.5, inspect=inspect)
    seq = ctrl.sequences[0]
    assert seq.status is SeqStatus.FINISHED and seq.num_generated == 4 and seq.output_len == 4
    assert ctrl.kv.num_used == 0


def test_paced_clock_follows_the_wall_clock_at_its_scale():
    ctrl = _online(scale=20.0)
    t0 = time.perf_counter()
    ctrl.submit(Request(0, ctrl.executor.now(), 256, 20))
    _drive(ctrl)
    wall = time.perf_counter() - t0
    seq = ctrl.sequences[0]
    # the simulated finish time is reached in wall time / scale (never earlier)
    assert wall >= (seq.finish_s - seq.request.arrival_s) / 20.0
    assert seq.finish_s <= ctrl.executor.now()


def test_generation_stops_on_eos_stop_ids_and_stop_strings():
    codec = Codec(100)
    codec.eos_token_ids = frozenset({2})

    def gen(**kw):
        spec = GenerateSpec((1, 2, 3), 50, SamplingParams(), **kw)
        return Generation(0, spec, None, None)

    g = gen()
    assert not g.accept(7, codec, True) and g.accept(2, codec, True) and g.stop_reason == "stop"
    assert g.delta(final=True) == " 7"  # the EOS token's text is not part of the reply
    g = gen(ignore_eos=True)
    assert not g.accept(2, codec, True)
    g = gen(stop_token_ids=frozenset({9}))
    assert g.accept(9, codec, True)
    g = gen(stops=(" 4 5",))
    assert not g.accept(3, codec, True) and not g.accept(4, codec, True)
    assert g.delta(final=False) == " "  # " 3 4" minus what could still become " 4 5"
    assert g.accept(5, codec, True)
    assert g.delta(final=True) == "3" and g.text == " 3"


def test_fallback_codec_round_trips_ids():
    codec = Codec(32000)
    assert codec.encode(codec.decode([5, 17, 31999])) == [5, 17, 31999]
    assert codec.encode("hi") == [104, 105]


def test_per_request_sampling_rows():
    torch = pytest.importorskip("torch")
    from engine.torch_exec.stage.sampling import Sampler

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    run = Sampler(50)  # the run samples greedily; rows 1 and 2 are served requests with their own params
    run.set_params({11: SamplingParams(temperature=0.0, repetition_penalty=1.5).as_tuple(),
                    12: SamplingParams(temperature=0.7, top_k=5, seed=3).as_tuple()})
    for sid in (10, 11, 12):
        run.observe_prefill(sid, 0, [int(logits[1].argmax())])
    out = run.sample(logits, [(10, 4), (11, 4), (12, 4)])
    assert out[0] == int(logits[0].argmax())
    pen = Sampler(50, repetition_penalty=1.5)  # the same penalty as a run setting gives the same token
    pen.observe_prefill(11, 0, [int(logits[1].argmax())])
    assert out[1] == pen.sample(logits[1:2], [(11, 4)])[0]
    other = Sampler(50)
    other.set_params({99: SamplingParams(temperature=0.7, top_k=5, seed=3).as_tuple()})
    assert other.sample(logits[2:3], [(99, 4)]) == [out[2]]  # a seed keys draws by position, not request
    assert out[2] in torch.topk(logits[2], 5).indices.tolist()
