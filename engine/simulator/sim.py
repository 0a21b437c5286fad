"""The discrete-event pipeline simulator: P stages and P-1 links as servers on a virtual clock.

Events live in one heap keyed `(time, priority, sequence number)`, so two runs of the same
config pop events in exactly the same order, bit for bit; the priority breaks same-time ties in
a fixed, documented order (tests/test_sim.py pins it):

    STAGE_DONE < LINK_DONE < ARRIVE < PREP_DONE < SAMPLE_DONE < COMPLETE

What one micro-batch does, stage s = 0..P-1:
  input preparation (CPU: metadata, tensors; serial before the forward unless the runtime
  overlaps it into a second buffer) -> forward of the stage's layers (cost model) -> on the last
  stage, sampling (inline on the GPU, or on a pool of CPU sampler processes with SiPipe's
  `cpu_sampling`) -> the activation crosses link s->s+1, a server with bandwidth whose data lands
  `latency` later; which pending activation (or chunk of one) a link sends is the policy's
  `schedule_transfer` choice; without `structure_aware_transfer` every send pays the cost model's
  per-hop metadata rounds. Token ids return to the driver after one link latency. A profile
  calibrated from a real engine's runs adds the driver's dispatch before stage 0 and the ids'
  return after sampling (`CostModel.dispatch_s`, `return_s`; 0 otherwise).

The common case needs no events at all: with FIFO sends, GPU sampling, serial input preparation
and asynchronous sends every stage and link serves micro-batches in launch order, so one batch's
whole timeline follows at launch from when each server is next free (`fifo_pipeline.FifoPipeline`, the same
float operations in the same order per stage and link). The controller and policies see only
completions and the clock, which come out the same; the tracer gets the same busy sums and the
same spans in the order the event loop would have recorded them (buffered and released by their
trigger event's heap key). Sarathi's 45k micro-batches of the 5,000-request benchmark simulated
in 1.9 s instead of 3.8 s this way (shared 2-core machine, load ~1).
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, replace

import numpy as np

from engine.core.batch import MicroBatch
from engine.base.errors import bad_value
from engine.core.executor import EXECUTORS, Completion, Executor, ExecutorBuild, ExecutorSpec
from engine.core.policy import LinkState, PendingTransfer, Policy, RuntimeFeatures, Transfer
from engine.core.trace import Tracer
from engine.pricing.sampling_ops import SamplerSettings
from engine.pricing.tcp_modes import tcp_links

from engine.simulator.handover import RELEASE, handover_for, receive_start
from engine.simulator.shared_device import SharedDevices, device_map
from engine.simulator.fifo_pipeline import (  # noqa: F401  (the event names are this module's API)
    ARRIVE, COMPLETE, EVENT_NAMES, LINK_DONE, PREP_DONE, SAMPLE_DONE, STAGE_DONE, FifoPipeline, PipelineView, Priced)


class EventQueue:
    """Min-heap of (time, priority, seq_no, payload); seq_no makes ties first-in first-out."""

    __slots__ = ("_heap", "_counter")

    def __init__(self) -> None:
        self._heap: list[tuple] = []
        self._counter = itertools.count()

    def push(self, time: float, priority: int, payload: tuple) -> None:
        heapq.heappush(self._heap, (time, priority, next(self._counter), payload))

    def pop(self) -> tuple:
        return heapq.heappop(self._heap)

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)


class SimExecutor(Executor):
    def __init__(self, cost_model, *, runtime: RuntimeFeatures = RuntimeFeatures(),
                 link_bandwidth_Bps: float, link_latency_s: float,
                 transfer_scheduler: Callable[[LinkState, Seq[PendingTransfer]], Transfer] | None = None,
                 num_cpu_samplers: int = 4, tracer: Tracer | None = None, blocking_send: bool = False,
                 event_driven: bool = False, link_model: str = "ideal",
                 sampling: SamplerSettings | None = None, compute_scale: float = 1.0, devices: int = 0) -> None:
        self.cost = cost_model
        self._forward_s = _scaled_forward(cost_model, compute_scale)
        self._sampling = sampling  # what GPU sampling is priced for (None: the host tables' path)
        self.pipeline_depth = P = cost_model.pp
        self.runtime = runtime
        self.bandwidth = float(link_bandwidth_Bps)
        self.latency = float(link_latency_s)
        self.transfer_scheduler = transfer_scheduler or _fifo
        self.blocking_send = blocking_send
        self.tracer = tracer or Tracer()
        self.events = EventQueue()
        self._clock = 0.0
        self._mbs: dict[int, MicroBatch] = {}
        # stage servers
        self._gpu_busy = [False] * P
        self._ready: list[deque[int]] = [deque() for _ in range(P)]  # input arrived (and prepared)
        self._running: list[tuple[float, float, int] | None] = [None] * P  # (start, end, mb) now on the GPU
        # overlapped input preparation (double buffer: at most one prepared batch waits per stage)
        self._prep_queue: list[deque[int]] = [deque() for _ in range(P)]
        self._cpu_busy = [False] * P
        self._prepared: list[set[int]] = [set() for _ in range(P)]
        self._arrived: list[set[int]] = [set() for _ in range(P)]
        # links s -> s+1
        self._link_pending: list[list[PendingTransfer]] = [[] for _ in range(max(0, P - 1))]
        self._link_busy = [False] * max(0, P - 1)
        self._inbound: dict[tuple[int, int], int] = {}  # (stage, mb) -> bytes still to arrive
        self._sampler_free_at = [0.0] * max(1, num_cpu_samplers)
        self._dispatched = 0.0  # when the driver's last dispatch reached stage 0 (engine terms)
        self._blocked_since: list[float | None] = [None] * P  # blocking send: stage held since
        self._last_result_at = -math.inf  # when the last stage last finished (`last_stage_request_s` counts from it)
        self._stage_tracks = [f"stage{s}" for s in range(P)]
        # stages sharing a device take turns on it (shared_device.py; None: a device per stage)
        placed = device_map(P, devices)
        self._devices = SharedDevices(placed) if placed is not None else None
        self._link_tracks = [f"link{s}-{s + 1}" for s in range(P - 1)]
        # Hot-path state (see `_price`, `_try_send`): the heap and its tie counter used directly,
        # each in-flight batch's costs computed once at launch, and FIFO sends without building
        # a LinkState when the scheduler is the default.
        self._heap = self.events._heap
        self._counter = self.events._counter
        self._priced: dict[int, Priced] = {}
        self._by_counts: dict[tuple[int, int, int, int], tuple] = {}  # `_price`'s memo
        self._fifo_sends = transfer_scheduler is None or transfer_scheduler is _fifo
        self._metadata_s = 0.0 if runtime.structure_aware_transfer else cost_model.coefficients.transfer_metadata_s
        # link.model=tcp: one TCP connection's state per link (engine/pricing/tcp_link.py), priced over its
        # burst outcomes (tcp_modes.py); None: the ideal pipe
        self._tcp = tcp_links(link_model, max(0, P - 1), self.bandwidth, self.latency)
        self._first_messages = 1 if runtime.structure_aware_transfer else 3  # size, metadata, tensor
        # a blocking send held until the next stage takes the activation (handover.py; None: off)
        self._handover = handover_for(blocking_send, P, cost_model.coefficients.handover_rendezvous_s,
                                      bool(runtime.structure_aware_transfer))
        # No events where every server is FIFO (see the module doc); `event_driven=True` forces the
        # event loop (tests compare the two).
        c = cost_model.coefficients
        host_recv = bool(c.recv_fixed_s or c.recv_per_byte_s)  # the FIFO path has no receive on the stage
        # vLLM 0.5.3's mp executor: the last stage's next request waits for its last result's round trip
        # (at P = 1 the one stage is the driver's own worker, called without a lock or a queue)
        self._request_after_result = P > 1 and bool(c.last_stage_request_fixed_s or c.last_stage_request_per_seq_s
                                                    or c.last_stage_request_per_context_token_s)
        fifo_only = not (runtime.overlap_input_prep or runtime.cpu_sampling or blocking_send or host_recv
                         or self._request_after_result or self._devices is not None) and self._fifo_sends
        plain_tracer = type(self.tracer).span is Tracer.span and type(self.tracer).chain is Tracer.chain
        self._fifo = FifoPipeline(self._pipeline_view()) if fifo_only and plain_tracer and not event_driven else None

    def _pipeline_view(self) -> PipelineView:
        """What the launch-time path (fifo_pipeline.py) needs of this executor."""
        return PipelineView(
            tracer=self.tracer, latency=self.latency, bandwidth=self.bandwidth,
            metadata_s=None if self.runtime.structure_aware_transfer else self._metadata_s,
            tcp=self._tcp, first_messages=self._first_messages,
            stage_tracks=tuple(self._stage_tracks), link_tracks=tuple(self._link_tracks))

    # --- Executor interface ----------------------------------------------------------------------
    def now(self) -> float:
        return self._clock

    def wait_until(self, t: float) -> None:
        if t > self._clock:
            self._clock = t

    def peek_time(self) -> float | None:
        """When the next pending event happens (None: nothing in flight); the paced executor
        (engine/simulator/paced.py) sleeps until then. Without per-stage events that is the next completion."""
        if self._fifo is not None:
            return self._fifo.done[0][0] if self._fifo.done else None
        return self.events.peek_time()

    def launch(self, mb: MicroBatch) -> None:
        if self._fifo is not None:
            self._fifo.launch(mb.mb_id, self._price(mb), self._clock)
            return
        self._mbs[mb.mb_id] = mb
        self._priced[mb.mb_id] = self._price(mb)
        if self.runtime.overlap_input_prep:
            for s in range(self.pipeline_depth):
                self._prep_queue[s].append(mb.mb_id)
                self._try_prep(s)
        dispatch = self._priced[mb.mb_id].dispatch
        if dispatch:  # the driver's step and message before stage 0 sees the batch (engine terms)
            self._dispatched = arrive = max(self._clock + dispatch, self._dispatched)  # one driver: in launch order
            heapq.heappush(self._heap, (arrive, ARRIVE, next(self._counter), (0, mb.mb_id, None)))
        else:
            self._arrive(0, mb.mb_id)

    def next_completion(self, deadline: float | None = None) -> Completion | None:
        if self._fifo is not None:
            done = self._fifo.next_done(deadline)
            if done is None:
                if deadline is not None and deadline > self._clock:
                    self._clock = deadline
                return None
            self._clock = done[0]
            return Completion(done[1], done[0])
        heap = self._heap
        pop = heapq.heappop
        while True:
            if not heap or (deadline is not None and heap[0][0] > deadline):
                if deadline is not None and deadline > self._clock:
                    self._clock = deadline
                return None
            t, prio, _, payload = pop(heap)
            self._clock = t
            if prio == STAGE_DONE:
                self._on_stage_done(*payload)
            elif prio == LINK_DONE:
                self._on_link_done(*payload)
            elif prio == ARRIVE:
                self._on_arrive(*payload)
            elif prio == PREP_DONE:
                self._on_prep_done(*payload)
            elif prio == SAMPLE_DONE:
                self._complete_after_return(payload[0])
            elif prio == RELEASE:
                self._release(*payload)
            else:  # COMPLETE
                mb_id = payload[0]
                del self._mbs[mb_id]
                del self._priced[mb_id]
                return Completion(mb_id, t)

    def shutdown(self) -> None:
        if self._fifo is not None:  # spans of batches still in flight, as the event loop had them so far
            self._fifo.release_spans(math.inf)
            self._fifo.settle()

    def _price(self, mb: MicroBatch) -> Priced:
        shape = mb.shape
        key = (shape.num_prefill_tokens, shape.num_decode_seqs, shape.num_seqs, shape.num_sampled)
        counts = self._by_counts.get(key)
        if counts is None:
            counts = self._by_counts[key] = self._price_counts(shape)
        # tuple.__new__ directly: a NamedTuple's own __new__ is Python code, run per micro-batch
        return _new_tuple(Priced, (self._forward_s(shape), _FORWARD_NAMES[mb.kind], *counts))

    def _price_counts(self, shape) -> tuple:
        """What a batch costs besides its forward: (prep, sample, nbytes, dispatch, ret), functions of
        the shape's four counts alone (`_price` keys them by those; tests/test_sim_price_memo.py
        checks that no other field moves them). 1,461 distinct keys among the 44,919 micro-batches
        of the 5,000-request Sarathi benchmark, where every whole shape is distinct."""
        cost = self.cost
        return (cost.prep_s(shape), cost.sample_s(shape, self._sampling), cost.activation_bytes(shape), cost.dispatch_s(shape),
                cost.return_s(shape), cost.recv_s(shape), cost.cpu_handoff_s(shape))

    # --- stages ------------------------------------------------------------------------------------
    def _arrive(self, stage: int, mb_id: int) -> None:
        if self.runtime.overlap_input_prep:
            self._arrived[stage].add(mb_id)
            if mb_id in self._prepared[stage]:
                self._ready[stage].append(mb_id)
        else:
            self._ready[stage].append(mb_id)
        self._try_start(stage, arrived=True)

    def _try_start(self, s: int, arrived: bool = False) -> None:
        ready = self._ready[s]
        if self._gpu_busy[s] or not ready:
            return
        mb_id = ready.popleft()
        priced = self._priced[mb_id]
        now = self._clock
        forward = (priced.forward_name, priced.forward[s])
        if self.runtime.overlap_input_prep:
            self._prepared[s].discard(mb_id)
            self._arrived[s].discard(mb_id)
            self._try_prep(s)  # the buffer it used is free for the next batch
            parts = (forward,)
        else:
            parts = (("prepare", priced.prep), forward)
        if s and priced.recv:  # a host device's receive, before the forward (0: not priced, no span)
            parts = parts[:-1] + (("recv", priced.recv), forward)
        if s == self.pipeline_depth - 1:
            if self._request_after_result:  # the driver's round trip since the last result (host: "schedule")
                wait = self._last_result_at + self.cost.last_stage_request_s(self._mbs[mb_id].shape) - now
                if wait > 0:
                    parts = (("schedule", wait),) + parts
            if not self.runtime.cpu_sampling:
                parts += (("sample", priced.sample),)
            elif priced.handoff:  # the logits' copy to the samplers holds the stage
                parts += (("to_samplers", priced.handoff),)
        if s and self._handover is not None:  # the previous stage waits for this receive (handover.py)
            freed = self._handover.taken(s - 1, mb_id, now if arrived else receive_start(now, parts))
            if freed is not None:
                heapq.heappush(self._heap, (freed[0], RELEASE, next(self._counter), (s - 1, freed[1])))
        if self._devices is None:
            t = self.tracer.chain(self._stage_tracks[s], now, parts, mb_id)
        else:  # the forward and what follows it wait for the device
            at = next(i for i, part in enumerate(parts) if part[0] == priced.forward_name)
            t = self._devices.chain(self.tracer, self._stage_tracks[s], s, now, parts, at, mb_id)
        self._gpu_busy[s] = True
        self._running[s] = (now, t, mb_id)
        heapq.heappush(self._heap, (t, STAGE_DONE, next(self._counter), (s, mb_id)))

    def _on_stage_done(self, s: int, mb_id: int) -> None:
        self._gpu_busy[s] = False
        self._running[s] = None
        now = self._clock
        mb = self._mbs[mb_id]
        if s == self.pipeline_depth - 1:
            self._last_result_at = now
        if s < self.pipeline_depth - 1:
            nbytes = self._priced[mb_id].nbytes
            if not self._fifo_sends:  # FIFO sends whole activations: each arrives in one piece
                self._inbound[(s + 1, mb_id)] = nbytes
            self._link_pending[s].append(PendingTransfer(mb, nbytes, nbytes, now))
            if self.blocking_send:
                # torch.distributed's send on CPU (gloo) returns only once the data has left:
                # the stage stays busy until its activation is off the link.
                self._gpu_busy[s] = True
                self._blocked_since[s] = now
                if self._handover is not None:
                    self._handover.sent(s, mb_id)
            self._try_send(s)
            if self.blocking_send:
                return
        elif self.runtime.cpu_sampling:
            # Logits go to the CPU sampler pool; the GPU is free at once. The pool shares a
            # micro-batch's rows among its processes (each holds the vocab-major penalty state
            # of its rows), so a batch starts when every sampler is free and takes 1/n of the
            # single-process time (plus the fixed cost).
            n = len(self._sampler_free_at)
            start = max(now, max(self._sampler_free_at))
            busy = sum(self._gpu_busy[:s])  # the stages before this one, working beside the samplers
            end = start + self.cost.cpu_sample_s(mb.shape, workers=n, sampling=self._sampling, busy_stages=busy)
            for k in range(n):
                self._sampler_free_at[k] = end
                self.tracer.span(f"sampler{k}", "sample", start, end, mb_id)
            self.events.push(end, SAMPLE_DONE, (mb_id,))
        else:
            self._complete_after_return(mb_id)
        self._try_start(s)

    def _complete_after_return(self, mb_id: int) -> None:
        done = self._clock + self.latency + self._priced[mb_id].ret  # + 0.0 unless calibrated: the same float
        heapq.heappush(self._heap, (done, COMPLETE, next(self._counter), (mb_id,)))

    # --- overlapped preparation ------------------------------------------------------------------
    def _try_prep(self, s: int) -> None:
        waiting_prepared = len(self._prepared[s])
        if self._cpu_busy[s] or not self._prep_queue[s] or waiting_prepared >= 1:
            return
        mb_id = self._prep_queue[s].popleft()
        prep = self._priced[mb_id].prep
        self._cpu_busy[s] = True
        self.tracer.span(f"{self._stage_tracks[s]}.cpu", "prepare", self._clock, self._clock + prep, mb_id)
        self.events.push(self._clock + prep, PREP_DONE, (s, mb_id))

    def _on_prep_done(self, s: int, mb_id: int) -> None:
        self._cpu_busy[s] = False
        self._prepared[s].add(mb_id)
        if mb_id in self._arrived[s]:
            self._ready[s].append(mb_id)
            self._try_start(s)
        self._try_prep(s)

    # --- links ---------------------------------------------------------------------------------------
    def _try_send(self, link: int) -> None:
        pending = self._link_pending[link]
        if self._link_busy[link] or not pending:
            return
        now = self._clock
        if self._fifo_sends:  # the default scheduler: the oldest activation, whole
            item = pending[0]
            nbytes = item.remaining_bytes
        else:
            running = self._running[link]
            info = {"upstream_busy": running is not None,
                    "upstream_start_s": running[0] if running else None,
                    "upstream_end_s": running[1] if running else None}
            state = LinkState(link, link + 1, self.bandwidth, self.latency, now, info)
            choice = self.transfer_scheduler(state, pending)
            item, nbytes = choice.item, int(choice.nbytes)
        if not 0 < nbytes <= item.remaining_bytes or item not in pending:
            raise RuntimeError(f"schedule_transfer chose {nbytes} bytes of micro-batch {item.mb.mb_id}, "
                               f"which has {item.remaining_bytes} pending on link {link}")
        first = item.remaining_bytes == item.total_bytes
        item.remaining_bytes -= nbytes
        if item.remaining_bytes == 0:
            pending.remove(item)
        if self._tcp is not None:  # a later chunk of an activation is one message: its metadata went first
            duration = self._tcp[link].send(now, nbytes, self._first_messages if first else 1)[0] - now
        else:
            duration = nbytes / self.bandwidth
            if not self.runtime.structure_aware_transfer:
                duration += self._metadata_s
        self._link_busy[link] = True
        mb_id = item.mb.mb_id
        self.tracer.span(self._link_tracks[link], "send", now, now + duration, mb_id)
        heapq.heappush(self._heap, (now + duration, LINK_DONE, next(self._counter),
                                    (link, mb_id, nbytes, item.remaining_bytes == 0)))

    def _on_link_done(self, link: int, mb_id: int, nbytes: int, last: bool) -> None:
        self._link_busy[link] = False
        heapq.heappush(self._heap, (self._clock + self.latency, ARRIVE, next(self._counter), (link + 1, mb_id, nbytes)))
        if self.blocking_send and last and self._blocked_since[link] is not None:
            # the sending stage (index == link) is released once its activation has left (and,
            # with the hand-over term, once the next stage has taken it: handover.py)
            if self._handover is None or self._handover.free(link):
                self._release(link, mb_id)
            else:
                self._handover.hold(link, mb_id)
        self._try_send(link)

    def _release(self, s: int, mb_id: int) -> None:
        """Stage `s`, held by its blocking send of `mb_id`, goes on."""
        self.tracer.span(self._stage_tracks[s], "send", self._blocked_since[s], self._clock, mb_id)
        self._blocked_since[s] = None
        self._gpu_busy[s] = False
        self._try_start(s)

    def _on_arrive(self, stage: int, mb_id: int, nbytes: int | None) -> None:
        if self._fifo_sends or nbytes is None:  # whole activations, or the driver's dispatch to stage 0
            self._arrive(stage, mb_id)
            return
        key = (stage, mb_id)
        left = self._inbound[key] - nbytes
        if left > 0:
            self._inbound[key] = left
            return
        del self._inbound[key]
        self._arrive(stage, mb_id)


_new_tuple = tuple.__new__


def _scaled_forward(cost, scale: float) -> Callable:
    """Every stage's forward price, times `scale` unless it is 1 (the cost model's own method then:
    no extra call per micro-batch, and the default's results are the unscaled floats)."""
    if scale == 1.0:
        return cost.stage_compute_all_s
    price = cost.stage_compute_all_s
    return lambda shape: tuple([v * scale for v in price(shape)])


