"""The simulator's fast path (engine/simulator/sim.py): a micro-batch's whole timeline computed at
launch when every stage and link serves in launch order, with the event loop's tie-breaking keys.

Split from sim.py to keep both modules small; the event priorities and a batch's costs (`Priced`) live
here because both use them, and the executor hands over what the path needs as a `PipelineView`.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from engine.core.trace import Tracer
from engine.pricing.tcp_link import TcpConnection

STAGE_DONE, LINK_DONE, ARRIVE, PREP_DONE, SAMPLE_DONE, COMPLETE = range(6)
EVENT_NAMES = ("STAGE_DONE", "LINK_DONE", "ARRIVE", "PREP_DONE", "SAMPLE_DONE", "COMPLETE")
_LAUNCH = 6  # a launch sorts after every event of its instant (the controller launches between pops)
GAP_LOG_FLUSH = 4 * 8_192  # numbers (four a gap) logged by the FIFO path before they go to the tracer's ledger


@dataclass(frozen=True)
class PipelineView:
    """What the launch-time path needs of its executor (sim.SimExecutor builds it), so that neither
    module reads the other's state: the servers' names, the links' terms and where spans go."""

    tracer: Tracer  # busy sums, spans and the breakdown ledger: shared with the executor
    latency: float  # s: a link's propagation, also the token ids' return to the driver
    bandwidth: float  # bytes/s of every link (the ideal pipe)
    metadata_s: float | None  # per-hop metadata rounds added to each send; None: structure-aware transfer
    tcp: Sequence[TcpConnection] | None  # link.model=tcp: one connection per link (its state); None: the ideal pipe
    first_messages: int  # messages of an activation's first send on a TCP link (size, metadata, tensor: 3)
    stage_tracks: tuple[str, ...]  # the tracer's track of each stage
    link_tracks: tuple[str, ...]  # of each link s -> s+1


class Priced(NamedTuple):
    """One micro-batch's costs, computed once at launch instead of once per stage and event."""

    forward: tuple[float, ...]  # GPU time per stage, sampling excluded
    forward_name: str  # the trace label, "forward:<kind>"
    prep: float  # input preparation (the same on every stage)
    sample: float  # GPU sampling on the last stage
    nbytes: int  # activation bytes per hop
    dispatch: float  # driver -> stage 0 before the first stage prepares (engine terms; 0 by default)
    ret: float  # last stage -> driver after sampling, on top of the link latency (0 by default)
    recv: float  # a host device's receive on stages > 0, before the forward (0 by default; the event loop's)
    handoff: float  # SiPipe: the last stage's copy of the logits to the CPU samplers (0 by default; the event loop's)


