"""Conformance: every registered policy keeps the contract of `engine/core/policy.py`.

Parametrised over the registry (plus the newcomer's one-file policy in `tests/toy_policy.py`), so a
new policy gets these checks for free:
- conservation: every request ends exactly once, FINISHED with exactly its output tokens, at
  P = 1..4, with the block manager's integrity checked after every commit and completion;
- no double scheduling: no sequence is in two in-flight micro-batches, and no more micro-batches
  are in flight than the policy's `max_inflight` (checked at every launch);
- the view's status index: `view.prefilling` and `view.num_decoding` agree with a scan of
  `view.running` at every launch;
- determinism: the same config gives identical per-request and per-micro-batch tables;
- liveness under forced preemption: a harness preempts a running sequence behind the policy's
  back every few completions, and the run still finishes every request;
- `parallel.num_microbatches` at 1, P and 2P: never more in flight than the setting (and the
  setting is reached), every request finished once, in the simulator and the torch engine;
- a short run on the real engine (tiny-llama, P=2) finishes every request with the same greedy
  tokens whatever the policy.
"""
from __future__ import annotations

import pytest

import policies  # noqa: F401  (registers the seed policies)
import toy_policy  # noqa: F401  (registers toy_fcfs, a policy written against the contract only)
from engine.core.policy import POLICIES
from engine.core.request import SeqStatus
from testbed.run.runner import prepare_experiment
from conftest import small_config

ALL = POLICIES.names()
WORKLOAD = ["workload.num_requests=80", "workload.input_dist=uniform", "workload.input_min=16",
            "workload.input_max=600", "workload.output_dist=uniform", "workload.output_min=1",
            "workload.output_max=200", "workload.rate=50"]


class Watch:
    """Wraps the executor's `launch` to check the in-flight invariants at every launch."""

    def __init__(self, prepared) -> None:
        self.ctrl = prepared.controller
        self.max_inflight_seen = 0
        self.launches = 0
        self._launch = self.ctrl.executor.launch
        self.ctrl.executor.launch = self.launch

    def launch(self, mb) -> None:
        ctrl = self.ctrl
        assert ctrl.inflight.get(mb.mb_id) is mb  # committed before launch
        seen: set[int] = set()
        for other in ctrl.inflight.values():
            ids = {s.seq_id for s in other.sequences()}
            assert not ids & seen, f"sequences {sorted(ids & seen)} in two in-flight micro-batches"
            seen |= ids
        assert len(ctrl.inflight) <= ctrl.policy.max_inflight(ctrl.view)
        view = ctrl.view
        assert list(view.prefilling) == [s for s in view.running if s.status is SeqStatus.PREFILLING]
        assert view.num_decoding == sum(s.status is SeqStatus.DECODING for s in view.running)
        self.max_inflight_seen = max(self.max_inflight_seen, len(ctrl.inflight))
        self.launches += 1
        self._launch(mb)


def _prepared(policy: str, *extra: str):
    return prepare_experiment(small_config(f"policy={policy}", *WORKLOAD, *extra))


def _assert_conserved(res, n: int = 80) -> None:
    assert res.error is None, res.error
    rows = res.requests
    assert len(rows) == n and len({r["request_id"] for r in rows}) == n
    bad = [r for r in rows if r["status"] != "finished" or r["num_generated"] != r["output_len"]]
    assert not bad, bad[:3]
    decoded = sum(m["num_decode_seqs"] for m in res.microbatches)
    # every token not made by a decode came from a prefill that completed a prompt
    assert n <= sum(r["output_len"] for r in rows) - decoded <= n + res.summary["num_preemptions"]


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_conservation_and_no_double_scheduling(policy, pp):
    prepared = _prepared(policy, f"parallel.pp={pp}", "kv.num_blocks=150")
    watch = Watch(prepared)
    res = prepared.run()
    _assert_conserved(res)
    assert watch.launches == res.summary["num_microbatches"]


