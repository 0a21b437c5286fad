"""TD-Pipe: work stealing (the paper's worked example), the KV forecast, both phase-switch rules
and their ablations on hand-built states, and end-to-end runs where every request finishes once."""
import numpy as np
import pytest
from conftest import small_config
from helpers import make_state

from engine.base.errors import ConfigError
from engine.core.executor import Completion
from engine.core.policy import POLICIES, make_params
from engine.core.request import SeqStatus
from policies.tdpipe import TdpipeParams, TdpipePolicy, WorkStealer, spatial_intensity, temporal_intensity
from policies.tdpipe_forecast import CODE_POINTS, PAPER_POINTS, KVForecast, parse_points
from testbed.run.runner import prepare_experiment, run_experiment


# --- work stealing ---------------------------------------------------------------------------------
def test_work_stealing_reproduces_the_papers_worked_example():
    # 512 requests in 4 batches of 128.
    ws = WorkStealer(4)
    batches = [list(range(128 * i, 128 * (i + 1))) for i in range(4)]
    ws.start([len(b) for b in batches])
    # Round 1: batch 0 returns with 48 finished, batch 1 with 8 finished.
    b0 = ws.resubmit(batches[0][48:])
    assert ws.average == 116 and len(b0) == 80 and ws.pool == []  # below average, nothing to steal yet
    b1 = ws.resubmit(batches[1][8:])
    assert ws.average == 114 and len(b1) == 114  # cut to the average
    assert ws.pool == batches[1][8:][114:]  # its 6 excess requests are withheld
    b2 = ws.resubmit(batches[2])
    b3 = ws.resubmit(batches[3])
    assert len(b2) == len(b3) == 114 and len(ws.pool) == 6 + 14 + 14
    stolen = list(ws.pool)
    # Round 2: batch 0 returns (no new finishes) and is topped up with the stolen requests.
    b0 = ws.resubmit(b0)
    assert ws.average == 114 and len(b0) == 114 and b0[80:] == stolen and ws.pool == []
    # every request is in exactly one place
    assert sorted(b0 + b1 + b2 + b3) == sorted(set(b0 + b1 + b2 + b3)) and len(b0 + b1 + b2 + b3) == 456


def test_without_stealing_batches_keep_their_requests():
    ws = WorkStealer(4, enabled=False)
    ws.start([128] * 4)
    assert ws.resubmit(list(range(120))) == list(range(120)) and ws.pool == []


def test_stealing_rounds_up_so_the_pool_drains():
    ws = WorkStealer(4)
    ws.start([10, 10, 10, 11])
    assert len(ws.resubmit(list(range(11)))) == 11 and ws.pool == []  # 10.25 -> 11, nothing withheld


# --- the KV forecast ---------------------------------------------------------------------------------
def test_forecast_counts_blocks_at_each_future_point():
    fc = KVForecast([32, 64, 128], block_size=16)
    fc.add([16, 100], [40, 200])
    # request 1 (16 tokens, 40 more): blocks(48)=3 at f=32, finished by f=64; request 2: 9, 11, 15
    assert fc.usage.tolist() == [3 + 9, 0 + 11, 0 + 15]
    assert fc.peak == 15
    # each new 16-token request adds 3, 5, 9 blocks: admit-while-below 30 admits at peaks 15 and
    # 24, then stops at 33; at capacity 24 it stops at 24 (the check is strict)
    assert fc.admissible([16, 16, 16, 16], [200] * 4, capacity=30) == 2
    assert fc.admissible([16, 16, 16, 16], [200] * 4, capacity=24) == 1
    assert fc.admissible([16, 16, 16, 16], [200] * 4, capacity=15) == 0
    assert parse_points("paper") == PAPER_POINTS and PAPER_POINTS[:2] == (32, 64) and PAPER_POINTS[-1] == 1024
    assert parse_points("code") == CODE_POINTS and parse_points("64,8") == (8, 64)
    with pytest.raises(ConfigError):
        parse_points("0,5")


