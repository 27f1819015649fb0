"""Multi-token steps against their floor: decode batches and verify blocks through a backend's ``forward``.

A step of B decode segments at context C must read every weight once and each segment's KV:

    floor = (decode_weight_bytes + B * C * kv_bytes_per_token) / streaming-read bandwidth (measured in this run)

and a verify step of S segments of K tokens reads the same weights and S contexts' KV (plus the block's own rows).
This script times the megakernel backend's step (``MegakernelBackend.forward``: the megakernel for one decode
token; for more the fastest of B replays of the M = 1 megakernel (decode batches), one launch of its multi-token
step (up to ``plan.max_tokens`` tokens) and one pass of its prefill path (a CUDA graph per step pattern where the
segments are short), as its ``StepRouter`` measured them) and each path alone (``replay_ms``, ``kernel_ms``,
``batched_ms``; the multi-token launch's logits checked against the pass's: ``kernel_max_rel_err``,
``kernel_argmax_agree``), for B in ``--batch`` and verify blocks of K in
``--verify``. Every segment has its own pages, filled with random K/V; weights are random at the preset's shape.
The two paths' logits are checked against each other (argmax agreement and the largest relative error) before
anything is timed.

``--kv-dtype fp8`` runs the backend over an fp8 cache (e4m3, a bf16 scale per (token, KV head)); the floor counts
the fp8 bytes and the peers read the same values dequantised.

``--peers`` times the same step, same tokens, positions and cache contents, through peers (``peers/batched_peers.py``):
``reference`` (mimw's reference decoder, for scale), ``torch-graph`` (a gpt-fast-style batched PyTorch decoder in a
CUDA graph) and ``torch-compile`` (the same module through Inductor max-autotune, in a CUDA graph), each built for
the step's shape inside the run and checked against the backend's logits (``<peer>_max_rel_err``,
``<peer>_argmax_agree``) before it is timed (``<peer>_ms``). ``--peer-budget-s`` caps the seconds each peer may take
per model (compiling the 8B takes minutes a shape); shapes past it keep the other numbers and say why that peer is
missing. The JSON and the tables (``steps_report.markdown``), rewritten after every shape, and a chart of ms per
step versus tokens per step land in ``--out`` as ``<stamp>-batch-steps.json/.md/.png``.

    mimw bench steps --model llama-3.2-1b,llama-3.1-8b --context 1024 --peers torch-graph --out $OUT
    (or PYTHONPATH=src python3 -m mimw.bench.batch_steps ... from a source tree)
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Sequence

import torch

from ..kv import fp8
from ..kv.pages import PagedKVCache, parse_kv_dtype
from ..models.reference import Segment
from ..models.spec import get_preset
from ..models.weights import random_weights
from .bandwidth import measure_read_bandwidth
from .floor import floor_ms
from .peers.base import Unavailable
from .peers.batched_peers import PEERS, StepInputs, build_peer, parse_peers
from .steps_report import markdown, write_chart
from .timing import time_steps


def step_segments(batch: int, block: int, context: int, pages_per_seq: int) -> list[Segment]:
    """``batch`` segments of ``block`` new tokens each after ``context`` cached positions, sequence i on pages
    [i * pages_per_seq, (i + 1) * pages_per_seq)."""
    return [Segment(tuple(range(i * pages_per_seq, (i + 1) * pages_per_seq)), context, block, block)
            for i in range(batch)]


def step_floor_bytes(spec, segments: Sequence[Segment], kv_bytes_per_token: int) -> int:
    """Weights once, plus every segment's KV: its cached context and its own new rows."""
    return spec.decode_weight_bytes() + sum(s.start + s.length for s in segments) * kv_bytes_per_token


def fill_random(cache: PagedKVCache, g: torch.Generator) -> None:
    """Every page of ``cache`` filled with standard-normal K and V rows (an fp8 cache: those rows quantised as its
    own store does, ``fp8.quantize``, scales included)."""
    for pool, scales in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        if not cache.layout.quantized:
            pool.normal_(generator=g)
            continue
        for layer in range(pool.shape[0]):  # a layer at a time: the bf16 rows of a whole 8B pool are gigabytes
            x = torch.empty(pool.shape[1:], dtype=torch.bfloat16, device=pool.device).normal_(generator=g)
            pool[layer], scales[layer] = fp8.quantize(x)


