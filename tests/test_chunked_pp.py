"""Chunked pipeline prefill (`policy=chunked_pp`): one prompt's chunks in flight on several stages,
chunk sizes from the cost model, both executors."""
from __future__ import annotations

import pytest

import policies  # noqa: F401  (registers every policy)
from engine.base.errors import ConfigError
from engine.core.batch import PolicyContractError
from engine.core.policy import POLICIES
from engine.core.request import Request
from policies.chunked_pp import ChunkedPPPolicy
from testbed.config.spec import compose_spec
from testbed.run.runner import prepare_experiment, run_experiment

LONG = ["workload=synthetic", "workload.input_mean=32768", "workload.output_mean=16", "workload.num_requests=12",
        "workload.rate=0.2", "hardware=h100-80g", "model=llama-3.1-70b", "parallel.pp=4", "output.mlflow=false",
        "check_integrity=true"]


def _run(*extra):
    keys = {e.split("=")[0] for e in extra}
    res = run_experiment(compose_spec([*(v for v in LONG if v.split("=")[0] not in keys), *extra]))
    assert res.error is None, res.error
    return res


def test_dynamic_chunks_shrink_to_the_first_chunks_stage_time():
    prepared = prepare_experiment(compose_spec([*LONG, "policy=chunked_pp"]))
    pol, view = prepared.controller.policy, prepared.controller.view
    first = view.estimate_prefill(0, 4096)
    sizes = [pol.chunk_size(view, prefix) for prefix in (0, 8192, 16384, 28672)]
    assert sizes[0] == 4096 and sizes == sorted(sizes, reverse=True) and sizes[-1] < 3500
    for prefix, x in zip((8192, 16384, 28672), sizes[1:]):
        t = view.estimate_prefill(prefix, x)
        assert t <= first * 1.0001 and view.estimate_prefill(prefix, x + 64) > first  # the largest that fits
    fixed = POLICIES.get("chunked_pp").from_config({"chunking": "fixed"})
    assert fixed.chunk_size(view, 28672) == 4096


def test_one_prompts_chunks_are_in_flight_on_several_stages_at_once():
    res = _run("policy=chunked_pp", "workload.num_requests=1", "output.trace=full")
    mbs = res.microbatches
    assert len(mbs) >= 8 + 1  # 32k prompt in >= 8 chunks, then decodes
    chunks = [m for m in mbs if m["num_prefill_tokens"]]
    # chunk k+1 launched before chunk k completed: the prompt is pipelined, not serial (vLLM #41682)
    overlapped = sum(1 for a, b in zip(chunks, chunks[1:]) if b["scheduled_s"] < a["completed_s"])
    assert overlapped >= len(chunks) - 2
    assert chunks[0]["num_prefill_tokens"] == 4096 > chunks[-2]["num_prefill_tokens"]


def test_dynamic_beats_fixed_chunks_and_sarathi_on_mean_ttft():
    dyn = _run("policy=chunked_pp").summary["ttft_mean_s"]
    fixed = _run("policy=chunked_pp", "policy.chunking=fixed").summary["ttft_mean_s"]
    sarathi = _run("policy=sarathi", "policy.token_budget=4096").summary["ttft_mean_s"]
    assert dyn < fixed < sarathi


def test_builder_refuses_a_pipelined_decode_and_overlong_chunks():
    from engine.core.batch import BatchBuilder
    from engine.core.kv import BlockManager
    from engine.core.request import SeqStatus, Sequence

    kv = BlockManager(64, 16)
    seq = Sequence(Request(0, 0.0, 100, 4))
    seq.status, seq.in_flight, seq.inflight_prefill = SeqStatus.PREFILLING, True, 40
    kv.ensure(seq.seq_id, 40)
    b = BatchBuilder(kv)
    with pytest.raises(PolicyContractError):
        b.add_pipelined_prefill(seq, 61)  # 60 left unscheduled
    assert b.add_pipelined_prefill(seq, 60)
    assert b.prefills[0].start == 40 and b.prefills[0].samples
    with pytest.raises(PolicyContractError):
        BatchBuilder(kv).add_prefill(seq, 1)  # the ordinary add refuses a sequence in flight
    seq.status = SeqStatus.DECODING
    with pytest.raises(PolicyContractError):
        BatchBuilder(kv).add_pipelined_prefill(seq, 1)


@pytest.mark.parametrize("values", [{"chunking": "adaptive"}, {"first_chunk": 0}, {"min_chunk": 8192}])
def test_params_are_validated(values):
    with pytest.raises(ConfigError):
        POLICIES.get("chunked_pp").from_config(values)


def test_pipelined_chunks_on_the_real_engine_equal_hf_generate(model_cache, monkeypatch):
    """P=2 on CPU: chunks of 8 tokens of prompts up to 60 tokens, several of one prompt in flight,
    give the unsplit Hugging Face model's greedy tokens; the run's time breakdown from the stages'
    real spans adds up (the engine's half of tests/test_breakdown.py)."""
    from test_torch_engine import _hf_greedy, _requests, _run_pipeline
    from engine.pricing.models import get_model
    from engine.torch_exec.weights.checkpoint import random_checkpoint

    pipelined = []  # sequences given a chunk while an earlier chunk of theirs was in flight
    schedule = ChunkedPPPolicy.schedule

    def spy(self, view):
        mb = schedule(self, view)
        if mb is not None:
            pipelined.extend(c.seq.seq_id for c in mb.prefills if c.seq.in_flight)
        return mb

    monkeypatch.setattr(ChunkedPPPolicy, "schedule", spy)
    requests = _requests()
    path = random_checkpoint(get_model("tiny-llama"), 0, model_cache)
    ctrl, _ = _run_pipeline(requests, pp=2, model="tiny-llama", cache=model_cache, policy="chunked_pp",
                            policy_params={"first_chunk": 8, "min_chunk": 4, "align": 4, "max_num_seqs": 8},
                            num_blocks=64, block_size=4)
    assert ctrl.num_finished == len(requests)
    assert len(set(pipelined)) >= 2  # prompts of 17..60 tokens in chunks of 8: several pipelined
    ref = _hf_greedy(path, requests)
    for r in requests:
        assert ctrl.sequences[r.request_id].output_token_ids == ref[r.request_id], r.request_id
    # where the time went, from the stages' measured spans: the parts add up to each stage's wall time
    from engine.core.breakdown import run_breakdown
    from test_breakdown import assert_parts_sum_to_wall

    bd = run_breakdown(ctrl, ["stage0", "stage1"])
    assert_parts_sum_to_wall(bd)
    assert all(row["compute"] > 0 and row["host"] > 0 for row in bd["stages"])
    assert bd["stages"][0]["transfer"] > 0  # gloo's blocking send on CPU, on stage 0's own track


def test_bad_chunking_is_one_error_line():
    with pytest.raises(ConfigError, match="policy.chunking"):
        compose_spec([*LONG, "policy=chunked_pp", "policy.chunking=nope"]).policy
