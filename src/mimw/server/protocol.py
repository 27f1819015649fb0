"""The OpenAI-compatible wire format: request bodies (validated strictly), response/chunk builders, error bodies.

Request models are strict (a string is not a number, a number is not a boolean) and ignore unknown fields, like
most OpenAI-compatible servers. Everything a client can get wrong becomes an ``APIError`` with an OpenAI-style body

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

and a 4xx status; nothing here raises anything else for bad input.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (top_k, ignore_eos, stop_token_ids: extensions)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | int | None = None
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # not supported: rejected rather than silently ignored
    response_format: dict[str, Any] | None = None  # only {"type": "text"}


def parse(model: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        # pydantic reports union members as extra path parts (e.g. prompt.str): name the field the client sent
        field = ".".join(x for x in loc if x not in ("str", "int", "list[int]", "list[str]", "list[list[int]]",
                                                      "bool", "list[ContentPart]"))
        msg = "required field is missing" if err["type"] == "missing" else err["msg"]
        raise bad_request(f"{field or 'body'}: {msg}", loc[0] if loc else None) from None


# --- responses ----------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "mimw"}


class Envelope:
    """Fixed fields of every response and chunk of one request."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.model = model
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
        return {**self._base("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": use, "system_fingerprint": None}

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": None, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def chunk(self, index: int, text: str | None, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            ch = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._base("chat.completion.chunk"), "choices": [ch]}
        ch = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._base("text_completion"), "choices": [ch]}

    def usage_chunk(self, use: dict[str, Any]) -> dict[str, Any]:
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": use}
