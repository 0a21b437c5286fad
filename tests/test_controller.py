"""Controller conservation: every request ends exactly once, finished or failed with a reason."""
import pytest

from engine.base.errors import RunFailedError
from engine.core.policy import Policy
from engine.core.request import Request
from testbed.run.runner import run_experiment
from conftest import small_config


def test_every_request_finishes_once_with_exact_token_counts():
    res = run_experiment(small_config("policy=sarathi", "kv.num_blocks=150", "workload.input_dist=uniform",
                                      "workload.input_min=8", "workload.input_max=900", "workload.output_dist=uniform",
                                      "workload.output_min=1", "workload.output_max=400", "workload.rate=100"))
    rows = res.requests
    assert len(rows) == 200 and len({r["request_id"] for r in rows}) == 200
    assert all(r["status"] == "finished" for r in rows)
    assert all(r["num_generated"] == r["output_len"] for r in rows)
    assert res.summary["num_preemptions"] > 0
    # Every token not made by a decode came from a prefill that finished a prompt: one per request,
    # plus at most one per preemption (a recomputed prefill samples the next token).
    produced = sum(m["num_decode_seqs"] for m in res.microbatches)
    sampled_prefills = sum(r["output_len"] for r in rows) - produced
    assert 200 <= sampled_prefills <= 200 + res.summary["num_preemptions"]
    assert sampled_prefills > 200  # preempted decoders did recompute
    for r in rows:
        assert r["arrival_s"] <= r["first_token_s"] <= r["finish_s"]


def test_request_too_large_for_the_whole_cache_is_reported_failed():
    reqs = [Request(0, 0.0, 100, 10), Request(1, 0.0, 5000, 10), Request(2, 0.1, 50, 5)]
    res = run_experiment(small_config("policy=sarathi", "kv.num_blocks=20"), requests=reqs)
    status = {r["request_id"]: (r["status"], r["fail_reason"]) for r in res.requests}
    assert status[0][0] == "finished" and status[2][0] == "finished"
    assert status[1][0] == "failed" and "KV blocks" in status[1][1]
    assert res.summary["num_failed"] == 1 and res.summary["num_finished"] == 2


class LazyPolicy(Policy):
    name = "lazy"

    def schedule(self, view):
        return None


def test_a_policy_that_never_schedules_fails_loudly_not_hangs(monkeypatch):
    import testbed.run.runner as runner

    monkeypatch.setattr(runner, "build_policy", lambda cfg: LazyPolicy())
    res = run_experiment(small_config("policy=sarathi"))
    assert res.error and "scheduled nothing" in res.error
    assert {r["status"] for r in res.requests} == {"failed"}
    assert res.summary["num_failed"] == 200


def test_online_arrivals_are_not_scheduled_before_they_arrive():
    res = run_experiment(small_config("policy=sarathi", "workload.rate=2"))
    for r in res.requests:
        assert r["first_scheduled_s"] >= r["arrival_s"]
