"""gLLM Token Throttling (SC'25; docs/policies.md#gllm): pipeline-balanced hybrid micro-batches.

Every micro-batch carries #D decode tokens and up to #P prefill tokens, both throttled so that
consecutive micro-batches carry similar work (a PP pipeline runs at the pace of its slowest
micro-batch):

- Prefill: no prefill at all while KV_free < KV_thresh; otherwise
      #P = max( min( #WP / #T , #MaxP * (KV_free - KV_thresh) / (1 - KV_thresh) ), #MinP )
  (#WP / #T rounded up, the KV term down, and never below one token while prompts wait).
  #WP: prompt tokens still to prefill (waiting and partially prefilled sequences, minus chunks
  already in flight); the "WT" term drains them over #T iterations instead of in bursts; the
  "UT" term shrinks prefill as the KV cache fills so decodes keep room to grow. #MaxP caps #P
  also when the UT term is switched off. Prompts are chunked (partial prompts first, then FCFS)
  and, as in gLLM, KV is allocated per chunk, not for the whole prompt at admission.
- Decode: #D = ceil(#RD / P) with the rounding remainder rotating between micro-batches: the
  k-th micro-batch of a round takes floor((#RD + P-1 - k mod P) / P), so P consecutive
  micro-batches take exactly #RD sequences and differ by at most one. #RD counts every sequence
  in the decode state, in flight or not. Capped by `max_d`; a free slot with idle decodes takes
  at least one (otherwise #RD < P would leave slots empty and, with nothing in flight, stall).
- Before the decodes are chosen, while free KV blocks < #D, the most recently admitted idle
  decode sequence is preempted (recompute), as the public code does.

`rules="code"` switches to the public code where it differs from the paper: #MinP floors only
the WT term (the UT term and a page cap of block_size * (free - thresh) blocks still bound #P),
the WT term is used only when more than one sequence waits, #RD also counts every sequence of
the in-flight micro-batches (prefill chunks too), the offset is random (seeded), and #RD < P
gives #D = 1.

Differences forced by the engine or needed for liveness: a sequence is never in two in-flight
micro-batches, so a long prompt advances one chunk per pipeline round (gLLM's code pipelines
consecutive chunks of one prompt); with nothing in flight, an empty batch lets `max(min_p, 1)`
prefill tokens through despite the cut-off, and partial prompts that hold the whole cache (KV is
per chunk) are broken by recomputing the latest admitted one, where gLLM's code would hang.

Measured in the simulator (Azure conv, Qwen2.5-32B on 4 x L20, 1,000 requests): maximum
throughput 3,489 tok/s against 1,578 for Sarathi at budget 2,048; "w/o UT" 2,487; "w/o WT"
keeps the maximum but doubles TPOT at 1 req/s (283 vs 142 ms).

Ablations named in the paper: `use_wt=false` ("w/o WT": drop the #WP/#T term), `use_ut=false`
("w/o UT": drop the KV_free term; the KV_thresh cut-off stays), and "w/ CK" (Sarathi's chunked
prefill on gLLM's runtime), which is `policy=sarathi` (token_budget=2048 in gLLM's comparison).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.core.batch import BatchBuilder
from engine.base.errors import bad_value
from engine.core.policy import Policy, SchedulerView, register_policy
from engine.core.request import SeqStatus, Sequence
from policies.common import IdleOrder, fill_chunked_prefills

RULES = ("paper", "code")


@dataclass(frozen=True)
class GllmParams:
    T: int = 8  # #T (gLLM's --iterp): iterations over which waiting prefill tokens are drained
    max_p: int = 2048  # #MaxP: prefill tokens per micro-batch at an empty KV cache
    min_p: int = 32  # #MinP: floor of #P (the paper measured < 2% effect)
    kv_thresh: float = 0.05  # KV_thresh: free-KV fraction below which no prefill is scheduled
    max_d: int | None = None  # cap on decode sequences per micro-batch (gLLM's --maxd); None = no cap
    use_wt: bool = True  # False = the paper's "w/o WT" ablation
    use_ut: bool = True  # False = the paper's "w/o UT" ablation
    rules: str = "paper"  # paper | code (see the module docstring)
    seed: int = 0  # rules=code only: the random decode offset

    def __post_init__(self) -> None:
        if self.T < 1:
            raise bad_value("policy.T", self.T, "must be >= 1")
        if self.max_p < 1:
            raise bad_value("policy.max_p", self.max_p, "must be >= 1")
        if not 0 <= self.min_p <= self.max_p:
            raise bad_value("policy.min_p", self.min_p, f"must be in [0, policy.max_p={self.max_p}]")
        if not 0.0 <= self.kv_thresh < 1.0:
            raise bad_value("policy.kv_thresh", self.kv_thresh, "must be in [0, 1)")
        if self.max_d is not None and (isinstance(self.max_d, bool) or not isinstance(self.max_d, int)
                                       or self.max_d < 1):
            raise bad_value("policy.max_d", self.max_d, "must be an integer >= 1 or null (no cap)")
        if self.rules not in RULES:
            raise bad_value("policy.rules", self.rules, f"must be one of {', '.join(RULES)}")


def prefill_budget(p: GllmParams, wp: int, kv_free: float, *, num_waiting_seqs: int = 2,
                   free_blocks: int | None = None, total_blocks: int | None = None, block_size: int = 16) -> int:
    """#P for `wp` waiting prompt tokens at free-KV fraction `kv_free` (the formula in the module
    docstring; `rules="code"` also needs the block counts for its page cap)."""
    if wp <= 0:
        return 0
    ut = p.max_p * (kv_free - p.kv_thresh) / (1.0 - p.kv_thresh)
    if p.rules == "paper":
        if kv_free < p.kv_thresh:
            return 0
        terms = [p.max_p]
        if p.use_wt:
            terms.append(math.ceil(wp / p.T))  # ceil: the queue drains within T iterations
        if p.use_ut:
            terms.append(math.floor(ut))
        # At least one token: with min_p=0 a rounded-down term would otherwise starve a short
        # prompt forever (and stall a run with nothing else to do).
        return max(min(terms), p.min_p, 1)
    # rules == "code"
    if free_blocks is None or total_blocks is None:
        raise ValueError("rules=code needs free_blocks and total_blocks")
    budget = block_size * max(free_blocks - int(p.kv_thresh * total_blocks), 0)
    if budget == 0:
        return 0
    budget = min(round(max(ut, 0.0)) if p.use_ut else p.max_p, budget)
    if p.use_wt and num_waiting_seqs > 1:
        budget = min(max(wp // p.T, p.min_p), budget)
    return max(budget, 1)  # as above; the public code would schedule nothing here


def decode_budget(rd: int, depth: int, offset: int, max_d: int | None = None) -> int:
    """#D = floor((rd + offset) / depth) for offset in [0, depth): over `depth` micro-batches with
    offsets depth-1, ..., 0 the sizes are ceil/floor of rd/depth and sum to exactly rd."""
    d = (rd + offset) // depth
    return d if max_d is None else min(d, max_d)


@register_policy("gllm")
class GllmPolicy(Policy):
    Params = GllmParams

    def __init__(self, params=None) -> None:
        super().__init__(params)
        self._round = 0  # micro-batches formed so far (drives the rotating offset)
        self._idle = IdleOrder()
        self._rng = np.random.default_rng(self.params.seed)
        self.last_budgets: tuple[int, int] = (0, 0)  # (#P, #D) of the last micro-batch, for tests/traces

    @classmethod
    def search_space(cls, trial) -> dict:
        # The paper's sensitivity ranges: #T 1..16, #MaxP 512..4096, KV_thresh 0..0.2, #MinP small.
        return {"T": trial.suggest_int("T", 1, 16),
                "max_p": trial.suggest_int("max_p", 512, 4096, step=256),
                "min_p": trial.suggest_categorical("min_p", [0, 16, 32, 64, 128]),
                "kv_thresh": trial.suggest_float("kv_thresh", 0.0, 0.2)}

    # --- the two budgets from the view -----------------------------------------------------------
    def budgets(self, view: SchedulerView) -> tuple[int, int]:
        """(#P, #D) for the next micro-batch in this state (does not advance the rotation)."""
        return self._budgets(view, *_split_running(view))

    def _budgets(self, view: SchedulerView, num_decoding: int, idle: list[Sequence],
                 partial: list[Sequence]) -> tuple[int, int]:
        p = self.params
        inflight_chunk: dict[int, int] = {}
        inflight_seqs = 0
        for mb in view.inflight:
            inflight_seqs += mb.num_seqs
            for c in mb.prefills:
                inflight_chunk[c.seq.seq_id] = c.num_tokens
        wp = view.waiting_prefill_tokens
        num_waiting = len(view.waiting)
        for s in partial:  # every running prefilling sequence, in flight or not
            wp += s.remaining_prefill - inflight_chunk.get(s.seq_id, 0)
        num_waiting += len(partial)
        rd = num_decoding
        idle_decodes = len(idle)
        pb = prefill_budget(p, wp, view.kv_free_fraction, num_waiting_seqs=num_waiting,
                            free_blocks=view.kv_free_blocks, total_blocks=view.kv_total_blocks,
                            block_size=view.block_size)
        P = self.max_inflight(view)  # the micro-batches the decodes are spread over (P by default)
        if p.rules == "paper":
            db = decode_budget(rd, P, P - 1 - self._round % P, p.max_d)
        else:
            rd = idle_decodes + inflight_seqs
            db = 1 if rd < P else decode_budget(rd, P, int(self._rng.integers(0, P)), p.max_d)
        if db == 0 and idle_decodes:
            db = 1  # never leave a free slot empty while a decode could run in it
        return pb, db

    # --- the hook ----------------------------------------------------------------------------------
    def schedule(self, view: SchedulerView):
        mb = self._compose(view)
        if mb is None and not view.num_inflight and view.num_running + len(view.waiting):
            mb = self._compose(view)  # a preemption-only decision changed the state: look again
        return mb

    def _compose(self, view: SchedulerView):
        num_decoding, idle, prefilling = _split_running(view)  # one scan of the running set serves all
        pb, db = self._budgets(view, num_decoding, idle, prefilling)
        b = view.new_batch()
        if db and idle:
            self._preempt_for(b, idle, min(db, len(idle)))
            self._idle.sort(idle)  # longest idle first
            b.add_decodes(idle, db)  # until #D decodes or the first that does not fit
        if b.preempted:  # the prefill budget sees the KV this batch just freed
            pb = self._prefill_after_preemption(view, b)
        fill_chunked_prefills(b, view, pb, [s for s in prefilling if not s.in_flight])
        if b.is_empty() and not view.num_inflight:
            # Liveness: below KV_thresh with no decode to run and nothing in flight, no KV will
            # ever be freed; let a little prefill through (partial prompts first) instead of
            # stalling. gLLM's formula has no such case; its code would hang here too.
            fill_chunked_prefills(b, view, max(self.params.min_p, 1))
            partial = sorted((s for s in view.running if s.status is SeqStatus.PREFILLING and s not in b),
                             key=lambda s: s.admit_order)
            if b.is_empty() and len(partial) > 1:
                # Chunk-only KV allocation can deadlock: partial prompts hold the whole cache and
                # none can finish. Recompute the latest admitted one (the retry then proceeds).
                b.preempt(partial[-1])
        mb = view.finish(b)
        if mb is not None:
            mb.tags["P"], mb.tags["D"] = pb, db
            self.last_budgets = (pb, db)
            self._round += 1
        return mb

    def _prefill_after_preemption(self, view: SchedulerView, b: BatchBuilder) -> int:
        """#P with the KV a batch's preemptions free, over the prompts that batch may still take."""
        total = view.kv_total_blocks
        partial = [s for s in view.running if s.status is SeqStatus.PREFILLING and not s.in_flight and s not in b]
        if b.prefills:
            waiting = [s for s in view.waiting if s not in b]
            wp = sum(s.remaining_prefill for s in waiting)
            num_left = len(waiting)
        else:  # only a prefill puts a waiting sequence in a batch: all wait, and their sum is kept
            wp = view.waiting_prefill_tokens  # (O(1) instead of a scan of up to 5,000 prompts)
            num_left = len(view.waiting)
        wp += sum(s.remaining_prefill for s in partial)
        return prefill_budget(self.params, wp, b.free_blocks / total, num_waiting_seqs=num_left + len(partial),
                              free_blocks=b.free_blocks, total_blocks=total, block_size=view.block_size)

    @staticmethod
    def _preempt_for(b: BatchBuilder, idle: list[Sequence], need: int) -> None:
        """While free blocks < `need` (the decodes about to be added), preempt the most recently
        admitted idle decode sequence."""
        if b.free_blocks >= need:
            return  # the common case: no victim needed, so skip the sort (5.8% of a benchmark run in py-spy)
        victims = sorted(idle, key=lambda s: s.admit_order)
        while b.free_blocks < need and victims:
            victim = victims.pop()
            b.preempt(victim)
            idle.remove(victim)
            need = min(need, len(idle))

    def on_complete(self, view: SchedulerView, micro_batch, finished) -> None:
        self._idle.on_complete(micro_batch, finished)


def _split_running(view: SchedulerView) -> tuple[int, list[Sequence], list[Sequence]]:
    """(number decoding, idle decoding, prefilling) running sequences, the lists in admission
    order, once per micro-batch: one scan of the running set for the idle decodes; the count and
    the prefilling ones are the controller's (`view.num_decoding`, `view.prefilling`). Three
    comprehensions over the running set before (12% of the 5,000-request benchmark, py-spy)."""
    decoding = SeqStatus.DECODING
    idle = [s for s in view.running if not s.in_flight and s.status is decoding]
    return view.num_decoding, idle, list(view.prefilling)