def oracle(**kw):
    return TdpipePolicy(TdpipeParams(predictor="oracle", **kw))


def test_prefill_to_decode_flips_exactly_when_the_forecast_exceeds_capacity():
    # Each request: 16 prompt tokens, 40 to generate -> 3 blocks at the only future point (32).
    # Capacity 12 blocks: after 4 prefills the forecast is 12 (not above), after 5 it is 15.
    pol = oracle(future_points="32", prefill_tokens=1)
    ctrl, seqs = make_state(pol, pp=4, num_blocks=12, waiting=[(16, 40)] * 8)
    pol.start(ctrl.view)
    ctrl._fill_pipeline()
    launched = ctrl.executor.launched
    assert [mb.kind for mb in launched] == ["prefill"] * 4 and pol.forecast.peak == 12
    assert not pol.should_enter_decode(ctrl.view)
    ctrl.complete(Completion(launched[0].mb_id, 1.0))
    ctrl._fill_pipeline()
    assert launched[-1].kind == "prefill" and pol.forecast.peak == 15 and pol.phase == "prefill"
    assert pol.should_enter_decode(ctrl.view)
    ctrl.complete(Completion(launched[1].mb_id, 2.0))
    ctrl._fill_pipeline()
    assert pol.phase == "decode" and launched[-1].kind == "decode"
    assert {s.seq_id for s in launched[-1].decodes} <= {0, 1}


def test_kv_ratio_ablation_switches_at_the_ratio():
    pol = oracle(switch_kv_ratio=0.5)
    ctrl, seqs = make_state(pol, pp=2, num_blocks=100, decoding=[(16 * 49 - 1, 40, 1)], waiting=[(16, 4)])
    pol.start(ctrl.view)
    assert 1 - ctrl.view.kv_free_fraction == 0.49 and not pol.should_enter_decode(ctrl.view)
    ctrl2, _ = make_state(pol, pp=2, num_blocks=100, decoding=[(16 * 50 - 1, 40, 1)], waiting=[(16, 4)])
    assert 1 - ctrl2.view.kv_free_fraction == 0.50 and pol.should_enter_decode(ctrl2.view)


# --- decode -> prefill -----------------------------------------------------------------------------
def test_intensity_formulas():
    step = {1: 1.0, 2: 1.0, 4: 1.2, 256: 8.0}.__getitem__
    assert spatial_intensity(step, 2, 256) == pytest.approx((2 / 1.0) / (256 / 8.0))
    assert spatial_intensity(step, 256, 256) == 1.0 and spatial_intensity(step, 0, 256) == 0.0
    # bubble = (2 - 0.5) x 3 = 4.5; paper total = 4 + 4.5; code total = 4 + 2 x 3
    assert temporal_intensity([1, 1, 2], 0.5, 4) == pytest.approx(1 - 4.5 / 8.5)
    assert temporal_intensity([1, 1, 2], 0.5, 4, "code") == pytest.approx(1 - 4.5 / 10)
    assert temporal_intensity([1, 1, 2], 3.0, 4) == 1.0  # no bubble when decode steps are longer
    assert temporal_intensity([], 1.0, 4) == 0.0  # nothing would be admitted: never switch


def decode_state(n, **kw):
    pol = oracle(**kw)
    ctrl, seqs = make_state(pol, pp=4, num_blocks=100_000, decoding=[(200, 300, 50)] * n,
                            waiting=[(500, 200)] * 50)
    pol.start(ctrl.view)
    pol._enter_decode(ctrl.view)
    return pol, ctrl


