"""``mimw bench prefill``'s secondary measurements, run after a model's main rows while time is left:

``attention_sweep``: one layer's attention alone for the last pass of a causal prompt of each of
``attention_lengths`` (its last ``chunk`` tokens, everything before them already in the cache): each
implementation at its defaults, then the paged kernel at other tiles and the Gluon kernel with its warpgroups'
other turn-taking at the first length, TFLOP/s (do_bench median) and each output's largest difference from the
paged Triton kernel's on the same inputs (``err_vs_triton``, relative to its largest value). ``engine_ttft``:
TTFT through the engine with the megakernel backend (its multi-token steps on the ``PrefillRunner``), one request at
a time, prefix cache off.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict

# (block_m, block_n, num_warps, num_stages) swept at the first attention length, by head dim: the default
# (``AttentionTiles.for_head_dim``) first, then the earlier default and its measured neighbours; one that does not
# compile or fit is a row with its error. Other head dims: the default only.
TILES = {64: ((128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (256, 128, 8, 3)),
         128: ((256, 64, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (256, 64, 8, 4))}
COMPARED = ("gluon", "cudnn", "sdpa", "flex")  # beside the paged Triton kernel, when in ``--impls``


class _Ids:
    """A tokenizer for random-weight models: every id is one character."""

    def decode(self, ids) -> str:
        return "".join(chr(0x4E00 + i % 20000) for i in ids)


def attention_sweep(bench, model, spec, cache, pages) -> None:
    """One layer's attention for the last pass of a causal prompt of each of ``attention_lengths``: every
    implementation at its defaults, each length in turn; then the paged kernel's other tiles at the first length
    (last, so that a deadline cuts the sweep before the comparison)."""
    import torch

    from ..prefill.paged_attention import AttentionTiles

    cache.k[0].normal_()
    cache.v[0].normal_()
    lengths = bench.cfg.attention_lengths
    for n in lengths:
        cases = [("triton", None)] + [(impl, None) for impl in COMPARED if impl in bench.cfg.impls
                                      and (impl not in ("sdpa", "flex") or n <= bench.cfg.gathered_max_tokens)]
        _time_attention(bench, model, spec, cache, pages, n, cases)
        torch.cuda.empty_cache()
    default = AttentionTiles.for_head_dim(spec.head_dim)
    others = [AttentionTiles(*t) for t in TILES.get(spec.head_dim, ()) if AttentionTiles(*t) != default]
    cases = [("triton", t) for t in others]
    if lengths and cases:
        _time_attention(bench, model, spec, cache, pages, lengths[0], cases)


def _time_attention(bench, model, spec, cache, pages, n, cases) -> None:
    import torch
    from triton.testing import do_bench

    from ..prefill.batch import Piece, PrefillBatch
    from ..prefill.gluon_attention import GluonTiles
    from ..prefill.paged_attention import AttentionTiles
    from ..prefill.runner import make_attention

    length = min(bench.cfg.chunk, n)
    start = n - length
    table = tuple(torch.randperm(pages)[:-(-n // bench.cfg.page_size)].tolist())
    batch = PrefillBatch.build([Piece(table, start, length)], bench.cfg.page_size, "cuda")
    q = torch.randn(length, spec.num_heads, spec.head_dim, device="cuda", dtype=torch.bfloat16)
    pairs = length * start + length * (length + 1) / 2
    flops = 4.0 * spec.num_heads * spec.head_dim * pairs
    ref = make_attention("triton", None, torch.device("cuda")).plan(batch)(q, cache.k[0], cache.v[0]).float()
    for impl, tiles in cases:
        shown = tiles or (AttentionTiles.for_head_dim(spec.head_dim) if impl == "triton" else None)
        if impl == "gluon" and tiles is None and spec.head_dim in (64, 128):
            shown = GluonTiles.for_head_dim(spec.head_dim, spec.group_size, spec.num_kv_heads, bench.cfg.page_size)
        row = {"model": model, "tokens": n, "impl": impl,
               "tiles": None if shown is None else list(asdict(shown).values())}
        if not bench.time_left():
            row["error"] = "skipped (deadline)"
        else:
            try:
                attend = make_attention(impl, tiles, torch.device("cuda")).plan(batch)
                err = (attend(q, cache.k[0], cache.v[0]).float() - ref).abs().max() / ref.abs().max()
                ms = do_bench(lambda: attend(q, cache.k[0], cache.v[0]), warmup=10, rep=60, return_mode="median")
                row.update(ms=ms, tflops=flops / ms / 1e9, err_vs_triton=float(err))
            except Exception as e:  # noqa: BLE001 - a tile that does not fit shared memory is a row
                row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
        bench.doc["attention"].append(row)
        print(f"[prefill] attention {model} {n} {impl} {row.get('tiles')} {row.get('tflops') or row.get('error')}"
              f" err_vs_triton {row.get('err_vs_triton')}", file=sys.stderr, flush=True)
        bench.save()


def engine_ttft(bench, model, spec, mw, pages) -> None:
    """TTFT through the engine (megakernel backend: prefill on the PrefillRunner), one request at a time."""
    import torch

    from ..engine.backends.megakernel import MegakernelBackend
    from ..engine.engine import Engine, EngineConfig
    from ..engine.sampling import SamplingParams

    try:
        backend = MegakernelBackend(mw)
    except Exception as e:  # noqa: BLE001
        bench.record({"model": model, "tokens": 0, "impl": "engine", "error": f"{type(e).__name__}: {e}"}, spec)
        return
    lengths = [n for n in bench.cfg.lengths if n <= 32768]
    engine = Engine(backend, _Ids(), EngineConfig(num_pages=pages, page_size=bench.cfg.page_size, max_batch=4,
                                                  max_step_tokens=512, max_prefill_step_tokens=bench.cfg.chunk,
                                                  enable_prefix_cache=False))
    gen = torch.Generator().manual_seed(bench.cfg.seed + 1)
    for n in lengths:
        row = {"model": model, "tokens": n, "impl": "engine-triton", "chunk": bench.cfg.chunk}
        if not bench.time_left():
            bench.record({**row, "error": "skipped (deadline)"}, spec)
            continue
        times = []
        for rep in range(3 if n <= 8192 else 2):
            prompt = torch.randint(spec.vocab_size, (n,), generator=gen).tolist()
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.add_request(f"{n}-{rep}", prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                                    ignore_eos=True))
            while engine.has_work():
                engine.step()
            times.append(time.perf_counter() - t)
        row.update(ttft_s=statistics.median(times), ttft_min_s=min(times), runs=len(times))
        bench.record(row, spec)
