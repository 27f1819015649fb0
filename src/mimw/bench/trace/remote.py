"""Replaying a trace against a running ``mimw serve`` over HTTP (loopback only), with httpx's async client.

Each request is a streamed ``POST /v1/completions`` whose prompt is the synthesised token ids, with
``max_tokens`` = the trace's output length, greedy, ``ignore_eos``, the session in ``session_id`` and, on a
session's last request, ``close_session``. TTFT is the first streamed chunk (the server streams text, so a token
that decodes to nothing arrives with the next one); the usage chunk gives the cached prompt tokens. A prompt the
server's context cannot hold (400 ``context_length_exceeded``) is reported as skipped, as in-process. The split of
hits between the device and the host tier comes from the server's /metrics, read before and after the run (the
HTTP API reports only the total per request).

Bounds: loopback addresses only; ``max_duration_s`` for the whole run (requests still open are cancelled and
reported as cut); ``max_inflight`` requests at once.
"""
from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlparse

from .format import Trace
from .replay import Clock, Outcome
from .tokens import TokenSynth

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"--url {url}: only a server on this machine can be replayed against "
                         f"({', '.join(LOOPBACK)}), got {host!r}")


def tier_hits(metrics_text: str) -> dict[str, float] | None:
    """{tier: prompt tokens} from a /metrics page, or None when the server does not export the split."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name.startswith("mimw_prefix_cache_tier_hits") and "tier" in s.labels:
                out[s.labels["tier"]] = s.value
    return out or None


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int, session: str | None, close: bool,
               o: Outcome, t0: float) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if session is not None:
        body["session_id"] = session
        body["close_session"] = close
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            too_long = resp.status_code == 400 and "context_length_exceeded" in text
            o.status, o.error = ("skipped" if too_long else "error"), f"HTTP {resp.status_code}: {text[:300]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                o.status, o.error = "error", str(chunk["error"].get("message"))
                return
            if chunk.get("choices"):
                o.token_times.append(time.perf_counter() - t0)
            use = chunk.get("usage")
            if use:
                o.output_tokens = use["completion_tokens"]
                o.cached_tokens = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    o.status = "ok"


async def _replay(url: str, model: str, trace: Trace, synth: TokenSynth, sessions: bool, max_duration_s: float,
                  max_inflight: int, progress) -> list[Outcome]:
    import httpx

    clock = Clock(trace)
    ideal = trace.ideal_hit_tokens()
    closers = trace.last_of_session()
    out = {r.index: Outcome(r.index, r.session, r.input_length, ideal[r.index], 0.0) for r in trace.requests}
    sem = asyncio.Semaphore(max_inflight)
    t0 = time.perf_counter()
    tasks: set[asyncio.Task] = set()

    async def run(i: int) -> None:
        r, o = trace.requests[i], out[i]
        async with sem:
            try:
                await _one(client, url, model, synth.prompt(r), r.output_length,
                           r.session if sessions else None, sessions and i in closers, o, t0)
            except (httpx.HTTPError, OSError, ValueError) as e:
                o.status, o.error = "error", f"{type(e).__name__}: {e}"
            except asyncio.CancelledError:
                o.status = "cut"
                raise
            finally:
                o.end = time.perf_counter() - t0
                if o.status != "cut":
                    clock.finished(i, o.end)
                    if progress is not None:
                        progress(o)

    timeout = httpx.Timeout(max_duration_s + 10, connect=10)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=max_inflight)) as client:
        while not clock.done:
            now = time.perf_counter() - t0
            if now > max_duration_s:
                break
            for i, due in clock.pop_due(now):
                out[i].due = due
                t = asyncio.create_task(run(i))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            nxt = clock.next_due()
            wait = 0.05 if nxt is None else max(0.0, min(nxt - now, 0.05))
            if tasks:
                await asyncio.wait(set(tasks), timeout=max(wait, 0.001), return_when=asyncio.FIRST_COMPLETED)
            elif nxt is None:
                break
            else:
                await asyncio.sleep(wait)
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for o in out.values():
        if o.status == "pending":
            o.status = "cut"
    return [out[i] for i in range(len(trace.requests))]


def replay_http(url: str, model: str, trace: Trace, synth: TokenSynth, sessions: bool = True,
                max_duration_s: float = 600.0, max_inflight: int = 64, progress=None) -> list[Outcome]:
    check_loopback(url)
    return asyncio.run(_replay(url.rstrip("/"), model, trace, synth, sessions, max_duration_s, max_inflight,
                               progress))
