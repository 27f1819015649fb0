"""The OpenAI-compatible wire format: request bodies (validated strictly), response/chunk builders, error bodies.

Request models are strict (a string is not a number, a number is not a boolean) and closed: a field the OpenAI
API defines that mimw does not implement (``UNSUPPORTED``) is refused by name unless it carries its default
value, and a field nobody defines is refused as unknown. Documented extensions (vLLM's names): ``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``. Everything a client can get wrong becomes
an ``APIError`` with an OpenAI-style body

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
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    include_obfuscation: Literal[False] | None = None  # mimw adds no obfuscation padding to chunks


class _Sampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for abuse monitoring: accepted, has no effect on the output
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    session_id: str | None = Field(default=None, min_length=1, max_length=256)  # also the X-Session-ID header
    close_session: bool = False  # stop retaining the session's KV once this request finishes


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=5)


# --- chat ---------------------------------------------------------------------------------------------------
class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages
    # fields of earlier assistant replies sent back as history: accepted when empty, not shown to the model
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list[Any] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    safety_identifier: str | None = None  # like ``user``: accepted, no effect on the output


# OpenAI parameters mimw does not implement, with the values that mean "off" (accepted: they ask for nothing).
UNSUPPORTED: dict[str, dict[str, tuple[Any, ...]]] = {
    "chat": {"audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "functions": (None,),
             "function_call": (None,), "web_search_options": (None,), "service_tier": (None, "auto", "default"),
             "store": (None, False), "metadata": (None,), "reasoning_effort": (None,), "verbosity": (None,),
             "prompt_cache_key": (None,), "prompt_cache_retention": (None,)},
    "completions": {"best_of": (None, 1), "suffix": (None, "")},
}
_WHY = {"functions": "use tools", "function_call": "use tool_choice",
        "best_of": "use n and pick a choice client-side"}


def parse(model: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    kind = "chat" if model is ChatCompletionRequest else "completions"
    for name, off in UNSUPPORTED[kind].items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in off):
            hint = f" ({_WHY[name]})" if name in _WHY else ""
            raise bad_request(f"{name} is not supported by this server{hint}", name, "unsupported_parameter")
    body = {k: v for k, v in body.items() if k not in UNSUPPORTED[kind]}
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        # pydantic reports union members as extra path parts (e.g. prompt.str): name the field the client sent
        field = ".".join(x for x in loc if x not in _UNION_PARTS and not x.startswith(("literal[", "function-")))
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unknown parameter: {field}", loc[0] if loc else None,
                              "unknown_parameter") from None
        msg = "required field is missing" if err["type"] == "missing" else err["msg"]
        raise bad_request(f"{field or 'body'}: {msg}", loc[0] if loc else None) from None


_UNION_PARTS = {"str", "int", "list[int]", "list[str]", "list[list[int]]", "bool", "list[ContentPart]",
                "NamedToolChoice", "float", "dict[str,float]"}


# --- responses ----------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "mimw"}


SYSTEM_FINGERPRINT = "mimw"


class Envelope:
    """Fixed fields of every response and chunk of one request."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.model = model
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    def response(self, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
        return {**self._base("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": use}

    def choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: Any = None,
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.chat:
            msg: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if tool_calls:
                msg["tool_calls"] = tool_calls
            return {"index": index, "message": msg, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk(self, index: int, text: str | None, finish_reason: str | None, first: bool = False,
              logprobs: Any = None, tool_calls: list[dict[str, Any]] | None = None,
              with_usage: bool = False) -> dict[str, Any]:
        """One SSE chunk; ``with_usage``: the stream will end with a usage chunk, so this one says ``null``."""
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            ch = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            out = {**self._base("chat.completion.chunk"), "choices": [ch]}
        else:
            ch = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            out = {**self._base("text_completion"), "choices": [ch]}
        if with_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, use: dict[str, Any]) -> dict[str, Any]:
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": use}
