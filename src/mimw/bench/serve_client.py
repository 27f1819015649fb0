"""One benchmark request over HTTP: a streamed OpenAI completion (or chat completion), timed chunk by chunk.

Times come from ``time.perf_counter`` on the client: ``start`` when the request is sent, then the arrival of every
SSE chunk that carries text (the chat endpoint's first chunk, the role alone, is not a token; nor is the final
usage chunk). The output token count is the server's ``usage.completion_tokens`` (``stream_options.include_usage``);
chunks and tokens may differ, since a token that ends inside a multi-byte character sends no text of its own.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from .serve_dataset import BenchRequest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass
class RequestResult:
    """ok: a complete answer; error: why not (HTTP status and message, a timeout, ``cancelled``)."""

    prompt_len: int
    output_len: int  # asked for
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    ok: bool = False
    error: str | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # the server's count
    cached_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self, t0: float = 0.0) -> dict[str, Any]:
        """Times in seconds; ``start_s`` from ``t0`` (the run's start)."""
        sent = self.start > 0
        return {"ok": self.ok, "error": self.error, "prompt_len": self.prompt_len, "output_len": self.output_len,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "cached_tokens": self.cached_tokens, "start_s": self.start - t0 if sent else None,
                "ttft_s": self.ttft, "e2e_s": self.e2e if sent else None, "tpot_s": self.tpot, "itl_s": self.itl}


def request_body(req: BenchRequest, model: str, endpoint: str, decode: Any = None) -> dict[str, Any]:
    """The JSON body for ``req``; the chat endpoint takes text, so token-id prompts are decoded with ``decode``."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": req.ignore_eos}
    if endpoint == CHAT:
        text = req.prompt if isinstance(req.prompt, str) else decode(list(req.prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
    return body


async def send(client: httpx.AsyncClient, endpoint: str, body: dict[str, Any], result: RequestResult) -> None:
    """Send one streamed request, filling ``result`` (never raises for a failed request: ``result.error``)."""
    chat = endpoint == CHAT
    result.start = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                result.error = f"HTTP {r.status_code}: {_message(text)}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.ok = result.error is None
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    break
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        result.chunk_times.append(now)
                if chunk.get("usage"):
                    u = chunk["usage"]
                    result.output_tokens = int(u.get("completion_tokens") or 0)
                    result.prompt_tokens = u.get("prompt_tokens")
                    result.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    except httpx.TimeoutException:
        result.error = "timed out"
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.end = time.perf_counter()
    if result.ok and not result.output_tokens:
        result.output_tokens = len(result.chunk_times)  # a server without usage in streams


def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200]
