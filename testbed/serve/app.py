"""The ASGI app (FastAPI): OpenAI-compatible completions and chat completions, models, health,
Prometheus metrics.

Every request is validated before it reaches the engine: a bad body, an unknown model, a prompt
token outside the vocabulary or a prompt + max_tokens that could never fit the KV cache is a
400/404 with OpenAI's error body; more than `serve.max_queue` requests held at once is a 429; a
dead engine is a 503. A client that goes away (stream cancelled, or a non-streaming client whose
connection closes) aborts its request, which frees its KV (`Controller.abort`). Streams follow
OpenAI's SSE format: `data: {chunk}` lines, an optional usage chunk
(`stream_options.include_usage`), then `data: [DONE]`; an error after the stream started is sent
as a `data: {"error": ...}` event before `[DONE]`, as vLLM does.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from testbed.serve.codec import Codec
from testbed.serve.engine_loop import EngineLoop, Generation
from testbed.serve.limits import BodyLimit
from testbed.serve.metrics import ServeMetrics
from testbed.serve.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, GenerateSpec, _Sampling,
                                    public_message, single_prompt)
from testbed.config.serve import ServeSettings

DISCONNECT_POLL_S = 0.25  # non-streaming requests: how often the connection is checked


@dataclass
class ServeState:
    engine: EngineLoop
    codec: Codec
    settings: ServeSettings
    model_name: str
    metrics: ServeMetrics
    vocab_size: int
    max_model_len: int | None  # the real model's context; None under executor=sim (as `testbed run`: KV only)
    open: int = 0
    created: int = 0
    setup: dict[str, str] | None = None  # model, hardware, executor, policy, pp: `testbed bench serve` logs these

    # --- validation ----------------------------------------------------------------------------------
    def spec(self, body: _Sampling, prompt_ids: list[int], default_max: int, max_tokens: int | None) -> GenerateSpec:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty (no tokens)", param="prompt")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        stop_ids = frozenset(body.stop_token_ids or ())
        bad = next((t for t in sorted(stop_ids) if t >= self.vocab_size), None)
        if bad is not None:  # it could never match: the request would run to max_tokens unstopped
            raise ApiError(400, f"stop token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                           param="stop_token_ids")
        max_tokens = max_tokens if max_tokens is not None else min(default_max, self.max_model_len or default_max)
        total = len(prompt_ids) + max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                                f"this model's context of {self.max_model_len} tokens", param="max_tokens")
        kv = self.engine.ctrl.kv
        need = kv.blocks_for(total)
        if need > kv.num_blocks:
            raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks; "
                                f"the whole cache has {kv.num_blocks}", param="max_tokens")
        return GenerateSpec(tuple(prompt_ids), max_tokens, body.sampling(), body.stops(), stop_ids, body.ignore_eos)

    def admit(self) -> None:
        if self.engine.dead is not None:
            self.metrics.on_reject(503)
            raise ApiError(503, f"the engine failed: {public_message(self.engine.dead)}", type_="service_unavailable")
        if self.open >= self.settings.max_queue:
            self.metrics.on_reject(429)
            raise ApiError(429, f"the server holds serve.max_queue={self.settings.max_queue} requests; retry later",
                           type_="rate_limit_error", code="rate_limit_exceeded")


def _usage(ev: tuple) -> dict:
    return {"prompt_tokens": ev[2], "completion_tokens": ev[3], "total_tokens": ev[2] + ev[3]}


class _Reply:
    """OpenAI's response and chunk objects for one request (completions or chat)."""

    def __init__(self, chat: bool, rid: int, model: str) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage}

    def full(self, text: str, finish: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _generate(state: ServeState, request: Request, body: _Sampling, spec: GenerateSpec, chat: bool):
    state.admit()
    gen = state.engine.submit(spec, asyncio.get_running_loop())
    state.open += 1
    reply = _Reply(chat, gen.request_id, state.model_name)
    if body.stream:
        return _Stream(_stream(state, gen, reply, body.include_usage), lambda: _release(state, gen),
                       media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        return await _collect(state, request, gen, reply)
    finally:
        _release(state, gen)


class _Stream(StreamingResponse):
    """A stream whose request is released however it ends: a client gone before the first chunk
    never starts the generator, so its `finally` alone would not run."""

    def __init__(self, content, on_close, **kw) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _release(state: ServeState, gen: Generation) -> None:
    """Once per request: count it out and abort it unless it ended (idempotent)."""
    if gen.released:
        return
    gen.released = True
    state.open -= 1
    if not gen.ended:
        state.engine.abort(gen, "client disconnected")


FAILED = ("error", "shutdown")


def _failure(ev: tuple) -> ApiError:
    """The error of a request's failed end: 503 when the shutdown cut it, else 500."""
    if ev[1] == "shutdown":
        return ApiError(503, f"the request was cut: {public_message(ev[4])}", type_="service_unavailable")
    return ApiError(500, f"the request failed: {public_message(ev[4])}", type_="server_error")


async def _collect(state: ServeState, request: Request, gen: Generation, reply: _Reply):
    parts = []
    check_at = time.monotonic() + DISCONNECT_POLL_S
    while True:
        try:
            ev = await asyncio.wait_for(gen.queue.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            ev = None
        if time.monotonic() >= check_at:  # tokens may arrive faster than the poll: check by the clock
            check_at = time.monotonic() + DISCONNECT_POLL_S
            if await request.is_disconnected():
                return Response(status_code=499)
        if ev is None:
            continue
        if ev[0] == "delta":
            parts.append(ev[1])
            continue
        if ev[1] in FAILED:
            raise _failure(ev)
        return JSONResponse(reply.full("".join(parts), ev[1], _usage(ev)))


async def _stream(state: ServeState, gen: Generation, reply: _Reply, include_usage: bool):
    try:
        if reply.chat:
            yield _sse(reply.chunk(None, role=True))
        while True:
            ev = await gen.queue.get()
            if ev[0] == "delta":
                if ev[1]:
                    yield _sse(reply.chunk(ev[1]))
                continue
            if ev[1] in FAILED:
                yield _sse(_failure(ev).body())
            else:
                yield _sse(reply.chunk(None if reply.chat else "", finish=ev[1]))
                if include_usage:
                    yield _sse(reply.usage_chunk(_usage(ev)))
            yield "data: [DONE]\n\n"
            return
    finally:
        _release(state, gen)


def _is_tag(part) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "list", "dict") or "[" in part)


def build_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="testbed serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    app.add_middleware(BodyLimit, max_bytes=state.settings.max_body_bytes, deadline_s=state.settings.body_timeout_s)

    @app.exception_handler(ApiError)
    async def _api_error(_req, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, exc: RequestValidationError):
        errs = exc.errors()
        broken = next((e for e in errs if e.get("type") == "json_invalid"), None)
        if broken is not None:  # its path is ("body", <character>): say so, not "40: JSON decode error"
            at = broken.get("loc", ())[-1]
            why = (broken.get("ctx") or {}).get("error", "JSON decode error")
            return JSONResponse(ApiError(400, f"the request body is not valid JSON: {why} at character {at}").body(),
                                status_code=400)
        # a union field fails once per member: a validator's own message says most
        first = next((e for e in errs if e.get("type") == "value_error"), errs[0] if errs else {})
        # pydantic names union members and validators in the path ("str", "function-after[...]")
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_tag(x)]
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        where = ".".join(loc)
        return JSONResponse(ApiError(400, f"{where}: {msg}" if where else msg, param=where or None).body(),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, exc: StarletteHTTPException):
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), type_="invalid_request_error").body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_req, exc: Exception):
        return JSONResponse(ApiError(500, public_message(f"{type(exc).__name__}: {exc}"), type_="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        if state.engine.dead is not None:
            return JSONResponse({"status": "failed", "error": public_message(state.engine.dead)}, status_code=503)
        return {"status": "ok"}

    kv = state.engine.ctrl.kv
    kv_tokens = kv.num_blocks * kv.block_size

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "testbed",
                                            "max_model_len": state.max_model_len or kv_tokens,
                                            "testbed": state.setup or {}}]}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check_supported()
        prompt = single_prompt(body.prompt)
        try:
            ids = state.codec.encode(prompt) if isinstance(prompt, str) else prompt
        except ValueError as exc:  # the fallback's digits that are no token id
            raise ApiError(400, str(exc), param="prompt") from None
        spec = state.spec(body, ids, 16, body.max_tokens)
        return await _generate(state, request, body, spec, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        body.check_supported()
        ids = state.codec.chat_prompt([{"role": m.role, "content": m.text()} for m in body.messages])
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        spec = state.spec(body, ids, state.settings.default_max_tokens, limit)
        return await _generate(state, request, body, spec, chat=True)

    return app
