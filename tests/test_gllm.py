"""gLLM token throttling: the #P and #D formulas on hand-built states, preemption, the ablation
switches, the relation to Sarathi, and end-to-end runs where every request finishes once."""
import math

import pytest
from conftest import small_config
from helpers import make_state

from engine.base.errors import ConfigError
from engine.core.executor import Completion
from engine.core.policy import POLICIES, make_params
from policies.gllm import GllmParams, GllmPolicy, decode_budget, prefill_budget
from policies.sarathi import SarathiParams, SarathiPolicy
from testbed.run.runner import run_experiment


# --- #P, the prefill formula ---------------------------------------------------------------------
def paper(wp, kv_free, **kw):
    return prefill_budget(GllmParams(**kw), wp, kv_free)


def test_prefill_formula_terms_cutoff_floor_and_cap():
    # WT binds: 8000 waiting tokens over T=8 iterations, empty cache -> 1000
    assert paper(8000, 1.0) == 1000
    # UT binds: 2048 * (0.5 - 0.05) / 0.95 = 970.1
    assert paper(80_000, 0.5) == math.floor(2048 * 0.45 / 0.95) == 970
    # #MinP floor: 100 / 8 = 12 -> 32
    assert paper(100, 1.0) == 32
    # KV_thresh cut-off: just below the threshold nothing, just above the floor
    assert paper(80_000, 0.0499) == 0
    assert paper(80_000, 0.05) == 32
    # #MaxP caps WT even without the UT term
    assert paper(80_000, 1.0, use_ut=False) == 2048
    # nothing waits -> nothing to prefill, whatever the floor says
    assert paper(0, 1.0) == 0
    # WT rounds up (drain within T iterations); never below one token while prompts wait
    assert paper(8001, 1.0) == 1001
    assert paper(5, 1.0, min_p=0) == 1 and paper(80_000, 0.0500001, min_p=0) == 1


def test_prefill_ablations_drop_their_term():
    # w/o WT: a small queue no longer limits #P, the KV term does
    assert paper(100, 1.0, use_wt=False) == 2048
    assert paper(100, 0.5, use_wt=False) == 970
    # w/o UT: a nearly full cache no longer limits #P (the cut-off still does)
    assert paper(8000, 0.06, use_ut=False) == 1000
    assert paper(8000, 0.06) == 32  # UT = 21.6 -> floored to #MinP
    assert paper(8000, 0.04, use_ut=False) == 0
    # sensitivity knobs move #P as the formula says
    assert paper(8000, 1.0, T=1) == 2048 and paper(8000, 1.0, T=16) == 500
    assert paper(80_000, 1.0, max_p=512) == 512 and paper(80_000, 1.0, max_p=4096) == 4096
    assert paper(100, 1.0, min_p=64) == 64


def test_code_rules_floor_only_the_wt_term_and_cap_by_pages():
    p = GllmParams(rules="code")
    # KV 6% free, thresh 5%: UT = 21.6 -> 22; MinP floors WT (12 -> 32), not UT -> 22 (paper: 32)
    assert prefill_budget(p, 100, 0.06, free_blocks=60, total_blocks=1000) == 22
    # page cap: 16 tokens x (60 - 50) free blocks above the threshold = 160
    assert prefill_budget(p, 80_000, 0.06, free_blocks=60, total_blocks=1000, num_waiting_seqs=1) == 22
    assert prefill_budget(GllmParams(rules="code", use_ut=False), 80_000, 0.06, free_blocks=60,
                          total_blocks=1000, num_waiting_seqs=1) == 160
    # WT only with more than one waiting sequence
    assert prefill_budget(p, 8000, 1.0, free_blocks=1000, total_blocks=1000, num_waiting_seqs=1) == 2048
    assert prefill_budget(p, 8000, 1.0, free_blocks=1000, total_blocks=1000, num_waiting_seqs=2) == 1000


# --- #D, the decode formula ----------------------------------------------------------------------
@pytest.mark.parametrize("rd", [1, 2, 5, 10, 11, 13, 100, 257])
def test_decode_split_over_a_round_is_exact_and_balanced(rd):
    sizes = [decode_budget(rd, 4, 3 - k % 4) for k in range(4)]
    assert sum(sizes) == rd
    assert max(sizes) - min(sizes) <= 1
    assert sizes[0] == math.ceil(rd / 4)


@pytest.mark.parametrize("n", [10, 11, 13, 40])
def test_pipeline_of_decodes_differs_by_at_most_one(n):
    pol = GllmPolicy()
    ctrl, seqs = make_state(pol, pp=4, decoding=[(20, 50, 1)] * n)
    ctrl._fill_pipeline()
    sizes = [len(mb.decodes) for mb in ctrl.executor.launched]
    assert len(sizes) == 4 and sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the rounding remainder goes first in each round
    ids = [s.seq_id for mb in ctrl.executor.launched for s in mb.decodes]
    assert len(set(ids)) == n


