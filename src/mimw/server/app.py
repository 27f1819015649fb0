"""The OpenAI-compatible HTTP front end (FastAPI) over an ``EngineLoop``.

Endpoints: GET /health, GET /metrics, GET /v1/models[/{id}], POST /v1/completions, POST /v1/chat/completions
(both with SSE streaming). The engine runs on its own thread; handlers only tokenize (in a worker thread), submit,
and await events that the engine thread hands to the event loop with ``call_soon_threadsafe`` - no handler ever
waits on model compute while holding the event loop.

Robustness contract:
  * every client mistake is a 4xx with an OpenAI error body (``protocol.APIError``); anything unexpected is a 500
    with the same shape, and the server keeps serving;
  * a full queue answers 429, a dead engine 503;
  * a client that goes away (mid-stream or while waiting for a non-streamed answer) has its requests aborted,
    which frees their KV pages on the engine's next iteration.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import RequestError
from ..engine.loop import EngineDead, EngineLoop, QueueFull
from ..engine.request import RequestOutput
from ..engine.sampling import SamplingParams
from . import protocol as P
from .metrics import ServerMetrics

log = logging.getLogger("mimw.server")
_DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_n: int = 16  # choices per request (n x prompts)
    max_stop: int = 16  # stop strings per request
    max_body_bytes: int = 32 << 20


class _SSE(StreamingResponse):
    """A StreamingResponse that always closes its generator, so that its ``finally`` (which aborts the engine
    requests) runs as soon as the client is gone, even when the response is cancelled."""

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Tracker:
    """Latency bookkeeping of one engine request (times from the engine thread's clock)."""

    def __init__(self, t0: float):
        self.t0, self.last = t0, None

    def observe(self, m: ServerMetrics, ev: RequestOutput, t: float) -> None:
        if ev.token_ids:
            if self.last is None:
                m.ttft.observe(t - self.t0)
            else:
                m.itl.observe(t - self.last)
            self.last = t
        if ev.finished:
            m.finished.labels(ev.finish_reason).inc()
            m.generation_tokens.inc(ev.completion_tokens)
            if ev.finish_reason in ("stop", "length"):
                m.e2e.observe(t - self.t0)


class OpenAIServer:
    def __init__(self, loop: EngineLoop, tokenizer: Any, config: ServerConfig):
        self.loop = loop
        self.tok = tokenizer
        self.cfg = config
        self.metrics = ServerMetrics(loop.stats)
        self.created = int(time.time())

    # --- plumbing -----------------------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        if self.cfg.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.cfg.api_key.encode()):
            raise P.APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                             "invalid_request_error", None, "invalid_api_key")

    async def _json(self, request: Request) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.cfg.max_body_bytes:
            raise P.APIError(413, f"request body too large (limit {self.cfg.max_body_bytes} bytes)")
        raw = await request.body()
        if len(raw) > self.cfg.max_body_bytes:
            raise P.APIError(413, f"request body too large (limit {self.cfg.max_body_bytes} bytes)")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise P.bad_request(f"the request body is not valid JSON: {e}") from None

    def _error(self, endpoint: str, e: P.APIError) -> JSONResponse:
        self.metrics.requests.labels(endpoint, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    async def serve(self, endpoint: str, request: Request, chat: bool) -> Response:
        try:
            self._check_auth(request)
            body = P.parse(P.ChatCompletionRequest if chat else P.CompletionRequest, await self._json(request))
            resp = await self._generate(request, body, chat)
        except P.APIError as e:
            return self._error(endpoint, e)
        except Exception:  # a bug, not the client's fault: answer 500, keep serving
            log.exception("internal error in %s", endpoint)
            return self._error(endpoint, P.APIError(500, "internal server error", "server_error"))
        self.metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        return resp

    # --- request -> engine requests -----------------------------------------------------------------------
    def _params(self, b: P._Sampling, max_tokens: int, j: int) -> SamplingParams:
        for f in ("presence_penalty", "frequency_penalty"):
            if getattr(b, f) not in (None, 0, 0.0):
                raise P.bad_request(f"{f} is not supported by this server", f)
        if b.logprobs not in (None, False):
            raise P.bad_request("logprobs are not supported by this server", "logprobs")
        stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
        if len(stop) > self.cfg.max_stop:
            raise P.bad_request(f"at most {self.cfg.max_stop} stop strings are supported, got {len(stop)}", "stop")
        try:
            return SamplingParams(
                temperature=1.0 if b.temperature is None else b.temperature,
                top_p=1.0 if b.top_p is None else b.top_p, top_k=b.top_k or 0,
                seed=None if b.seed is None else b.seed + j, max_tokens=max_tokens, stop=tuple(stop),
                stop_token_ids=tuple(b.stop_token_ids or ()), ignore_eos=b.ignore_eos)
        except ValueError as e:
            field = str(e).split()[0]
            raise P.bad_request(str(e), field if field.isidentifier() else None) from None

    def _prompts(self, b: Any, chat: bool) -> list[list[int]]:
        """Token ids of each prompt (runs in a worker thread: tokenizing a long prompt takes a while)."""
        if chat:
            if not getattr(self.tok, "has_chat_template", False):
                raise P.bad_request(f"model {self.cfg.model_name!r} has no chat template; use /v1/completions",
                                    "messages")
            msgs = [{"role": m.role, "content": m.text()} for m in b.messages]
            try:
                return [self.tok.apply_chat_template(msgs)]
            except Exception as e:  # the template rejected the conversation (e.g. roles out of order)
                raise P.bad_request(f"messages: the chat template rejected them: {e}", "messages") from None
        p = b.prompt
        if isinstance(p, str):
            return [self.tok.encode(p)]
        if not p:
            raise P.bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        if isinstance(p[0], str):
            return [self.tok.encode(s) for s in p]
        return [list(x) for x in p]

    async def _generate(self, request: Request, b: Any, chat: bool) -> Response:
        if b.model != self.cfg.model_name:
            raise P.APIError(404, f"The model `{b.model}` does not exist; this server serves "
                             f"`{self.cfg.model_name}`.", "invalid_request_error", "model", "model_not_found")
        if b.n < 1 or b.n > self.cfg.max_n:
            raise P.bad_request(f"n must be between 1 and {self.cfg.max_n}, got {b.n}", "n")
        if not chat and b.echo:
            raise P.bad_request("echo is not supported by this server", "echo")
        prompts = await run_in_threadpool(self._prompts, b, chat)
        asked = (b.max_completion_tokens or b.max_tokens) if chat else (16 if b.max_tokens is None else b.max_tokens)
        param = "max_completion_tokens" if chat and b.max_completion_tokens is not None else "max_tokens"
        if asked is not None and asked < 1:
            raise P.bad_request(f"{param} must be at least 1, got {asked}", param)
        subs: list[tuple[str, list[int], SamplingParams]] = []
        env = P.Envelope(chat, self.cfg.model_name)
        for i, ids in enumerate(prompts):
            try:
                max_tokens = self.loop.engine.check_lengths(len(ids), asked)
            except RequestError as e:
                p = "messages" if chat and e.param == "prompt" else (param if e.param == "max_tokens" else e.param)
                raise P.bad_request(str(e), p, e.code) from None
            for j in range(b.n):
                subs.append((f"{env.id}-{i * b.n + j}", ids, self._params(b, max_tokens, j)))
        if len(subs) > self.cfg.max_n:
            raise P.bad_request(f"at most {self.cfg.max_n} choices per request (prompts x n), got {len(subs)}", "n")

        queue: asyncio.Queue = asyncio.Queue()
        aio = asyncio.get_running_loop()
        trackers = []
        submitted: list[str] = []
        try:
            for k, (rid, ids, params) in enumerate(subs):
                def on_output(ev: RequestOutput, k: int = k) -> None:  # engine thread
                    aio.call_soon_threadsafe(queue.put_nowait, (k, ev, time.monotonic()))
                trackers.append(_Tracker(time.monotonic()))
                self.loop.submit(rid, ids, params, on_output)
                submitted.append(rid)
        except (RequestError, QueueFull, EngineDead) as e:
            for rid in submitted:
                self.loop.abort(rid)
            if isinstance(e, QueueFull):
                raise P.APIError(429, f"the server is busy ({e}); retry later", "rate_limit_exceeded", None,
                                 "rate_limit_exceeded") from None
            if isinstance(e, EngineDead):
                raise P.APIError(503, f"the engine is not running: {e}", "server_error") from None
            raise P.bad_request(str(e), e.param, e.code) from None
        group = _Group(self, env, subs, queue, trackers, b.n, len(prompts))
        if b.stream:
            include_usage = bool(b.stream_options and b.stream_options.include_usage)
            return _SSE(group.stream(include_usage), media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await group.collect(request))


class _Group:
    """The engine requests behind one HTTP request (prompts x n choices), merged into one response or stream."""

    def __init__(self, srv: OpenAIServer, env: P.Envelope, subs: Sequence[tuple[str, list[int], SamplingParams]],
                 queue: asyncio.Queue, trackers: list[_Tracker], n: int, num_prompts: int):
        self.srv, self.env, self.subs, self.queue, self.trackers = srv, env, subs, queue, trackers
        self.n, self.num_prompts = n, num_prompts
        self.last: list[RequestOutput | None] = [None] * len(subs)

    async def _next(self) -> tuple[int, RequestOutput]:
        k, ev, t = await self.queue.get()
        self.trackers[k].observe(self.srv.metrics, ev, t)
        if ev.finished:
            self.last[k] = ev
        return k, ev

    def _abort_unfinished(self) -> None:
        for k, (rid, _, _) in enumerate(self.subs):
            if self.last[k] is None:  # the client went away (or the request failed): stop generating
                self.srv.loop.abort(rid)
                self.srv.metrics.finished.labels("abort").inc()

    def _usage(self) -> dict[str, Any]:
        firsts = [self.last[i * self.n] for i in range(self.num_prompts)]
        done = [ev for ev in self.last if ev is not None]
        prompt = sum(ev.prompt_tokens for ev in firsts if ev is not None)
        self.srv.metrics.prompt_tokens.inc(prompt)
        return P.usage(prompt, sum(ev.completion_tokens for ev in done),
                       sum(ev.cached_tokens for ev in firsts if ev is not None))

    @staticmethod
    def _failure(ev: RequestOutput) -> P.APIError:
        if ev.finish_reason == "error":
            return P.APIError(500, f"generation failed: {ev.error}", "server_error")
        return P.APIError(503, "the request was cancelled by the server (shutting down)", "server_error")

    async def collect(self, request: Request) -> dict[str, Any]:
        texts = [""] * len(self.subs)
        next_check = time.monotonic() + _DISCONNECT_POLL_S
        try:
            while any(ev is None for ev in self.last):
                try:
                    k, ev = await asyncio.wait_for(self._next(), timeout=_DISCONNECT_POLL_S)
                    texts[k] += ev.text
                    if ev.finish_reason in ("error", "abort"):
                        raise self._failure(ev)
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() >= next_check:  # events may flow faster than the poll: check by the clock
                    next_check = time.monotonic() + _DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        raise P.APIError(499, "client disconnected")
        finally:
            self._abort_unfinished()
        choices = [self.env.choice(k, texts[k], ev.finish_reason) for k, ev in enumerate(self.last) if ev]
        return self.env.response(choices, self._usage())

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        try:
            if self.env.chat:
                for k in range(len(self.subs)):
                    yield _sse(self.env.chunk(k, "", None, first=True))
            while any(ev is None for ev in self.last):
                k, ev = await self._next()
                if ev.finish_reason in ("error", "abort"):
                    yield _sse(self._failure(ev).body())
                    return
                if ev.text or ev.finished:
                    yield _sse(self.env.chunk(k, ev.text or None, ev.finish_reason))
            if include_usage:
                yield _sse(self.env.usage_chunk(self._usage()))
            else:
                self._usage()
            yield "data: [DONE]\n\n"
        finally:
            self._abort_unfinished()


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

    return app