@pytest.mark.parametrize("policy", ALL)
def test_same_config_same_tables(policy):
    a = _prepared(policy, "kv.num_blocks=150").run()
    b = _prepared(policy, "kv.num_blocks=150").run()
    assert a.requests == b.requests
    assert a.microbatches == b.microbatches


@pytest.mark.parametrize("policy", ALL)
def test_live_under_forced_preemption(policy):
    """Every 5th completion the harness preempts the latest admitted sequence that is not in
    flight and was not forced out before (as a KV shortage would; once per sequence, so the
    harness cannot livelock a long prompt), up to 20 times: the policy must cope with sequences
    leaving behind its back."""
    prepared = _prepared(policy, "parallel.pp=2")
    ctrl = prepared.controller
    complete, forced = ctrl.complete, []

    def complete_then_preempt(completion):
        finished = complete(completion)
        idle = [s for s in ctrl.running.values() if not s.in_flight and s.seq_id not in forced]
        if len(ctrl.records) % 5 == 0 and idle and len(forced) < 20:
            victim = max(idle, key=lambda s: s.admit_order)
            ctrl.apply_preemptions([victim])
            forced.append(victim.seq_id)
        return finished

    ctrl.complete = complete_then_preempt
    res = prepared.run()
    assert len(forced) >= 5
    _assert_conserved(res)
    assert res.summary["num_preemptions"] >= len(forced)


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize("count", [1, 2, 4])
def test_num_microbatches_bounds_the_pipeline_in_the_simulator(policy, count):
    prepared = _prepared(policy, "parallel.pp=2", f"parallel.num_microbatches={count}", "kv.num_blocks=400")
    watch = Watch(prepared)
    res = prepared.run()
    _assert_conserved(res)
    assert watch.max_inflight_seen == count  # never above the setting, and the setting is used
    assert res.info["num_microbatches"] == count


# --- the real engine ---------------------------------------------------------------------------------

TORCH = ["executor=torch", "model=tiny-llama", "parallel.pp=2", "kv.num_blocks=96", "kv.block_size=8",
         "workload.num_requests=6", "workload.rate=100", "workload.input_min=8", "workload.input_max=48",
         "workload.output_min=4", "workload.output_max=12"]


def _torch_run(tmp_path, policy: str, *extra: str):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cfg = small_config(f"policy={policy}", "workload.input_dist=uniform", "workload.output_dist=uniform",
                       *TORCH, f"executor.model_cache_dir={tmp_path.parent / 'models'}", *extra,
                       out_dir=tmp_path)
    prepared = prepare_experiment(cfg)
    watch = Watch(prepared)
    res = prepared.run()
    _assert_conserved(res, n=6)
    return res, watch


def _tokens(res) -> dict[int, object]:
    return {r["request_id"]: r.get("output_token_ids") for r in res.requests}


@pytest.fixture(scope="module")
def reference_tokens(tmp_path_factory):
    res, _ = _torch_run(tmp_path_factory.mktemp("ref"), "sarathi")
    tokens = _tokens(res)
    assert all(tokens.values())
    return tokens


@pytest.mark.parametrize("policy", ALL)
def test_short_torch_run_same_greedy_tokens(policy, tmp_path, reference_tokens):
    res, _ = _torch_run(tmp_path, policy)
    assert _tokens(res) == reference_tokens
    assert res.info["host"]["gemm_probe_ms"] > 0 and res.info["host"]["logical_cpus"] >= 1  # host_probe.py
    stages = res.info["stages"]  # each stage's set-up as its Ready said (CUDA graph capture on a GPU)
    assert len(stages) == res.spec.settings.parallel.pp
    assert all(s["load_s"] > 0 and s["init_s"] >= s["runtime_s"] >= 0 and s["runtime_mib"] == 0 for s in stages)


@pytest.mark.parametrize("count", [1, 2, 4])
def test_num_microbatches_bounds_the_torch_pipeline(count, tmp_path, reference_tokens):
    res, watch = _torch_run(tmp_path, "gllm", f"parallel.num_microbatches={count}")
    assert watch.max_inflight_seen <= count
    assert _tokens(res) == reference_tokens
