"""Speculative decoding on the GPU at acceptance measured on real text: verify-step timings x measured block mix.

Random weights at the 1B/8B shapes cannot measure acceptance (their drafts are never right), so acceptance comes
from ``mimw bench spec`` on the CPU with the real default model: per prompt set and drafter, how many verify steps
drafted k tokens and accepted a of them, and how many tokens came from plain steps. This script times, through a
backend at real shapes on the GPU, a plain decode step (1 token) and a verify step of 1 + k tokens with 1 + k
logits rows for k = 1 .. K, at one context length, and combines them:

    plain:        t_1 per token
    speculative:  (n_plain t_1 + sum_{k,a} n_{k,a} t_verify(k)) / (n_plain + sum_{k,a} n_{k,a} (a + 1)) per token

Not included: the drafter's own time (host-side n-gram/suffix lookups; a draft model's steps), prefill, and any
change in acceptance between the CPU model and the GPU model (labelled: random weights, CPU-measured acceptance).
The megakernel backend runs a verify block of up to ``plan.max_tokens`` tokens on the megakernel's multi-token step
or its prefill path's (graphed) pass, whichever its router measured faster; this script measures whatever the
backend does.

    PYTHONPATH=src python3 -m mimw.bench.spec_steps --results bench/results/<date>-cpu-spec-<model>.json \\
        --model llama-3.2-1b,llama-3.1-8b --backend megakernel,reference --context 1024 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from ..models.reference import Segment
from ..models.spec import get_preset
from ..models.weights import random_weights
from .timing import time_steps

_BACKENDS = {"megakernel": ("mimw.engine.backends.megakernel", "MegakernelBackend"),
             "reference": ("mimw.engine.backends.reference", "ReferenceBackend")}


def block_mix(summary: dict) -> tuple[int, dict[int, list[tuple[int, int]]]]:
    """From one set x drafter summary of ``mimw bench spec``: (tokens from plain steps, {k: [(a, n), ...]})."""
    blocks: dict[int, list[tuple[int, int]]] = {}
    verified = 0
    for key, n in summary.get("blocks", {}).items():
        k, a = (int(x) for x in key.split(","))
        blocks.setdefault(k, []).append((a, n))
        verified += (a + 1) * n
    return summary["tokens"] - verified, blocks


def estimate(t1: float, t_verify: dict[int, float], plain_tokens: int,
             blocks: dict[int, list[tuple[int, int]]]) -> dict:
    """Per-token time of plain decoding and of the measured mix (ms), and the speedup."""
    time_ms = plain_tokens * t1
    tokens = plain_tokens
    for k, rows in blocks.items():
        for a, n in rows:
            time_ms += n * t_verify[k]
            tokens += n * (a + 1)
    spec_ms = time_ms / tokens if tokens else t1
    return {"plain_ms_per_token": t1, "spec_ms_per_token": spec_ms, "speedup": t1 / spec_ms,
            "plain_tok_s": 1e3 / t1, "spec_tok_s": 1e3 / spec_ms}


SETTLE_STEPS = 24  # untimed steps of a shape first: a backend with a router (the megakernel's) tries each of its paths
# for a new bucket (a warm-up time and two samples each, read a few steps late) before it keeps the cheapest; timed
# from the first steps, the first shape of each bucket measured that trial (H100: the 1B's k = 1 1.538 ms against
# k = 2's 1.380; bench/README.md)


def time_verify_steps(backend, spec, context: int, max_k: int, device: torch.device, budget_s: float) -> dict:
    """Median ms of a step over 1 + k new tokens (k = 0: plain decode) at ``context`` cached positions, each shape
    timed once the backend settled on its path (``SETTLE_STEPS``): a serving step's cost, not its first ones'."""
    page = 16
    cache = backend.make_cache(page, -(-(context + max_k + 1) // page))
    g = torch.Generator(device=device).manual_seed(0)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    table = tuple(range(cache.layout.num_pages))
    toks = torch.randint(1, spec.vocab_size, (max_k + 1,), generator=torch.Generator().manual_seed(1))
    out = {}
    for k in range(max_k + 1):
        seg = [Segment(table, context, k + 1, k + 1)]
        t = time_steps(lambda: backend.forward(toks[:k + 1], seg, cache), device, max_steps=50,
                       warmup=SETTLE_STEPS, budget_s=budget_s)
        out[k] = t.median_ms
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mimw.bench.spec_steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", required=True, help="JSON written by `mimw bench spec`")
    p.add_argument("--model", default="llama-3.2-1b,llama-3.1-8b", help="presets (random weights), comma-separated")
    p.add_argument("--backend", default="megakernel,reference", help=f"of {', '.join(_BACKENDS)}")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--budget-s", type=float, default=1.0, help="timing seconds per step shape")
    p.add_argument("--out", default=".", help="directory for the JSON")
    args = p.parse_args(argv)
    import importlib

    cpu = json.loads(Path(args.results).read_text())
    mixes = {(s, d): block_mix(summ) for s, per in cpu["summary"].items() for d, summ in per.items() if d != "plain"}
    max_k = max([k for _, blocks in mixes.values() for k in blocks] + [1])
    device = torch.device(args.device)
    rows, timings = [], {}
    for model in [m.strip() for m in args.model.split(",") if m.strip()]:
        spec = get_preset(model)
        weights = random_weights(spec, seed=0, dtype=getattr(torch, args.dtype), device=device)
        for name in [b.strip() for b in args.backend.split(",") if b.strip()]:
            module, cls = _BACKENDS[name]
            try:
                backend = getattr(importlib.import_module(module), cls)(weights)
                t = time_verify_steps(backend, spec, args.context, max_k, device, args.budget_s)
            except Exception as e:  # noqa: BLE001 - one backend failing must not lose the others' rows
                print(f"[spec_steps] {model} {name}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            timings[f"{model}/{name}"] = t
            print(f"[spec_steps] {model} {name}: " + " ".join(f"k={k}:{ms:.3f}ms" for k, ms in t.items()),
                  file=sys.stderr, flush=True)
            for (set_name, drafter), (plain_tokens, blocks) in mixes.items():
                est = estimate(t[0], {k: t[k] for k in range(1, max_k + 1)}, plain_tokens, blocks)
                rows.append({"model": model, "backend": name, "set": set_name, "drafter": drafter, **est})
            del backend
        del weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{gpu}, context {args.context}, random weights, acceptance measured on the CPU ({args.results})")
    print("| model | backend | set | drafter | plain tok/s | spec tok/s | speedup |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['backend']} | {r['set']} | {r['drafter']} | {r['plain_tok_s']:.1f} | "
              f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{time.strftime('%Y%m%d-%H%M', time.gmtime())}-spec-steps.json"
    path.write_text(json.dumps({"gpu": gpu, "context": args.context, "cpu_results": args.results,
                                "timings_ms": timings, "rows": rows}, indent=1))
    print(f"[spec_steps] wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
