"""The engine thread: the same Controller and policy as `testbed run`, fed by HTTP requests.

One thread owns the controller (it is not thread-safe) and loops over its online API
(engine/core/controller.py): new requests and aborts come through a thread-safe inbox and are applied
between steps (`Controller.submit`, `Controller.abort`); `Controller.step` schedules, launches and
applies one completion; its `inspect` hook sees each sampled token first, so a request that
samples EOS (unless `ignore_eos`), one of its `stop_token_ids` or completes a stop string ends
with that token (`Controller.finish_early`). Text deltas go to each request's asyncio queue with
`loop.call_soon_threadsafe`, as `("delta", text, tokens)` events and one final
`("end", finish_reason, prompt_tokens, completion_tokens, error)`; finish_reason is
"stop", "length", "abort", "error" or "shutdown" (cut by the server's shutdown after
`serve.drain_timeout_s`: `cut_open`; its client gets an error event and `[DONE]`, or a 503).

Waiting for work: the paced simulator is woken at once by a new arrival (`PacedExecutor.wake`);
the real engine's executor blocks on its sockets, so the thread waits at most
`serve.poll_interval_s` (5 ms) before it looks at the inbox again while a pipeline slot is free.

One request cannot stop the loop: a request whose sampling the stages cannot take
(`SamplingParams.problem`) or whose submission raises ends with an error alone, and a step that
raises anything but a dead stage fails the requests it held (their KV freed) while the loop goes
on serving; only stages that are gone make the engine dead (503).

Text: the whole reply is decoded again after each token (simple and exact for any tokenizer;
the fallback codec of codec.py appends instead), and the text that could still become a stop
string, or ends in an incomplete UTF-8 character, is held back until it cannot.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from dataclasses import dataclass, field

from engine.core.batch import MicroBatch
from engine.core.controller import Controller
from engine.base.errors import RunFailedError
from engine.core.executor import Completion
from engine.core.request import Request, SeqStatus, Sequence
from testbed.serve.codec import Codec
from testbed.serve.protocol import GenerateSpec


@dataclass(eq=False)
class Generation:
    """One served request: its spec, its asyncio queue, and the engine thread's text state."""

    request_id: int
    spec: GenerateSpec
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    seq: Sequence | None = None
    ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    stop_reason: str | None = None
    ended: bool = False
    released: bool = False  # the HTTP side let go of it (app.py `_release`)

    def accept(self, tok: int, codec: Codec, incremental: bool) -> bool:
        """Record a sampled token; True when it ends the request (EOS, stop token, stop string)."""
        spec = self.spec
        self.ids.append(tok)
        if (not spec.ignore_eos and tok in codec.eos_token_ids) or tok in spec.stop_token_ids:
            self.stop_reason = "stop"  # the stopping token's text is not part of the reply
            return True
        before = len(self.text)
        self.text = self.text + codec.decode([tok]) if incremental else codec.decode(self.ids)
        for stop in spec.stops:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                self.text = self.text[:at]
                self.stop_reason = "stop"
                return True
        return False

    def delta(self, final: bool) -> str:
        """Text not yet sent that can no longer change."""
        safe = len(self.text)
        if not final:
            if self.spec.stops:
                safe -= max(len(s) for s in self.spec.stops) - 1
            while safe > self.sent and self.text[safe - 1] == "\ufffd":
                safe -= 1
        if safe <= self.sent:
            return ""
        out = self.text[self.sent:safe]
        self.sent = safe
        return out

    def push(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class EngineLoop:
    def __init__(self, ctrl: Controller, codec: Codec, *, poll_interval_s: float = 0.005, metrics=None) -> None:
        self.ctrl = ctrl
        self.codec = codec
        self.incremental = type(codec) is Codec
        self.placeholder = not hasattr(ctrl.executor, "model_path")  # the simulator samples nothing
        self.wake = getattr(ctrl.executor, "wake", None)
        self.arrival = getattr(ctrl.executor, "arrival", ctrl.executor.now)  # the paced simulator notes arrivals
        self.interval = poll_interval_s if self.wake is None else 1.0
        self.metrics = metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.gens: dict[int, Generation] = {}
        self.dead: str | None = None  # the engine failed: the server answers 503
        # set when the server starts to shut down: requests aborted from then on were cut by the
        # shutdown (uvicorn cancels their handlers, which abort them), so the run is KILLED
        self.draining = False
        self.aborted_at_shutdown = 0
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._touched: list[Generation] = []
        self.thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)

    # --- from the HTTP side (any thread) -----------------------------------------------------------
    def start(self) -> None:
        self.ctrl.start()
        self.thread.start()

    def submit(self, spec: GenerateSpec, loop: asyncio.AbstractEventLoop) -> Generation:
        gen = Generation(next(self._ids), spec, loop, asyncio.Queue())
        self._post(("submit", gen))
        return gen

    def abort(self, gen: Generation, reason: str) -> None:
        self._post(("abort", gen, reason))

    def cut_open(self, reason: str) -> None:
        """End every open request with a "shutdown" event (the drain time is over): their
        handlers then answer and return, so uvicorn need not cancel them (a cancelled stream was
        cut off mid-body with no error event or `[DONE]`, and printed a traceback: issue 38
        item 10)."""
        self._post(("cut", reason))

    def reset_statistics(self, timeout_s: float = 60.0) -> None:
        """Forget the requests served so far (after the warm-up), on the engine thread, which
        owns the controller; waits until done."""
        done = threading.Event()
        self._post(("reset", done))
        if not done.wait(timeout_s):
            raise RuntimeError("the engine thread did not reset its statistics")

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the loop; requests still open are aborted (their KV freed) and told so."""
        self._stop.set()
        self._post(("noop",))
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    @property
    def num_open(self) -> int:
        return len(self.gens)

    def _post(self, item: tuple) -> None:
        self.inbox.put(item)
        if self.wake is not None:
            self.wake()

    # --- the engine thread -----------------------------------------------------------------------------
    def _main(self) -> None:
        ctrl = self.ctrl
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not (ctrl.waiting or ctrl.running or ctrl.inflight))
                if self._stop.is_set():
                    break
                try:
                    mb = ctrl.step(self.interval, inspect=self._inspect)
                except Exception as exc:  # noqa: BLE001 - fail what the step held, keep serving
                    error = str(exc) if isinstance(exc, RunFailedError) else f"{type(exc).__name__}: {exc}"
                    ctrl.fail_unfinished(f"run failed: {error}")  # frees every KV block (a stall already did)
                    self._fail_open(error)
                    if getattr(ctrl.executor, "_failed", None):  # the real engine's stages are gone
                        self.dead = error
                        return
                    continue
                if mb is not None:
                    self._deliver()
        except BaseException as exc:  # a bug must not leave clients waiting forever
            self.dead = f"{type(exc).__name__}: {exc}"
            self._fail_open(self.dead)
            raise
        finally:
            self._abort_open("server shutting down")

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "submit":
            self._submit(item[1])
        elif kind == "reset":
            if not (self.gens or self.ctrl.waiting or self.ctrl.running or self.ctrl.inflight):
                self.ctrl.reset_statistics()
            item[1].set()
        elif kind == "cut":
            self._cut(item[1])
        elif kind == "abort":
            gen, reason = item[1], item[2]
            if self.gens.pop(gen.request_id, None) is not None:
                self.ctrl.abort(gen.request_id, f"aborted: {reason}")
                gen.ended = True
                self.aborted_at_shutdown += self.draining
                if self.metrics is not None:
                    self.metrics.on_abort()

    def _submit(self, gen: Generation) -> None:
        spec = gen.spec
        problem = spec.sampling.problem() if spec.sampling is not None else None
        if problem is not None:  # the stages could not take it: this request fails, not the engine
            self._end(gen, "error", f"invalid sampling: {problem}")
            return
        try:
            req = Request(gen.request_id, self.arrival(), len(spec.prompt_ids), spec.max_tokens,
                          prompt_token_ids=spec.prompt_ids, sampling=spec.sampling)
            gen.seq = self.ctrl.submit(req)
        except Exception as exc:  # noqa: BLE001 - one bad request ends alone
            self._end(gen, "error", f"invalid request: {type(exc).__name__}: {exc}")
            return
        if gen.seq.is_done:  # could never fit the KV cache (the HTTP side checks this first)
            self._end(gen, "error", gen.seq.fail_reason)
        else:
            self.gens[gen.request_id] = gen

    def _inspect(self, mb: MicroBatch, completion: Completion) -> None:
        tokens = completion.token_ids
        for i, seq in enumerate(mb.sampled_sequences()):
            gen = self.gens.get(seq.seq_id)
            if gen is None:
                continue
            tok = seq.num_generated if tokens is None else tokens[i]
            if gen.accept(tok, self.codec, self.incremental):
                self.ctrl.finish_early(seq)
            self._touched.append(gen)

    def _deliver(self) -> None:
        for gen in self._touched:
            seq = gen.seq
            if seq.status is SeqStatus.FINISHED:
                del self.gens[gen.request_id]
                self._end(gen, gen.stop_reason or "length")
                if self.metrics is not None:
                    self.metrics.on_finish(seq, gen.stop_reason or "length")
            elif seq.status is SeqStatus.FAILED:
                del self.gens[gen.request_id]
                self._end(gen, "error", seq.fail_reason)
            else:
                text = gen.delta(final=False)
                gen.push(("delta", text, len(gen.ids)))
        self._touched.clear()

    def _end(self, gen: Generation, reason: str, error: str | None = None) -> None:
        gen.ended = True
        text = gen.delta(final=True)
        if text or reason != "error":
            gen.push(("delta", text, len(gen.ids)))
        gen.push(("end", reason, len(gen.spec.prompt_ids), len(gen.ids), error))

    def _fail_open(self, error: str) -> None:
        """After a failed step every unfinished request is FAILED (Controller.fail_unfinished)."""
        for gen in list(self.gens.values()):
            if gen.seq is not None and gen.seq.status is not SeqStatus.FINISHED:
                self.gens.pop(gen.request_id)
                self._end(gen, "error", error)
        self._touched.clear()

    def _cut(self, reason: str) -> None:
        for gen in list(self.gens.values()):
            self.gens.pop(gen.request_id)
            self.ctrl.abort(gen.request_id, f"aborted: {reason}")
            self._end(gen, "shutdown", reason)
            self.aborted_at_shutdown += 1
            if self.metrics is not None:
                self.metrics.on_abort()

    def _abort_open(self, reason: str) -> None:
        """At shutdown: every open request is aborted and its KV freed, in flight or not (the
        stages are about to stop, so nothing in flight will complete)."""
        for gen in list(self.gens.values()):
            self.gens.pop(gen.request_id)
            self._end(gen, "abort", reason)
            self.aborted_at_shutdown += 1
        self.ctrl.fail_unfinished(f"aborted: {reason}")
