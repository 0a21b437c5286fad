"""Building blocks shared by the seed policies, one definition each.

- `idle_decodes(view)`: decoding sequences not in any in-flight micro-batch (the ones a free
  slot may take), in admission order.
- `IdleOrder`: longest-idle-first ordering of those, for policies that take only part of them
  (gLLM, TD-Pipe): picking the sequences that returned longest ago keeps every sequence's TPOT
  even instead of starving the latest admitted.
- `add_decode_or_preempt`: a decode that cannot get a KV slot preempts the latest admitted
  candidate (vLLM's and Sarathi-Serve's recompute rule).
- `fill_prefills` (Sarathi-Serve: the whole prompt's KV reserved at admission, `max_num_seqs`
  cap) and `fill_chunked_prefills` (gLLM: KV for the chunk only): partial prompts first, then
  waiting requests first-come first-served.
"""
from __future__ import annotations

from operator import attrgetter

from engine.core.batch import BatchBuilder
from engine.core.policy import SchedulerView
from engine.core.request import SeqStatus, Sequence


def idle_decodes(view: SchedulerView) -> list[Sequence]:
    """Decoding sequences not in flight, in admission order."""
    decoding = SeqStatus.DECODING
    return [s for s in view.running if s.status is decoding and not s.in_flight]


class IdleOrder:
    """Remembers when each decoding sequence last returned from the pipeline.

    The order is (completion counter when it last returned, admission order), -1 for a sequence
    that never returned. `sort` runs two stable sorts on C-level keys (admission order, then
    the counter, read by the stamp dict's own lookup) instead of one on a Python lambda building a
    tuple per idle decode: the lambda, the sort and the stamping were 20% of gLLM's
    5,000-request benchmark (py-spy). Stamps are keyed by the sequence itself and hold the
    shared counter object, so stamping a returned batch allocates nothing."""

    def __init__(self) -> None:
        self._stamp = _Stamps()  # sequence -> completion counter when it last returned
        self._completions = 0

    def on_complete(self, micro_batch, finished) -> None:
        self._completions += 1
        stamp, now, decoding = self._stamp, self._completions, SeqStatus.DECODING
        for chunk in micro_batch.prefills:  # micro_batch.sequences() without building the list
            if chunk.seq.status is decoding:
                stamp[chunk.seq] = now
        for seq in micro_batch.decodes:
            if seq.status is decoding:
                stamp[seq] = now
        for seq in finished:
            stamp.pop(seq, None)

    def sort(self, seqs: list) -> None:
        """In place: longest idle first, then admission order."""
        seqs.sort(key=_admit_order)
        seqs.sort(key=self._stamp.__getitem__)  # stable: ties keep admission order


_admit_order = attrgetter("admit_order")


class _Stamps(dict):
    """`IdleOrder`'s stamps; a sequence that never returned reads -1 (before every completion)."""

    __slots__ = ()

    def __missing__(self, seq: Sequence) -> int:
        return -1


def add_decode_or_preempt(b: BatchBuilder, seq: Sequence, victims: list[Sequence]) -> bool:
    """Add `seq` as a decode, preempting from the end of `victims` (latest admitted first) until
    its KV slot fits; if `seq` itself is the last candidate it is preempted. True if added."""
    while not b.add_decode(seq):
        victim = None
        while victims:
            cand = victims.pop()
            if cand not in b and not cand.in_flight:
                victim = cand
                break
        if victim is None or victim is seq:
            if seq not in b:
                b.preempt(seq)
            return False
        b.preempt(victim)
    return True


def fill_prefills(b: BatchBuilder, view: SchedulerView, budget: int, max_num_seqs: int,
                  partial: list[Sequence] | None = None) -> int:
    """Sarathi's prefill part: continue partial prompts, then admit new requests FCFS while
    their whole prompt fits in KV and the running set is under `max_num_seqs`. Returns the
    budget left. `partial`: the running prefilling sequences not in flight (admission order)
    if the caller has them, which spares a scan of the whole running set."""
    prefilling = SeqStatus.PREFILLING
    for seq in view.running if partial is None else partial:
        if budget <= 0:
            return 0
        if seq.status is prefilling and not seq.in_flight and seq not in b:
            n = min(seq.remaining_prefill, budget)
            if b.add_prefill(seq, n):
                budget -= n
    running = view.num_running - len(b.preempted)
    for seq in view.waiting:
        if budget <= 0 or running >= max_num_seqs:
            break
        if seq in b:  # preempted in this very batch: recompute later
            continue
        n = min(seq.remaining_prefill, budget)
        if not b.add_prefill(seq, n, reserve_tokens=seq.prefill_target):
            break  # first-come first-served: do not let later requests jump the queue
        budget -= n
        running += 1
    return budget


def fill_chunked_prefills(b: BatchBuilder, view: SchedulerView, budget: int,
                          partial: list[Sequence] | None = None) -> int:
    """Chunked prefill within `budget` tokens: partial prompts first, then waiting requests FCFS;
    KV for the chunk only. Returns the budget left. `partial`: as for `fill_prefills`."""
    prefilling = SeqStatus.PREFILLING
    for seq in view.running if partial is None else partial:
        if budget <= 0:
            return 0
        if seq.status is prefilling and not seq.in_flight and seq not in b:
            n = min(seq.remaining_prefill, budget)
            if not b.add_prefill(seq, n):
                return budget
            budget -= n
    for seq in view.waiting:
        if budget <= 0:
            break
        if seq in b:  # preempted in this very batch
            continue
        n = min(seq.remaining_prefill, budget)
        if not b.add_prefill(seq, n):
            break  # FCFS: later requests do not jump the queue
        budget -= n
    return budget