class FifoPipeline:
    """A micro-batch's whole timeline at launch, when every stage and link serves in launch order.

    Each server keeps when it is next free and the heap key `(time, priority, parent, index)`
    of the event that frees it: the event loop's key with the insertion counter replaced by the
    key of the event that pushed it and the push's index within that event, so same-time ties
    resolve as the heap's counter did. The parent is cut to (time, priority, push index): keys
    stay flat instead of chaining the run's whole history, and two events that agree that far
    are not told apart anyway. A stage starts at `max(arrival, free)`, on the arrival
    when it is idle then (a stage's STAGE_DONE pops before an ARRIVE of the same instant) and
    on the previous batch's STAGE_DONE otherwise; a link likewise, where a same-instant
    LINK_DONE pops after the STAGE_DONE. Kept spans wait in a heap under their trigger's key
    and join the tracer once the clock has passed it: every later launch's spans sort after."""

    def __init__(self, view: PipelineView) -> None:
        P = len(view.stage_tracks)
        self.tracer = view.tracer
        self.latency = view.latency
        self.bandwidth = view.bandwidth
        self.metadata_s = view.metadata_s
        self.tcp, self.first_messages = view.tcp, view.first_messages
        self.stage_tracks = view.stage_tracks
        self.link_tracks = view.link_tracks
        # Where each stage's time went (engine/core/breakdown.py), at O(1) per launch: preparation
        # and sampling cost the same on every stage, so their sums and the stage's busy time give
        # the parts (`settle`), and an idle gap is logged only where a stage starts idle, as four
        # numbers (stage, idle since, start, mb) on one flat list that goes to the ledger's typed
        # columns every GAP_LOG_FLUSH gaps (`flush_gaps`). A tuple per gap, handed over one
        # `ledger.gap` call each, made the 5,000-request Sarathi benchmark's loop ~8% slower than
        # without the ledger (1.34 vs 1.21 s CPU, load 17) and held 18 MB; this costs ~1%.
        self.gap_log: list[float] = []
        self.prep_total = 0.0
        self.sample_total = 0.0
        self.stage_free = [-math.inf] * P
        self.stage_key: list[tuple] = [()] * P  # key of the STAGE_DONE that frees the stage
        self.link_free = [-math.inf] * max(0, P - 1)
        self.link_key: list[tuple] = [()] * max(0, P - 1)
        self.done: deque[tuple[float, int]] = deque()  # (completion time, mb id), in time order
        self.spans: list[tuple] = []  # heap of (trigger key, span index, spans)
        self.launches = 0
        self.dispatched = 0.0  # when the driver's last dispatch reached stage 0 (engine terms)

    def launch(self, mb_id: int, priced: Priced, now: float) -> None:
        """Each stage is `Tracer.chain` of its parts inlined (the same sums in the same order):
        one call per micro-batch instead of one per stage."""
        self.launches += 1
        last = len(self.stage_free) - 1
        keep = self.tracer.keeps(mb_id)
        busy = self.tracer.busy
        stage_free, stage_key, link_free, link_key = self.stage_free, self.stage_key, self.link_free, self.link_key
        stage_tracks, link_tracks, latency = self.stage_tracks, self.link_tracks, self.latency
        prep, forward = priced.prep, priced.forward
        send_s = priced.nbytes / self.bandwidth
        if self.metadata_s is not None:
            send_s += self.metadata_s
        arrive, arrive_key = now, (now, _LAUNCH, (), self.launches)
        if priced.dispatch:  # the event loop's ARRIVE pushed by the launch (engine terms)
            self.dispatched = arrive = max(now + priced.dispatch, self.dispatched)
            arrive_key = (arrive, ARRIVE, (now, _LAUNCH, self.launches), 0)
        self.prep_total += prep
        self.sample_total += priced.sample
        gap_log = self.gap_log
        if len(gap_log) >= GAP_LOG_FLUSH:
            self.flush_gaps()
        for s in range(last + 1):
            free = stage_free[s]
            if free > arrive:  # busy: starts when the previous batch's forward ends
                start, trigger, index = free, stage_key[s], 1
            else:
                start, trigger, index = arrive, arrive_key, 0
                if arrive > free:  # the stage was idle (or had not worked yet)
                    gap_log += (s, free, arrive, mb_id)
            track = stage_tracks[s]
            prepared = start + prep
            end = prepared + forward[s]
            total = busy.get(track, 0.0) + (prepared - start) + (end - prepared)
            if s == last:
                sampled = end + priced.sample
                busy[track] = total + (sampled - end)
                if keep:
                    heapq.heappush(self.spans, (trigger, index, [
                        (track, "prepare", start, prepared, mb_id), (track, priced.forward_name, prepared, end, mb_id),
                        (track, "sample", end, sampled, mb_id)]))
                stage_free[s] = sampled
                stage_key[s] = (sampled, STAGE_DONE, (trigger[0], trigger[1], trigger[3]), index)
                self.done.append((sampled + latency + priced.ret, mb_id))
                return
            busy[track] = total
            if keep:
                heapq.heappush(self.spans, (trigger, index, [
                    (track, "prepare", start, prepared, mb_id), (track, priced.forward_name, prepared, end, mb_id)]))
            stage_free[s] = end
            stage_key[s] = key = (end, STAGE_DONE, (trigger[0], trigger[1], trigger[3]), index)
            if link_free[s] >= end:  # busy: sends when the previous activation has left
                start, trigger, index = link_free[s], link_key[s], 1
            else:
                start, trigger, index = end, key, 0
            sent = start + send_s if self.tcp is None else self.tcp[s].send(start, priced.nbytes, self.first_messages)[0]
            track = link_tracks[s]
            busy[track] = busy.get(track, 0.0) + (sent - start)
            if keep:
                heapq.heappush(self.spans, (trigger, index, [(track, "send", start, sent, mb_id)]))
            link_free[s] = sent
            link_key[s] = (sent, LINK_DONE, (trigger[0], trigger[1], trigger[3]), index)
            arrive = sent + latency
            arrive_key = (arrive, ARRIVE, (sent, LINK_DONE, index), 0)  # the LINK_DONE's key, cut

    def flush_gaps(self) -> None:
        """Hand the logged idle gaps to the tracer's ledger, per stage in launch order (a stage's
        first one, from -inf, is its first span)."""
        if not self.gap_log:
            return
        log = np.array(self.gap_log, dtype=np.float64).reshape(-1, 4)
        self.gap_log.clear()
        ledger = self.tracer.ledger
        for s, track in enumerate(self.stage_tracks):
            rows = log[log[:, 0] == s]
            if len(rows):
                ledger.extend_gaps(ledger.track(track), rows[:, 1], rows[:, 2], rows[:, 3].astype(np.int64), "prepare")

    def settle(self) -> None:
        """Write each stage's parts and latest end into the ledger (idempotent; at shutdown)."""
        self.flush_gaps()
        busy = self.tracer.busy
        last = len(self.stage_tracks) - 1
        for s, track in enumerate(self.stage_tracks):
            tl = self.tracer.ledger.track(track)
            total = busy.get(track, 0.0)
            sample = self.sample_total if s == last else 0.0
            tl.parts.update(prepare=self.prep_total, forward=total - self.prep_total - sample)
            if s == last:
                tl.parts["sample"] = sample
            tl.last = self.stage_free[s]

    def next_done(self, deadline: float | None) -> tuple[float, int] | None:
        done = self.done
        if not done or (deadline is not None and done[0][0] > deadline):
            return None
        t, mb_id = done.popleft()
        if self.spans:
            self.release_spans(t if done else math.inf)
        return t, mb_id

    def release_spans(self, until: float) -> None:
        """Move buffered spans triggered at or before `until` to the tracer, in trigger order."""
        heap, tracer = self.spans, self.tracer
        spans, cap = tracer.spans, tracer.max_spans
        while heap and heap[0][0][0] <= until:
            for span in heapq.heappop(heap)[2]:
                if len(spans) < cap:
                    spans.append(span)
                else:
                    tracer.dropped += 1
