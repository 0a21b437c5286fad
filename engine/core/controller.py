"""The controller: owns requests, the KV block manager, the clock's bookkeeping and the records.

Its loop is three calls, the same for the simulator and the real engine:

    mb = policy.schedule(view)          # while a pipeline slot is free
    executor.launch(mb)
    controller.complete(executor.next_completion())

Every request ends exactly once, FINISHED or FAILED with a reason: a request that could never
fit the whole KV cache fails at arrival, and if the policy stops scheduling while work remains
(a policy bug) the run fails loudly instead of hanging.
"""
from __future__ import annotations

import dataclasses
from array import array
from collections import deque
from collections.abc import Callable, Mapping, Sequence as Seq
from types import MappingProxyType

from engine.core.batch import BatchBuilder, MicroBatch, prefill_shape, shape_of
from engine.base.errors import RunFailedError
from engine.core.executor import Completion, Executor
from engine.core.kv import BlockManager
from engine.core.policy import HistoryProvider, Policy, SchedulerView
from engine.core.records import MicroBatchRecords
from engine.core.request import Request, SeqStatus, Sequence


# An untagged micro-batch's record shares this instead of keeping the batch's own empty dict
# (45k dicts, 2.8 MB, in the 5,000-request benchmark); read-only, so no policy can tag them all.
_NO_TAGS: Mapping = MappingProxyType({})


