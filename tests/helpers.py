"""Hand-built controller states for policy unit tests."""
from __future__ import annotations

from engine.core.controller import Controller
from engine.pricing.costmodel import CostModel
from engine.core.executor import Completion, Executor
from engine.pricing.hardware import get_hardware
from engine.core.kv import BlockManager
from engine.pricing.models import get_model
from engine.core.request import Request, SeqStatus
from engine.core.trace import Tracer


class ManualExecutor(Executor):
    """Launches nothing by itself: tests complete micro-batches when they choose."""

    def __init__(self, pipeline_depth: int) -> None:
        self.pipeline_depth = pipeline_depth
        self.tracer = Tracer()
        self.launched = []
        self.clock = 0.0

    def launch(self, mb):
        self.launched.append(mb)

    def next_completion(self, deadline=None):
        return None

    def now(self):
        return self.clock

    def wait_until(self, t):
        self.clock = max(self.clock, t)


def make_state(policy, *, pp=2, num_blocks=1000, block_size=16, decoding=(), prefilling=(), waiting=()):
    """A controller whose sequences are already in the given states.

    `decoding`: (prompt_len, output_len, generated) per sequence, admitted in that order;
    `prefilling`: (prompt_len, output_len, computed); `waiting`: (prompt_len, output_len).
    """
    reqs, rid = [], 0
    for group in (decoding, prefilling, waiting):
        for spec in group:
            reqs.append(Request(rid, 0.0, spec[0], spec[1]))
            rid += 1
    ex = ManualExecutor(pp)
    cost = CostModel(get_model("llama2-13b"), get_hardware("a100-80g"), pp=pp)
    ctrl = Controller(reqs, policy, ex, BlockManager(num_blocks, block_size), cost_model=cost)
    ctrl._admit_arrivals(0.0)
    seqs = [ctrl.sequences[r.request_id] for r in reqs]
    i = 0
    for prompt, out, gen in decoding:
        s = seqs[i]; i += 1
        ctrl.waiting.remove(s)
        s.status, s.num_generated, s.num_computed = SeqStatus.DECODING, gen, prompt + gen - 1
        s.last_token_s = 0.0  # its latest token came at the start (the time between tokens needs one)
        s.admit_order = ctrl._admit_counter; ctrl._admit_counter += 1
        ctrl.running[s.seq_id] = s
        ctrl.num_decoding += 1
        ctrl.kv.allocate(s.seq_id, s.num_computed)
    for prompt, out, computed in prefilling:
        s = seqs[i]; i += 1
        ctrl.waiting.remove(s)
        s.status, s.num_computed = SeqStatus.PREFILLING, computed
        s.admit_order = ctrl._admit_counter; ctrl._admit_counter += 1
        ctrl.running[s.seq_id] = s
        ctrl.prefilling[s.seq_id] = s
        ctrl.kv.allocate(s.seq_id, prompt)
    ctrl.waiting_prefill_tokens = sum(s.remaining_prefill for s in ctrl.waiting)
    return ctrl, seqs
