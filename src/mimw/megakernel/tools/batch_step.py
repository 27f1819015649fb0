"""Time the megakernel's decode batch (``MegakernelDecoder.step_batch``) against its M = 1 step and the floor.

For each model shape (random bf16 weights) and batch B: B sequences of ``context`` past positions each in one paged
cache (shuffled pages), the step captured in a CUDA graph and replayed; median ms per replay beside the floor (every
weight once plus every sequence's KV, at the streaming read measured in the same run) and the M = 1 step of the
same run. ``--tunings`` times each batch (and verify step) under several ``Tuning`` overrides (``"default;ring=5"``),
``--trace`` also records one traced step per cell and prints its per-instruction summary (tools/trace.py; an MoE
model's loaders' routing waits among it), to say where a batch's time goes, ``--layers N`` keeps a preset's first N
layers. Each cell is printed as it is measured; a table at the end, and JSON to ``$OUT/batch_step.json`` when $OUT
is set.

``--verify 1x16,4x4`` also times verify steps (S sequences, a block of K tokens each, at the same context) on the
multi-token kernel twice: with each block as attention's query block (``blocks``: one instruction per block, KV
head and split, ops/attn_query_block.py; what step_segments runs) and with every token its own attention
(``per-token``: the decode batch's program), so one run gives both; with ``--trace`` each also prints where its
time goes (ATTN_PARTIAL's us a layer among them).

    PYTHONPATH=src python3 -m mimw.megakernel.tools.batch_step [--models llama-3.2-1b,llama-3.1-8b]
        [--batches 1,2,8,16,32] [--context 1024] [--tunings "default;ring=5"] [--verify 1x16,4x4] [--trace]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from ...bench.floor import floor_ms, step_bytes
from ...kv.pages import KVLayout, PagedKVCache
from ...models.reference import Segment
from ...models.spec import get_preset
from ...models.weights import random_weights
from ..launch.decoder import MegakernelDecoder
from ..launch.one_token import split_segments
from ..plan import Tuning, max_tokens
from .trace import format_summary, summarize
from .variants import read_bandwidth, time_step


def _spec(model: str, layers: int):
    """The preset, cut to its first ``layers`` layers where that is > 0 (a shape too large for the GPU's memory)."""
    spec = get_preset(model)
    return spec.with_(num_layers=layers) if layers else spec


def _floor_bytes(spec, context: int, tokens: int, sequences: int) -> int:
    """Weights plus each sequence's KV; an MoE shape's routed experts taken at their most, min(E, tokens x k) a layer
    (random routing of a few tokens picks nearly that many distinct experts), so its x floor is a lower bound."""
    routed = len(spec.moe_layers) * min(spec.num_experts, tokens * spec.num_experts_per_tok) if spec.is_moe else None
    return step_bytes(spec, context, routed_experts=routed) + (sequences - 1) * context * spec.kv_bytes_per_token(2)


def measure(model: str, batches: list[int], context: int, bw: float, page_size: int = 16,
            tuning: Tuning = Tuning(), name: str = "default", trace: bool = False, layers: int = 0) -> list[dict]:
    spec = _spec(model, layers)
    batches = [b for b in batches if b <= max_tokens(spec, tuning)]  # the 8B shapes plan at most 16
    if not batches:
        return []
    w = random_weights(spec, 0, dtype=torch.bfloat16, device="cuda")
    b_max = max(batches)
    per_seq = -(-(context + 1) // page_size)
    cache = PagedKVCache(KVLayout.for_spec(spec, page_size, b_max * per_seq + 3, torch.bfloat16), "cuda")
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    pages = torch.randperm(b_max * per_seq).tolist()
    tables = [pages[i * per_seq: (i + 1) * per_seq] for i in range(b_max)]
    rows = []
    for traced in (False, True) if trace else (False,):
        dec = MegakernelDecoder(w, cache, max_pages_per_seq=per_seq, context_hint=context,
                                tuning=dataclasses.replace(tuning, trace=traced), use_graph=not traced)
        for b in batches:
            bdec = dec.batch_decoder(b)
            bdec.set_batch(list(range(1, b + 1)), [context] * b, tables[:b])
            if traced:
                _record_trace(bdec, next(r for r in rows if r["batch"] == b), f"{model} B={b} {name}")
                continue
            ms = time_step(bdec)
            floor = floor_ms(_floor_bytes(spec, context, b, b), bw)
            rows.append(dict(model=model, tuning=name, batch=b, context=context, ms=ms, floor_ms=floor,
                             x_floor=ms / floor, ring=bdec.plan.ring, down_parts=bdec.program.down_parts))
            print(f"[batch_step] {model} {name} B={b}: {ms:.3f} ms (floor {floor:.3f})", flush=True)  # kept if a
            # later cell fails
        del dec
    one = next((r["ms"] for r in rows if r["batch"] == 1), None)
    for r in rows:
        r["x_m1"] = r["ms"] / one if one else None
    return rows


def _record_trace(dec: MegakernelDecoder, row: dict, label: str) -> None:
    """Two launches of ``dec``'s traced step (the second, warm one is recorded): its summary into ``row``, printed."""
    dec.run()
    dec.run()
    torch.cuda.synchronize()
    row["trace"] = summarize(dec.trace, dec.words, dec.lens, dec.wait_trace)
    print(f"--- {label} traced\n{format_summary(row['trace'])}", flush=True)


def measure_verify(model: str, shapes: list[tuple[int, int]], context: int, bw: float, page_size: int = 16,
                   tuning: Tuning = Tuning(), name: str = "default", trace: bool = False,
                   layers: int = 0) -> list[dict]:
    """Verify steps of S sequences x K tokens at ``context``: per shape, the query-block program and the per-token
    one, each timed as graph replays (and traced once with ``trace``)."""
    spec = _spec(model, layers)
    shapes = [(n, k) for n, k in shapes if 2 <= n * k <= max_tokens(spec, tuning)]
    if not shapes:
        return []
    w = random_weights(spec, 0, dtype=torch.bfloat16, device="cuda")
    n_max, k_max = max(n for n, _ in shapes), max(k for _, k in shapes)
    per_seq = -(-(context + k_max) // page_size)
    cache = PagedKVCache(KVLayout.for_spec(spec, page_size, n_max * per_seq + 3, torch.bfloat16), "cuda")
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    pages = torch.randperm(n_max * per_seq).tolist()
    tables = [tuple(pages[i * per_seq: (i + 1) * per_seq]) for i in range(n_max)]
    rows = []
    for traced in (False, True) if trace else (False,):
        dec = MegakernelDecoder(w, cache, max_pages_per_seq=per_seq, context_hint=context,
                                tuning=dataclasses.replace(tuning, trace=traced), use_graph=not traced)
        for n, k in shapes:
            one = split_segments([Segment(tables[i], context, k, k) for i in range(n)], least=2)  # blocks at any k
            for path, blocks in (("blocks", one.blocks), ("per-token", ())):
                vdec = dec.batch_decoder(one.num_tokens, blocks)
                vdec.set_batch(list(range(1, one.num_tokens + 1)), one.positions, one.block_tables, one.firsts)
                shape = f"verify {n}x{k} {path}"
                if traced:
                    _record_trace(vdec, next(r for r in rows if r["shape"] == shape), f"{model} {shape} {name}")
                    continue
                ms = time_step(vdec)
                floor = floor_ms(_floor_bytes(spec, context, n * k, n), bw)
                rows.append(dict(model=model, tuning=name, shape=shape, tokens=n * k, context=context, ms=ms,
                                 floor_ms=floor, x_floor=ms / floor, splits=vdec.program.max_splits))
                print(f"[batch_step] {model} {name} {shape}: {ms:.3f} ms (floor {floor:.3f})", flush=True)
        del dec
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--batches", default="1,2,8,16,32", help="batch sizes; those above the model's max_tokens are "
                    "left out ('': none, with --verify)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tunings", default="default", help="';'-separated Tuning overrides (tools/variants.py syntax)")
    ap.add_argument("--trace", action="store_true", help="also trace one step per cell and print its summary")
    ap.add_argument("--layers", type=int, default=0, help="each model's first N layers only (0: all), e.g. an MoE "
                    "shape larger than the GPU's memory")
    ap.add_argument("--verify", default="", metavar="SxK[,...]", help="verify steps: S sequences x K tokens each, "
                    "as query blocks and per token (e.g. 1x16,4x4)")
    a = ap.parse_args()
    try:
        verify = [tuple(int(x) for x in v.split("x")) for v in a.verify.split(",") if v]
        if any(len(v) != 2 or min(v) < 1 for v in verify):
            raise ValueError
    except ValueError:
        ap.error(f"--verify {a.verify!r}: expected SxK[,SxK...], e.g. 1x16,4x4")
    bw = read_bandwidth()
    print(f"read bandwidth {bw / 1e12:.2f} TB/s  ({torch.cuda.get_device_name()})")
    rows = []
    for m in a.models.split(","):
        for name in a.tunings.split(";"):
            tuning = Tuning() if name == "default" else Tuning.parse(name)
            rows += measure(m, [int(b) for b in a.batches.split(",") if b], a.context, bw, tuning=tuning, name=name,
                            trace=a.trace, layers=a.layers)
    print(f"{'model':14s} {'tuning':>12s} {'B':>3s} {'ms':>8s} {'floor':>8s} {'x floor':>8s} {'x M=1':>7s} ring parts")
    for r in rows:
        x1 = f"{r['x_m1']:7.2f}" if r["x_m1"] else "      -"
        print(f"{r['model']:14s} {r['tuning']:>12s} {r['batch']:3d} {r['ms']:8.3f} {r['floor_ms']:8.3f} "
              f"{r['x_floor']:8.2f} {x1} {r['ring']:4d} {r['down_parts']:5d}")
    vrows = []
    for m in a.models.split(",") if verify else []:
        for name in a.tunings.split(";"):
            tuning = Tuning() if name == "default" else Tuning.parse(name)
            vrows += measure_verify(m, verify, a.context, bw, tuning=tuning, name=name, trace=a.trace,
                                    layers=a.layers)
    if vrows:
        print(f"{'model':14s} {'tuning':>12s} {'shape':>24s} {'ms':>8s} {'floor':>8s} {'x floor':>8s} splits")
        for r in vrows:
            print(f"{r['model']:14s} {r['tuning']:>12s} {r['shape']:>24s} {r['ms']:8.3f} {r['floor_ms']:8.3f} "
                  f"{r['x_floor']:8.2f} {r['splits']:6d}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "batch_step.json"), "w") as f:
            json.dump(dict(read_tbps=bw / 1e12, device=torch.cuda.get_device_name(), rows=rows, verify=vrows), f,
                      indent=1)


if __name__ == "__main__":
    main()
