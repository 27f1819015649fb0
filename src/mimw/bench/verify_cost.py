"""CPU cost of a speculative verify block: a step over 1 + k tokens (1 + k logits rows) against a one-token step.

The draft-length policy pays for k drafted tokens with v(k) = t(1 + k) / t(1) (``engine/spec/policy.py``); on the
CPU that slope, more than acceptance, decides how far speculation pays. This times both of the reference
backend's paths on the default model (or ``--model``) at one context: ``F.linear`` (MKL: GEMV for one row, a GEMM
that repacks the weights for more) and ``packed_linear`` (oneDNN on weights prepacked once), interleaved, each
step's process CPU time (one torch thread: what it takes on an idle core, which a shared machine's wall clock is
not), the median of ``--reps``; and a prefill of the context in decode steps.

    PYTHONPATH=src python -m mimw.bench.verify_cost --context 300 --reps 7
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import torch

KS = (0, 1, 2, 3, 4, 6, 8, 12, 16)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mimw.bench.verify_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--context", type=int, default=300, help="cached tokens before the step")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.context < 1 or args.reps < 1 or args.threads < 1:
        print("verify_cost: error: --context, --reps and --threads must be >= 1", file=sys.stderr)
        return 2
    from ..engine.backends.reference import ReferenceBackend
    from ..models.checkpoint import load_model
    from ..models.reference import Segment

    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32, progress=False)
    backends = {"F.linear": ReferenceBackend(model.weights),
                "packed": ReferenceBackend(model.weights, packed_linear=True)}
    if backends["packed"].packed is None:
        del backends["packed"]
    ctx, page = args.context, 16
    toks = torch.randint(0, model.spec.vocab_size, (ctx + max(KS) + 1,), generator=torch.Generator().manual_seed(0))
    times: dict[tuple[str, int], list[float]] = {}
    prefill: dict[str, float] = {}
    caches = {}
    for name, be in backends.items():
        cache = caches[name] = be.make_cache(page, -(-(ctx + max(KS) + 1) // page))
        table = tuple(range(cache.layout.num_pages))
        c0 = time.process_time()
        be.forward(toks[:ctx], [Segment(table, 0, ctx, 1)], cache)
        prefill[name] = time.process_time() - c0
    for _ in range(args.reps):
        for name, be in backends.items():
            table = tuple(range(caches[name].layout.num_pages))
            for k in KS:
                c0 = time.process_time()
                be.forward(toks[ctx:ctx + k + 1], [Segment(table, ctx, k + 1, k + 1)], caches[name])
                times.setdefault((name, k), []).append(time.process_time() - c0)
    med = {key: sorted(v)[len(v) // 2] * 1e3 for key, v in times.items()}
    print(f"{model.spec.name} fp32, {args.threads} thread(s), context {ctx}, median of {args.reps}, process CPU ms")
    print("| k | " + " | ".join(f"{n} ms | {n} v(k)" for n in backends) + " |")
    print("|---|" + "---|---|" * len(backends))
    for k in KS:
        print(f"| {k} | " + " | ".join(f"{med[(n, k)]:.1f} | {med[(n, k)] / med[(n, 0)]:.3f}" for n in backends) + " |")
    for n in backends:
        print(f"prefill of {ctx} tokens ({n}): {prefill[n] * 1e3:.0f} ms = {prefill[n] * 1e3 / med[(n, 0)]:.1f} "
              f"one-token steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