def test_decode_to_prefill_flips_exactly_when_si_drops_below_ti():
    decisions = []
    for n in (4, 40, 200, 400, 600, 800, 1100):
        pol, ctrl = decode_state(n)
        view = ctrl.view
        si, ti = pol.intensities(view)
        cm, b = view.cost_model, n // 4  # context of each decode: 200 prompt + 50 generated
        expect_si = 1.0 if b >= 256 else (b / cm.decode_step_s(b, 250)) / (256 / cm.decode_step_s(256, 250))
        assert si == pytest.approx(expect_si)
        times = [cm.prefill_s(t, k) for t, k in pol.plan_prefills(view)]
        assert ti == pytest.approx(temporal_intensity(times, cm.decode_step_s(b, 250), 4))
        decisions.append(pol.should_enter_prefill(view))
        assert decisions[-1] == (si < ti)
    # SI grows with the batch, TI barely moves: exactly one flip, from prefill to staying in decode
    assert decisions[0] and not decisions[-1]
    assert sum(a != b for a, b in zip(decisions, decisions[1:])) == 1


def test_no_switch_to_prefill_without_waiting_prompts_and_always_when_nothing_runs():
    pol, ctrl = decode_state(4)
    ctrl.waiting.clear()
    assert not pol.should_enter_prefill(ctrl.view)
    pol2 = oracle()
    ctrl2, _ = make_state(pol2, pp=4, waiting=[(100, 10)])
    pol2.start(ctrl2.view)
    assert pol2.should_enter_prefill(ctrl2.view)


def test_finish_ratio_ablation_switches_at_the_ratio():
    pol, ctrl = decode_state(400, switch_finish_ratio=0.25)
    assert pol._phase_start == 400
    pol._phase_finished = 99
    assert not pol.should_enter_prefill(ctrl.view)
    pol._phase_finished = 100
    assert pol.should_enter_prefill(ctrl.view)


def test_decode_phase_starts_with_an_even_split():
    pol, ctrl = decode_state(10)
    ctrl.waiting.clear()
    ctrl._fill_pipeline()
    assert [len(mb.decodes) for mb in ctrl.executor.launched] == [3, 3, 2, 2]


def test_decode_overflow_preempts_the_most_recently_admitted():
    pol = oracle()
    # 4 decodes with full blocks, 5 blocks: the first decode takes the free block, the second
    # frees one by preempting the latest admitted (3), the third finds itself the latest (2)
    ctrl, seqs = make_state(pol, pp=1, num_blocks=5, decoding=[(16, 40, 1)] * 4)
    pol.start(ctrl.view)
    pol._enter_decode(ctrl.view)
    mb = pol.schedule(ctrl.view)
    assert mb.kind == "decode" and [s.seq_id for s in mb.preempted] == [3, 2]
    assert [s.seq_id for s in mb.decodes] == [0, 1]
    ctrl._commit(mb)
    assert [s.seq_id for s in ctrl.waiting] == [3, 2] and seqs[3].status is SeqStatus.PREEMPTED


# --- config, registry, end to end ----------------------------------------------------------------
def test_registered_with_validated_params():
    assert POLICIES.get("tdpipe") is TdpipePolicy
    for key, value in [("switch_kv_ratio", 1.5), ("switch_finish_ratio", 0), ("kv_capacity", 0),
                       ("predictor", "bert"), ("future_points", "x"), ("steal_rule", "greedy")]:
        with pytest.raises(ConfigError, match=f"policy.{key}"):
            make_params(TdpipeParams, {key: value}, prefix="policy")
    assert make_params(TdpipeParams, {"switch_kv_ratio": 0.35}, prefix="policy").switch_kv_ratio == 0.35


OFFLINE = ("policy=tdpipe", "workload.arrival=offline", "workload.num_requests=60", "workload.input_mean=96",
           "workload.output_dist=lognormal", "workload.output_mean=48", "workload.output_max=400",
           "parallel.pp=4", "kv.num_blocks=60")


