"""Timestamped spans of what each stage and link did, shared by both executors.

Busy time is summed per track for every span, so bubble ratio and utilisation cover the whole
run; the spans themselves are kept only for the first `max_spans` (default 200,000, about 60 MB
of Python tuples) because a Perfetto trace of a 50,000-micro-batch run is unreadable anyway.
The summary records how many spans were dropped, so a truncated trace is never silent.

Every busy span of a stage track (`stageN`) also goes to the tracer's `StageLedger`, whatever
the span sampling keeps: time per span name and each idle gap before a busy span, which
`engine/core/breakdown.py` turns into where each stage's wall time went.
"""
from __future__ import annotations

import json
import math
from array import array
from pathlib import Path

TRANSFER_NAMES = ("send",)  # busy spans that are a transfer on the stage's own track (breakdown's `transfer`)


class TrackLedger:
    """One stage track's part of the `StageLedger`: busy seconds by span name, the idle gaps as
    typed columns (end of the previous busy span `gap_a`, start of the next `gap_b`, its
    micro-batch `gap_mb`, whether that span is a send `gap_send`), the first busy span (start,
    micro-batch, name) and the end of the latest. Columns, not a tuple per gap: the 5,000-request
    benchmark logs 107k gaps, which as tuples held 18 MB of its peak and cost the garbage
    collector their traversal; as columns they hold 2.7 MB. The simulator's FIFO path fills them
    in bulk (`extend_gaps`)."""

    __slots__ = ("parts", "gap_a", "gap_b", "gap_mb", "gap_send", "first", "last")

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self.gap_a = array("d")
        self.gap_b = array("d")
        self.gap_mb = array("q")
        self.gap_send = array("b")
        self.first: tuple[float, int, str] | None = None
        self.last = -math.inf

    @property
    def num_gaps(self) -> int:
        return len(self.gap_b)

    def gaps(self) -> list[tuple[float, float, int, bool]]:
        """The gaps as rows (a, b, mb_id, is_send): for tests and inspection, not the hot path."""
        return list(zip(self.gap_a, self.gap_b, self.gap_mb, map(bool, self.gap_send)))

    def trim_to_whole_rows(self) -> int:
        """Drop a gap that is in some columns only; the number of columns cut. A stop signal
        raises in the main thread between any two bytecodes, so a stopped run can leave a gap
        half-appended: one bulk `extend_gaps` stopped after its first column left 44,178 ends
        beside 39,868 starts, and the breakdown of the saved partial run failed (the fresh-clone
        CI's repeated-signals test)."""
        return trim_columns(self.gap_a, self.gap_b, self.gap_mb, self.gap_send)


class StageLedger:
    """Per stage track: busy time by span name, and every idle gap (from the end of the stage's
    previous work to the start of its next busy span) with the micro-batch and span name that end
    it. Gaps past `max_gaps` per track are counted in `overflow` (a server's endless run), never
    silently."""

    __slots__ = ("tracks", "max_gaps", "overflow")

    def __init__(self, max_gaps: int = 500_000) -> None:
        self.tracks: dict[str, TrackLedger] = {}
        self.max_gaps = max_gaps
        self.overflow = 0

    def track(self, name: str) -> TrackLedger:
        tl = self.tracks.get(name)
        if tl is None:
            tl = self.tracks[name] = TrackLedger()
        return tl

    def gap(self, tl: TrackLedger, start: float, mb_id: int, name: str) -> None:
        """`start` is later than the track's latest end: its first span, or an idle gap."""
        if tl.first is None:
            tl.first = (start, mb_id, name)
        elif len(tl.gap_b) < self.max_gaps:
            tl.gap_a.append(tl.last)
            tl.gap_b.append(start)
            tl.gap_mb.append(mb_id)
            tl.gap_send.append(name in TRANSFER_NAMES)
        else:
            self.overflow += 1

    def extend_gaps(self, tl: TrackLedger, a, b, mb, name: str) -> None:
        """`gap` for each (a[i], b[i], mb[i]) in order (numpy arrays), all ending in a span called
        `name`: the first row of a track that has not worked yet is its first span."""
        import numpy as np

        if tl.first is None and len(b):
            tl.first = (float(b[0]), int(mb[0]), name)
            a, b, mb = a[1:], b[1:], mb[1:]
        room = max(0, self.max_gaps - len(tl.gap_b))
        if len(b) > room:
            self.overflow += len(b) - room
            a, b, mb = a[:room], b[:room], mb[:room]
        tl.gap_a.frombytes(np.ascontiguousarray(a, dtype=np.float64).tobytes())
        tl.gap_b.frombytes(np.ascontiguousarray(b, dtype=np.float64).tobytes())
        tl.gap_mb.frombytes(np.ascontiguousarray(mb, dtype=np.int64).tobytes())
        tl.gap_send.frombytes(np.full(len(b), name in TRANSFER_NAMES, dtype=np.int8).tobytes())

    def trim_to_whole_rows(self) -> int:
        """`TrackLedger.trim_to_whole_rows` for every track: after a stop, before the breakdown."""
        return sum(tl.trim_to_whole_rows() for tl in self.tracks.values())

    def add(self, track: str, name: str, start: float, end: float, mb_id: int) -> None:
        tl = self.tracks.get(track) or self.track(track)
        if start > tl.last:
            self.gap(tl, start, mb_id, name)
        if end > tl.last:
            tl.last = end
        parts = tl.parts
        parts[name] = parts.get(name, 0.0) + (end - start)


