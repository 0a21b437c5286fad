"""vLLM's v0 pipeline-parallel runtime (policies/vllm.py, `runtime=v0`) against the `shared`
idealisation: requests placed on arrival, 1/P of the KV a virtual engine, max(max_model_len, 2048)
prompt tokens a batch."""
import pytest
from helpers import make_state

from engine.base.errors import ConfigError
from engine.core.executor import Completion
from policies.vllm import VllmParams, VllmPolicy


def _prefill_ids(mb):
    return [c.seq.seq_id for c in mb.prefills]


def test_arrivals_join_the_engine_with_fewest_unfinished_and_stay_there():
    pol = VllmPolicy(VllmParams())
    ctrl, _ = make_state(pol, pp=2, waiting=[(20, 5)] * 4)
    pol.start(ctrl.view)
    first = pol.schedule(ctrl.view)
    ctrl._commit(first)
    second = pol.schedule(ctrl.view)
    # 0 -> engine 0, 1 -> engine 1, 2 -> engine 0 (tie: the first), 3 -> engine 1
    assert (first.tags["ve"], _prefill_ids(first)) == (0, [0, 2])
    assert (second.tags["ve"], _prefill_ids(second)) == (1, [1, 3])
    shared = VllmPolicy(VllmParams(runtime="shared"))
    ctrl, _ = make_state(shared, pp=2, waiting=[(20, 5)] * 4)
    assert _prefill_ids(shared.schedule(ctrl.view)) == [0, 1, 2, 3]  # a free engine takes any prompt


def test_an_engine_admits_only_what_its_share_of_the_cache_holds():
    # 100 blocks of 16 tokens, two engines: 50 each; prompts of 30 blocks
    pol = VllmPolicy(VllmParams())
    ctrl, _ = make_state(pol, pp=2, num_blocks=100, waiting=[(480, 5)] * 4)
    pol.start(ctrl.view)
    assert _prefill_ids(pol.schedule(ctrl.view)) == [0]  # prompt 2 would take engine 0 past 50 blocks
    shared = VllmPolicy(VllmParams(runtime="shared"))
    ctrl, _ = make_state(shared, pp=2, num_blocks=100, waiting=[(480, 5)] * 4)
    assert _prefill_ids(shared.schedule(ctrl.view)) == [0, 1, 2]  # one pool: 90 of 100 blocks


def test_a_prompt_larger_than_an_empty_engines_share_goes_alone():
    pol = VllmPolicy(VllmParams())
    ctrl, _ = make_state(pol, pp=2, num_blocks=100, waiting=[(1200, 5), (20, 5), (20, 5)])
    pol.start(ctrl.view)
    assert _prefill_ids(pol.schedule(ctrl.view)) == [0]  # 75 blocks: more than 50, alone


def test_the_prompt_budget_is_vllms_default_for_the_models_context():
    """llama2-13b (the helper's model): max_model_len 4,096, so two 3,000-token prompts are two
    batches in v0; the shared idealisation's 8,192 took both."""
    pol = VllmPolicy(VllmParams())
    ctrl, _ = make_state(pol, pp=1, num_blocks=2000, waiting=[(3000, 5)] * 2)
    pol.start(ctrl.view)
    assert _prefill_ids(pol.schedule(ctrl.view)) == [0]
    shared = VllmPolicy(VllmParams(runtime="shared"))
    ctrl, _ = make_state(shared, pp=1, num_blocks=2000, waiting=[(3000, 5)] * 2)
    assert _prefill_ids(shared.schedule(ctrl.view)) == [0, 1]


def test_a_decode_short_of_its_share_preempts_within_its_engine():
    """Two engines of 4 blocks; engine 0 holds prompts 0 and 2 (two full blocks each), engine 1
    prompt 1 only. Engine 0's decodes each need a third block: its share is full, so it preempts its
    latest (2) although the cache has 3 blocks free."""
    pol = VllmPolicy(VllmParams())
    ctrl, seqs = make_state(pol, pp=2, num_blocks=8, waiting=[(32, 5)] * 3)
    pol.start(ctrl.view)
    for t in (1.0, 2.0):
        mb = pol.schedule(ctrl.view)
        ctrl._commit(mb)
        ctrl.complete(Completion(mb.mb_id, t))
    assert ctrl.kv.num_free == 2 and set(pol._members[0]) == {0, 2}
    mb = pol.schedule(ctrl.view)
    assert mb.tags["ve"] == 0 and [s.seq_id for s in mb.decodes] == [0]
    assert [s.seq_id for s in mb.preempted] == [2]


def test_an_unknown_runtime_is_refused():
    with pytest.raises(ConfigError, match="policy.runtime"):
        VllmParams(runtime="v1")


def _serve_two(idle_engines, placement="step-start"):
    """Two engines, one step a time unit: request 0 (3 tokens) at t=0 goes to engine 0; request 1
    arrives while it is in flight. Returns the policy, when (and on which engine) request 1
    first ran, when 0 finished."""
    from engine.core.request import Request
    pol = VllmPolicy(VllmParams(idle_engines=idle_engines, placement=placement))
    ctrl, (first,) = make_state(pol, pp=2, waiting=[(20, 3)])
    pol.start(ctrl.view)
    inflight, t, starts = [], 0.0, []

    def fill():
        while (mb := pol.schedule(ctrl.view)) is not None:
            ctrl._commit(mb)
            inflight.append(mb)
            if 1 in [s.seq_id for s in mb.sequences()]:
                starts.append((t, pol._engine_of[1]))
    fill()
    assert len(inflight) == 1  # engine 1 has nothing: it ran dry (and, with "park", parked)
    ctrl.submit(Request(1, 0.0, 20, 3))
    fill()
    while inflight:
        t += 1.0
        ctrl.complete(Completion(inflight.pop(0).mb_id, t))
        fill()
    return pol, starts, first.finish_s


