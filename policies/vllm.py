"""Separate batching, the "PP+SB" baseline: vLLM's classic (v0) scheduler (SOSP'23; docs/policies.md#vllm).

A micro-batch is prefill-only (whole prompts, up to `max_num_batched_tokens` and
`max_num_seqs`) whenever waiting prompts fit in KV; otherwise decode-only. Prefill first.

vLLM runs PP with one scheduler per "virtual engine" (one per stage): each micro-batch slot has
its own running set, so the P in-flight batches hold disjoint sequences and similar sizes.
`virtual_engines=true` (default) models that: a sequence belongs to the virtual engine that
admitted it, and a free slot is served by a virtual engine with nothing in flight. With
`virtual_engines=false` one scheduler serves every slot and takes every idle decode at once,
which starves the other slots (the PP pitfall of vllm issue 41682) -- kept as a switch to show it.
A prompt longer than `max_num_batched_tokens` is admitted alone rather than never.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.batch import MicroBatch
from engine.base.errors import bad_value
from engine.core.policy import Policy, SchedulerView, register_policy
from engine.core.request import SeqStatus, Sequence
from policies.common import add_decode_or_preempt


@dataclass(frozen=True)
class VllmParams:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256  # vLLM's default, per virtual engine
    virtual_engines: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise bad_value("policy.max_num_batched_tokens", self.max_num_batched_tokens, "must be >= 1")
        if self.max_num_seqs < 1:
            raise bad_value("policy.max_num_seqs", self.max_num_seqs, "must be >= 1")


@register_policy("vllm")
class VllmPolicy(Policy):
    Params = VllmParams

    def __init__(self, params=None) -> None:
        super().__init__(params)
        self._engine_of: dict[int, int] = {}  # seq id -> virtual engine that admitted it
        self._members: dict[int, dict[int, Sequence]] = {}  # engine -> its running seqs, admission order
        self._busy: set[int] = set()  # virtual engines with a micro-batch in flight
        self._next = 0  # round-robin start

    @classmethod
    def search_space(cls, trial) -> dict:
        return {"max_num_batched_tokens": trial.suggest_categorical("max_num_batched_tokens", [2048, 4096, 8192, 16384]),
                "max_num_seqs": trial.suggest_categorical("max_num_seqs", [64, 128, 256, 512])}

    def schedule(self, view: SchedulerView):
        """Serve the first idle virtual engine (round robin) that has work; an engine with
        nothing to do must not block another whose sequences hold the KV."""
        p = self.params
        engines = self.num_engines(view) if p.virtual_engines else 1
        for i in range(engines):
            ve = (self._next + i) % engines
            if ve in self._busy:
                continue
            mb = self._schedule_engine(view, ve)
            if mb is not None:
                self._next = (ve + 1) % engines
                mb.tags["ve"] = ve
                if p.virtual_engines:
                    self._busy.add(ve)
                return mb
        return None

    def num_engines(self, view: SchedulerView) -> int:
        """One virtual engine per micro-batch slot (vLLM: one per stage, P by default)."""
        return self.max_inflight(view)

    def _schedule_engine(self, view: SchedulerView, ve: int):
        p = self.params
        if p.virtual_engines:
            decoding, prefilling = SeqStatus.DECODING, SeqStatus.PREFILLING  # `is_running`, inlined
            mine = [s for s in self._members.setdefault(ve, {}).values()
                    if (st := s.status) is decoding or st is prefilling]
        else:
            mine = [s for s in view.running if not s.in_flight]
        mb = self._prefill_batch(view, ve, len(mine) if p.virtual_engines else view.num_running)
        return mb if mb is not None else self._decode_batch(view, mine)

    def _prefill_batch(self, view: SchedulerView, ve: int, running: int) -> MicroBatch | None:
        p = self.params
        b = view.new_batch()
        b.tags["phase"] = "prefill"
        for seq in view.waiting:
            if running >= p.max_num_seqs:
                break
            n = seq.remaining_prefill
            if b.num_prefill_tokens + n > p.max_num_batched_tokens and b.num_seqs > 0:
                break
            if not b.add_prefill(seq, n, reserve_tokens=seq.prefill_target):
                break
            self._admit(seq, ve)
            running += 1
        return view.finish(b)

    def _decode_batch(self, view: SchedulerView, mine: list[Sequence]) -> MicroBatch | None:
        b = view.new_batch()
        b.tags["phase"] = "decode"
        decoding = SeqStatus.DECODING
        decodes = [s for s in mine if s.status is decoding]
        first = b.add_decodes(decodes, self.params.max_num_seqs)  # all that fit in one call, the common case
        victims = list(mine) if first < len(decodes) else []  # preemption candidates: the slow path only
        for seq in decodes[first:]:
            if b.num_decode_seqs >= self.params.max_num_seqs:
                break
            if seq not in b:
                add_decode_or_preempt(b, seq, victims)
        return view.finish(b)

    def _admit(self, seq: Sequence, ve: int) -> None:
        old = self._engine_of.get(seq.seq_id)
        if old is not None:  # re-admitted after preemption: move to the new engine, at the end
            self._members[old].pop(seq.seq_id, None)
        self._engine_of[seq.seq_id] = ve
        self._members.setdefault(ve, {})[seq.seq_id] = seq

    def on_abort(self, view: SchedulerView, seq: Sequence) -> None:
        ve = self._engine_of.pop(seq.seq_id, None)
        if ve is not None:
            self._members[ve].pop(seq.seq_id, None)

    def on_complete(self, view: SchedulerView, micro_batch: MicroBatch, finished) -> None:
        self._busy.discard(micro_batch.tags.get("ve"))
        for seq in finished:
            ve = self._engine_of.pop(seq.seq_id, None)
            if ve is not None:
                self._members[ve].pop(seq.seq_id, None)
