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
from pathlib import Path


class TrackLedger:
    """One stage track's part of the `StageLedger`: busy seconds by span name, the idle gaps (end
    of the previous busy span, start of the next, its micro-batch, its name), the first busy span
    (start, micro-batch, name) and the end of the latest. Plain slots: the simulator's FIFO path
    updates them inline (its 180k stage starts per benchmark run)."""

    __slots__ = ("parts", "gaps", "first", "last")

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self.gaps: list[tuple[float, float, int, str]] = []
        self.first: tuple[float, int, str] | None = None
        self.last = -math.inf


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
        elif len(tl.gaps) < self.max_gaps:
            tl.gaps.append((tl.last, start, mb_id, name))
        else:
            self.overflow += 1

    def add(self, track: str, name: str, start: float, end: float, mb_id: int) -> None:
        tl = self.tracks.get(track) or self.track(track)
        if start > tl.last:
            self.gap(tl, start, mb_id, name)
        if end > tl.last:
            tl.last = end
        parts = tl.parts
        parts[name] = parts.get(name, 0.0) + (end - start)


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
