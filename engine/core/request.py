"""Requests and the life of a sequence inside the controller.

A `Request` is what a workload produces: immutable, with an arrival time and the two lengths
that drive every cost (prompt tokens, tokens to generate). A `Sequence` is the controller's
mutable record of one request while it is served. Its states follow the usual paged-attention
engines:

    WAITING --admit--> PREFILLING --last prompt chunk sampled--> DECODING --last token--> FINISHED
        ^                  |                                          |
        +---- PREEMPTED <--+------------------------------------------+   (KV freed, recompute)
    any state --impossible to serve--> FAILED (reported, never silently dropped)

Preemption is by recomputation: the KV is freed and the sequence later re-prefills its prompt
plus the tokens it had already generated (vLLM's recompute mode), so `prefill_target` grows
with `num_generated`.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request as a workload yields it.

    `prompt_text` and `prompt_token_ids` are optional: the simulator needs only lengths, the
    torch executor derives deterministic ids from `request_id` when none are given, and text
    feeds output-length predictors.
    """

    request_id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams | None = None  # per-request sampling (served requests); None = the run's

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"request {self.request_id}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.output_len < 1:
            raise ValueError(f"request {self.request_id}: output_len must be >= 1, got {self.output_len}")
        if self.arrival_s < 0:
            raise ValueError(f"request {self.request_id}: arrival_s must be >= 0, got {self.arrival_s}")


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One request's sampling, as an OpenAI-compatible client asks for it (vLLM's definitions).

    The real engine's last stage applies it to this request's rows only (engine/torch_exec/
    sampling.py); requests without one use the run's `executor.*` sampling. `temperature` 0 is
    greedy; `top_k` 0 and `top_p` 1 are off; `seed` None draws from the run's `sample_seed`."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def problem(self) -> str | None:
        """Why the stage processes cannot take this sampling (None when they can): integers they
        cannot pack as int64 (`seed` >= 2^64 stopped the engine), non-finite or non-positive
        values. The HTTP API checks its narrower ranges first; this guards every other caller."""
        for name in ("seed", "top_k"):
            v = getattr(self, name)
            if v is not None and not INT64_MIN <= v <= INT64_MAX:
                return f"{name}={v} is outside [-2^63, 2^63-1]"
        floats = ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        bad = next((n for n in floats if not math.isfinite(getattr(self, n))), None)
        if bad is not None:
            return f"{bad}={getattr(self, bad)} is not a finite number"
        if self.temperature < 0 or self.repetition_penalty <= 0 or not 0 < self.top_p <= 1:
            return "temperature must be >= 0, repetition_penalty > 0 and top_p in (0, 1]"
        return None

    def as_tuple(self) -> tuple:
        """Plain values for the stage processes' control messages."""
        return (self.temperature, self.top_p, self.top_k, self.seed, self.repetition_penalty,
                self.presence_penalty, self.frequency_penalty)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"  # waiting again, to recompute its prompt + generated tokens
    FINISHED = "finished"
    FAILED = "failed"


_WAITING, _PREFILLING, _DECODING = SeqStatus.WAITING, SeqStatus.PREFILLING, SeqStatus.DECODING
_PREEMPTED, _FINISHED, _FAILED = SeqStatus.PREEMPTED, SeqStatus.FINISHED, SeqStatus.FAILED


@dataclass(eq=False, slots=True)
class Sequence:
    """The controller's state of one request. Policies read it; only the controller writes it."""

    request: Request
    seq_id: int = field(init=False)  # = request.request_id; a plain attribute, read on hot paths
    output_len: int = field(init=False)  # = request.output_len, likewise (read once per decoded token)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    num_generated: int = 0  # output tokens sampled so far
    in_flight: bool = False  # part of a launched, not yet completed micro-batch
    # prompt tokens in launched, not yet completed prefill chunks: more than one chunk of a prompt
    # may be in flight at once (chunked pipeline prefill, `BatchBuilder.add_pipelined_prefill`)
    inflight_prefill: int = 0
    admit_order: int = -1  # position in admission order; the latest admitted is preempted first
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None  # when its latest output token was sampled (the time between tokens)
    finish_s: float | None = None
    fail_reason: str | None = None
    output_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seq_id = self.request.request_id
        self.output_len = self.request.output_len

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def prefill_target(self) -> int:
        """Tokens to prefill before the next token can be sampled (prompt + recomputed output)."""
        return self.request.prompt_len + self.num_generated

    @property
    def remaining_prefill(self) -> int:
        return max(0, self.prefill_target - self.num_computed)

    @property
    def unscheduled_prefill(self) -> int:
        """Prompt tokens not yet in any launched chunk (`remaining_prefill` minus those in flight)."""
        return max(0, self.prefill_target - self.num_computed - self.inflight_prefill)

    @property
    def total_len(self) -> int:
        """Tokens known so far: prompt plus generated."""
        return self.request.prompt_len + self.num_generated

    @property
    def remaining_output(self) -> int:
        return self.request.output_len - self.num_generated

    # Identity tests against module constants: `status in (SeqStatus.A, SeqStatus.B)` looked up
    # both members and built a tuple on every call, and vLLM's per-batch scan of its engine's
    # sequences made `is_running` 18% of its 5,000-request benchmark run (py-spy); 230 -> 50 ns a call.
    @property
    def is_waiting(self) -> bool:
        status = self.status
        return status is _WAITING or status is _PREEMPTED

    @property
    def is_running(self) -> bool:
        status = self.status
        return status is _PREFILLING or status is _DECODING

    @property
    def is_done(self) -> bool:
        status = self.status
        return status is _FINISHED or status is _FAILED

    def __repr__(self) -> str:  # short, for error messages and debugging
        return (f"Sequence(id={self.seq_id}, {self.status.value}, computed={self.num_computed}, "
                f"generated={self.num_generated}/{self.output_len})")
