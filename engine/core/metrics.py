"""Run metrics, the same for the simulator and the real engine.

Definitions (stable: `summary.json` keys are documented in the README):
- TTFT = first token time - arrival; TPOT = (finish - first token) / (output_len - 1), over
  requests with at least two output tokens; E2EL = finish - arrival.
- Throughput counts finished requests only, over the window from the first arrival to the last
  completion: `throughput_tok_s` = (prompt + generated tokens) / window (gLLM's and TD-Pipe's
  definition), `output_throughput_tok_s` = generated tokens / window.
- SLO attainment: fraction of all requests (failed ones count as misses) with TTFT <= the TTFT
  limit and TPOT <= the TPOT limit (single-token requests are judged on TTFT alone).
- A stage's utilisation = its busy time / the window; its bubble ratio = 1 - busy time / the time
  with at least one micro-batch in flight, so idle periods with no work at all (low request
  rates) are not counted as pipeline bubbles. `bubble_ratio` is the mean over stages.
"""
from __future__ import annotations

import math
from collections.abc import Sequence as SequenceABC

import numpy as np

from engine.core.controller import Controller
from engine.core.request import SeqStatus
from engine.base.settings import SLO  # a run-config section; imported from here too (`engine.core.metrics.SLO`)

SUMMARY_KEYS = (
    "num_requests", "num_finished", "num_failed", "duration_s", "throughput_tok_s",
    "output_throughput_tok_s", "request_throughput", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s",
    "tpot_mean_s", "tpot_p50_s", "tpot_p99_s", "e2el_mean_s", "e2el_p50_s", "e2el_p99_s",
    "itl_mean_s", "itl_p50_s", "itl_p99_s", "slo_attainment", "bubble_ratio", "stage_bubble_ratio",
    "stage_utilization", "num_preemptions", "num_microbatches", "mean_tokens_per_microbatch", "kv_usage_mean",
    "kv_usage_max", "trace_spans_dropped",
)


def _stats(values: np.ndarray, in_place: bool = False) -> tuple[float, float, float]:
    """(mean, p50, p99). `in_place`: the percentiles partition `values` itself (reordered, same
    multiset) instead of a scratch copy, after the mean has read them in their order."""
    if values.size == 0:
        return (math.nan, math.nan, math.nan)
    mean = float(values.mean())
    # One call for both percentiles: one scratch copy of `values` instead of two (the 1.38M time
    # between tokens of the 5,000-request benchmark: 11 MB each, and the second stayed resident).
    p50, p99 = np.percentile(values, [50, 99], overwrite_input=in_place)
    return (mean, float(p50), float(p99))


def request_rows(ctrl: Controller) -> list[dict]:
    """One dict per request, in request id order (the per-request table)."""
    rows = []
    for rid in sorted(ctrl.sequences):
        s = ctrl.sequences[rid]
        r = s.request
        ttft = (s.first_token_s - r.arrival_s) if s.first_token_s is not None else math.nan
        done = s.status is SeqStatus.FINISHED
        e2el = (s.finish_s - r.arrival_s) if done else math.nan
        tpot = ((s.finish_s - s.first_token_s) / (r.output_len - 1)) if done and r.output_len > 1 else math.nan
        rows.append({
            "request_id": rid, "arrival_s": r.arrival_s, "prompt_len": r.prompt_len,
            "output_len": r.output_len, "status": s.status.value, "num_generated": s.num_generated,
            "first_scheduled_s": s.first_scheduled_s, "first_token_s": s.first_token_s,
            "finish_s": s.finish_s, "ttft_s": ttft, "tpot_s": tpot, "e2el_s": e2el,
            "num_preemptions": s.num_preemptions, "fail_reason": s.fail_reason or "",
            "output_token_ids": " ".join(map(str, s.output_token_ids)),  # real engine only; empty in simulation
        })
    return rows


