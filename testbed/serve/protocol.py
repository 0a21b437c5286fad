"""Request bodies of the OpenAI-compatible routes and the OpenAI-style error.

The bodies are pydantic models (FastAPI validates them; a bad body is a 400 with
`{"error": {"message", "type", "param", "code"}}`, as OpenAI and vLLM answer). Unknown fields are
ignored, as vLLM does. The sampling fields follow the OpenAI API plus vLLM's extensions that
benchmark clients send (`top_k`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`).
Refused with a 400 because the engine does not implement them: `n > 1`, `best_of > 1`,
`logprobs`, `echo`, and several prompts in one request.

Every sampling number has a range, named in the 400 (one request with `seed` >= 2^64 or a
`temperature` of 1e-45 stopped the real engine for every client): `seed` a signed 64-bit
integer, `top_k` up to 2^31-1, `temperature` 0 (greedy) or in [0.01, 2] (vLLM's floor),
`repetition_penalty` in [0.01, 100]. Token ids (prompt, `stop_token_ids`) are JSON integers in
the vocabulary and the flags (`stream`, `ignore_eos`, `echo`) JSON booleans. Error messages never carry a traceback (`public_message`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from engine.core.request import INT64_MAX, INT64_MIN, SamplingParams

MIN_TEMPERATURE = 0.01  # vLLM's floor for a non-zero temperature: below it the draws overflow
MAX_TOP_K = (1 << 31) - 1
PENALTY_RANGE = (0.01, 100.0)


# `code` is always a string, as OpenAI's own (e.g. "model_not_found"); by status unless given
STATUS_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
                413: "request_too_large", 422: "invalid_request", 429: "rate_limit_exceeded",
                500: "internal_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error answered to the client: HTTP status and OpenAI's error object (one shape for
    every error the server sends, `code` a string)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code or STATUS_CODES.get(self.status, f"http_{self.status}")}}


def _encodable(text: str) -> str:
    """JSON allows lone surrogates (`"\\ud800"`), which no tokenizer can encode: refuse them here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone surrogate {text[exc.start]!r} at position {exc.start}, "
                         f"which is not valid Unicode text") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
# Token ids and flags are taken as JSON gives them, never coerced: pydantic's lax mode read
# `"stream": "yes"` as true, `"ignore_eos": "no"` as false and a prompt `[true, false]` as ids
# [1, 0]; a stop id of -1 or 2**64 was kept and never matched (issue 38 item 9).
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)  # vLLM: -1 or 0 = off
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Union[Text, list[Text], None] = None
    stop_token_ids: list[TokenId] | None = None
    repetition_penalty: float = Field(1.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    ignore_eos: StrictBool = False
    n: int = Field(1, ge=1)
    best_of: int | None = None
    logprobs: Any = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"temperature={v} is outside the valid range: 0 (greedy) or [{MIN_TEMPERATURE}, 2]")
        return v

    def check_supported(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n={self.n} is not supported: this server returns one choice per request; "
                                "send n separate requests", param="n")
        if self.best_of not in (None, 1):
            raise ApiError(400, f"best_of={self.best_of} is not supported", param="best_of")
        if self.logprobs not in (None, False, 0):
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(0, self.top_k),
                              seed=self.seed, repetition_penalty=self.repetition_penalty,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stops):
            raise ApiError(400, "stop strings must not be empty", param="stop")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Union[Text, list[TokenId], list[Text], list[list[TokenId]]]
    echo: StrictBool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[Text, list[dict], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only text content parts are supported", param="messages")
            try:
                parts.append(_encodable(part["text"]))
            except ValueError as exc:
                raise ApiError(400, f"messages: a text part {exc}", param="messages") from None
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def public_message(text: str | None, limit: int = 500) -> str:
    """An error's text fit for a client: no traceback (a stage's error carried its Python
    traceback with the server's file paths), only the exception line, at most `limit` characters."""
    text = (text or "").strip()
    if "Traceback (most recent call last)" in text:
        head, _, tb = text.partition("Traceback (most recent call last)")
        lines = [ln.strip() for ln in tb.splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if not ln.startswith(("File ", "^", "~"))), "")
        text = ": ".join(x for x in (head.strip().rstrip(":"), last) if x)
    text = " ".join(ln.strip() for ln in text.splitlines() if not ln.strip().startswith('File "'))
    return text[:limit] or "internal error"


def single_prompt(prompt) -> str | list[int]:
    """The one prompt of a completions request (text or token ids); several are refused."""
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return list(prompt)
    if len(prompt) == 1:
        return prompt[0] if isinstance(prompt[0], str) else list(prompt[0])
    raise ApiError(400, f"{len(prompt)} prompts in one request are not supported; send one request per prompt",
                   param="prompt")


@dataclass(frozen=True)
class GenerateSpec:
    """What the engine thread needs to serve one request, validated."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stops: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: StrictBool = False
