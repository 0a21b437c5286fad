"""Sarathi-Serve chunked prefill, the "PP+HB" baseline (OSDI'24; docs/policies.md#sarathi).

Hybrid micro-batches under a fixed token budget: first every running decode that is not in
flight (one token each), then chunks of partially prefilled prompts, then new requests while
their whole prompt's KV fits and the running set is under `max_num_seqs`. A decode that cannot
get a KV slot preempts the most recently admitted running sequence (recompute). In PP a
sequence is never in two in-flight micro-batches, so each free slot gets the sequences the
others do not hold.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.base.errors import bad_value
from engine.core.policy import Policy, SchedulerView, register_policy
from engine.core.request import SeqStatus
from policies.common import add_decode_or_preempt, fill_prefills


@dataclass(frozen=True)
class SarathiParams:
    token_budget: int = 2048  # gLLM compared against Sarathi at 2048; Sarathi-Serve also used 512
    max_num_seqs: int = 128

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise bad_value("policy.token_budget", self.token_budget, "must be >= 1")
        if self.max_num_seqs < 1:
            raise bad_value("policy.max_num_seqs", self.max_num_seqs, "must be >= 1")


@register_policy("sarathi")
class SarathiPolicy(Policy):
    Params = SarathiParams

    @classmethod
    def search_space(cls, trial) -> dict:
        return {"token_budget": trial.suggest_categorical("token_budget", [256, 512, 1024, 2048, 4096]),
                "max_num_seqs": trial.suggest_categorical("max_num_seqs", [64, 128, 256, 512])}

    def schedule(self, view: SchedulerView):
        p = self.params
        b = view.new_batch()
        budget = p.token_budget
        decoding = SeqStatus.DECODING
        decodes = [s for s in view.running if not s.in_flight and s.status is decoding]
        partial = [s for s in view.prefilling if not s.in_flight]  # kept by the controller: no scan
        # Every idle decode in one call while they fit (the common case), then one at a time
        # with preemption: the same batch at 2/3 of the CPU per decode (BatchBuilder.add_decodes).
        first = b.add_decodes(decodes, budget)
        budget -= b.num_decode_seqs
        # Preemption candidates only when a decode did not fit (the builder mutates nothing, so
        # this is the set as it was before the batch): one scan fewer per micro-batch.
        victims = [s for s in view.running if not s.in_flight] if first < len(decodes) else []
        for seq in decodes[first:]:
            if budget <= 0:
                break
            if seq in b:  # preempted to make room for an earlier decode
                continue
            if b.add_decode(seq) or add_decode_or_preempt(b, seq, victims):
                budget -= 1
        fill_prefills(b, view, budget, p.max_num_seqs, partial)
        return view.finish(b)