def test_an_arrival_waits_for_the_next_engine_step_to_start():
    """vLLM reads new requests where an `engine_step` starts: engine 1 is dry and engine 0
    mid-step, so request 1 is placed (on engine 1) only when engine 0's step ends, at t=1.
    `placement=arrival` (the earlier model) placed and served it at t=0."""
    pol, starts, _ = _serve_two("step")
    assert pol.params.placement == "step-start" and starts[0] == (1.0, 1)
    _, starts, _ = _serve_two("step", "arrival")
    assert starts[0][0] == 0.0


def test_the_park_what_if_holds_a_request_until_the_other_engines_drain():
    """`idle_engines=park`: the engine that ran dry is not stepped again until every engine has;
    the request placed on it (fewest unfinished: engine 1) waits for engine 0's 3 steps. The
    default, `step` (vLLM's loop re-checks a dry engine every turn), serves it at once."""
    pol, starts, finished = _serve_two("park", "arrival")
    assert finished == 3.0 and starts[0] == (3.0, 1)
    _, starts, finished = _serve_two("step", "arrival")
    assert starts[0][0] == 0.0 < finished
    assert VllmParams().idle_engines == "step"


def test_an_unknown_idle_engine_rule_or_placement_is_refused():
    with pytest.raises(ConfigError, match="policy.idle_engines"):
        VllmParams(idle_engines="spin")
    with pytest.raises(ConfigError, match="policy.placement"):
        VllmParams(placement="now")


def _requests_csv(tmp_path, *overrides):
    from conftest import small_config
    from testbed.run.outputs import write_run_dir
    from testbed.run.runner import run_experiment
    res = run_experiment(small_config("policy=vllm", "parallel.pp=4", "workload.num_requests=120", *overrides))
    return (write_run_dir(res, tmp_path, plots=False) / "requests.csv").read_bytes()


def test_placement_and_parking_change_online_runs_and_leave_offline_runs_bit_for_bit(tmp_path):
    """Offline every request is read at the first step, so neither the placement time nor the
    `park` what-if changes anything (tdpipe-scaling, microbatch-count fast-offline); online both do."""
    off = ["workload.arrival=offline"]
    old = ["policy.placement=arrival", "policy.idle_engines=step"]
    base = _requests_csv(tmp_path / "a", *off, *old)
    assert base == _requests_csv(tmp_path / "b", *off) == _requests_csv(tmp_path / "c", *off, "policy.idle_engines=park")
    online = _requests_csv(tmp_path / "d", "workload.rate=2")
    assert online != _requests_csv(tmp_path / "e", "workload.rate=2", *old)
    assert online != _requests_csv(tmp_path / "f", "workload.rate=2", "policy.idle_engines=park")


# --- chunked prefill on the v0 runtime (`policy.chunked_prefill=true`: gLLM's vLLM 0.8.1 baseline) -----------
def _chunks(mb):
    return [(c.seq.seq_id, c.num_tokens) for c in mb.prefills]


def test_chunked_prefill_chunks_a_prompt_under_the_2048_token_budget_within_its_engine():
    pol = VllmPolicy(VllmParams(chunked_prefill=True))
    ctrl, _ = make_state(pol, pp=2, num_blocks=2000, waiting=[(3000, 5), (100, 5), (500, 5)])
    pol.start(ctrl.view)
    first = pol.schedule(ctrl.view)  # engine 0 holds prompts 0 and 2, engine 1 prompt 1
    assert (first.tags["ve"], _chunks(first)) == (0, [(0, 2048)])
    ctrl._commit(first)
    second = pol.schedule(ctrl.view)
    assert (second.tags["ve"], _chunks(second)) == (1, [(1, 100)])
    ctrl.complete(Completion(first.mb_id, 1.0))
    ctrl._commit(second)
    third = pol.schedule(ctrl.view)  # engine 0 again: the rest of prompt 0, then prompt 2 in the budget left
    assert (third.tags["ve"], _chunks(third)) == (0, [(0, 952), (2, 500)])


def test_chunked_prefill_puts_an_engines_decodes_first_in_a_hybrid_batch():
    pol = VllmPolicy(VllmParams(chunked_prefill=True, max_num_batched_tokens=100))
    ctrl, _ = make_state(pol, pp=1, num_blocks=2000, waiting=[(40, 5), (40, 5), (300, 5)])
    pol.start(ctrl.view)
    mb = pol.schedule(ctrl.view)
    assert _chunks(mb) == [(0, 40), (1, 40), (2, 20)]
    ctrl._commit(mb)
    ctrl.complete(Completion(mb.mb_id, 1.0))
    mb = pol.schedule(ctrl.view)  # two decodes, then 98 more tokens of prompt 2
    assert [s.seq_id for s in mb.decodes] == [0, 1] and _chunks(mb) == [(2, 98)]


def test_chunked_prefill_needs_vllms_own_pp_runtime():
    for bad in ({"runtime": "shared"}, {"virtual_engines": False}):
        with pytest.raises(ConfigError, match="policy.chunked_prefill"):
            VllmParams(chunked_prefill=True, **bad)