@pytest.mark.parametrize("extra", [
    ["policy.predictor=oracle"],
    ["policy.predictor=oracle", "policy.work_stealing=false"],
    ["policy.predictor=mean", "policy.history=run", "policy.steal_rule=even"],
    ["policy.predictor=mean", "policy.history=run", "policy.intensity_rule=code", "policy.future_points=code",
     "policy.kv_capacity=0.9"],
    ["policy.predictor=oracle", "policy.switch_finish_ratio=0.3"],
    ["policy.predictor=mean", "policy.history=run", "policy.switch_kv_ratio=0.95"],
    ["policy.predictor=bins", "policy.history=run"],
])
def test_every_request_finishes_once_under_preemption(extra):
    # 60 blocks of 16 tokens for 60 requests of ~96 + ~48 tokens: phases overflow the cache
    r = run_experiment(small_config(*OFFLINE, *extra))
    assert r.error is None
    assert r.summary["num_finished"] == 60 and r.summary["num_failed"] == 0
    assert all(x["status"] == "finished" and x["num_generated"] == x["output_len"] for x in r.requests)
    assert r.summary["num_preemptions"] > 0
    kinds = {m["kind"] for m in r.microbatches}
    assert "mixed" not in kinds and {"prefill", "decode"} <= kinds  # temporally disaggregated


def test_bins_predictor_on_sharegpt_trains_on_history_minus_the_run(shared_data):
    cfg = small_config("policy=tdpipe", "workload=sharegpt", "workload.arrival=offline", "workload.num_requests=100",
                       "kv.num_blocks=300", f"data_dir={shared_data}")
    run = prepare_experiment(cfg)
    pol = run.controller.policy
    r = run.run()
    assert r.error is None and r.summary["num_finished"] == 100
    info = pol.predictor_info
    assert "minus the run" in info["history"] and info["features"] == "hash"
    assert info["history_size"] <= 9902 - 100
    assert len(pol.pred) == 100 and min(pol.pred.values()) >= 1


def test_a_saved_model_is_used_only_when_disjoint_from_the_run(tmp_path, shared_data):
    from policies.length_predictor import train_predictor
    from workloads.history import history_requests

    dataset, records = history_requests({"name": "azure", "trace": "code", "max_input_len": 1000}, shared_data)
    train_predictor(dataset, records, tmp_path)
    common = ("policy=tdpipe", "workload=azure", "workload.trace=code", "workload.num_requests=60",
              "workload.rate=20", f"policy.predictor_dir={tmp_path}/predictors")
    # long prompts only: none of them in the model's training data -> the saved model is used
    run = prepare_experiment(small_config(*common, "workload.min_input_len=1001"))
    run.controller.policy.start(run.controller.view)
    assert run.controller.policy.predictor_info["model"].endswith("azure-code-length")
    # short prompts: some were training data -> not used, the policy trains on the trace minus the run
    run = prepare_experiment(small_config(*common, "workload.max_input_len=1000"))
    run.controller.policy.start(run.controller.view)
    info = run.controller.policy.predictor_info
    assert "model" not in info and "not used" in info["note"] and "minus the run" in info["history"]


@pytest.mark.parametrize("points,block_size", [(PAPER_POINTS, 16), (CODE_POINTS, 16), (PAPER_POINTS, 12)])
def test_forecast_sum_equals_the_summed_matrix(points, block_size):
    # `summed` takes a suffix-sum shortcut when every point is a multiple of the block size; it
    # must give the very integers of the (requests, points) matrix summed over requests.
    rng = np.random.default_rng(7)
    fc = KVForecast(points, block_size)
    for n in (1, 3, 400):
        lengths, remaining = rng.integers(1, 5000, n), rng.integers(0, 1500, n)
        expected = fc.contributions(lengths, remaining).sum(axis=0)
        assert fc.summed(lengths, remaining).tolist() == expected.tolist()
    fc.add([100, 37], [2000, 0])
    assert fc.usage.tolist() == fc.contributions([100, 37], [2000, 0]).sum(axis=0).tolist()