def test_rd_counts_inflight_decodes_and_remainder_rotates():
    pol = GllmPolicy()
    ctrl, seqs = make_state(pol, pp=4, decoding=[(20, 50, 1)] * 10)
    ctrl._fill_pipeline()
    first = ctrl.executor.launched[0]
    # the first batch returns; the next one is the 5th micro-batch: offset 3 again -> ceil(10/4) = 3
    ctrl.complete(Completion(first.mb_id, 1.0))
    ctrl._fill_pipeline()
    assert len(ctrl.executor.launched[-1].decodes) == 3
    # the sequences that waited longest go first
    assert {s.seq_id for s in ctrl.executor.launched[-1].decodes} == {s.seq_id for s in first.decodes}


def test_max_d_caps_decodes():
    pol = GllmPolicy(GllmParams(max_d=2))
    ctrl, _ = make_state(pol, pp=2, decoding=[(20, 50, 1)] * 10)
    assert len(pol.schedule(ctrl.view).decodes) == 2


def test_batch_matches_both_budgets_on_a_hand_built_state():
    pol = GllmPolicy()
    ctrl, seqs = make_state(pol, pp=4, num_blocks=2000, decoding=[(20, 50, 1)] * 9,
                            waiting=[(3000, 10), (3000, 10), (2000, 10)])
    view = ctrl.view
    wp = 8000
    kv_free = view.kv_free_fraction
    expect_p = max(min(math.ceil(wp / 8), math.floor(2048 * (kv_free - 0.05) / 0.95), 2048), 32)
    assert pol.budgets(view) == (expect_p, 3)
    mb = pol.schedule(view)
    assert mb.num_prefill_tokens == expect_p and len(mb.decodes) == 3
    assert [(c.seq.seq_id, c.num_tokens) for c in mb.prefills] == [(9, expect_p)]  # FCFS, chunked


def test_no_prefill_below_kv_thresh():
    pol = GllmPolicy()
    # 100 blocks, 2 decodes holding 48 blocks each (768 tokens): 4% free < 5%
    ctrl, _ = make_state(pol, pp=2, num_blocks=100, decoding=[(760, 50, 8)] * 2, waiting=[(100, 10)])
    assert ctrl.view.kv_free_fraction < 0.05
    mb = pol.schedule(ctrl.view)
    assert mb.num_prefill_tokens == 0 and len(mb.decodes) == 1


def test_preempts_latest_admitted_while_free_blocks_below_d():
    pol = GllmPolicy()
    # 6 decodes with full blocks (16 tokens each), 7 blocks: 1 free < #D = 3 -> preempt the latest two
    ctrl, seqs = make_state(pol, pp=2, num_blocks=7, decoding=[(16, 50, 1)] * 6)
    mb = pol.schedule(ctrl.view)
    assert [s.seq_id for s in mb.preempted] == [5, 4]
    assert len(mb.decodes) == 3
    ctrl._commit(mb)
    ctrl.kv.check_integrity()


# --- gLLM versus Sarathi on one state --------------------------------------------------------------
STATE = dict(num_blocks=5000, decoding=[(30, 50, 2)] * 12, prefilling=[(900, 10, 100)],
             waiting=[(700, 10), (600, 10), (500, 10)])


def test_gllm_equals_sarathi_when_the_formulas_coincide():
    # P = 1 makes #D = #RD (all decodes, as Sarathi); T = 1, KV_thresh = 0 and an empty-ish cache
    # make #P = min(#WP, #MaxP), and #MaxP = budget - decodes is what Sarathi leaves for prefill.
    budget = 2048
    g = GllmPolicy(GllmParams(T=1, kv_thresh=0.0, min_p=0, max_p=budget - 12))
    s = SarathiPolicy(SarathiParams(token_budget=budget))
    cg, _ = make_state(g, pp=1, **STATE)
    cs, _ = make_state(s, pp=1, **STATE)
    free = cg.view.kv_free_fraction
    assert g.budgets(cg.view) == (min(2400, math.floor((budget - 12) * free)), 12)
    mg, ms = g.schedule(cg.view), s.schedule(cs.view)
    assert [x.seq_id for x in mg.decodes] == [x.seq_id for x in ms.decodes]
    # identical chunks up to the UT term (free < 1 shaves a few tokens off the last chunk)
    cut = budget - 12 - mg.num_prefill_tokens
    assert 0 <= cut <= (budget - 12) * (1 - free) + 1
    pg = [(c.seq.seq_id, c.start, c.num_tokens) for c in mg.prefills]
    ps = [(c.seq.seq_id, c.start, c.num_tokens) for c in ms.prefills]
    assert pg[:-1] == ps[:-1] and pg[-1][:2] == ps[-1][:2] and pg[-1][2] == ps[-1][2] - cut


