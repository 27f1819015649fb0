"""The OpenAI-compatible HTTP front end (FastAPI) over an ``EngineLoop``.

Endpoints: GET /health, GET /metrics, GET /v1/models[/{id}], POST /v1/completions, POST /v1/chat/completions
(both with SSE streaming), DELETE /v1/sessions/{id} (stop retaining a session's KV; unknown ids are not errors).
A request joins a session with the ``session_id`` body field or the ``X-Session-ID`` header. The engine runs on
its own thread; handlers only tokenize (in a worker thread), submit, and await events that the engine thread
hands to the event loop with ``call_soon_threadsafe`` - no handler ever waits on model compute while holding the
event loop.

Robustness contract:
  * every client mistake is a 4xx with an OpenAI error body (``protocol.APIError``); anything unexpected is a 500
    with the same shape, and the server keeps serving; bodies are hostile input (``body``: size and value-count
    limits, JSON depth, numbers, Unicode); a client that disconnects mid-upload is counted as 499, not an error;
  * no request can stall the others: a prompt text longer in bytes than the context can hold in tokens is refused
    before tokenizing; tokenizing runs in worker threads on tokenizer copies of its own (``TokenizerPool``),
    never under a lock the engine thread's detokenisation shares;
  * a full queue answers 429 with Retry-After, a dead engine 503;
  * a client that goes away (mid-stream or while waiting for a non-streamed answer) has its requests aborted,
    which frees their KV pages on the engine's next iteration.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import RequestError
from ..engine.grammar import GrammarCompiler
from ..engine.loop import EngineDead, EngineLoop, QueueFull
from ..engine.sampling import SamplingParams
from . import params as R
from . import protocol as P
from . import tools as T
from .body import ClientGone, prompt_bytes, read_json
from .generation import Generation, OutputOptions
from .logprobs import TokenTable
from .metrics import ServerMetrics

log = logging.getLogger("mimw.server")
RETRY_AFTER_S = 1  # the Retry-After of a 429 (queue full): the queue drains at the engine's pace


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_n: int = 16  # choices per request (n x prompts)
    max_stop: int = 16  # stop strings per request
    max_body_bytes: int = 32 << 20
    max_body_values: int | None = None  # commas per body; None: max_n x the context + 65536
    max_prompt_bytes: int | None = None  # None: the tokenizer's bound for the context (if it has one)


class _SSE(StreamingResponse):
    """A StreamingResponse that always closes its generator, so that its ``finally`` (which aborts the engine
    requests) runs as soon as the client is gone, even when the response is cancelled."""

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


class OpenAIServer:
    def __init__(self, loop: EngineLoop, tokenizer: Any, config: ServerConfig):
        self.loop = loop
        self.tok = tokenizer
        self.cfg = config
        self.metrics = ServerMetrics(loop.stats, config.model_name)
        self.created = int(time.time())
        vocab = loop.engine.backend.spec.vocab_size
        self.tokens = TokenTable(tokenizer.token_bytes, vocab)
        self.grammars = R.Grammars(self._grammar_compiler_factory(vocab, sorted(loop.engine.eos_token_ids)))
        context = loop.engine.max_model_len
        self.max_body_values = config.max_body_values or config.max_n * context + (1 << 16)
        bound = getattr(tokenizer, "prompt_byte_limit", None)
        self.max_prompt_bytes = config.max_prompt_bytes or (bound(context) if bound else None)

    def _grammar_compiler_factory(self, vocab: int, stop_ids: list[int]):
        def build(tok: Any) -> GrammarCompiler:
            return GrammarCompiler(tok.hf, vocab, stop_ids)
        if not self.tok.borrow(lambda tok: hasattr(tok, "hf")):  # the byte fallback has no HF tokenizer
            return None
        return lambda: self.tok.borrow(build)

    # --- plumbing -----------------------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        if self.cfg.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.cfg.api_key.encode()):
            raise P.APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                             "invalid_request_error", None, "invalid_api_key")

    def _error(self, endpoint: str, e: P.APIError) -> JSONResponse:
        self.metrics.request(endpoint, e.status)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def _check_prompt_bytes(self, b: Any, chat: bool) -> None:
        """Refuse a prompt text too long for the context by its size alone, before tokenizing it (which could
        take seconds)."""
        limit = self.max_prompt_bytes
        if limit is None:
            return
        if chat:
            texts = [[m.text() for m in b.messages]]
        else:
            p = b.prompt
            texts = [[p]] if isinstance(p, str) else [[x] for x in p if isinstance(x, str)]
        for t in texts:
            size = prompt_bytes(t)
            if size > limit:
                raise P.bad_request(f"the prompt is {size} bytes long: more than {self.loop.engine.max_model_len} "
                                    f"tokens, this server's context, for any text over {limit} bytes",
                                    "messages" if chat else "prompt", "context_length_exceeded")

    async def serve(self, endpoint: str, request: Request, chat: bool) -> Response:
        try:
            self._check_auth(request)
            raw = await read_json(request, self.cfg.max_body_bytes, self.max_body_values)
            body = P.parse(P.ChatCompletionRequest if chat else P.CompletionRequest, raw)
            resp = await self._generate(request, body, chat)
        except P.APIError as e:
            return self._error(endpoint, e)
        except ClientGone:  # the client's fault, not the server's: counted as 499, not logged as an error
            log.debug("%s: the client disconnected before sending its whole request", endpoint)
            self.metrics.request(endpoint, 499)
            return Response(status_code=499)
        except Exception:  # a bug, not the client's fault: answer 500, keep serving
            log.exception("internal error in %s", endpoint)
            return self._error(endpoint, P.APIError(500, "internal server error", "server_error"))
        self.metrics.request(endpoint, resp.status_code)
        return resp

    # --- request -> engine requests -----------------------------------------------------------------------
    def _prompts(self, b: Any, chat: bool, plan: R.RequestPlan) -> tuple[list[list[int]], list[str] | None]:
        """Token ids of each prompt, and with ``echo`` each prompt's text (runs in a worker thread: tokenizing a
        long prompt takes a while)."""
        if chat:
            if not getattr(self.tok, "has_chat_template", False):
                raise P.bad_request(f"model {self.cfg.model_name!r} has no chat template; use /v1/completions",
                                    "messages")
            msgs, tools = T.template_messages(b.messages, R.tool_defs(b, plan.tool_choice), self.tok.chat_template)
            try:
                return [self.tok.apply_chat_template(msgs, tools=tools)], None
            except Exception as e:  # the template rejected the conversation (e.g. roles out of order)
                raise P.bad_request(f"messages: the chat template rejected them: {e}", "messages") from None
        p = b.prompt
        if isinstance(p, str):
            return [self.tok.encode(p)], [p] if b.echo else None
        if not p:
            raise P.bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            ids = [list(p)]
        elif isinstance(p[0], str):
            return [self.tok.encode(s) for s in p], list(p) if b.echo else None
        else:
            ids = [list(x) for x in p]
        vocab = self.tokens.vocab_size
        if b.echo and all(0 <= t < vocab for x in ids for t in x):  # bad ids are refused by the engine below
            return ids, [self.tok.decode(x) for x in ids]
        return ids, [""] * len(ids) if b.echo else None

    async def _generate(self, request: Request, b: Any, chat: bool) -> Response:
        if b.model != self.cfg.model_name:
            raise P.APIError(404, f"The model `{b.model}` does not exist; this server serves "
                             f"`{self.cfg.model_name}`.", "invalid_request_error", "model", "model_not_found")
        if b.n < 1 or b.n > self.cfg.max_n:
            raise P.bad_request(f"n must be between 1 and {self.cfg.max_n}, got {b.n}", "n")
        num_prompts = 1 if chat or isinstance(b.prompt, str) or (b.prompt and isinstance(b.prompt[0], int)) \
            else len(b.prompt)
        if num_prompts * b.n > self.cfg.max_n:  # before tokenizing them all
            raise P.bad_request(f"at most {self.cfg.max_n} choices per request (prompts x n), got "
                                f"{num_prompts * b.n}", "n")
        self._check_prompt_bytes(b, chat)
        plan = await run_in_threadpool(R.plan, b, chat, self.grammars, getattr(self.tok, "chat_template", ""),
                                       self.cfg.max_stop)
        prompts, echo = await run_in_threadpool(self._prompts, b, chat, plan)
        wants_logprobs = plan.logprobs is not None or plan.prompt_logprobs is not None
        if wants_logprobs and not self.tokens.ready:
            await run_in_threadpool(self.tokens.build)
        # max_completion_tokens is chat's name for max_tokens; it wins when both are given (as in vLLM)
        param = "max_completion_tokens" if chat and b.max_completion_tokens is not None else "max_tokens"
        asked = getattr(b, param)
        if asked is None and not chat:
            asked = 16  # the OpenAI default for /v1/completions; chat defaults to the rest of the context
        if asked is not None and asked < 1 and not (asked == 0 and not chat and b.echo):
            raise P.bad_request(f"{param} must be at least 1 (0 only with echo: score the prompt), got {asked}",
                                param)
        subs: list[tuple[str, list[int], SamplingParams]] = []
        env = P.Envelope(chat, self.cfg.model_name)
        for i, ids in enumerate(prompts):
            try:
                max_tokens = self.loop.engine.check_lengths(len(ids), asked)
            except RequestError as e:
                p = "messages" if chat and e.param == "prompt" else (param if e.param == "max_tokens" else e.param)
                raise P.bad_request(str(e), p, e.code) from None
            for j in range(b.n):
                subs.append((f"{env.id}-{i * b.n + j}", ids, plan.params(max_tokens, j)))

        out = OutputOptions(wants_logprobs, self.tokens if wants_logprobs else None, echo, plan.tool_choice,
                            plan.tool_format, not chat or b.parallel_tool_calls is not False)
        group = Generation(self.loop, self.metrics, env, subs, b.n, len(prompts), out, self._session(request, b),
                           b.close_session)
        try:
            group.submit()
        except QueueFull as e:
            raise P.APIError(429, f"the server is busy ({e}); retry later", "rate_limit_exceeded", None,
                             "rate_limit_exceeded") from None
        except EngineDead as e:
            raise P.APIError(503, f"the engine is not running: {e}", "server_error") from None
        except RequestError as e:
            raise P.bad_request(str(e), e.param, e.code) from None
        if b.stream:
            include_usage = bool(b.stream_options and b.stream_options.include_usage)
            return _SSE(group.stream(include_usage), media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await group.collect(request))


    @staticmethod
    def _session(request: Request, b: Any) -> str | None:
        """The session a request names: the body's ``session_id`` or the ``X-Session-ID`` header (equal if both)."""
        header = request.headers.get("x-session-id")
        if header is not None and not 1 <= len(header) <= 256:
            raise P.bad_request("the X-Session-ID header must be 1 to 256 characters", "session_id")
        if header is not None and b.session_id is not None and header != b.session_id:
            raise P.bad_request("session_id and the X-Session-ID header name different sessions", "session_id")
        return b.session_id if b.session_id is not None else header

    async def close_session(self, session_id: str, request: Request) -> JSONResponse:
        try:
            self._check_auth(request)
            if not 1 <= len(session_id) <= 256:
                raise P.bad_request("a session id is 1 to 256 characters", "session_id")
            if not self.loop.alive:
                raise P.APIError(503, "the engine is not running", "server_error")
            try:
                closed = await asyncio.wait_for(asyncio.wrap_future(self.loop.close_session(session_id)), 30.0)
            except asyncio.TimeoutError:
                raise P.APIError(503, "the engine did not answer in time", "server_error") from None
        except P.APIError as e:
            return self._error("sessions", e)
        self.metrics.request("sessions", 200)
        return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": closed})


def create_app(loop: EngineLoop, tokenizer: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``loop`` (already started by the caller, which also stops it)."""
    srv = OpenAIServer(loop, tokenizer, config)
    app = FastAPI(title="mimw", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(P.APIError(exc.status_code, msg, kind).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(P.APIError(500, "internal server error", "server_error").body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if loop.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse(P.APIError(503, loop.error or "engine stopped", "server_error").body(), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            srv._check_auth(request)
        except P.APIError as e:
            return srv._error("models", e)
        return JSONResponse({"object": "list", "data": [P.model_card(config.model_name, srv.created)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        try:
            srv._check_auth(request)
            if model_id != config.model_name:
                raise P.APIError(404, f"The model `{model_id}` does not exist.", "invalid_request_error", "model",
                                 "model_not_found")
        except P.APIError as e:
            return srv._error("models", e)
        return JSONResponse(P.model_card(config.model_name, srv.created))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await srv.serve("completions", request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await srv.serve("chat_completions", request, chat=True)

    @app.delete("/v1/sessions/{session_id:path}")
    async def delete_session(session_id: str, request: Request) -> JSONResponse:
        return await srv.close_session(session_id, request)

    return app