def summarize(ctrl: Controller, slo: SLO, stage_tracks: list[str]) -> dict:
    # The time between tokens: its percentiles partition the controller's array('d') in place
    # (a view, no copy). A scratch copy was the run's largest transient (11 MB of the
    # 5,000-request benchmark's peak); the gaps' order is read by nothing after the run.
    itl = _stats(np.asarray(ctrl.token_gaps, dtype=float) if ctrl.token_gaps else np.zeros(0), in_place=True)
    rows = request_rows(ctrl)
    fin = [r for r in rows if r["status"] == "finished"]
    n = len(rows)
    first_arrival = min((r["arrival_s"] for r in rows), default=0.0)
    last = ctrl.last_complete_s if ctrl.last_complete_s is not None else first_arrival
    window = max(last - first_arrival, 0.0)
    prompt_tok = sum(r["prompt_len"] for r in fin)
    out_tok = sum(r["output_len"] for r in fin)
    ttft = np.array([r["ttft_s"] for r in fin], dtype=float)
    tpot = np.array([r["tpot_s"] for r in fin if not math.isnan(r["tpot_s"])], dtype=float)
    e2el = np.array([r["e2el_s"] for r in fin], dtype=float)
    ok = sum(1 for r in fin if r["ttft_s"] <= slo.ttft_s and (math.isnan(r["tpot_s"]) or r["tpot_s"] <= slo.tpot_s))
    tracer = ctrl.executor.tracer
    busy = [tracer.busy_time(t) for t in stage_tracks]
    active = ctrl.active_time
    util = [b / window if window > 0 else 0.0 for b in busy]
    bubbles = [max(0.0, 1.0 - b / active) if active > 0 else 0.0 for b in busy]
    recs = ctrl.records
    kv = np.asarray(recs.kv_usage, dtype=float)  # the records' columns (engine/core/records.py): views
    tokens = (np.asarray(recs.num_prefill_tokens, dtype=np.int64) + np.asarray(recs.num_decode_seqs, dtype=np.int64)).astype(float)
    tt = _stats(ttft)
    tp = _stats(tpot)
    ee = _stats(e2el)
    summary = {
        "num_requests": n,
        "num_finished": len(fin),
        "num_failed": ctrl.num_failed,
        "duration_s": window,
        "throughput_tok_s": (prompt_tok + out_tok) / window if window > 0 else 0.0,
        "output_throughput_tok_s": out_tok / window if window > 0 else 0.0,
        "request_throughput": len(fin) / window if window > 0 else 0.0,
        "ttft_mean_s": tt[0], "ttft_p50_s": tt[1], "ttft_p99_s": tt[2],
        "tpot_mean_s": tp[0], "tpot_p50_s": tp[1], "tpot_p99_s": tp[2],
        "e2el_mean_s": ee[0], "e2el_p50_s": ee[1], "e2el_p99_s": ee[2],
        "itl_mean_s": itl[0], "itl_p50_s": itl[1], "itl_p99_s": itl[2],  # time between tokens (TBT), all tokens
        "slo_attainment": ok / n if n else 0.0,
        "bubble_ratio": float(np.mean(bubbles)) if bubbles else 0.0,
        "stage_bubble_ratio": bubbles,
        "stage_utilization": util,
        "num_preemptions": ctrl.num_preemptions,
        "num_microbatches": len(recs),
        "mean_tokens_per_microbatch": float(tokens.mean()) if tokens.size else 0.0,
        "kv_usage_mean": float(kv.mean()) if kv.size else 0.0,
        "kv_usage_max": float(kv.max()) if kv.size else 0.0,
        "trace_spans_dropped": tracer.dropped,
    }
    assert tuple(summary) == SUMMARY_KEYS
    return summary


def microbatch_rows(ctrl: Controller) -> MicroBatchRows:
    """The per-micro-batch table, one dict per row made when it is read."""
    return MicroBatchRows(ctrl.records)


def _row(m) -> dict:
    return {"mb_id": m.mb_id, "scheduled_s": m.scheduled_s, "completed_s": m.completed_s, "kind": m.kind,
            "num_prefill_tokens": m.num_prefill_tokens, "num_decode_seqs": m.num_decode_seqs,
            "num_tokens": m.num_prefill_tokens + m.num_decode_seqs, "num_seqs": m.num_seqs,
            "num_preempted": m.num_preempted, "kv_usage": m.kv_usage,
            **{f"tag_{k}": v for k, v in m.tags.items()}}


class MicroBatchRows(SequenceABC):
    """The per-micro-batch table as a read-only sequence of row dicts built on access from the
    controller's records: the 45k rows of the 5,000-request benchmark held at once took 12 MB
    of a run's peak memory, for a table that is written once and sampled for plots. Compares
    equal to a list of the same rows."""

    __slots__ = ("_records",)

    def __init__(self, records) -> None:
        self._records = records

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [_row(m) for m in self._records[i]]
        return _row(self._records[i])

    def __iter__(self):
        return map(_row, self._records)

    def __eq__(self, other) -> bool:
        if isinstance(other, (MicroBatchRows, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]
