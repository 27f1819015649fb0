"""Multi-token steps against their floor: decode batches and verify blocks through a backend's ``forward``.

A step of B decode segments at context C must read every weight once and each segment's KV:

    floor = (decode_weight_bytes + B * C * kv_bytes_per_token) / streaming-read bandwidth (measured in this run)

and a verify step of S segments of K tokens reads the same weights and S contexts' KV (plus the block's own rows).
This script times the megakernel backend's step (``MegakernelBackend.forward``: the megakernel for one decode
token; for a decode batch the faster of B replays of the M = 1 megakernel and one pass of its prefill path, as its
``StepRouter`` measured them; the prefill path for verify blocks) and, for decode
batches, both paths alone (``decode_replays``, ``decode_pass``), for B in ``--batch`` and verify blocks of K in
``--verify``; the reference backend as a peer where asked. Every segment has its own pages, filled with random K/V;
weights are random at the preset's shape. The two paths' logits are checked against each other (argmax agreement
and the largest relative error) before anything is timed.

    mimw bench steps --model llama-3.2-1b,llama-3.1-8b --context 1024 --out $OUT
    (or PYTHONPATH=src python3 -m mimw.bench.batch_steps ... from a source tree)
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
from .bandwidth import measure_read_bandwidth
from .floor import floor_ms
from .timing import time_steps


def step_segments(batch: int, block: int, context: int, pages_per_seq: int) -> list[Segment]:
    """``batch`` segments of ``block`` new tokens each after ``context`` cached positions, sequence i on pages
    [i * pages_per_seq, (i + 1) * pages_per_seq)."""
    return [Segment(tuple(range(i * pages_per_seq, (i + 1) * pages_per_seq)), context, block, block)
            for i in range(batch)]


def step_floor_bytes(spec, segments: Sequence[Segment], kv_bytes_per_token: int) -> int:
    """Weights once, plus every segment's KV: its cached context and its own new rows."""
    return spec.decode_weight_bytes() + sum(s.start + s.length for s in segments) * kv_bytes_per_token


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.2-1b,llama-3.1-8b", help="presets (random weights), comma-separated")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", default="1,2,4,8,16,32,64", help="decode batch sizes")
    p.add_argument("--verify", default="4,8,16", help="verify block lengths (one segment each, then 4 segments)")
    p.add_argument("--peers", default="", help="also time these backends: reference")
    p.add_argument("--budget-s", type=float, default=0.5, help="timing seconds per step shape")
    p.add_argument("--out", default=".", help="directory for the JSON")


def add_parser(sub) -> None:
    """`mimw bench steps`."""
    add_options(sub.add_parser("steps", help="multi-token steps (decode batches, verify blocks) vs their floor",
                               description=__doc__.split("\n\n")[0]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mimw.bench.batch_steps", description=__doc__.split("\n\n")[0])
    add_options(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("mimw bench steps: needs a Hopper GPU (the megakernel backend); none is available here",
              file=sys.stderr)
        return 1
    from ..engine.backends.megakernel import MegakernelBackend
    from ..engine.backends.reference import ReferenceBackend

    device = torch.device("cuda")
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    blocks = [int(k) for k in args.verify.split(",") if k.strip()]
    bw = measure_read_bandwidth()
    rows = []
    for model in [m.strip() for m in args.model.split(",") if m.strip()]:
        spec = get_preset(model)
        weights = random_weights(spec, seed=0, dtype=torch.bfloat16, device=device)
        mk = MegakernelBackend(weights)
        peers = {"reference": ReferenceBackend(weights)} if "reference" in args.peers else {}
        page = 16
        per_seq = -(-(args.context + max(blocks + [1]) + 1) // page)
        n_seq = max(batches + [4])
        cache = mk.make_cache(page, per_seq * n_seq)
        g = torch.Generator(device=device).manual_seed(0)
        cache.k.normal_(generator=g)
        cache.v.normal_(generator=g)
        kvb = cache.layout.bytes_per_token()
        gen = torch.Generator().manual_seed(1)
        shapes = [("decode", b, 1) for b in batches] + [("verify", s, k) for k in blocks for s in (1, 4)]
        for kind, nseg, k in shapes:
            segs = step_segments(nseg, k, args.context, per_seq)
            toks = torch.randint(1, spec.vocab_size, (nseg * k,), generator=gen).to(device)
            row = {"model": model, "kind": kind, "segments": nseg, "block": k, "context": args.context,
                   "tokens": nseg * k, "floor_ms": floor_ms(step_floor_bytes(spec, segs, kvb), bw.bytes_per_s)}
            try:
                if kind == "decode" and nseg > 1:  # the two paths of a decode batch, checked against each other
                    a = mk.decode_pass(toks, segs, cache)
                    r = mk.decode_replays(toks, segs, cache)
                    row["argmax_agree"] = (a.argmax(-1) == r.argmax(-1)).float().mean().item()
                    row["max_rel_err"] = ((a - r).abs().max() / r.abs().max()).item()
                    row["replay_ms"] = time_steps(lambda: mk.decode_replays(toks, segs, cache), device, 50,
                                                  budget_s=args.budget_s).median_ms
                    row["batched_ms"] = time_steps(lambda: mk.decode_pass(toks, segs, cache), device, 50,
                                                   budget_s=args.budget_s).median_ms
                row["mimw_ms"] = time_steps(lambda: mk.forward(toks, segs, cache), device, 50,
                                            budget_s=args.budget_s).median_ms
                for name, be in peers.items():
                    row[f"{name}_ms"] = time_steps(lambda: be.forward(toks, segs, cache), device, 20,
                                                   budget_s=args.budget_s).median_ms
            except Exception as e:  # noqa: BLE001 - one shape failing must not lose the others' rows
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            print(f"[batch_steps] {json.dumps(row)}", file=sys.stderr, flush=True)
        del mk, peers, weights, cache
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name(device)
    print(f"\n{gpu}, {bw.tbps:.2f} TB/s read, context {args.context}, random weights, bf16")
    print("| model | step | tokens | floor ms | mimw ms | x floor | tok/s | replays ms | one call ms | argmax agree |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "mimw_ms" not in r:
            print(f"| {r['model']} | {r['kind']} {r['segments']}x{r['block']} | {r['tokens']} | - | "
                  f"{r.get('error', '?')} |")
            continue
        rep = f"{r['replay_ms']:.3f}" if "replay_ms" in r else "-"
        one = f"{r['batched_ms']:.3f}" if "batched_ms" in r else "-"
        agree = f"{r['argmax_agree']:.3f}" if "argmax_agree" in r else "-"
        print(f"| {r['model']} | {r['kind']} {r['segments']}x{r['block']} | {r['tokens']} | {r['floor_ms']:.3f} | "
              f"{r['mimw_ms']:.3f} | {r['mimw_ms'] / r['floor_ms']:.2f} | {r['tokens'] * 1e3 / r['mimw_ms']:.0f} | "
              f"{rep} | {one} | {agree} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{time.strftime('%Y%m%d-%H%M', time.gmtime())}-batch-steps.json"
    path.write_text(json.dumps({"gpu": gpu, "read_TBps": bw.tbps, "torch": torch.__version__, "rows": rows},
                               indent=1))
    print(f"[batch_steps] wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
