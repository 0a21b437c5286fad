"""Chunked pipeline prefill with dynamic chunk sizes (SGLang's chunked pipeline parallelism,
2026-01; vLLM RFC #33914; docs/policies-specialised.md#chunked_pp).

A long prompt is cut into chunks that are in flight on different stages at once: chunk k+1 enters
stage 0 while chunk k runs on stage 1 (`BatchBuilder.add_pipelined_prefill`). Sarathi never puts
a sequence in two in-flight micro-batches, so one long prompt's chunks pass the pipeline one after
another and P-1 stages wait (vLLM issue #41682, measured here in the chunked-pp study).

A chunk's stage time grows with its prefix (attention reads every earlier token), so fixed-size
chunks get slower along the prompt and the slowest one paces the pipeline. `chunking=dynamic`
sizes each chunk from the run's cost model so that it costs the stage time of the first chunk
(SGLang's rule, Runtime(prefix + chunk) - Runtime(prefix) = Runtime(first chunk), through
`view.estimate_prefill`); `chunking=fixed` keeps every chunk at `first_chunk` tokens (the
fixed-chunk baseline, still pipelined).

A micro-batch is: the running decodes not in flight (one token each, as Sarathi), then the next
chunk of the oldest partial prompt, sized for its prefix, then new prompts FCFS within what is
left of that chunk's token count (a new prompt starts at prefix 0, so the batch stays near the
target time). A prompt's whole KV is reserved when it is admitted, as Sarathi does, so a half-
prefilled prompt never waits for blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.base.errors import bad_value
from engine.core.policy import Policy, SchedulerView, register_policy
from engine.core.request import SeqStatus
from policies.common import add_decode_or_preempt

CHUNKINGS = ("dynamic", "fixed")


@dataclass(frozen=True)
class ChunkedPPParams:
    first_chunk: int = 4096  # tokens of a prompt's first chunk (SGLang's chunked_prefill_size)
    chunking: str = "dynamic"  # dynamic: equal stage time per chunk; fixed: first_chunk tokens each
    min_chunk: int = 256  # dynamic chunks never go below this (per-pass costs dominate smaller ones)
    align: int = 64  # dynamic chunk sizes are rounded down to a multiple of this
    max_num_seqs: int = 128

    def __post_init__(self) -> None:
        if self.chunking not in CHUNKINGS:
            raise bad_value("policy.chunking", self.chunking, f"valid choices: {', '.join(CHUNKINGS)}")
        for name in ("first_chunk", "min_chunk", "align", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise bad_value(f"policy.{name}", getattr(self, name), "must be >= 1")
        if self.min_chunk > self.first_chunk:
            raise bad_value("policy.min_chunk", self.min_chunk, f"must be <= policy.first_chunk ({self.first_chunk})")


@register_policy("chunked_pp")
class ChunkedPPPolicy(Policy):
    Params = ChunkedPPParams

    def __init__(self, params=None) -> None:
        super().__init__(params)
        self._target_s: float | None = None  # stage time of a first chunk
        self._sizes: dict[int, int] = {}  # prefix -> dynamic chunk size

    @classmethod
    def search_space(cls, trial) -> dict:
        return {"first_chunk": trial.suggest_categorical("first_chunk", [1024, 2048, 4096, 8192]),
                "chunking": trial.suggest_categorical("chunking", list(CHUNKINGS)),
                "min_chunk": trial.suggest_categorical("min_chunk", [128, 256, 512])}

    # --- chunk sizes -------------------------------------------------------------------------------
    def chunk_size(self, view: SchedulerView, prefix: int) -> int:
        """Tokens of the chunk that starts after `prefix` prompt tokens."""
        p = self.params
        if p.chunking == "fixed" or prefix == 0:
            return p.first_chunk
        size = self._sizes.get(prefix)
        if size is None:
            size = self._sizes[prefix] = self._solve(view, prefix)
        return size

    def _solve(self, view: SchedulerView, prefix: int) -> int:
        """The largest aligned x in [min_chunk, first_chunk] whose stage time after `prefix` is
        at most the first chunk's (bisection: the estimate grows with x)."""
        p = self.params
        if self._target_s is None:
            self._target_s = view.estimate_prefill(0, p.first_chunk)
        target = self._target_s
        lo, hi = p.min_chunk, p.first_chunk
        if view.estimate_prefill(prefix, hi) <= target:
            return hi
        if view.estimate_prefill(prefix, lo) >= target:
            return lo
        while hi - lo > 1:  # estimate(lo) < target < estimate(hi)
            mid = (lo + hi) // 2
            if view.estimate_prefill(prefix, mid) <= target:
                lo = mid
            else:
                hi = mid
        return max(p.min_chunk, lo - lo % p.align)

    # --- scheduling ----------------------------------------------------------------------------------
    def schedule(self, view: SchedulerView):
        p = self.params
        b = view.new_batch()
        decoding = SeqStatus.DECODING
        decodes = [s for s in view.running if not s.in_flight and s.status is decoding]
        first = b.add_decodes(decodes, p.max_num_seqs)
        if first < len(decodes):
            victims = [s for s in view.running if not s.in_flight]
            for seq in decodes[first:]:
                if seq not in b:
                    add_decode_or_preempt(b, seq, victims)
        budget = None  # tokens for prefill chunks: the head prompt's chunk size, less the decodes
        for seq in view.prefilling:
            if seq in b or seq.unscheduled_prefill == 0:
                continue
            if budget is None:
                budget = self.chunk_size(view, seq.num_computed + seq.inflight_prefill) - b.num_decode_seqs
            if budget <= 0:
                return view.finish(b)
            n = min(seq.unscheduled_prefill, budget)
            if b.add_pipelined_prefill(seq, n):
                budget -= n
        if budget is None:
            budget = p.first_chunk - b.num_decode_seqs
        running = view.num_running - len(b.preempted)
        for seq in view.waiting:
            if budget <= 0 or running >= p.max_num_seqs:
                break
            if seq in b:  # preempted in this very batch: recompute later
                continue
            n = min(seq.remaining_prefill, budget)
            if not b.add_prefill(seq, n, reserve_tokens=seq.prefill_target):
                break  # first-come first-served
            budget -= n
            running += 1
        return view.finish(b)