def test_gllm_differs_from_sarathi_exactly_by_the_throttling():
    g, s = GllmPolicy(), SarathiPolicy(SarathiParams(token_budget=2048))
    cg, _ = make_state(g, pp=4, **STATE)
    cs, _ = make_state(s, pp=4, **STATE)
    mg, ms = g.schedule(cg.view), s.schedule(cs.view)
    # Sarathi: every idle decode, then prefill up to the budget
    assert len(ms.decodes) == 12 and ms.num_tokens == 2048
    # gLLM: #D = ceil(12 / 4) = 3 decodes (the same first three), #P = #WP / 8 = 2600 / 8 = 325
    assert [x.seq_id for x in mg.decodes] == [x.seq_id for x in ms.decodes][:3]
    assert mg.num_prefill_tokens == math.ceil(2600 / 8) == 325
    # the prefill order is the same (the partial prompt first); only the amounts differ
    assert [c.seq.seq_id for c in mg.prefills] == [c.seq.seq_id for c in ms.prefills][:len(mg.prefills)]
    assert mg.prefills[0].start == ms.prefills[0].start == 100


# --- config, registry, end to end ----------------------------------------------------------------
def test_registered_with_validated_params():
    assert POLICIES.get("gllm") is GllmPolicy
    with pytest.raises(ConfigError, match="policy.kv_thresh"):
        make_params(GllmParams, {"kv_thresh": 1.5}, prefix="policy")
    with pytest.raises(ConfigError, match="policy.min_p"):
        make_params(GllmParams, {"min_p": 5000}, prefix="policy")
    with pytest.raises(ConfigError, match="policy.rules"):
        GllmParams(rules="nope")
    assert make_params(GllmParams, {"T": 4, "max_d": 64}, prefix="policy") == GllmParams(T=4, max_d=64)


def test_search_space_covers_the_sensitivity_ranges():
    class Trial:
        def __init__(self):
            self.calls = {}

        def suggest_int(self, name, lo, hi, step=1):
            self.calls[name] = (lo, hi)
            return lo

        def suggest_float(self, name, lo, hi):
            self.calls[name] = (lo, hi)
            return hi

        def suggest_categorical(self, name, choices):
            self.calls[name] = tuple(choices)
            return choices[0]

    t = Trial()
    params = GllmParams(**GllmPolicy.search_space(t))
    assert t.calls["T"] == (1, 16) and t.calls["max_p"] == (512, 4096) and t.calls["kv_thresh"] == (0.0, 0.2)
    assert params.T == 1


@pytest.mark.parametrize("extra", [[], ["policy.rules=code"], ["policy.use_ut=false"], ["policy.use_wt=false"],
                                   ["policy.max_d=4"], ["policy.min_p=0"], ["policy.rules=code", "policy.min_p=0"]])
def test_every_request_finishes_once_under_preemption(extra):
    cfg = small_config("policy=gllm", "kv.num_blocks=40", "parallel.pp=4", "workload.rate=50",
                       "workload.num_requests=80", "workload.input_mean=128", "workload.output_mean=40", *extra)
    r = run_experiment(cfg)
    assert r.error is None
    assert r.summary["num_finished"] == 80 and r.summary["num_failed"] == 0
    assert r.summary["num_preemptions"] > 0
    assert all(x["status"] == "finished" and x["num_generated"] == x["output_len"] for x in r.requests)


def test_partial_prompts_holding_the_whole_cache_do_not_deadlock():
    # Two half-prefilled 64-token prompts hold all 4 blocks (gLLM allocates KV per chunk): neither
    # can continue, no decode can free KV. The latest admitted is recomputed, the other goes on.
    pol = GllmPolicy()
    ctrl, seqs = make_state(pol, pp=2, num_blocks=8, prefilling=[(64, 5, 32), (64, 5, 32)])
    for s in seqs:
        ctrl.kv.free(s.seq_id)
        ctrl.kv.allocate(s.seq_id, 32)
    ctrl.kv.allocate(999, 64)  # a stand-in for the rest of the cache: 4 of 8 blocks are left to the two
    assert ctrl.kv.num_free == 0
    mb = pol.schedule(ctrl.view)
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in mb.prefills] == [(0, 32, 32)]
    assert seqs[1].status.value == "preempted" and list(ctrl.waiting) == [seqs[1]]