def trim_columns(*columns) -> int:
    """Cut every column to the shortest one's length (the rows written whole); how many were cut."""
    n = min(len(c) for c in columns)
    cut = 0
    for c in columns:
        if len(c) > n:
            del c[n:]
            cut += 1
    return cut


def is_stage_track(track: str) -> bool:
    """`stage0`, `stage1`, ...: not `stage0.cpu` (overlapped preparation) nor links or samplers."""
    return track.startswith("stage") and track[5:].isdigit()


class Tracer:
    def __init__(self, max_spans: int = 200_000) -> None:
        self.max_spans = max_spans
        self.spans: list[tuple[str, str, float, float, int]] = []  # track, name, start, end, mb_id
        self.busy: dict[str, float] = {}
        self.dropped = 0
        self.ledger = StageLedger()
        self._ledgered: dict[str, bool] = {}  # track -> is a stage track (asked once per track)

    def ledgers(self, track: str) -> bool:
        known = self._ledgered.get(track)
        if known is None:
            known = self._ledgered[track] = is_stage_track(track)
        return known

    def keeps(self, mb_id: int) -> bool:
        """Whether the spans of micro-batch `mb_id` are kept (busy time always counts); subclasses
        sample (testbed/run/outputs.py)."""
        return True

    def span(self, track: str, name: str, start: float, end: float, mb_id: int = -1,
             busy: bool = True) -> None:
        """Record one span; `busy=False` for waits, which are traced but not counted as work."""
        if busy:
            total = self.busy
            total[track] = total.get(track, 0.0) + (end - start)
            if self.ledgers(track):
                self.ledger.add(track, name, start, end, mb_id)
        if not self.keeps(mb_id):
            return
        spans = self.spans
        if len(spans) < self.max_spans:
            spans.append((track, name, start, end, mb_id))
        else:
            self.dropped += 1

    def chain(self, track: str, start: float, parts: tuple[tuple[str, float], ...], mb_id: int = -1) -> float:
        """Busy spans back to back on one track from `start`, one per (name, duration); returns
        the end. The same records and sums as one `span` each; one call per stage start in the
        simulator instead of two or three (its 180k stage starts in the 5,000-request benchmark)."""
        total = self.busy
        spans = self.spans
        keep = self.keeps(mb_id)
        busy = total.get(track, 0.0)
        ledger = self.ledger if self.ledgers(track) else None
        t = start
        for name, duration in parts:
            end = t + duration
            busy += end - t
            if ledger is not None:
                ledger.add(track, name, t, end, mb_id)
            if not keep:
                pass
            elif len(spans) < self.max_spans:
                spans.append((track, name, t, end, mb_id))
            else:
                self.dropped += 1
            t = end
        total[track] = busy
        return t

    def busy_time(self, track: str) -> float:
        return self.busy.get(track, 0.0)

    def write_chrome_trace(self, path: Path, track_order: list[str] | None = None) -> None:
        """Chrome/Perfetto JSON: one thread per track (stage, link, sampler), times in us."""
        tracks = track_order or sorted({s[0] for s in self.spans})
        tids = {t: i for i, t in enumerate(tracks)}
        events: list[dict] = []
        for t, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": t}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid, "args": {"sort_index": tid}})
        for track, name, start, end, mb_id in self.spans:
            tid = tids.setdefault(track, len(tids))
            events.append({"ph": "X", "name": name, "pid": 0, "tid": tid, "ts": round(start * 1e6, 3),
                           "dur": round((end - start) * 1e6, 3), "args": {"mb": mb_id}})
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                    "otherData": {"dropped_spans": self.dropped}}))
