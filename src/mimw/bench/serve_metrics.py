"""The numbers of one ``mimw bench serve`` run, with vLLM's ``bench serve`` definitions:

  TTFT   time to first token: send -> first chunk with text, per request
  TPOT   time per output token: (E2E - TTFT) / (output tokens - 1), per request with >= 2 tokens
  ITL    inter-token latency: every gap between consecutive text chunks, over all requests
  E2E    end-to-end latency: send -> last byte, per request
  throughputs over the run's duration (first send -> last completion): completed requests/s, output tokens/s,
  total (prompt + output) tokens/s

Each latency gets mean, p50, p90, p99 and max, in milliseconds; only completed requests count.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from .serve_client import RequestResult

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    ms = [v * 1e3 for v in values]
    return {"mean": sum(ms) / len(ms), **{f"p{p}": percentile(ms, p) for p in PERCENTILES}, "max": max(ms)}


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in done)
    errors = Counter((r.error or "?").split(":")[0] for r in results if not r.ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": dict(errors),
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "cached_tokens": sum(r.cached_tokens or 0 for r in done),
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "ttft_ms": stats_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": stats_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": stats_ms([g for r in done for g in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in done]),
    }