_FORWARD_NAMES = {kind: f"forward:{kind}" for kind in ("prefill", "decode", "mixed")}  # by MicroBatch.kind
def _fifo(link: LinkState, pending: Seq[PendingTransfer]) -> Transfer:
    return Transfer(pending[0], pending[0].remaining_bytes)


@dataclass(frozen=True)
class SimSettings:
    """`executor=sim` settings."""

    num_cpu_samplers: int = 4  # SiPipe's CPU sampler pool size (used with runtime.cpu_sampling)
    # The sending stage waits until its activation has left the link, as torch.distributed's
    # blocking send does on CPU (gloo): measured 17 ms per hop on the 2-core machine at P=2,
    # longer than the forward. GPU engines send asynchronously (the default).
    blocking_send: bool = False
    # The accelerator is the host's CPU (the torch engine with executor.device=cpu): input
    # preparation "overlapped" on a second thread runs on the cores the forward uses, so it is priced
    # serial. SiPipe at P=2 on the 2-core machine: the engine served 2,906-2,933 tok/s like sarathi
    # (2,478-2,990), the simulator with the overlap +19-20% (tiny-llama ShareGPT 100, load ~15).
    host_device: bool = False
    # The sampling parameters GPU sampling is priced for (engine/pricing/sampling_ops.py; the names
    # and off values of vLLM's SamplingParams and of `executor=torch`). The defaults are what the
    # host tables measured (temperature 1, nothing else), priced by their fit alone.
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Every stage's forward time multiplied by this: a machine that runs this much slower (1.05) or
    # faster (0.95) than its profile. The CPU engine's same-shape forward moved 5-13% between repeats
    # of one command (set 7, docs/measurements/real-runs-2026-11-28d.md); `testbed validate --runs
    # --spread s` predicts a run as the mean over scales 1 - s ... 1 + s (testbed/calibrate/spread_sim.py).
    compute_scale: float = 1.0
    # The devices the P stages run on, stage s on s mod devices as the torch engine places them; fewer
    # than P: stages sharing a device take turns on it (engine/simulator/shared_device.py). 0: one each.
    devices: int = 0

    def __post_init__(self) -> None:
        if self.num_cpu_samplers < 1:
            raise bad_value("executor.num_cpu_samplers", self.num_cpu_samplers, "must be >= 1")
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 0:
            raise bad_value("executor.devices", self.devices, "must be an integer >= 0 (0: one device per stage)")
        if isinstance(self.compute_scale, bool) or not (isinstance(self.compute_scale, (int, float))
                                                        and 0.0 < self.compute_scale < 100.0):
            raise bad_value("executor.compute_scale", self.compute_scale, "must be a number in (0, 100)")
        _ = self.sampling  # validates the six settings (one `error:` line each)

    @property
    def sampling(self) -> SamplerSettings:
        return SamplerSettings(self.temperature, self.top_k, self.top_p, self.repetition_penalty,
                               self.presence_penalty, self.frequency_penalty)


def _make_sim(settings: SimSettings, build: ExecutorBuild) -> SimExecutor:
    # A policy that keeps the base class's FIFO schedule_transfer gets the executor's own FIFO
    # fast path (no LinkState per send); the choice is the same.
    custom = getattr(type(build.policy), "schedule_transfer", None) is not Policy.schedule_transfer
    runtime = replace(build.runtime, overlap_input_prep=False) if settings.host_device else build.runtime
    return SimExecutor(build.cost_model, runtime=runtime, link_bandwidth_Bps=build.link.bandwidth_Bps,
                       link_latency_s=build.link.latency_s,
                       transfer_scheduler=build.policy.schedule_transfer if custom else None,
                       num_cpu_samplers=settings.num_cpu_samplers, tracer=build.tracer,
                       blocking_send=settings.blocking_send, link_model=build.link.model,
                       sampling=settings.sampling, compute_scale=float(settings.compute_scale),
                       devices=settings.devices)


EXECUTORS.add("sim", ExecutorSpec(SimSettings, _make_sim))