def compare(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(largest |x - ref| over the largest |ref|, fraction of rows whose argmax agrees) of two [rows, V] logits."""
    x, ref = x.float(), ref.float()
    return ((x - ref).abs().max() / ref.abs().max()).item(), (x.argmax(-1) == ref.argmax(-1)).float().mean().item()


def measure_mimw(row: dict, mk, inp: StepInputs, device: torch.device, budget_s: float) -> torch.Tensor | None:
    """Time the backend's step into ``row`` (``mimw_ms``; for a decode batch also its two paths alone, checked
    against each other); return its logits, what every peer is checked against (None and ``row["error"]`` if the
    step failed: one shape failing must not lose the others' rows)."""
    toks, segs, cache = inp.tokens, list(inp.segments), inp.cache
    try:
        if row["kind"] == "decode" and len(segs) > 1:
            a = mk.decode_pass(toks, segs, cache)
            r = mk.decode_replays(toks, segs, cache)
            row["max_rel_err"], row["argmax_agree"] = compare(a, r)
            row["replay_ms"] = time_steps(lambda: mk.decode_replays(toks, segs, cache), device, 50,
                                          budget_s=budget_s).median_ms
            row["batched_ms"] = time_steps(lambda: mk.decode_pass(toks, segs, cache), device, 50,
                                           budget_s=budget_s).median_ms
        if 2 <= len(toks) <= mk.max_tokens:  # the megakernel's multi-token launch alone, checked against one pass
            row["kernel_max_rel_err"], row["kernel_argmax_agree"] = compare(
                mk.decode_kernel(toks, segs, cache), mk.decode_pass(toks, segs, cache))
            row["kernel_ms"] = time_steps(lambda: mk.decode_kernel(toks, segs, cache), device, 50,
                                          budget_s=budget_s).median_ms
        ref = mk.forward(toks, segs, cache).float().clone()
        row["mimw_ms"] = time_steps(lambda: mk.forward(toks, segs, cache), device, 50, budget_s=budget_s).median_ms
        row["router"] = mk.router.estimates()  # what the backend's router had measured when it chose mimw_ms's path
        return ref
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        return None


def measure_peer(row: dict, name: str, weights, inp: StepInputs, ref: torch.Tensor | None, device: torch.device,
                 budget_s: float) -> None:
    """Build peer ``name`` for this step, check its logits against ``ref`` (mimw's, same inputs) and time it, into
    ``row`` as ``<name>_build_s``, ``_notes``, ``_max_rel_err``, ``_argmax_agree``, ``_ms``; or ``<name>_error``
    (an unavailable peer or a failure loses this peer's entries only)."""
    peer = None
    try:
        t0 = time.monotonic()
        peer = build_peer(name, weights, inp)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row[f"{name}_build_s"] = round(time.monotonic() - t0, 2)
        row[f"{name}_notes"] = peer.notes
        peer.step()
        if ref is not None:
            row[f"{name}_max_rel_err"], row[f"{name}_argmax_agree"] = compare(peer.logits(), ref)
        row[f"{name}_ms"] = time_steps(peer.step, device, 20 if name == "reference" else 50,
                                       budget_s=budget_s).median_ms
    except Unavailable as e:
        row[f"{name}_error"] = f"unavailable: {e}"
    except Exception as e:  # noqa: BLE001 - one peer failing must not lose the others' entries
        row[f"{name}_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        if peer is not None:
            peer.release()
        del peer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.2-1b,llama-3.1-8b", help="presets (random weights), comma-separated")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", default="1,2,4,8,16,32,64", help="decode batch sizes")
    p.add_argument("--verify", default="4,8,16", help="verify block lengths (one segment each, then 4 segments)")
    p.add_argument("--peers", default="", metavar="NAME[,...]",
                   help=f"also time these on every step shape, each checked against mimw's logits: {', '.join(PEERS)}"
                        " (torch-compile compiles and autotunes every shape: expect minutes a model; --peer-budget-s)")
    p.add_argument("--peer-budget-s", type=float, default=0.0, metavar="S",
                   help="per model and peer: build that peer for no further shape once it has taken S seconds "
                        "(0: no limit); the shapes after that keep the other numbers and say why it is missing")
    p.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"),
                   help="the backend's KV cache element type (fp8: e4m3 with a bf16 scale per (token, KV head); the "
                        "floor counts its bytes, the peers hold the same values dequantised in their own caches)")
    p.add_argument("--budget-s", type=float, default=0.5, help="timing seconds per step shape")
    p.add_argument("--out", default=".", help="directory for the JSON, markdown and chart")


