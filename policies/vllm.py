"""Separate batching, the "PP+SB" baseline: vLLM's classic (v0) scheduler (SOSP'23; docs/policies.md#vllm).

A micro-batch is prefill-only (whole prompts, up to `max_num_batched_tokens` and `max_num_seqs`)
whenever waiting prompts fit in KV; otherwise decode-only. Prefill first.

`runtime=v0` (default) is vLLM's pipeline-parallel runtime as the seed papers ran it (TD-Pipe on
vLLM 0.5.3, MoLink on 0.7.2, gLLM on 0.8.1; the three versions agree on every point below, read
from their sources):
- One `Scheduler` per virtual engine, P of them (`LLMEngine.__init__`, vllm/engine/llm_engine.py),
  each with 1/P of the KV blocks (`Scheduler.__init__`, vllm/core/scheduler.py: `num_gpu_blocks //=
  pipeline_parallel_size`) and the full `max_num_seqs` / `max_num_batched_tokens` budget (one
  `SchedulerConfig` shared by all).
- A request joins the waiting queue of the virtual engine with the fewest unfinished sequence
  groups (waiting + running + swapped), the first on a tie (`LLMEngine._add_processed_request`:
  `costs.index(min(costs))`), and stays there: a preempted sequence waits again at the front of its
  own engine's queue. It is placed when an engine's next `engine_step` starts, not on arrival
  (`placement=step-start`, `_arrivals_read`); `placement=arrival` is the earlier model.
- Prefill admission (`Scheduler._schedule_prefills`): FCFS over the engine's own queue, stopping at
  the first prompt its share of KV cannot take with the watermark (`BlockSpaceManager.can_allocate`,
  1% of the blocks) or the budget cannot; decodes only when no prompt was admitted
  (`Scheduler._schedule_default`); a decode that finds no free block preempts the engine's latest
  running sequence (`_schedule_running`, recompute).
- `max_num_batched_tokens` defaults to max(max_model_len, 2048) without chunked prefill
  (`SchedulerConfig.__init__`, vllm/config.py); chunked prefill is off unless max_model_len > 32k
  (`EngineArgs`), which no separate-batching study uses.
- How a stage waits: each virtual engine has one step in flight (`AsyncLLMEngine.run_engine_loop`
  awaits `engine_step(ve)` before the next); every stage runs the steps in the order they were
  issued (`MultiprocessingGPUExecutorAsync._driver_execute_model_async`: one asyncio lock per
  stage). Output processing is synchronous: 0.5.3 has no async output processor, and 0.7.2 / 0.8.1
  turn it off for PP (`ModelConfig.verify_async_output_proc`,
  `verify_with_parallel_config`); the cost model's host terms price the step, this policy adds none.
- An engine that ran dry is stepped again as soon as a request is placed on it (`idle_engines=step`):
  `run_engine_loop` stops re-creating its `engine_step` task (`has_requests_in_progress[ve] = False`),
  but the finished task stays in `requests_in_progress`, so every `asyncio.wait(...,
  FIRST_COMPLETED)` returns at once with it in `done` and the loop re-checks
  `has_unfinished_requests_for_virtual_engine(ve)` each turn (0.5.3, 0.7.2, 0.8.1 alike). Only
  when every engine is dry does it wait for a new request. `idle_engines=park` is the what-if of an
  engine that is not re-checked (`_park_or_restart`); it is not what vLLM does.
Host costs are the cost model's, shared with every policy. One is vLLM 0.5.3's own: its mp executor
pickles each step's whole `ExecuteModelRequest` to every stage (`ProcessWorkerWrapper._enqueue_task`),
and each stage unpickles it. The variant `cost.prep_per_context_token_s=8e-8` prices that (measured
here, 75-85 ns a context token; TD-Pipe's own message 20-27 ns). It moves TD-Pipe / PP+SB from 1.243x
to 1.257x (docs/measurements/tdpipe-baseline-2026-11-27.md). It is off by default.
The variant `vllm053-mp` adds 0.5.3's second asymmetry with TD-Pipe: a stage gets its next step only
once its previous result is back at the driver (the request is put on the stage's queue inside the
stage's asyncio lock: `MultiprocessingGPUExecutorAsync._driver_execute_model_async`,
vllm/executor/multiproc_gpu_executor.py), which idles the last stage, whose call returns only after
sampling; TD-Pipe queues every step on every worker when it schedules it. `cost.last_stage_request_*`
price it from this machine's measurement (docs/measurements/reproduction-2026-11-28.md); off by default.
`runtime=shared` is this testbed's earlier idealisation, kept to show what the split costs: one KV
pool, a free virtual engine admits any waiting prompt, `max_num_batched_tokens` 8192 by default.
`chunked_prefill=true` is the same v0 runtime with vLLM's chunked prefill (`--enable-chunked-prefill`): each
virtual engine's step is a hybrid micro-batch under a 2,048-token budget by default (`_hybrid_batch`); vLLM
0.8.1 turns it on by itself only above 32,768 tokens of context (`EngineArgs._set_default_args_v0`,
vllm/engine/arg_utils.py), and with PP it runs the v0 engine (`_is_v1_supported_oracle`: PP falls back).
0.5.3 has the same step (`_schedule_chunked_prefill`) and allows it with PP, at a 512-token default
(`SchedulerConfig.__init__`): `max_num_batched_tokens=512` is that version (tdpipe-scaling's PP+HB).
`virtual_engines=false` makes one scheduler serve every slot (the PP pitfall of vllm issue 41682).
A prompt longer than `max_num_batched_tokens` is admitted alone rather than never.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.base.errors import bad_value
from engine.core.batch import MicroBatch
from engine.core.policy import Policy, SchedulerView, register_policy
from engine.core.request import SeqStatus, Sequence
from policies.common import add_decode_or_preempt

RUNTIMES = ("v0", "shared")
PLACEMENTS = ("step-start", "arrival")  # v0: when an arrival is placed (vLLM: an engine_step's start)
IDLE_ENGINES = ("step", "park")  # v0: an engine with work is stepped (vLLM) / the "park" what-if (`_park_or_restart`)
SHARED_BATCHED_TOKENS = 8192  # the `shared` idealisation's budget (this testbed's earlier default)
CHUNKED_BATCHED_TOKENS = 2048  # v0 with chunked prefill: `SchedulerConfig.__post_init__` (vllm/config.py, 0.8.1)
WATERMARK = 0.01  # vLLM's `CacheConfig.watermark`: blocks a prefill admission must leave free


@dataclass(frozen=True)
class VllmParams:
    max_num_batched_tokens: int = 0  # 0: vLLM's default (v0: max(max_model_len, 2048); chunked_prefill: 2048; shared: 8192)
    max_num_seqs: int = 256  # vLLM's default, per virtual engine
    virtual_engines: bool = True
    runtime: str = "v0"
    placement: str = "step-start"  # v0 only: "step-start" is vLLM (`_arrivals_read`), "arrival" the earlier model
    idle_engines: str = "step"  # v0 only: "step" is vLLM's run_engine_loop as it runs; "park" a what-if it does not do
    chunked_prefill: bool = False  # v0 only: each virtual engine's step as `Scheduler._schedule_chunked_prefill`

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 0:
            raise bad_value("policy.max_num_batched_tokens", self.max_num_batched_tokens,
                            "must be >= 1, or 0 for vLLM's default")
        if self.max_num_seqs < 1:
            raise bad_value("policy.max_num_seqs", self.max_num_seqs, "must be >= 1")
        if self.runtime not in RUNTIMES:
            raise bad_value("policy.runtime", self.runtime, f"choose one of {', '.join(RUNTIMES)}")
        if self.placement not in PLACEMENTS:
            raise bad_value("policy.placement", self.placement, f"choose one of {', '.join(PLACEMENTS)}")
        if self.idle_engines not in IDLE_ENGINES:
            raise bad_value("policy.idle_engines", self.idle_engines, f"choose one of {', '.join(IDLE_ENGINES)}")
        if self.chunked_prefill and (self.runtime != "v0" or not self.virtual_engines):
            raise bad_value("policy.chunked_prefill", self.chunked_prefill,
                            "needs policy.runtime=v0 with policy.virtual_engines=true (vLLM's own PP runtime)")


@register_policy("vllm")
class VllmPolicy(Policy):
    Params = VllmParams

    def __init__(self, params=None) -> None:
        super().__init__(params)
        self._engine_of: dict[int, int] = {}  # seq id -> its virtual engine
        self._members: dict[int, dict[int, Sequence]] = {}  # engine -> its running seqs, admission order
        self._unfinished: dict[int, int] = {}  # v0: engine -> its unfinished sequences (waiting or running)
        self._busy: set[int] = set()  # virtual engines with a micro-batch in flight
        self._next = 0  # round-robin start
        self._v0 = self.params.runtime == "v0" and self.params.virtual_engines
        self._park = self._v0 and self.params.idle_engines == "park"
        self._at_step_start = self._v0 and self.params.placement == "step-start"
        self._parked: set[int] = set()  # v0 "park": engines run_engine_loop no longer steps
        self._budget = self.params.max_num_batched_tokens or SHARED_BATCHED_TOKENS

    @classmethod
    def search_space(cls, trial) -> dict:
        return {"max_num_batched_tokens": trial.suggest_categorical("max_num_batched_tokens", [2048, 4096, 8192, 16384]),
                "max_num_seqs": trial.suggest_categorical("max_num_seqs", [64, 128, 256, 512])}

    def start(self, view: SchedulerView) -> None:
        model = getattr(view.cost_model, "model", None)
        if self.params.chunked_prefill and not self.params.max_num_batched_tokens:
            self._budget = CHUNKED_BATCHED_TOKENS
        elif self.params.runtime == "v0" and not self.params.max_num_batched_tokens and model is not None:
            self._budget = max(model.max_position_embeddings, 2048)  # without a model: 8,192

    def schedule(self, view: SchedulerView):
        """Serve the first idle virtual engine (round robin) that has work; an engine with
        nothing to do must not block another whose sequences hold the KV."""
        p = self.params
        engines = self.num_engines(view) if p.virtual_engines else 1
        if self._v0:
            self._assign_arrivals(view, engines)
        for i in range(engines):
            ve = (self._next + i) % engines
            if ve in self._busy or ve in self._parked:
                continue
            mb = self._schedule_engine(view, ve, engines)
            if mb is not None:
                self._next = (ve + 1) % engines
                mb.tags["ve"] = ve
                if p.virtual_engines:
                    self._busy.add(ve)
                return mb
        return None

    def num_engines(self, view: SchedulerView) -> int:
        """One virtual engine per micro-batch slot (vLLM: one per stage, P by default)."""
        return self.max_inflight(view)

    def _assign_arrivals(self, view: SchedulerView, engines: int) -> None:
        """Arrivals not yet placed join the engine with the fewest unfinished sequences. They are
        the tail of the waiting queue (arrivals are appended; preempted sequences, placed long
        ago, go to its front), placed in arrival order."""
        new = []
        for seq in reversed(view.waiting):
            if seq.seq_id in self._engine_of:
                break
            new.append(seq)
        counts = self._unfinished
        if self._park:
            self._park_or_restart(engines, bool(new))
        if new and self._at_step_start and not self._arrivals_read(engines):
            return
        for seq in reversed(new):
            ve = min(range(engines), key=lambda e: counts.get(e, 0))
            self._engine_of[seq.seq_id] = ve
            counts[ve] = counts.get(ve, 0) + 1

    def _arrivals_read(self, engines: int) -> bool:
        """vLLM reads new requests only where an `engine_step(ve)` starts
        (`RequestTracker.get_new_and_finished_requests`, 0.7.2 / 0.8.1 `get_new_and_aborted_requests`,
        vllm/engine/async_llm_engine.py), and places them then, by the costs of that moment. A step starts on an
        engine that is free and has work (it just finished a step, or spins on empty ones), or on
        every engine when all are dry (`wait_for_new_requests` returns at once). While each engine
        with work is mid-step and the rest are dry, an arrival waits in the tracker for the next
        step to end (a dry engine is re-checked but not stepped: it has nothing to read them)."""
        busy, unfinished, parked = self._busy, self._unfinished, self._parked
        free = [ve for ve in range(engines) if ve not in busy and ve not in parked]
        if any(unfinished.get(ve, 0) for ve in free):
            return True
        return len(free) == engines

    def _park_or_restart(self, engines: int, arrivals: bool) -> None:
        """The `park` what-if, a reading of `AsyncLLMEngine.run_engine_loop` (vllm/engine/
        async_llm_engine.py, 0.5.3 / 0.7.2 / 0.8.1) that vLLM does not run: an engine whose step
        left it no unfinished sequence is not stepped until every engine is so (then all restart
        when a request came since the last restart: `wait_for_new_requests`), while arrivals are
        placed on it by fewest unfinished (`LLMEngine._add_processed_request`), so they wait there
        until the others drain. vLLM re-checks such an engine every loop turn (its finished task
        stays in the set `asyncio.wait` returns at once: module docstring), so `step` is the
        default. Kept to show what parking would cost (gllm-capacity, placement on arrival: vLLM-SB
        0.2828 -> 0.0155 req/s, docs/measurements/vllm-v0-idle-2026-11-28c.md). A free engine with nothing to do parks at
        once (its empty step costs nothing here); offline nothing arrives after the first restart,
        so nothing changes (a test)."""
        unfinished = self._unfinished
        parked = self._parked
        for ve in range(engines):
            if ve not in self._busy and not unfinished.get(ve, 0):
                parked.add(ve)
        if len(parked) == engines and (arrivals or any(unfinished.get(ve, 0) for ve in range(engines))):
            parked.clear()

    def _schedule_engine(self, view: SchedulerView, ve: int, engines: int):
        p = self.params
        if p.virtual_engines:
            decoding, prefilling = SeqStatus.DECODING, SeqStatus.PREFILLING  # `is_running`, inlined
            mine = [s for s in self._members.setdefault(ve, {}).values()
                    if (st := s.status) is decoding or st is prefilling]
        else:
            mine = [s for s in view.running if not s.in_flight]
        free = self._kv_share_free(view, mine, engines) if self._v0 else None
        if p.chunked_prefill:
            return self._hybrid_batch(view, ve, mine, free)
        mb = self._prefill_batch(view, ve, len(mine) if p.virtual_engines else view.num_running, free, mine)
        return mb if mb is not None else self._decode_batch(view, mine, free)

    def _kv_share_free(self, view: SchedulerView, mine: list[Sequence], engines: int) -> int:
        """Free blocks of this engine's 1/P share of the cache."""
        return view.kv_total_blocks // engines - sum(view.kv_blocks_of(s) for s in mine)

    def _prefill_batch(self, view: SchedulerView, ve: int, running: int, free: int | None,
                       mine: list[Sequence]) -> MicroBatch | None:
        b = view.new_batch()
        b.tags["phase"] = "prefill"
        if free is not None:  # the share less the watermark
            b.free_blocks = min(b.free_blocks, free - self._watermark(view))
        self._admit_prompts(view, b, ve, mine, running, free, self._budget, chunked=False)
        return view.finish(b)

    def _watermark(self, view: SchedulerView) -> int:
        """Blocks a prompt's admission leaves free in an engine's share (`CacheConfig.watermark`)."""
        return int(WATERMARK * (view.kv_total_blocks // max(1, self.num_engines(view))))

    def _admit_prompts(self, view: SchedulerView, b, ve: int, mine: list[Sequence], running: int,
                       free: int | None, budget: int, chunked: bool) -> None:
        """The engine's waiting prompts into `b`, FCFS, while it runs fewer than `max_num_seqs` and
        `budget` prompt tokens are left: whole prompts, or (`chunked`) a prompt's next chunk of at most
        what is left; each admitted only while its whole prompt's blocks fit (reserved at admission)."""
        for seq in view.waiting:
            if self._v0 and self._engine_of.get(seq.seq_id) != ve or seq in b:
                continue
            if running >= self.params.max_num_seqs or budget <= 0:
                break
            n = min(seq.remaining_prefill, budget) if chunked else seq.remaining_prefill
            if n > budget and b.num_seqs > 0:
                break
            if not b.add_prefill(seq, n, reserve_tokens=seq.prefill_target):
                if not (free is not None and not mine and not b.num_seqs and self._alone(view, b, seq, n)):
                    break
            self._admit(seq, ve)
            budget -= n
            running += 1

    def _hybrid_batch(self, view: SchedulerView, ve: int, mine: list[Sequence], free: int) -> MicroBatch | None:
        """One virtual engine's step with chunked prefill (`Scheduler._schedule_chunked_prefill`,
        vllm/core/scheduler.py, 0.8.1): its running decodes first, FCFS, one token each (a decode
        without a free block preempts the engine's latest running sequence, `_schedule_running`); then
        the next chunk of its partial prompts; then its waiting prompts FCFS (`_schedule_prefills` with
        `enable_chunking`), each chunk min(what is left of the prompt, the budget left); a new prompt is
        admitted only while its whole prompt's blocks fit the engine's share less the watermark
        (`BlockSpaceManager.can_allocate` at admission) and the engine runs fewer than `max_num_seqs`."""
        b = view.new_batch()
        b.tags["phase"] = "hybrid"
        b.free_blocks = min(b.free_blocks, free)
        self._add_decodes(b, mine, min(self._budget, self.params.max_num_seqs))
        budget = self._budget - b.num_decode_seqs
        prefilling = SeqStatus.PREFILLING
        for seq in mine:
            if budget <= 0:
                break
            if seq.status is prefilling and seq not in b and not seq.in_flight:
                n = min(seq.remaining_prefill, budget)
                if b.add_prefill(seq, n):
                    budget -= n
        b.free_blocks -= self._watermark(view)
        self._admit_prompts(view, b, ve, mine, len(mine) - len(b.preempted), free, budget, chunked=True)
        return view.finish(b)

    @staticmethod
    def _alone(view: SchedulerView, b, seq: Sequence, n: int) -> bool:
        """A prompt larger than an empty engine's share goes alone on the whole cache (vLLM
        would ignore it: `AllocStatus.NEVER`); nothing else joins it."""
        b.free_blocks = view.kv_free_blocks
        ok = b.add_prefill(seq, n, reserve_tokens=seq.prefill_target)
        b.free_blocks = 0
        return ok

    def _decode_batch(self, view: SchedulerView, mine: list[Sequence], free: int | None) -> MicroBatch | None:
        b = view.new_batch()
        b.tags["phase"] = "decode"
        if free is not None:
            b.free_blocks = min(b.free_blocks, free)
        self._add_decodes(b, mine, self.params.max_num_seqs)
        return view.finish(b)

    @staticmethod
    def _add_decodes(b, mine: list[Sequence], limit: int) -> None:
        """The engine's decodes into `b`, FCFS, up to `limit`; one short of a block preempts the engine's
        latest running sequence (`_schedule_running`)."""
        decoding = SeqStatus.DECODING
        decodes = [s for s in mine if s.status is decoding]
        first = b.add_decodes(decodes, limit)  # all that fit in one call, the common case
        victims = list(mine) if first < len(decodes) else []  # preemption candidates: the slow path only
        for seq in decodes[first:]:
            if b.num_decode_seqs >= limit:
                break
            if seq not in b:
                add_decode_or_preempt(b, seq, victims)

    def _admit(self, seq: Sequence, ve: int) -> None:
        old = self._engine_of.get(seq.seq_id)
        if old is not None and old in self._members:  # re-admitted after preemption: at the end
            self._members[old].pop(seq.seq_id, None)
        if not self._v0:
            self._engine_of[seq.seq_id] = ve
        self._members.setdefault(ve, {})[seq.seq_id] = seq

    def _forget(self, seq: Sequence) -> None:
        ve = self._engine_of.pop(seq.seq_id, None)
        if ve is not None:
            self._members.setdefault(ve, {}).pop(seq.seq_id, None)
            if self._v0:
                self._unfinished[ve] -= 1

    def on_abort(self, view: SchedulerView, seq: Sequence) -> None:
        self._forget(seq)

    def on_complete(self, view: SchedulerView, micro_batch: MicroBatch, finished) -> None:
        self._busy.discard(micro_batch.tags.get("ve"))
        for seq in finished:
            self._forget(seq)
