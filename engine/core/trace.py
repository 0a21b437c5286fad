"""Timestamped spans of what each stage and link did, shared by both executors.

Busy time is summed per track for every span, so bubble ratio and utilisation cover the whole
run; the spans themselves are kept only for the first `max_spans` (default 200,000, about 60 MB
of Python tuples) because a Perfetto trace of a 50,000-micro-batch run is unreadable anyway.
The summary records how many spans were dropped, so a truncated trace is never silent.
"""
from __future__ import annotations

import json
from pathlib import Path


class Tracer:
    def __init__(self, max_spans: int = 200_000) -> None:
        self.max_spans = max_spans
        self.spans: list[tuple[str, str, float, float, int]] = []  # track, name, start, end, mb_id
        self.busy: dict[str, float] = {}
        self.dropped = 0

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
        t = start
        for name, duration in parts:
            end = t + duration
            busy += end - t
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
