"""The controller's per-micro-batch records, kept as columns.

One record per completed micro-batch: 45k of them in the 5,000-request benchmark. As objects
(a slotted dataclass plus a boxed int or float per field) they held 9.8 MB of the run's peak
memory; as typed arrays they hold 3.6 MB. Reading gives `MicroBatchRecord` objects made on
access, so callers iterate and index them as a list of records.
"""
from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from engine.core.trace import trim_columns


@dataclass(slots=True)
class MicroBatchRecord:
    """One row of the per-micro-batch table."""

    mb_id: int
    scheduled_s: float
    completed_s: float
    kind: str
    num_prefill_tokens: int
    num_decode_seqs: int
    num_seqs: int
    num_preempted: int
    kv_usage: float
    tags: Mapping = field(default_factory=dict)  # read-only, shared by records with equal tags (see `append`)


class MicroBatchRecords:
    """Append-only columns of `MicroBatchRecord` fields; a read-only sequence of records."""

    __slots__ = ("mb_id", "scheduled_s", "completed_s", "kind", "num_prefill_tokens", "num_decode_seqs",
                 "num_seqs", "num_preempted", "kv_usage", "tags", "_shared_tags")

    def __init__(self) -> None:
        self.mb_id = array("q")
        self.scheduled_s = array("d")
        self.completed_s = array("d")
        self.kind: list[str] = []  # three interned strings: one pointer a record
        self.num_prefill_tokens = array("q")
        self.num_decode_seqs = array("q")
        self.num_seqs = array("q")
        self.num_preempted = array("q")
        self.kv_usage = array("d")
        self.tags: list[Mapping] = []
        self._shared_tags: dict[tuple, Mapping] = {}  # the tags' items -> one read-only mapping

    def append(self, mb_id: int, scheduled_s: float, completed_s: float, kind: str, num_prefill_tokens: int,
               num_decode_seqs: int, num_seqs: int, num_preempted: int, kv_usage: float, tags: Mapping) -> None:
        self.mb_id.append(mb_id)
        self.scheduled_s.append(scheduled_s)
        self.completed_s.append(completed_s)
        self.kind.append(kind)
        self.num_prefill_tokens.append(num_prefill_tokens)
        self.num_decode_seqs.append(num_decode_seqs)
        self.num_seqs.append(num_seqs)
        self.num_preempted.append(num_preempted)
        self.kv_usage.append(kv_usage)
        if tags:  # one read-only mapping per distinct set of tags, not the batch's own dict per record:
            # gLLM tags every batch with its two budgets, and a capacity probe of the main setting (4,000
            # requests at 0.2 req/s, 597,519 micro-batches) held ~140 MB of such dicts
            key = tuple(tags.items())
            if all(type(v) is int or type(v) is str for _, v in key):  # equal means identical (not 1 vs True)
                shared = self._shared_tags.get(key)
                if shared is None:
                    shared = self._shared_tags[key] = MappingProxyType(dict(key))
                tags = shared
            else:  # other values: the record keeps a read-only view of its own copy
                tags = MappingProxyType(dict(tags))
        self.tags.append(tags)

    def __len__(self) -> int:
        return len(self.kind)

    def trim_to_whole_rows(self) -> int:
        """Drop a record that is in some columns only (a stop signal raised inside `append`); the
        number of columns cut. After a stop, before the run's tables and breakdown are read."""
        return trim_columns(*(getattr(self, name) for name in self.__slots__ if name != "_shared_tags"))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return MicroBatchRecord(self.mb_id[i], self.scheduled_s[i], self.completed_s[i], self.kind[i],
                                self.num_prefill_tokens[i], self.num_decode_seqs[i], self.num_seqs[i],
                                self.num_preempted[i], self.kv_usage[i], self.tags[i])

    def __iter__(self) -> Iterator[MicroBatchRecord]:
        return map(MicroBatchRecord, self.mb_id, self.scheduled_s, self.completed_s, self.kind,
                   self.num_prefill_tokens, self.num_decode_seqs, self.num_seqs, self.num_preempted,
                   self.kv_usage, self.tags)
