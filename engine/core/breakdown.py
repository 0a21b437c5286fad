"""Where each stage's time went: compute, host work, transfer, and idle time by cause.

Both executors feed the same ledger (engine/core/trace.py `StageLedger`: busy time by span name
and every idle gap of each stage track), the simulator from its trace and the real engine from
the spans its stage processes measured; this module adds the controller's launch and completion
times and splits a stage's wall time (the run's window, the summary's `duration_s`) into

- `compute`: forward spans (`forward:*`);
- `host`: input preparation, sampling, the hand-off to CPU samplers, and the driver's scheduling
  and dispatch where an engine profile models it (`prepare`, `sample`, `to_samplers`, `schedule`);
- `transfer`: sends on the stage's own track (a blocking send: gloo on CPU, `blocking_send` in the
  simulator);
- `idle_wait_prev`: the micro-batch the stage runs next was launched, its input not here yet
  (upstream stages, links, the driver's dispatch);
- `idle_wait_next`: held by what lies downstream: every micro-batch slot (`max_inflight`) was
  taken by batches further down the pipeline, or the stage's output waited to be sent;
- `idle_no_work`: a slot was free and nothing was launched (no request waiting, or the policy
  admitted none: KV full, its sequences all in flight);
- `idle_drain`: after the stage's last work, while the rest of the pipeline finished.

The parts of a stage add up to its wall time: idle is every gap between its busy spans, so only
overlapping busy spans (none in the simulator) or spans outside the window could make them
differ; `residual_frac` reports it (tests hold it under 1% in both executors).
"""
from __future__ import annotations

import numpy as np

from engine.core.trace import TRANSFER_NAMES

PARTS = ("compute", "host", "transfer", "idle_wait_prev", "idle_wait_next", "idle_no_work", "idle_drain")
HOST_NAMES = ("prepare", "sample", "to_samplers", "schedule")


def _category(name: str) -> str:
    """A busy span's part: host and transfer by name, everything else (`forward:*`) compute."""
    if name in TRANSFER_NAMES:
        return "transfer"
    return "host" if name in HOST_NAMES else "compute"


