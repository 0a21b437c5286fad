"""A newcomer's policy in one file, as `docs/writing-a-policy.md` describes: first-come
first-served with a fixed micro-batch size. The conformance suite runs it beside the seed
policies, so a policy written only against `engine/core/policy.py` gets the same checks for free."""
from __future__ import annotations

from dataclasses import dataclass

from engine.base.errors import bad_value
from engine.core.policy import Policy, register_policy
from policies.common import add_decode_or_preempt, fill_prefills, idle_decodes


@dataclass(frozen=True)
class ToyParams:
    max_seqs: int = 16  # sequences per micro-batch (decodes first)
    chunk_tokens: int = 256  # prefill tokens per micro-batch

    def __post_init__(self) -> None:
        if self.max_seqs < 1 or self.chunk_tokens < 1:
            raise bad_value("policy.max_seqs", self.max_seqs, "max_seqs and chunk_tokens must be >= 1")


@register_policy("toy_fcfs")
class ToyFcfsPolicy(Policy):
    Params = ToyParams

    @classmethod
    def search_space(cls, trial) -> dict:
        return {"max_seqs": trial.suggest_int("max_seqs", 4, 64)}

    def schedule(self, view):
        b = view.new_batch()
        victims = [s for s in view.running if not s.in_flight]
        for seq in idle_decodes(view)[:self.params.max_seqs]:
            if seq not in b:
                add_decode_or_preempt(b, seq, victims)
        fill_prefills(b, view, self.params.chunk_tokens, max_num_seqs=10_000)
        return view.finish(b)
