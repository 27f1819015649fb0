"""``mimw bench prefill``: time to first token and prefill tokens/s versus prompt length, for each prefill
implementation, against a plain PyTorch SDPA prefill of the same weights and the compute roofline, in one run.

For every model (presets with random bf16 weights) and prompt length: a fresh random prompt on a shuffled block
table is prefilled from an empty cache in passes of ``--chunk`` tokens (what the engine does with
``max_prefill_step_tokens`` = chunk and nothing decoding) by the ``PrefillRunner`` with each attention
(``triton``: mimw's paged kernel; ``sdpa``, ``flex``: torch's over gathered pages), then the first token is taken
(argmax, synchronised): TTFT is that wall time. ``plain-sdpa`` (``plain_prefill.py``) runs the whole prompt in one
eager call. Each row checks its logits against plain-sdpa's (relative max error). Then, time permitting: the
attention alone (one layer, TFLOP/s; the paged kernel at several tiles), the chunk size swept on the first model,
and TTFT through the engine (megakernel backend, one request).

Rows past ``--deadline-s`` are recorded as skipped, so a run fits its time box; the JSON and markdown are rewritten
after every row. FLOPs, roofline and MFU: ``prefill_report``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from .prefill_sweeps import attention_sweep, engine_ttft

IMPLS = ("plain-sdpa", "triton", "sdpa", "flex")


@dataclass(frozen=True)
class PrefillBenchConfig:
    models: tuple[str, ...] = ("llama-3.2-1b", "llama-3.1-8b")
    lengths: tuple[int, ...] = (2048, 8192, 32768, 131072)
    impls: tuple[str, ...] = IMPLS
    chunk: int = 16384
    page_size: int = 16
    flex_max_tokens: int = 32768  # FlexAttention rows up to this length (its gathers and masks are per pass)
    chunk_sweep: tuple[int, ...] = (4096, 8192, 32768)
    sweep_tokens: int = 32768
    attention_sweep: bool = True
    engine: bool = True
    deadline_s: float = 0.0  # 0: no deadline
    out_dir: str = "bench/results"
    seed: int = 0
    device: str = "cuda"
    kernels: str = "triton"  # the PrefillRunner's elementwise kernels ("torch": the reference's, for CPU smoke runs)


def add_arguments(sub) -> None:
    p = sub.add_parser("prefill", description=__doc__.split("\n\n")[0],
                       help="TTFT and prefill tokens/s vs prompt length, against plain SDPA and the roofline")
    p.add_argument("--model", default="llama-3.2-1b,llama-3.1-8b", metavar="PRESET[,...]")
    p.add_argument("--lengths", default="2048,8192,32768,131072", metavar="N[,N...]")
    p.add_argument("--impls", default=",".join(IMPLS), metavar="NAME[,...]", help=f"of {', '.join(IMPLS)}")
    p.add_argument("--chunk", type=int, default=16384, help="tokens per prefill pass (default 16384)")
    p.add_argument("--chunk-sweep", default="4096,8192,32768", metavar="N[,N...]",
                   help="extra chunk sizes timed with the triton attention on the first model ('' for none)")
    p.add_argument("--no-attention-sweep", action="store_true")
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--deadline-s", type=float, default=0.0, help="skip rows started after this many seconds")
    p.add_argument("--out", default="bench/results", metavar="DIR")
    p.add_argument("--seed", type=int, default=0)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if any(v <= 0 for v in vals):
        raise ValueError(f"{what}: expected positive integers, got {text!r}")
    return vals


def config_from_args(args: argparse.Namespace) -> PrefillBenchConfig:
    from ..models.spec import get_preset

    models = tuple(m.strip() for m in args.model.split(",") if m.strip())
    for m in models:
        get_preset(m)
    impls = tuple(i.strip() for i in args.impls.split(",") if i.strip())
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls:
        raise ValueError(f"--impls: unknown {bad or impls}; choose from {', '.join(IMPLS)}")
    lengths = _ints(args.lengths, "--lengths")
    if not lengths:
        raise ValueError("--lengths: give at least one length")
    if args.chunk <= 0:
        raise ValueError("--chunk must be positive")
    return PrefillBenchConfig(models, lengths, impls, args.chunk, chunk_sweep=_ints(args.chunk_sweep, "--chunk-sweep"),
                              attention_sweep=not args.no_attention_sweep, engine=not args.no_engine,
                              deadline_s=args.deadline_s, out_dir=args.out, seed=args.seed)


class PrefillBench:
    def __init__(self, cfg: PrefillBenchConfig, doc: dict, save):
        self.cfg, self.doc, self.save = cfg, doc, save
        self.t0 = time.monotonic()

    def time_left(self) -> bool:
        return self.cfg.deadline_s <= 0 or time.monotonic() - self.t0 < self.cfg.deadline_s

    def record(self, row: dict, spec) -> None:
        from .prefill_report import finish_row

        self.doc["rows"].append(finish_row(row, spec, self.doc["gemm_tflops"]))
        t = f"{row['ttft_s']:.4f} s" if row.get("ttft_s") else row.get("error")
        print(f"[prefill] {row['model']} {row['tokens']:>6} {row['impl']:<14} {t}", file=sys.stderr, flush=True)
        self.save()

    @property
    def cuda(self) -> bool:
        return self.cfg.device.startswith("cuda")

    def timed(self, fn, n: int):
        """Runs ``fn`` (-> logits) a few times; TTFT = wall time until the first token's id is on the host."""
        import torch

        reps = 3 if n <= 8192 else (2 if n <= 32768 else 1)
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, logits = [], None
        for _ in range(reps):
            t = time.perf_counter()
            logits = fn()
            first = int(logits.argmax())
            times.append(time.perf_counter() - t)
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if self.cuda else 0.0
        return {"ttft_s": statistics.median(times), "ttft_min_s": min(times), "runs": reps, "first_token": first,
                "peak_gb": peak}, logits

    def empty_cache(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.empty_cache()

    def run_model(self, model: str, first: bool) -> None:
        import torch

        from ..kv.pages import KVLayout, PagedKVCache
        from ..models.reference import Segment
        from ..models.spec import get_preset
        from ..models.weights import random_weights
        from ..prefill import FusedWeights, PrefillConfig, PrefillRunner
        from .plain_prefill import plain_sdpa_prefill

        cfg, spec, dev = self.cfg, get_preset(model), self.cfg.device
        fw = FusedWeights.from_weights(random_weights(spec, cfg.seed, torch.bfloat16, dev))
        mw = fw.unfused()
        pages = -(-max(cfg.lengths + (cfg.sweep_tokens,)) // cfg.page_size) + 1
        cache = PagedKVCache(KVLayout.for_spec(spec, cfg.page_size, pages, torch.bfloat16), dev)
        runners = {i: PrefillRunner(fw, PrefillConfig(i, cfg.kernels, cfg.chunk))
                   for i in cfg.impls if i != "plain-sdpa"}
        gen = torch.Generator().manual_seed(cfg.seed)

        def prompt(n):
            toks = torch.randint(spec.vocab_size, (n,), generator=gen).to(dev)
            return toks, tuple(torch.randperm(pages, generator=gen)[:-(-n // cfg.page_size)].tolist())

        def fn_for(impl, toks, table, runner=None):
            if impl == "plain-sdpa":
                return lambda: plain_sdpa_prefill(mw, toks)
            run = runner or runners[impl]
            return lambda: run.forward(toks, [Segment(table, 0, toks.numel())], cache)[0]

        toks, table = prompt(1024)
        for impl in cfg.impls:  # compile and warm every implementation once
            try:
                fn_for(impl, toks, table)()
            except Exception as e:  # noqa: BLE001 - a broken implementation is a row, not the end of the run
                print(f"[prefill] {model} {impl} warm-up failed: {type(e).__name__}: {e}", file=sys.stderr)
        for n in cfg.lengths:
            toks, table = prompt(n)
            ref = None
            for impl in cfg.impls:
                row = {"model": model, "tokens": n, "impl": impl, "chunk": None if impl == "plain-sdpa" else cfg.chunk}
                if impl == "flex" and n > cfg.flex_max_tokens:
                    continue
                if not self.time_left():
                    self.record({**row, "error": "skipped (deadline)"}, spec)
                    continue
                try:
                    res, logits = self.timed(fn_for(impl, toks, table), n)
                    row.update(res)
                    if ref is None:
                        ref = logits
                    else:
                        row["rel_err"] = float((logits - ref).abs().max() / ref.abs().max())
                        row["same_first_token"] = bool(logits.argmax() == ref.argmax())
                except torch.cuda.OutOfMemoryError:
                    row["error"] = "out of memory"
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                self.empty_cache()
                self.record(row, spec)
        if first and cfg.chunk_sweep and "triton" in runners:
            n = cfg.sweep_tokens
            toks, table = prompt(n)
            for c in cfg.chunk_sweep:
                row = {"model": model, "tokens": n, "impl": f"triton@{c}", "chunk": c}
                if self.time_left():
                    run = PrefillRunner(fw, PrefillConfig("triton", cfg.kernels, c))
                    row.update(self.timed(fn_for("triton", toks, table, run), n)[0])
                else:
                    row["error"] = "skipped (deadline)"
                self.record(row, spec)
        if cfg.attention_sweep:
            attention_sweep(self, model, spec, cache, pages)
        if first and cfg.engine:
            engine_ttft(self, model, spec, mw, pages)
        self.empty_cache()


def measure_gemm_tflops() -> float:
    import torch
    from triton.testing import do_bench

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return 2 * 8192 ** 3 / ms / 1e9


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"mimw bench prefill: error: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("mimw bench prefill: needs a CUDA GPU; none is available here", file=sys.stderr)
        return 1
    return run_bench(cfg)


def run_bench(cfg: PrefillBenchConfig, gemm_tflops: float | None = None) -> int:
    """The whole run; ``gemm_tflops`` replaces the in-run GEMM measurement (CPU smoke tests)."""
    import torch
    import triton

    from .main import git_commit, slug
    from .prefill_report import markdown, summary, write_chart
    from .report import write_json

    gpu = torch.cuda.get_device_name() if cfg.device.startswith("cuda") else cfg.device
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"{time.strftime('%Y%m%d-%H%M', time.gmtime())}-{slug(gpu)}-prefill"
    doc = {"gpu": gpu, "commit": git_commit(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
           "config": asdict(cfg), "gemm_tflops": gemm_tflops or measure_gemm_tflops(), "rows": [], "attention": []}
    print(f"[prefill] {gpu}: bf16 GEMM {doc['gemm_tflops']:.0f} TFLOP/s", file=sys.stderr, flush=True)

    def save(chart: bool = False) -> None:
        write_json(base.with_suffix(".json"), doc)
        base.with_suffix(".md").write_text(markdown(doc))
        if chart:
            write_chart(doc, base.with_suffix(".png"))

    bench = PrefillBench(cfg, doc, save)
    for i, model in enumerate(cfg.models):
        try:
            bench.run_model(model, first=i == 0)
        except Exception:  # noqa: BLE001 - one model failing keeps the other's rows
            traceback.print_exc()
        bench.empty_cache()
    save(chart=True)
    print(markdown(doc), flush=True)
    print(summary(doc), flush=True)
    print(f"[prefill] wrote {base}.json, .md, .png", file=sys.stderr, flush=True)
    return 0