class _SlotsFull:
    """Time during which every micro-batch slot was taken, as a cumulative function of time
    (piecewise linear, so any interval's share is two `np.interp` calls)."""

    def __init__(self, launched: np.ndarray, completed: np.ndarray, cap: int) -> None:
        # One temporary at a time (the 5,000-request benchmark's 90k events: 0.7 MB an array); at one
        # instant completions sort after launches (the key: is a completion).
        n = len(launched)
        times = np.concatenate([launched, completed])
        order = np.lexsort((np.arange(len(times)) >= n, times))
        times = times[order]
        inflight = np.cumsum(np.where(order < n, 1.0, -1.0))
        del order
        full = inflight >= cap  # on [times[i], times[i+1])
        del inflight
        if len(times):
            cum = np.diff(times)
            cum *= full[:-1]
            cum = np.concatenate([[0.0], np.cumsum(cum)])
        else:
            cum = np.zeros(0)
        self.times, self.cum = times, cum

    def within(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if not len(self.times):
            return np.zeros_like(a)
        return np.interp(b, self.times, self.cum) - np.interp(a, self.times, self.cum)


def stage_breakdown(tracer, records, stage_tracks: list[str], window: tuple[float, float],
                    max_inflight: int) -> dict:
    """`{"stages": [{part: seconds, ..., "wall_s", "residual_frac"}], "fractions": [...]}` for the
    stage tracks, from the tracer's ledger and the controller's micro-batch records (launch and
    completion times) over `window` = (first arrival, last completion)."""
    w0, w1 = window
    wall = max(w1 - w0, 0.0)
    ledger = tracer.ledger
    ids, launched, completed = _record_columns(records)
    launch = _LaunchTimes(ids, launched)
    slots = _SlotsFull(launched, completed, max(1, max_inflight))
    stages = []
    for track in stage_tracks:
        row = dict.fromkeys(PARTS, 0.0)
        tl = ledger.tracks.get(track)
        first = tl.first if tl is not None else None
        if first is None:  # the stage never worked: nothing was launched, or nothing reached it
            row["idle_no_work"] = wall
        else:
            for name, seconds in tl.parts.items():
                row[_category(name)] += seconds
            a = np.concatenate([[w0], np.asarray(tl.gap_a, dtype=float)])  # the first gap: the window's start
            b = np.concatenate([[first[0]], np.asarray(tl.gap_b, dtype=float)])
            mb = np.concatenate([[first[1]], np.asarray(tl.gap_mb, dtype=np.int64)])
            sends = np.concatenate([[first[2] in TRANSFER_NAMES], np.asarray(tl.gap_send, dtype=bool)])
            _classify(row, a, b, mb, sends, launch, slots)
            row["idle_drain"] = max(0.0, w1 - tl.last)
        parts = sum(row[p] for p in PARTS)
        row["wall_s"] = wall
        row["residual_frac"] = (parts - wall) / wall if wall > 0 else 0.0
        stages.append(row)
    fractions = [{p: (row[p] / wall if wall > 0 else 0.0) for p in PARTS} for row in stages]
    return {"parts": list(PARTS), "stages": stages, "fractions": fractions,
            "gaps_over_cap": ledger.overflow}


def _record_columns(records) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mb ids, launch times, completion times) of the records: the controller's typed columns
    (engine/core/records.py) read in place, or any sequence of records."""
    if all(hasattr(records, c) for c in ("mb_id", "scheduled_s", "completed_s")):
        return (np.asarray(records.mb_id, dtype=np.int64), np.asarray(records.scheduled_s, dtype=float),
                np.asarray(records.completed_s, dtype=float))
    return (np.array([r.mb_id for r in records], dtype=np.int64), np.array([r.scheduled_s for r in records], dtype=float),
            np.array([r.completed_s for r in records], dtype=float))


class _LaunchTimes:
    """Launch time by micro-batch id (NaN for an id with no record: never completed, or -1)."""

    def __init__(self, ids: np.ndarray, launched: np.ndarray) -> None:
        size = int(ids.max()) + 1 if len(ids) else 0
        self.table = np.full(size, np.nan)
        ok = ids >= 0
        self.table[ids[ok]] = launched[ok]

    def of(self, mb: np.ndarray) -> np.ndarray:
        known = (mb >= 0) & (mb < len(self.table))
        if not len(self.table):
            return np.full(len(mb), np.nan)
        return np.where(known, self.table[np.where(known, mb, 0)], np.nan)


def _classify(row: dict, a: np.ndarray, b: np.ndarray, mb: np.ndarray, sends: np.ndarray,
              launch: _LaunchTimes, slots: _SlotsFull) -> None:
    """Split each idle gap [a, b) that ends in micro-batch m's span: a send waiting on what is
    downstream -> wait_next; before m's launch -> wait_next while every slot was taken, else
    no_work; after it -> wait_prev."""
    ok = b > a
    a, b, sends = a[ok], b[ok], sends[ok]
    lt = launch.of(mb[ok])
    lt = np.where(np.isnan(lt), a, lt)  # a batch the controller never completed: count it launched
    pre_end = np.clip(lt, a, b)  # [a, pre_end): before the launch; [pre_end, b): after it
    full = slots.within(a, pre_end)
    before = pre_end - a
    after = b - pre_end
    row["idle_wait_next"] += float(np.sum(np.where(sends, b - a, full)))
    row["idle_no_work"] += float(np.sum(np.where(sends, 0.0, before - full)))
    row["idle_wait_prev"] += float(np.sum(np.where(sends, 0.0, after)))


def run_breakdown(ctrl, stage_tracks: list[str]) -> dict:
    """`stage_breakdown` of a finished run, over the summary's window (engine/core/metrics.py:
    first arrival to last completion)."""
    first = min((s.request.arrival_s for s in ctrl.sequences.values()), default=0.0)
    last = ctrl.last_complete_s if ctrl.last_complete_s is not None else first
    return stage_breakdown(ctrl.executor.tracer, ctrl.records, stage_tracks, (first, last),
                           ctrl.policy.max_inflight(ctrl.view))


def summary_line(breakdown: dict) -> str:
    """One line for the printed summary: each stage's percentages, compute/host/transfer/idle."""
    cells = []
    for s, f in enumerate(breakdown["fractions"]):
        idle = f["idle_wait_prev"] + f["idle_wait_next"] + f["idle_no_work"] + f["idle_drain"]
        cells.append(f"s{s} {100 * f['compute']:.0f}/{100 * f['host']:.0f}/{100 * f['transfer']:.0f}/"
                     f"{100 * idle:.0f} (prev {100 * f['idle_wait_prev']:.0f}, next {100 * f['idle_wait_next']:.0f},"
                     f" none {100 * f['idle_no_work']:.0f}, drain {100 * f['idle_drain']:.0f})")
    return "compute/host/transfer/idle %: " + "; ".join(cells)


def flat_metrics(breakdown: dict) -> dict[str, float]:
    """`breakdown.<part>_frac.stage<i>` for MLflow, one number per stage and part."""
    return {f"breakdown.{p}_frac.stage{s}": float(f[p])
            for s, f in enumerate(breakdown["fractions"]) for p in PARTS}