def add_parser(sub) -> None:
    """`mimw bench steps`."""
    add_options(sub.add_parser("steps", help="multi-token steps (decode batches, verify blocks) vs their floor",
                               description=__doc__.split("\n\n")[0]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mimw.bench.batch_steps", description=__doc__.split("\n\n")[0])
    add_options(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    try:
        peers = parse_peers(args.peers)
    except ValueError as e:
        print(f"mimw bench steps: error: --peers: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("mimw bench steps: needs a Hopper GPU (the megakernel backend); none is available here",
              file=sys.stderr)
        return 1
    from ..engine.backends.megakernel import MegakernelBackend

    device = torch.device("cuda")
    bw = measure_read_bandwidth()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"{time.strftime('%Y%m%d-%H%M', time.gmtime())}-batch-steps"
    json_path, md_path = base.with_name(base.name + ".json"), base.with_name(base.name + ".md")
    doc = {"gpu": torch.cuda.get_device_name(device), "read_TBps": bw.tbps, "torch": torch.__version__,
           "context": args.context, "kv_dtype": args.kv_dtype, "peers": list(peers), "command": " ".join(sys.argv),
           "rows": []}

    def emit(row: dict) -> None:
        doc["rows"].append(row)
        print(f"[batch_steps] {json.dumps(row)}", file=sys.stderr, flush=True)
        json_path.write_text(json.dumps(doc, indent=1))  # after every shape: a run cut short keeps its rows
        md_path.write_text(markdown(doc))

    for model in [m.strip() for m in args.model.split(",") if m.strip()]:
        spec = get_preset(model)
        weights = random_weights(spec, seed=0, dtype=torch.bfloat16, device=device)
        # fuses its own copy (mk.prefill.w, what the torch peers read)
        mk = MegakernelBackend(weights, kv_dtype=parse_kv_dtype(args.kv_dtype))
        del weights  # the unfused originals: 16 GB on the 8B that nothing reads any more
        run_model(model, mk, args, peers, device, bw.bytes_per_s, emit)
        del mk
        gc.collect()
        torch.cuda.empty_cache()
        write_chart(doc, base.with_name(base.name + ".png"))
    print(markdown(doc))
    print(f"[batch_steps] wrote {json_path} (.md, .png beside it)", file=sys.stderr)
    return 0


def run_model(model: str, mk, args: argparse.Namespace, peers: Sequence[str], device: torch.device,
              read_bytes_per_s: float, emit) -> None:
    """Every step shape of one model through backend ``mk`` (``forward``, ``decode_pass``, ``decode_replays``,
    ``make_cache``, ``prefill.w``, ``router``: the megakernel backend's interface) and the peers; ``emit(row)`` per
    shape."""
    spec = get_preset(model)
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    blocks = [int(k) for k in args.verify.split(",") if k.strip()]
    page = 16
    per_seq = -(-(args.context + max(blocks + [1]) + 1) // page)
    cache = mk.make_cache(page, per_seq * max(batches + [4]))
    fill_random(cache, torch.Generator(device=device).manual_seed(0))
    kvb = cache.layout.bytes_per_token()
    gen = torch.Generator().manual_seed(1)
    shapes = [("decode", b, 1) for b in batches] + [("verify", s, k) for k in blocks for s in (1, 4)]
    spent = dict.fromkeys(peers, 0.0)
    for kind, nseg, k in shapes:
        segs = step_segments(nseg, k, args.context, per_seq)
        toks = torch.randint(1, spec.vocab_size, (nseg * k,), generator=gen).to(device)
        row = {"model": model, "kind": kind, "segments": nseg, "block": k, "context": args.context,
               "tokens": nseg * k, "floor_ms": floor_ms(step_floor_bytes(spec, segs, kvb), read_bytes_per_s)}
        inp = StepInputs(toks, tuple(segs), cache)
        ref = measure_mimw(row, mk, inp, device, args.budget_s)
        for name in peers:
            if args.peer_budget_s and spent[name] >= args.peer_budget_s:
                row[f"{name}_error"] = f"skipped: --peer-budget-s {args.peer_budget_s:g} spent on earlier shapes"
                continue
            t0 = time.monotonic()
            measure_peer(row, name, mk.prefill.w, inp, ref, device, args.budget_s)
            spent[name] += time.monotonic() - t0
        emit(row)


if __name__ == "__main__":
    sys.exit(main())
