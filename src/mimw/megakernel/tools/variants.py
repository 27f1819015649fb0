"""Development benchmark for the megakernel alone: correctness spot-check, then decode-step latency of tuning
variants (plan.Tuning overrides) against the HBM floor measured in the same run, optionally with one traced step
each. (The full comparison with peers is `mimw bench decode`.)
    python -m mimw.megakernel.tools.variants --models llama-3.2-1b,llama-3.1-8b --variants default,if3 --out $OUT
An MoE preset's floor counts the k experts a token routes to in every MoE layer; ``--layers N`` cuts each preset to
its first N layers (the 30B-A3B's trace on an H100: ``--models qwen3-30b-a3b --layers 12 --check-steps 0 --trace``;
``--check-steps 0`` skips the correctness spot-check, whose fp32 oracle would not fit beside it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import time

import torch

from ...bench.config import preset_spec
from ...bench.floor import step_bytes
from ...models.weights import random_weights
from ..launch.decoder import MegakernelDecoder
from ..plan import Tuning
from .check import check_decode, random_cache
from .trace import format_summary, summarize


def read_bandwidth(gib: float = 4.0) -> float:
    """Streaming-read bandwidth (bytes/s) of a large read-only Triton kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(pid * BLOCK, n, nprog * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + pid, tl.sum(acc))

    n = int(gib * 2**30 / 4)
    x = torch.rand(n, device="cuda")
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(nsm * 8, device="cuda")
    t = triton.testing.do_bench(lambda: _read[(nsm * 8,)](x, out, n, BLOCK=4096, num_warps=8), warmup=10, rep=100,
                                return_mode="median")
    del x
    return n * 4 / (t * 1e-3)


def time_step(dec: MegakernelDecoder, iters: int = 200) -> float:
    """Median ms per graph replay."""
    dec.capture()
    for _ in range(10):
        dec.run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dec.run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


VARIANTS = {  # the default, and one step either side of each knob (bench/NOTES.md has what each measured)
    "default": Tuning(),
    "tickets": Tuning(clusters=False),  # ATTN_IN's parts and DOWN_PROJ's blocks joined through global memory
    "quiet0": Tuning(quiet=0),
    "quiet4": Tuning(quiet=4),
    "loud": Tuning(quiet=-1),  # no release hold
    "if3": Tuning(inflight=3),
    "if6": Tuning(inflight=6),
    "split128": Tuning(min_split_tokens=128),
    "ring10": Tuning(ring=10),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="names from VARIANTS, or Tuning overrides such as 'inflight=5' (commas split variants: "
                    "one override per variant)")
    ap.add_argument("--check-steps", type=int, default=4, help="steps of the correctness spot-check (0: none)")
    ap.add_argument("--layers", type=int, default=0, help="each preset's first N layers only (0: all)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--trace", action="store_true", help="also record one traced step per variant (tools/trace.py)")
    ap.add_argument("--save-trace", action="store_true", help="with --trace, also save each traced step's stamps "
                    "and program (trace-<model>-<variant>.pt under --out: trace, words, lens, waits) for analysis "
                    "off the GPU")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse of this tree; the GPU "
                    "machine's copy may carry a stale .git, so pass the hash taken where the repository is)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)  # before the runs: a missing directory must not lose their JSON at the end
    bw = read_bandwidth()
    print(f"read bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    for model in a.models.split(","):
        spec = preset_spec(model, a.layers)
        routed = spec.num_experts_per_tok * len(spec.moe_layers) if spec.is_moe else None  # one token: k distinct
        floor_bytes = step_bytes(spec, a.context, routed_experts=routed)
        floor_ms = floor_bytes / bw * 1e3
        w = random_weights(spec, 0, dtype=torch.bfloat16, device="cuda")
        for name in a.variants.split(","):
            tuning = VARIANTS[name] if name in VARIANTS else Tuning.parse(name)
            row = dict(model=model, variant=name, context=a.context, floor_ms=floor_ms)
            try:
                t0 = time.time()
                if a.check_steps > 0:
                    chk = check_decode(spec, a.context, steps=a.check_steps, tuning=tuning, graph=False)
                    row.update(check=chk.as_dict(), check_ok=chk.ok())
                cache, table = random_cache(spec, a.context, 8, 16, 1)
                dec = MegakernelDecoder(w, cache, max_pages_per_seq=len(table), tuning=tuning, context_hint=a.context)
                dec.set_inputs(5, a.context, table)
                ms = time_step(dec)
                row.update(ms=ms, ratio=ms / floor_ms, TBps=floor_bytes / (ms * 1e-3) / 1e12, secs=time.time() - t0)
                del dec
                if a.trace:
                    tdec = MegakernelDecoder(w, cache, max_pages_per_seq=len(table),
                                             tuning=dataclasses.replace(tuning, trace=True), context_hint=a.context)
                    tdec.step(5, a.context, table)
                    tdec.step(5, a.context, table)  # the second, warm launch is the one recorded
                    torch.cuda.synchronize()
                    row["trace"] = summarize(tdec.trace, tdec.words, tdec.lens, tdec.wait_trace)
                    if a.save_trace:
                        torch.save(dict(trace=tdec.trace.cpu(), words=tdec.words.cpu(), lens=tdec.lens.cpu(),
                                        waits=tdec.wait_trace.cpu()),
                                   os.path.join(a.out, f"trace-{model}-{name}.pt"))
                    print(format_summary(row["trace"]), flush=True)
                    del tdec
                del cache
            except Exception as e:  # one failing variant must not hide the others
                row.update(error=f"{type(e).__name__}: {str(e)[:400]}")
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
        del w
        torch.cuda.empty_cache()
    commit = a.commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, read_TBps=bw / 1e12, commit=commit)
    with open(os.path.join(a.out, "megakernel_variants.json"), "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    print(f"\n{'model':14s} {'variant':18s} {'ms':>7s} {'floor':>7s} {'ratio':>6s} {'TB/s':>6s}  check")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:14s} {r['variant']:18s} ERROR {r['error'][:80]}")
            continue
        c = r.get("check")
        verdict = "(not checked)" if c is None else (
            f"err={c['max_rel_err']:.1e} (bf16 {c['bf16_rel_err']:.1e}) "
            f"agree={c['argmax_agree']:.2f} (bf16 {c['bf16_argmax_agree']:.2f}) "
            f"or-tie={c['argmax_agree_or_tie']:.2f} bit={c['bit_identical']}")
        print(f"{r['model']:14s} {r['variant']:18s} {r['ms']:7.3f} {r['floor_ms']:7.3f} {r['ratio']:6.2f} "
              f"{r['TBps']:6.2f}  {verdict}")


if __name__ == "__main__":
    main()