class Controller:
    def __init__(self, requests: Seq[Request], policy: Policy, executor: Executor, kv: BlockManager,
                 cost_model=None, *, check_integrity: bool = False, data_dir: str | None = None,
                 progress: Callable[[int, int], None] | None = None, num_microbatches: int | None = None,
                 link_bandwidth_Bps: float | None = None, link_latency_s: float | None = None,
                 history: HistoryProvider | None = None) -> None:
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        self.policy = policy
        # the policy's hook, or None where it keeps the contract's no-op (a call per micro-batch saved)
        self._on_complete = None if type(policy).on_complete is Policy.on_complete else policy.on_complete
        self.executor = executor
        self.kv = kv
        executor.attach(kv)
        self.cost_model = cost_model
        self.pipeline_depth = executor.pipeline_depth
        self.num_microbatches = num_microbatches  # parallel.num_microbatches; None: the policy's choice
        self.link_bandwidth_Bps = link_bandwidth_Bps
        self.link_latency_s = link_latency_s
        self.check_integrity = check_integrity
        self.progress = progress
        self.sequences: dict[int, Sequence] = {r.request_id: Sequence(r) for r in self.requests}
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        # The running set by status, kept at every transition so policies need not scan it per
        # micro-batch (`view.prefilling`, `view.num_decoding`): prefilling ones in admission order.
        self.prefilling: dict[int, Sequence] = {}
        self.num_decoding = 0
        self.inflight: dict[int, MicroBatch] = {}
        self.view = SchedulerView(self)
        self.data_dir = data_dir  # where the workload's data set lives, for policies that learn from history
        self.history_provider = history  # `view.history`: injected by the runner (engine reads no workload files)
        self._started = False
        self.records = MicroBatchRecords()
        self.num_finished = 0
        self.num_failed = 0
        self.num_preemptions = 0
        # time between consecutive output tokens of a sequence (TBT / ITL); None: not kept (a server's
        # controller, which would otherwise grow by one float per token for as long as it serves).
        # Unboxed doubles: 1.38M gaps in the 5,000-request benchmark took 43 MB as a list of floats
        # (most of its peak RSS of 163 MB), 11 MB here; the same values.
        self.token_gaps: array | None = array("d")
        self.waiting_prefill_tokens = 0  # sum of remaining_prefill over `waiting`, kept incrementally
        self._next_arrival = 0
        self._next_mb_id = 0
        self._admit_counter = 0
        self._arrival_times = [r.arrival_s for r in self.requests]
        self._active_since: float | None = None
        self.active_time = 0.0  # time with at least one micro-batch in flight
        self.first_launch_s: float | None = None
        self.last_complete_s: float | None = None
        self._aborting: dict[int, str] = {}  # online: in-flight sequences to drop at completion

    # --- the loop ------------------------------------------------------------------------------
    @property
    def num_not_arrived(self) -> int:
        return len(self.requests) - self._next_arrival

    @property
    def num_done(self) -> int:
        return self.num_finished + self.num_failed

    def start(self) -> None:
        """Bring the executor up and let the policy prepare (e.g. fit a predictor); idempotent,
        and separate from `run` so that preparation is not counted as serving time."""
        if not self._started:
            self._started = True
            self.executor.start()
            self.policy.start(self.view)
            self.executor.start_clock()

    def run(self) -> None:
        """Serve every request to completion (or failure); raises RunFailedError on a stall."""
        total = len(self.requests)
        self.start()
        while self.num_finished + self.num_failed < total:  # `num_done`, without a property call a turn
            self._admit_arrivals(self.executor.now())  # one now() a turn: a replay's clock moves on reads
            self._fill_pipeline()
            if self.inflight:
                slot_free = len(self.inflight) < self.policy.max_inflight(self.view)
                deadline = self._arrival_times[self._next_arrival] if (
                    slot_free and self._next_arrival < total) else None
                completion = self.executor.next_completion(deadline)
                if completion is not None:
                    self.complete(completion)
                    if self.progress is not None:
                        self.progress(self.num_done, total)
            elif self._next_arrival < total:
                self.executor.wait_until(self._arrival_times[self._next_arrival])
            elif self.num_done < total:
                self._stall()

    def _fill_pipeline(self) -> None:
        view = self.view
        while len(self.inflight) < self.policy.max_inflight(view):
            preempted_before = self.num_preemptions
            mb = self.policy.schedule(view)
            if mb is None:
                if self.num_preemptions != preempted_before:
                    continue  # the policy only made room: the state changed, so ask again
                return
            self._commit(mb)
            self.executor.launch(mb)

    def _admit_arrivals(self, now: float) -> None:
        total = len(self.requests)
        while self._next_arrival < total and self._arrival_times[self._next_arrival] <= now:
            seq = self.sequences[self.requests[self._next_arrival].request_id]
            self._next_arrival += 1
            self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """An arrival waits for the policy, or fails at once if it could never fit the whole cache."""
        need = self.kv.blocks_for(seq.prompt_len + seq.output_len)
        if need > self.kv.num_blocks:
            self._fail(seq, f"needs {need} KV blocks for {seq.prompt_len}+{seq.output_len} tokens, "
                            f"the whole cache has {self.kv.num_blocks}")
        else:
            self.waiting.append(seq)
            self.waiting_prefill_tokens += seq.remaining_prefill

    # --- commit and completion -------------------------------------------------------------------
    def _commit(self, mb: MicroBatch) -> None:
        now = self.executor.now()
        if mb.preempted:
            self.apply_preemptions(mb.preempted)
        for chunk in mb.prefills:
            seq = chunk.seq
            if seq.is_waiting:
                self.waiting.remove(seq)
                self.waiting_prefill_tokens -= seq.remaining_prefill
                seq.status = SeqStatus.PREFILLING
                seq.admit_order = self._admit_counter
                self._admit_counter += 1
                self.running[seq.seq_id] = seq
                self.prefilling[seq.seq_id] = seq
                if seq.first_scheduled_s is None:
                    seq.first_scheduled_s = now
            self.kv.ensure(seq.seq_id, chunk.reserve_tokens)
            seq.in_flight = True
            seq.inflight_prefill += chunk.num_tokens
        self.kv.launch_decodes(mb.decodes)  # marks each in flight; a decode holds exactly num_computed tokens
        mb.mb_id = self._next_mb_id
        self._next_mb_id += 1
        mb.scheduled_s = now
        mb.kv_usage = self.kv.usage
        self.inflight[mb.mb_id] = mb
        if self._active_since is None:
            self._active_since = now
        if self.first_launch_s is None:
            self.first_launch_s = now
        if self.check_integrity:
            self.kv.check_integrity()
            self._check_status_index()

    def apply_preemptions(self, victims: Seq[Sequence]) -> None:
        """Free each victim's KV and queue it first for recomputation (vLLM's recompute mode)."""
        for seq in reversed(victims):  # appendleft in reverse keeps the policy's order at the front
            self.kv.free(seq.seq_id)
            self._leave_running(seq)
            seq.status = SeqStatus.PREEMPTED
            seq.num_computed = 0
            seq.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(seq)
            self.waiting_prefill_tokens += seq.remaining_prefill

    def complete(self, completion: Completion) -> list[Sequence]:
        mb = self.inflight.pop(completion.mb_id)
        now = completion.time_s
        mb.completed_s = now
        tokens = completion.token_ids
        k = 0
        finished: list[Sequence] = []
        prefills, decodes = mb.prefills, mb.decodes
        prefill_tokens = 0  # mb.num_prefill_tokens without its generator (once per micro-batch)
        for chunk in prefills:
            seq = chunk.seq
            prefill_tokens += chunk.num_tokens
            if chunk.start != seq.num_computed:  # chunks of one prompt complete in launch order
                raise RuntimeError(f"micro-batch {mb.mb_id}: a chunk of {seq!r} from token {chunk.start} "
                                   "completed before the chunk ahead of it")
            left = seq.inflight_prefill - chunk.num_tokens  # > 0: a later chunk of it is still in flight
            seq.inflight_prefill = left
            seq.in_flight = left > 0
            seq.num_computed += chunk.num_tokens
            if chunk.samples:
                if tokens is not None:
                    seq.output_token_ids.append(tokens[k])
                k += 1
                self._emit_token(seq, now, finished)
        # The hot path: _emit_token inlined for sequences past their first token (a decode stays
        # DECODING while in flight: nothing preempts or drops an in-flight sequence).
        if tokens is not None:
            for seq in decodes:
                seq.output_token_ids.append(tokens[k])
                k += 1
        else:
            k += len(decodes)
        gaps = self.token_gaps
        if gaps is not None:  # two copies of the loop: no per-token test, `append` looked up once
            append = gaps.append
            for seq in decodes:
                seq.in_flight = False
                seq.num_computed += 1
                n = seq.num_generated + 1
                seq.num_generated = n
                append(now - seq.last_token_s)
                seq.last_token_s = now
                if n >= seq.output_len:
                    self._emit_finish(seq, now, finished)
        else:
            for seq in decodes:
                seq.in_flight = False
                seq.num_computed += 1
                n = seq.num_generated + 1
                seq.num_generated = n
                seq.last_token_s = now
                if n >= seq.output_len:
                    self._emit_finish(seq, now, finished)
        if tokens is not None and k != len(tokens):
            raise RuntimeError(f"micro-batch {mb.mb_id}: {len(tokens)} tokens returned for {k} samplers")
        kind = ("mixed" if decodes else "prefill") if prefills else "decode"  # mb.kind, inline
        self.records.append(
            mb.mb_id, mb.scheduled_s, now, kind, prefill_tokens, len(decodes), len(prefills) + len(decodes),
            len(mb.preempted), mb.kv_usage, mb.tags or _NO_TAGS)
        self.last_complete_s = now
        if not self.inflight and self._active_since is not None:
            self.active_time += now - self._active_since
            self._active_since = None
        if self._on_complete is not None:
            self._on_complete(self.view, mb, finished)
        if self.check_integrity:
            self.kv.check_integrity()
            assert self.waiting_prefill_tokens == sum(q.remaining_prefill for q in self.waiting)
            self._check_status_index()
        return finished

    def _check_status_index(self) -> None:
        """`prefilling` and `num_decoding` agree with a scan of the running set (integrity mode)."""
        scan = [s for s in self.running.values() if s.status is SeqStatus.PREFILLING]
        assert list(self.prefilling.values()) == scan, "controller's prefilling index is stale"
        assert self.num_decoding == len(self.running) - len(scan), "controller's decoding count is stale"
        for s in self.running.values():  # what BatchBuilder's decode fast path relies on
            if s.status is SeqStatus.DECODING and not s.in_flight:
                assert self.kv.num_tokens(s.seq_id) == s.num_computed, f"{s!r} holds {self.kv.num_tokens(s.seq_id)} tokens"

    def _emit_token(self, seq: Sequence, now: float, finished: list[Sequence]) -> None:
        seq.num_generated += 1
        if seq.first_token_s is None:
            seq.first_token_s = now
        elif self.token_gaps is not None:
            self.token_gaps.append(now - seq.last_token_s)
        seq.last_token_s = now
        if seq.num_generated >= seq.output_len:
            self._emit_finish(seq, now, finished)
        elif seq.status is not SeqStatus.DECODING:  # its prompt is done: PREFILLING -> DECODING
            seq.status = SeqStatus.DECODING
            del self.prefilling[seq.seq_id]
            self.num_decoding += 1

    def _emit_finish(self, seq: Sequence, now: float, finished: list[Sequence]) -> None:
        self._leave_running(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_s = now
        self.kv.free(seq.seq_id)
        self.num_finished += 1
        finished.append(seq)

    def _leave_running(self, seq: Sequence) -> None:
        """Take `seq` off the running set and its status index (before its status changes)."""
        del self.running[seq.seq_id]
        if seq.status is SeqStatus.DECODING:
            self.num_decoding -= 1
        else:
            del self.prefilling[seq.seq_id]

    # --- failure -----------------------------------------------------------------------------------
    def _fail(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FAILED
        seq.fail_reason = reason
        self.num_failed += 1

    def drop_half_written_rows(self) -> int:
        """After a stop signal: drop a micro-batch record or a breakdown gap that the signal cut
        off half-written (`MicroBatchRecords.trim_to_whole_rows`, `StageLedger.trim_to_whole_rows`),
        so that the partial run's tables and breakdown can be read; the number of columns cut."""
        tracer = getattr(self.executor, "tracer", None)
        cut = self.records.trim_to_whole_rows()
        return cut + (tracer.ledger.trim_to_whole_rows() if tracer is not None else 0)

    def fail_unfinished(self, reason: str) -> int:
        """Mark every request not yet done as FAILED (after a stall or an executor failure)."""
        n = 0
        for seq in self.sequences.values():
            if not seq.is_done:
                if seq.seq_id in self.running:
                    self.kv.free(seq.seq_id)
                    self._leave_running(seq)
                seq.in_flight = False
                seq.inflight_prefill = 0
                self._fail(seq, reason)
                n += 1
        self.waiting.clear()
        self.waiting_prefill_tokens = 0
        self.inflight.clear()
        return n

    def _stall(self) -> None:
        waiting, running = len(self.waiting), len(self.running)
        reason = (f"policy {self.policy.name!r} scheduled nothing while {waiting} requests waited, "
                  f"{running} were running and no micro-batch was in flight")
        self.fail_unfinished(reason)
        raise RunFailedError(reason)

    # --- online serving (testbed/serve) --------------------------------------------------------------
    # `run` replays a list known in advance; a server instead calls `submit` when a request arrives,
    # `abort` when its client goes away, `finish_early` when a sampled token ends it (EOS, a stop
    # string) and `step` in its loop. The controller is not thread-safe: a server calls all of these
    # from the one thread that owns the engine (testbed/serve/engine_loop.py).
    def submit(self, request: Request) -> Sequence:
        """Add a request that arrives now (its `arrival_s` should read `executor.now()`); it waits
        for the policy like any arrival. A request that could never fit the whole KV cache comes
        back already FAILED, with the reason."""
        if request.request_id in self.sequences:
            raise ValueError(f"request id {request.request_id} is already known")
        seq = Sequence(request)
        self.sequences[request.request_id] = seq
        self._enqueue(seq)
        return seq

    def abort(self, seq_id: int, reason: str) -> bool:
        """End a request that is not done: free its KV, take it off the waiting queue or the
        running set and report it FAILED with `reason`. A sequence inside an in-flight micro-batch
        is only marked: its stages still hold its metadata, so it is dropped when that micro-batch
        completes (`step`). Returns False when the request is unknown or already done."""
        seq = self.sequences.get(seq_id)
        if seq is None or seq.is_done:
            return False
        if seq.in_flight:
            self._aborting[seq_id] = reason
        else:
            self._drop(seq, reason)
        return True

    def reset_statistics(self) -> None:
        """Forget every request and micro-batch so far, as if the run started now: a server's
        warm-up requests (testbed/serve/warmup.py) must not count in its results. Only between
        requests: nothing waiting, running or in flight."""
        if self.waiting or self.running or self.inflight:
            raise RuntimeError("reset_statistics() while requests are in progress")
        self.sequences = {r.request_id: s for r, s in ((s.request, s) for s in self.sequences.values())
                          if r in self.requests}  # an offline run's own requests stay
        self.records = MicroBatchRecords()
        self.token_gaps = None if self.token_gaps is None else array("d")
        self.num_finished = self.num_failed = self.num_preemptions = 0
        self._active_since = self.first_launch_s = self.last_complete_s = None
        self.active_time = 0.0
        tracer = self.executor.tracer
        tracer.spans, tracer.busy, tracer.dropped = [], {}, 0
        tracer.ledger = type(tracer.ledger)()

    def finish_early(self, seq: Sequence) -> None:
        """Make the token that `seq`'s in-flight micro-batch samples its last (EOS or a stop string,
        seen by the caller between `next_completion` and `complete`). The request then reads as if
        its output length had been that long, so metrics and the policy's `on_complete` see an
        ordinary finish."""
        seq.request = dataclasses.replace(seq.request, output_len=seq.num_generated + 1)
        seq.output_len = seq.request.output_len

    def step(self, timeout_s: float,
             inspect: Callable[[MicroBatch, Completion], None] | None = None) -> MicroBatch | None:
        """One turn of the online loop: schedule while slots are free, wait up to `timeout_s` for a
        completion and apply it. `inspect(mb, completion)` sees the sampled tokens before they are
        applied (to call `finish_early`). Returns the completed micro-batch (each of its
        `sampled_sequences()` got one token) or None. Raises RunFailedError, with every unfinished
        request failed, if the policy leaves queued work with nothing in flight (a policy bug)."""
        self.start()
        self._fill_pipeline()
        if not self.inflight:
            if self.waiting or self.running:
                self._stall()
            return None
        completion = self.executor.next_completion(self.executor.now() + timeout_s)
        if completion is None:
            return None
        mb = self.inflight[completion.mb_id]
        if inspect is not None:
            inspect(mb, completion)
        self.complete(completion)
        if self._aborting:
            for seq in mb.sequences():
                reason = self._aborting.pop(seq.seq_id, None)
                if reason is not None and not seq.is_done and not seq.in_flight:
                    self._drop(seq, reason)
        return mb

    def _drop(self, seq: Sequence, reason: str) -> None:
        if seq.is_waiting:
            self.waiting.remove(seq)
            self.waiting_prefill_tokens -= seq.remaining_prefill
        if seq.seq_id in self.running:
            self.kv.free(seq.seq_id)
            self._leave_running(seq)
        self._fail(seq, reason)
        seq.finish_s = self.executor.now()
        self.policy.on_abort(self.view, seq)
        if self.check_integrity:
            self.kv.check_integrity()

    # --- cost estimates for policies ---------------------------------------------------------------
    def estimate(self, batch: MicroBatch | BatchBuilder) -> float:
        if self.cost_model is None:
            raise RuntimeError("this run has no cost model, so view.estimate is unavailable")
        shape = batch.shape if isinstance(batch, MicroBatch) else shape_of(batch.prefills, batch.decodes)
        return self.cost_model.bottleneck_s(shape)

    def estimate_prefill(self, prefix_tokens: int, num_tokens: int) -> float:
        if self.cost_model is None:
            raise RuntimeError("this run has no cost model, so view.estimate_prefill is unavailable")
        return self.cost_model.bottleneck_s(prefill_shape(prefix_tokens, num_tokens))

