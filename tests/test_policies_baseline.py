"""Sarathi (hybrid, decode first, token budget) and vLLM separate batching on hand-built states."""
import pytest
from helpers import make_state

from engine.core.batch import PolicyContractError
from engine.core.request import SeqStatus
from policies.sarathi import SarathiParams, SarathiPolicy
from policies.vllm import VllmParams, VllmPolicy
from testbed.run.runner import run_experiment
from conftest import small_config


def test_sarathi_decodes_first_then_partial_then_new_within_budget():
    pol = SarathiPolicy(SarathiParams(token_budget=100))
    ctrl, seqs = make_state(pol, decoding=[(50, 10, 2)] * 3, prefilling=[(200, 5, 64)], waiting=[(300, 5), (40, 5)])
    mb = pol.schedule(ctrl.view)
    assert [s.seq_id for s in mb.decodes] == [0, 1, 2]
    # partial prompt continues before any new request: 97 tokens left of budget, 136 of the prompt
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in mb.prefills] == [(3, 64, 97)]
    assert mb.num_tokens == 100


def test_sarathi_admits_new_request_with_leftover_budget():
    pol = SarathiPolicy(SarathiParams(token_budget=100))
    ctrl, seqs = make_state(pol, decoding=[(50, 10, 2)] * 2, prefilling=[(80, 5, 60)], waiting=[(300, 5)])
    mb = pol.schedule(ctrl.view)
    chunks = [(c.seq.seq_id, c.num_tokens, c.samples) for c in mb.prefills]
    assert chunks == [(2, 20, True), (3, 78, False)]
    assert mb.num_tokens == 100


def test_sarathi_respects_max_num_seqs():
    pol = SarathiPolicy(SarathiParams(token_budget=1000, max_num_seqs=3))
    ctrl, _ = make_state(pol, decoding=[(10, 10, 1)] * 2, waiting=[(10, 5)] * 4)
    mb = pol.schedule(ctrl.view)
    assert len(mb.decodes) == 2 and len(mb.prefills) == 1


def test_sarathi_preempts_latest_admitted_when_kv_is_short():
    # 3 decoding sequences each with a full block (16 tokens computed): each decode needs a new block.
    pol = SarathiPolicy(SarathiParams(token_budget=64))
    ctrl, seqs = make_state(pol, num_blocks=4, decoding=[(16, 10, 1)] * 3)
    # blocks: 3 used (one each), 1 free -> the first decode gets it, the second must preempt the last admitted
    mb = pol.schedule(ctrl.view)
    assert [s.seq_id for s in mb.decodes] == [0, 1]
    assert [s.seq_id for s in mb.preempted] == [2]
    ctrl._commit(mb)
    assert seqs[2].status is SeqStatus.PREEMPTED and seqs[2].num_computed == 0
    assert ctrl.waiting[0] is seqs[2]
    ctrl.kv.check_integrity()


def test_no_sequence_in_two_inflight_microbatches():
    pol = SarathiPolicy(SarathiParams(token_budget=64))
    ctrl, seqs = make_state(pol, pp=4, decoding=[(10, 10, 1)] * 5, waiting=[(200, 5)] * 4)
    ctrl._fill_pipeline()
    launched = ctrl.executor.launched
    assert len(launched) == 4
    ids = [s.seq_id for mb in launched for s in mb.sequences()]
    assert len(ids) == len(set(ids))


def test_builder_refuses_inflight_sequence():
    pol = SarathiPolicy()
    ctrl, seqs = make_state(pol, decoding=[(10, 10, 1)])
    ctrl._fill_pipeline()
    b = ctrl.view.new_batch()
    with pytest.raises(PolicyContractError, match="in-flight"):
        b.add_decode(seqs[0])


def test_vllm_prefers_prefill_and_never_mixes():
    pol = VllmPolicy(VllmParams(max_num_batched_tokens=100))
    ctrl, _ = make_state(pol, pp=2, decoding=[(10, 10, 1)] * 2, waiting=[(60, 5), (60, 5)])
    mb = pol.schedule(ctrl.view)
    assert mb.kind == "prefill" and len(mb.prefills) == 1  # the second prompt would pass 100 tokens
    assert all(c.samples for c in mb.prefills)  # whole prompts


def test_vllm_decode_when_prompts_do_not_fit():
    pol = VllmPolicy(VllmParams(virtual_engines=False))
    ctrl, _ = make_state(pol, num_blocks=4, decoding=[(10, 10, 1)] * 2, waiting=[(100, 5)])
    mb = pol.schedule(ctrl.view)
    assert mb.kind == "decode" and len(mb.decodes) == 2


@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_runs_complete_with_preemption_for_every_depth(policy, pp):
    cfg = small_config(f"policy={policy}", f"parallel.pp={pp}", "kv.num_blocks=120",
                       "workload.input_dist=uniform", "workload.input_min=16", "workload.input_max=600",
                       "workload.output_dist=uniform", "workload.output_min=1", "workload.output_max=300",
                       "workload.rate=50")
    res = run_experiment(cfg)
    assert res.error is None
    assert res.summary["num_finished"] == 200
    assert res.summary["num_preemptions"] > 0
    for row in res.requests:
        assert row["status"] == "finished" and row["num_generated"] == row["output_len"]
    if policy == "vllm":
        assert {m["kind"] for m in res.microbatches} <= {"prefill", "decode"}
