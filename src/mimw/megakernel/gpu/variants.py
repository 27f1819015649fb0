"""Development benchmark for the megakernel alone: correctness spot-check, then decode-step latency of several
KernelConfig variants against the HBM floor measured in the same run. (The full comparison with peers is
`mimw bench decode`.)   python -m mimw.megakernel.gpu.variants --models llama-3.2-1b,llama-3.1-8b --out $OUT
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import time

import torch

from ...models.spec import get_preset
from ...models.weights import random_weights
from .check import check_decode, random_cache
from .config import KernelConfig
from .decoder import MegakernelDecoder
from .timeline import write_timeline
from .trace import format_summary, format_tiles, issue_series, summarize, summarize_tiles


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


VARIANTS = {
    "default": KernelConfig(),  # what MegakernelDecoder runs for 32-row shapes (tensor cores, 32 x 256, ring 10)
    "tr32-fma": KernelConfig(mma=0),  # matvec tiles on the CUDA cores (the default until session 11)
    # session 11's default (before a4a86e4's run): no early dispatch, LM_HEAD signals, 16 KB fixed cost, 256 KB blocks
    "tr32-s11": KernelConfig(dispatch=False, signal_logits=True, fixed_cost_kb=16, max_block_kb=256),
    # at most this many weight tiles requested and not landed per SM (the default 4; the ring still buffers 10)
    "tr32-loud": KernelConfig(quiet=-1),  # no release hold (the default until session 17)
    "tr32-quiet0": KernelConfig(quiet=0),  # a new stage's tiles all wait for the SM's previous release
    "tr32-quiet3": KernelConfig(quiet=3),  # ... past its first three (the default: two)
    "tr32-quiet4": KernelConfig(quiet=4),  # ... past its first four
    "tr32-quiet6": KernelConfig(quiet=6),
    "tr32-quiet8": KernelConfig(quiet=8),
    "tr32-early": KernelConfig(quiet_early=True),  # the hold ends before the release's fence, not after it
    "tr32-early0": KernelConfig(quiet=0, quiet_early=True),
    # the hold at some boundaries only: into MLP_IN and DOWN_PROJ (not the next layer's ATTN_IN, parked through
    # the attention window, nor O_PROJ), and everywhere but ATTN_IN
    "tr32-hold-mlp": KernelConfig(quiet_ops=("MLP_IN", "DOWN_PROJ")),
    # the hold through compute's count of its releases in shared memory instead of an mbarrier's phases
    "tr32-holdcount": KernelConfig(hold_count=True),
    "tr32-hold-noattn": KernelConfig(quiet_ops=("O_PROJ", "MLP_IN", "DOWN_PROJ", "LM_HEAD")),
    # more tiles in flight only where fewer SMs stream a stage (the 1B's DOWN_PROJ and O_PROJ: 64 row tiles a layer)
    "tr32-deepdown6": KernelConfig(deep_ops=("DOWN_PROJ",), inflight_deep=6),
    "tr32-deepdown8": KernelConfig(deep_ops=("DOWN_PROJ",), inflight_deep=8),
    "tr32-deepsparse8": KernelConfig(deep_ops=("ATTN_IN", "O_PROJ", "DOWN_PROJ"), inflight_deep=8),
    "tr32-deepdown8-noattn": KernelConfig(deep_ops=("DOWN_PROJ",), inflight_deep=8,
                                          quiet_ops=("O_PROJ", "MLP_IN", "DOWN_PROJ", "LM_HEAD")),
    # each consumer warp releases a ring slot on its own (no partition barrier a tile)
    "tr32-wrel": KernelConfig(warp_release=True),
    "tr32-wrel-deepdown8": KernelConfig(warp_release=True, deep_ops=("DOWN_PROJ",), inflight_deep=8),
    # DOWN_PROJ's row blocks whole on one SM each, half the SMs idle in the 1B's stage (the default until session 19)
    "tr32-noxdown": KernelConfig(cluster_down=False),
    # the attention's step row as a masked 64-position block in the split that holds it (not a one-position block)
    "tr32-norow1": KernelConfig(attn_row=False),
    # a DOWN_PROJ half stages all of act's column tiles (two staging groups on the 1B), not only its own
    "tr32-noxds": KernelConfig(down_half_stage=False),
    "tr32-s19": KernelConfig(attn_row=False, down_half_stage=False),  # the default until session 20
    "tr32-if0": KernelConfig(inflight=0),  # the whole ring in flight (the default until session 13)
    "tr32-if2": KernelConfig(inflight=2),
    "tr32-if3": KernelConfig(inflight=3),
    "tr32-if6": KernelConfig(inflight=6),
    "tr32-flag": KernelConfig(flag_act=True),  # MLP_IN -> DOWN_PROJ through versioned act words, no counter hop
    "tr32-flagx": KernelConfig(flag_act=True, flag_x=True),  # and x: no counter between attention windows
    "tr32-flagxa": KernelConfig(flag_act=True, flag_x=True, flag_attn=True),  # and attn: O_PROJ polls nothing
    # and q + the new K/V row: no counter hop left in a layer, only the tickets
    "tr32-flagall": KernelConfig(flag_act=True, flag_x=True, flag_attn=True, flag_q=True),
    # the versioned stagings probed one word in 16 / 64 while words are missing (vprobe): less polling traffic
    "tr32-flag-p16": KernelConfig(flag_act=True, vprobe=16),
    "tr32-flag-p64": KernelConfig(flag_act=True, vprobe=64),
    "tr32-flagx-p16": KernelConfig(flag_act=True, flag_x=True, vprobe=16),
    "tr32-flagxa-p16": KernelConfig(flag_act=True, flag_x=True, flag_attn=True, vprobe=16),
    "tr32-flagall-p16": KernelConfig(flag_act=True, flag_x=True, flag_attn=True, flag_q=True, vprobe=16),
    # ATTN_IN's heads finished by the attention splits (isa.QKV_IN_ATTN): no ticket, no finisher round trip
    "tr32-qkvattn": KernelConfig(qkv_in_attn=True),
    # an attention split's later K/V blocks through shared memory (two cp.async stages; the deepest ring that fits
    # beside them: 10 slots 1B, 9 8B). Its gain is at long contexts: run with --context 8192 too
    "tr32-kvp": KernelConfig(kv_pipeline=True, ring=0),
    "tr32-ring9": KernelConfig(ring=9),  # the 8B's ring under tr32-kvp, without the pipeline
    # one release per run of same-stage blocks on an SM (8B: 92 of 224 MLP_IN blocks a layer); with 256 KB blocks
    # (the 1B's default blocks leave no runs) it tests whether the block-size gain was the releases'
    "tr32-merge": KernelConfig(merge_signals=True),
    "tr32-merge-b256": KernelConfig(merge_signals=True, max_block_kb=256),
    "tr32-qkvattn-merge": KernelConfig(qkv_in_attn=True, merge_signals=True),
    # O_PROJ in column parts of 8 / 4 / 2 KV groups: no combining split, each block combines its groups' splits,
    # MLP_IN and DOWN_PROJ sum the parts (o_parts); with the heads finished in attention a layer has no ticket left
    "tr32-op8": KernelConfig(o_parts=8),
    "tr32-op4": KernelConfig(o_parts=4),
    "tr32-op2": KernelConfig(o_parts=2),
    "tr32-op8-qkvattn": KernelConfig(o_parts=8, qkv_in_attn=True),
    "tr32-op8-qkvattn-merge": KernelConfig(o_parts=8, qkv_in_attn=True, merge_signals=True),
    # the tensor-core epilogue's folds summed by warp shuffles (one barrier a row tile instead of three); with the
    # O_PROJ parts, whose blocks have 4-8x more row tiles (the 8B's compile spills 12 bytes)
    "tr32-shfl": KernelConfig(fold_shuffle=True),
    "tr32-shfl-op8": KernelConfig(fold_shuffle=True, o_parts=8),
    # without early dispatch a reader arrives later and spins less: if flag_act gains here, early spinning costs
    "tr32-nodisp": KernelConfig(dispatch=False),
    "tr32-flag-nodisp": KernelConfig(flag_act=True, dispatch=False),
    # fewer, longer attention splits (context 1024: 8 / 4 splits a KV head instead of 16)
    "tr32-split128": KernelConfig(min_split_tokens=128),
    "tr32-split256": KernelConfig(min_split_tokens=256),
    # ATTN_IN in one column part a head (no ticket, no finisher: the head's own SM ropes and stores it) or three/four
    "tr32-qp1": KernelConfig(qkv_parts=1),
    "tr32-qp3": KernelConfig(qkv_parts=3),
    "tr32-qp4": KernelConfig(qkv_parts=4),
    # ATTN_IN's two parts of a head on the two CTAs of a cluster, swapping sums through distributed shared memory
    # (no ticket, no global round trip of partials; gpu/cluster.py); with the deeper ring the exchange leaves room for
    # (the default since session 16: asynchronous remote stores, st.async); tickets as before it; remote stores with
    # release arrivals (a MEMBAR.GPU on every thread)
    "tr32-tickets": KernelConfig(cluster_qkv=0),
    "tr32-cluster-release": KernelConfig(cluster_qkv=1),
    # the release hold announced at every signalling streaming release, the loader applying the rule itself (the
    # default until session 21; synccheck's "Missing wait"), against the host's marks (gpu/hold.py)
    "tr32-nomarks": KernelConfig(hold_marks=False),
    # the staging buffer sized for a whole DOWN_PROJ where the halves stage their own columns (the default until
    # session 22; the 1B's ring 12 slots instead of 13); the 8B's DOWN_PROJ is unpaired and stages whole either way
    "tr32-wholehbuf": KernelConfig(half_hbuf=False),
    # ATTN_PARTIAL's warps merged by Triton's reductions over the warp axis (the default until session 22), not
    # through the staging buffer with one barrier (attention._merge_smem)
    "tr32-tmerge": KernelConfig(attn_smem_merge=False),
    "tr32-ring10": KernelConfig(ring=10),  # the ring's depth before session 21 (the default now: as deep as shared
    # memory allows, 12 slots for the 1B, 11 for the 8B)
    "tr16-tk512-nb10": KernelConfig(tile_rows=16, tile_k=512, ring=10),
    "tr16-tk256-nb20": KernelConfig(tile_rows=16, tile_k=256, ring=20),
    "tr32-tk512-nb5": KernelConfig(tile_rows=32, tile_k=512, ring=5),
    "tr32-w8": KernelConfig(num_warps=8),  # 8 compute warps (168 registers instead of 255)
    "tr16-tk512-nb10-w8": KernelConfig(tile_rows=16, tile_k=512, ring=10, num_warps=8),
    "tr32-reduce": KernelConfig(combine_splits=False),  # the separate ATTN_REDUCE stage
    "tr32-nb11": KernelConfig(ring=11),  # deeper rings: the most shared memory allows for the 8B / the 1B
    "tr32-nb12": KernelConfig(ring=12),
    "tr32-rowmajor": KernelConfig(tile_major=False, mma=0),  # weights row-major: each TMA load a strided [TR, TK] box
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--check-steps", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--trace", action="store_true", help="also record one traced step per variant (gpu/trace.py)")
    ap.add_argument("--save-trace", action="store_true", help="with --trace, also save each traced step's stamps "
                    "and program (trace-<model>-<variant>.pt under --out: trace, words, lens) for analysis off the GPU")
    ap.add_argument("--trace-tiles", action="store_true", help="with --trace, also stamp every weight tile (load "
                    "latency, the loaders' wait for slots, bytes issued per stage window)")
    ap.add_argument("--timelines", default="default", help="variants whose tile trace is also drawn as a timeline "
                    "PNG (comma-separated, 'all' or 'none'; the device machine returns only a few files a call)")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse of this tree; the GPU "
                    "machine's copy may carry a stale .git, so pass the hash taken where the repository is)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)  # before the runs: a missing directory must not lose their JSON at the end
    bw = read_bandwidth()
    print(f"read bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    for model in a.models.split(","):
        spec = get_preset(model)
        floor_bytes = spec.decode_weight_bytes() + a.context * spec.kv_bytes_per_token()
        floor_ms = floor_bytes / bw * 1e3
        w = random_weights(spec, 0, dtype=torch.bfloat16, device="cuda")
        for name in a.variants.split(","):
            kcfg = VARIANTS[name]
            row = dict(model=model, variant=name, context=a.context, floor_ms=floor_ms)
            try:
                t0 = time.time()
                chk = check_decode(spec, a.context, steps=a.check_steps, kcfg=kcfg, graph=False)
                row.update(check=chk.as_dict(), check_ok=chk.ok())
                cache, table = random_cache(spec, a.context, 8, kcfg.page_size, 1)
                dec = MegakernelDecoder(w, cache, max_pages_per_seq=len(table), kcfg=kcfg, context_hint=a.context)
                dec.set_inputs(5, a.context, table)
                ms = time_step(dec)
                row.update(ms=ms, ratio=ms / floor_ms, TBps=floor_bytes / (ms * 1e-3) / 1e12, secs=time.time() - t0)
                del dec
                if a.trace:
                    tdec = MegakernelDecoder(w, cache, max_pages_per_seq=len(table),
                                             kcfg=dataclasses.replace(kcfg, trace=True, trace_tiles=a.trace_tiles),
                                             context_hint=a.context)
                    tdec.step(5, a.context, table)
                    tdec.step(5, a.context, table)  # the second, warm launch is the one recorded
                    torch.cuda.synchronize()
                    row["trace"] = summarize(tdec.trace, tdec.words, tdec.lens)
                    if a.save_trace:
                        torch.save(dict(trace=tdec.trace.cpu(), words=tdec.words.cpu(), lens=tdec.lens.cpu()),
                                   os.path.join(a.out, f"trace-{model}-{name}.pt"))
                    print(format_summary(row["trace"]), flush=True)
                    if a.trace_tiles:
                        tr = row["trace"]
                        row["tiles"] = summarize_tiles(tdec.tiles, tdec.program, kcfg.tile_rows, kcfg.tile_k,
                                                       tr["stages"], tr["origin_ns"], tdec.trace)
                        print(format_tiles(row["tiles"]), flush=True)
                    if a.trace_tiles and (a.timelines == "all" or name in a.timelines.split(",")):
                        png = os.path.join(a.out, f"timeline-{model}-{name}.png")
                        write_timeline(issue_series(tdec.tiles, tdec.program, kcfg.tile_rows, kcfg.tile_k,
                                                    origin_ns=tr["origin_ns"]), tr["stages"], png,
                                       f"{model} · {name} · context {a.context} · weight bytes issued by all "
                                       f"loaders", bw / 1e12)
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
        else:
            c = r["check"]
            print(f"{r['model']:14s} {r['variant']:18s} {r['ms']:7.3f} {r['floor_ms']:7.3f} {r['ratio']:6.2f} "
                  f"{r['TBps']:6.2f}  err={c['max_rel_err']:.1e} (bf16 {c['bf16_rel_err']:.1e}) "
                  f"agree={c['argmax_agree']:.2f} (bf16 {c['bf16_argmax_agree']:.2f}) "
                  f"or-tie={c['argmax_agree_or_tie']:.2f} bit={c['bit_identical']}")


if __name__ == "__main__":
    main()
