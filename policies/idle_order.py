"""Longest-idle-first ordering of decode sequences, shared by gLLM and TD-Pipe.

Both policies take only part of the idle decodes into a micro-batch; picking the sequences that
returned longest ago keeps every sequence's TPOT even instead of starving the latest admitted.
"""
from __future__ import annotations

from engine.request import SeqStatus


class IdleOrder:
    def __init__(self) -> None:
        self._stamp: dict[int, int] = {}  # seq id -> completion counter when it last returned
        self._completions = 0

    def on_complete(self, micro_batch, finished) -> None:
        self._completions += 1
        for seq in micro_batch.sequences():
            if seq.status is SeqStatus.DECODING:
                self._stamp[seq.seq_id] = self._completions
        for seq in finished:
            self._stamp.pop(seq.seq_id, None)

    def sort(self, seqs: list) -> None:
        """In place: longest idle first, then admission order."""
        seqs.sort(key=lambda s: (self._stamp.get(s.seq_id, -1), s.admit_order))
