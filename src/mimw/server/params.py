"""An OpenAI request body -> what the engine runs: ``SamplingParams`` per choice, the grammar of
``response_format`` or of a forced tool call, and the checks that tie fields together (400s naming the field).

``RequestPlan`` is built once per HTTP request (``plan``), in a worker thread (a grammar compiles there);
``RequestPlan.params(max_tokens, j)`` gives choice j's parameters.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..engine.grammar import Grammar, GrammarCompiler, GrammarError
from ..engine.sampling import SamplingParams
from . import protocol as P
from . import tools as T


class Grammars:
    """The server's grammar compiler, built on first use (it reads the whole vocabulary once)."""

    def __init__(self, make: Callable[[], GrammarCompiler] | None):
        self._make = make
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compiler(self, param: str) -> GrammarCompiler:
        if self._make is None:
            raise P.bad_request(f"{param}: structured output needs the model's tokenizer, which this checkpoint "
                                "lacks", param)
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make()
            return self._compiler


@dataclass(frozen=True)
class RequestPlan:
    """What one HTTP request asks of the engine, beyond its prompts."""

    body: Any
    chat: bool
    grammar: Grammar | None
    tool_choice: str | None  # None: no tool parsing; "auto", "required", or the forced function's name
    tool_format: str
    logprobs: int | None  # alternatives per generated token (None: no logprobs)
    prompt_logprobs: int | None  # completions with echo and logprobs
    max_stop: int

    def params(self, max_tokens: int, j: int) -> SamplingParams:
        """Choice j's parameters (its seed is the request's seed + j, so choices differ but repeat)."""
        b = self.body
        stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
        if len(stop) > self.max_stop:
            raise P.bad_request(f"at most {self.max_stop} stop strings are supported, got {len(stop)}", "stop")
        bias = {}
        for k, v in (b.logit_bias or {}).items():
            if not k.lstrip("-").isdigit():
                raise P.bad_request(f"logit_bias keys must be token ids, got {k!r}", "logit_bias")
            bias[int(k)] = v
        try:
            return SamplingParams(
                temperature=1.0 if b.temperature is None else b.temperature,
                top_p=1.0 if b.top_p is None else b.top_p, top_k=b.top_k or 0,
                min_p=0.0 if b.min_p is None else b.min_p,
                presence_penalty=b.presence_penalty or 0.0, frequency_penalty=b.frequency_penalty or 0.0,
                repetition_penalty=1.0 if b.repetition_penalty is None else b.repetition_penalty,
                logit_bias=bias, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
                grammar=self.grammar, seed=None if b.seed is None else b.seed + j, max_tokens=max_tokens,
                stop=tuple(stop), stop_token_ids=tuple(b.stop_token_ids or ()), ignore_eos=b.ignore_eos)
        except ValueError as e:
            field = str(e).split()[0]
            raise P.bad_request(str(e), field if field.isidentifier() else None) from None


def plan(body: Any, chat: bool, grammars: Grammars, chat_template: str, max_stop: int) -> RequestPlan:
    """Cross-field checks, the grammar (compiled here: call from a worker thread) and the logprob counts."""
    if body.stream_options is not None and not body.stream:
        raise P.bad_request("stream_options is only allowed with stream: true", "stream_options")
    if chat:
        logprobs = _chat_logprobs(body)
        choice = _tool_choice(body)
        grammar = _grammar(body, choice, grammars)
        return RequestPlan(body, True, grammar, choice, T.tool_format(chat_template), logprobs, None, max_stop)
    echo_lp = body.logprobs if body.echo and body.logprobs is not None else None
    return RequestPlan(body, False, None, None, "", body.logprobs, echo_lp, max_stop)


def _chat_logprobs(b: P.ChatCompletionRequest) -> int | None:
    if b.top_logprobs is not None and not b.logprobs:
        raise P.bad_request("top_logprobs requires logprobs: true", "top_logprobs")
    return (b.top_logprobs or 0) if b.logprobs else None


def _tool_choice(b: P.ChatCompletionRequest) -> str | None:
    c = b.tool_choice
    if not b.tools:
        if c not in (None, "none"):
            raise P.bad_request("tool_choice needs tools", "tool_choice")
        return None
    names = [t.function.name for t in b.tools]
    if len(set(names)) != len(names):
        raise P.bad_request("tools: two functions share a name", "tools")
    if c is None or c == "auto":
        return "auto"
    if c == "none":
        return None
    if c == "required":
        return "required"
    if c.function.name not in names:
        raise P.bad_request(f"tool_choice names {c.function.name!r}, which is not among the tools", "tool_choice")
    return c.function.name


def _grammar(b: P.ChatCompletionRequest, choice: str | None, grammars: Grammars) -> Grammar | None:
    rf = b.response_format
    forced = choice not in (None, "auto")
    if rf is not None and rf.type != "text" and forced:
        raise P.bad_request("response_format cannot be combined with a forced tool_choice", "response_format")
    try:
        if forced:
            tools = [t.model_dump(by_alias=True, exclude_none=True) for t in b.tools or ()]
            schema = T.forced_schema(tools, choice, b.parallel_tool_calls is not False)
            return grammars.compiler("tool_choice").json_schema(schema, f"tool_choice {choice}")
        if rf is None or rf.type == "text":
            if rf is not None and rf.json_schema is not None:
                raise P.bad_request("response_format: json_schema is only allowed with type json_schema",
                                    "response_format")
            return None
        if rf.type == "json_object":
            return grammars.compiler("response_format").json_object()
        if rf.json_schema is None:
            raise P.bad_request("response_format: type json_schema needs a json_schema object", "response_format")
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        return grammars.compiler("response_format").json_schema(schema, f"json_schema {rf.json_schema.name}")
    except GrammarError as e:
        raise P.bad_request(str(e), "tool_choice" if forced else "response_format") from None


def tool_defs(b: P.ChatCompletionRequest, choice: str | None) -> Sequence[dict[str, Any]] | None:
    """The tools as the chat template receives them (none when tool_choice is "none")."""
    if not b.tools or choice is None:
        return None
    return [t.model_dump(by_alias=True, exclude_none=True) for t in b.tools]
