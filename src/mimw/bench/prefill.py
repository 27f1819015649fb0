"""``mimw bench prefill``: time to first token and prefill tokens/s versus prompt length, for each prefill
implementation, against a plain PyTorch SDPA prefill of the same weights and the compute roofline, in one run.

For every model (presets with random bf16 weights) and prompt length: a fresh random prompt on a shuffled block
table is prefilled from an empty cache in passes of ``--chunk`` tokens (what the engine does with
``max_prefill_step_tokens`` = chunk and nothing decoding) by the ``PrefillRunner`` with each attention (``triton``:
mimw's paged kernel; ``gluon``: its warp-specialized Gluon kernel for Hopper; ``cudnn``, ``sdpa``, ``flex``:
torch's over gathered pages), then the first token is
taken (argmax, synchronised): TTFT is that wall time (``times_s``: each run's). ``plain-sdpa``
(``plain_prefill.py``) runs the whole prompt in one eager call. ``no-attention`` is the runner with its attention
replaced by a copy of q (wrong logits, no check): the time of its GEMMs and elementwise kernels alone, so a row's
attention time is its TTFT minus that one's. Each other row checks its logits against plain-sdpa's (relative max
error). sdpa and flex stop at ``gathered_max_tokens`` (32k). Once every model's rows are done, time permitting
(``prefill_sweeps``): the attention alone (one layer's last pass at each of ``attention_lengths``, TFLOP/s; the
paged kernel at several tiles at the first length, at its default tiles after), the chunk size swept on the first
model, and TTFT through the engine (megakernel backend, one request).

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

IMPLS = ("plain-sdpa", "triton", "gluon", "cudnn", "sdpa", "flex", "no-attention")
NO_ATTENTION = "no-attention"  # the runner with attention replaced by a copy of q: its GEMMs and elementwise alone


@dataclass(frozen=True)
class PrefillBenchConfig:
    models: tuple[str, ...] = ("llama-3.2-1b", "llama-3.1-8b")
    lengths: tuple[int, ...] = (2048, 8192, 32768, 131072)
    impls: tuple[str, ...] = IMPLS
    chunk: int = 16384
    page_size: int = 16
    gathered_max_tokens: int = 32768  # sdpa/flex rows up to this length (128k: mimw's kernel and plain SDPA)
    chunk_sweep: tuple[int, ...] = (4096, 8192, 32768)
    sweep_tokens: int = 32768
    attention_lengths: tuple[int, ...] = (32768,)
    attention_sweep: bool = True
    engine: bool = True
    deadline_s: float = 0.0  # 0: no deadline
    out_dir: str = "bench/results"
    seed: int = 0
    commit: str | None = None  # recorded as given (the GPU machine's copy of the tree has no .git)
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
    p.add_argument("--attention-lengths", default="32768", metavar="N[,N...]",
                   help="prompt lengths whose last pass the attention sweep times alone (default 32768)")
    p.add_argument("--no-attention-sweep", action="store_true")
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--deadline-s", type=float, default=0.0, help="skip rows started after this many seconds")
    p.add_argument("--out", default="bench/results", metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None, metavar="REV",
                   help="commit to record (default: git rev-parse of this tree, or 'unknown' without .git)")


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
    attention_lengths = _ints(args.attention_lengths, "--attention-lengths")
    if any(n <= args.chunk for n in attention_lengths):
        raise ValueError("--attention-lengths: each length must be longer than --chunk (its last pass has a prefix)")
    return PrefillBenchConfig(models, lengths, impls, args.chunk, chunk_sweep=_ints(args.chunk_sweep, "--chunk-sweep"),
                              attention_lengths=attention_lengths,
                              attention_sweep=not args.no_attention_sweep, engine=not args.no_engine,
                              deadline_s=args.deadline_s, out_dir=args.out, seed=args.seed,
                              commit=args.commit)


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
        return {"ttft_s": statistics.median(times), "ttft_min_s": min(times), "runs": reps, "times_s": times,
                "first_token": first, "peak_gb": peak}, logits

    def empty_cache(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.empty_cache()

    def setup(self, model: str) -> "_Model":
        return _Model(self.cfg, model)

    def main_rows(self, m: "_Model") -> None:
        """Every implementation at every length, the plain SDPA prefill first (the others' check)."""
        import torch

        cfg = self.cfg
        toks, table = m.prompt(1024)
        for impl in cfg.impls:  # compile and warm every implementation once
            try:
                m.fn_for(impl, toks, table)()
            except Exception as e:  # noqa: BLE001 - a broken implementation is a row, not the end of the run
                print(f"[prefill] {m.name} {impl} warm-up failed: {type(e).__name__}: {e}", file=sys.stderr)
        for n in cfg.lengths:
            toks, table = m.prompt(n)
            ref = None
            for impl in cfg.impls:
                row = {"model": m.name, "tokens": n, "impl": impl,
                       "chunk": None if impl == "plain-sdpa" else cfg.chunk}
                if impl in ("sdpa", "flex") and n > cfg.gathered_max_tokens:
                    continue
                if not self.time_left():
                    self.record({**row, "error": "skipped (deadline)"}, m.spec)
                    continue
                try:
                    res, logits = self.timed(m.fn_for(impl, toks, table), n)
                    row.update(res)
                    if impl == NO_ATTENTION:
                        pass
                    elif ref is None:
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
                self.record(row, m.spec)

    def extra_rows(self, m: "_Model", first: bool) -> None:
        """The chunk sweep (first model), attention alone, TTFT through the engine (first model)."""
        from ..prefill import PrefillConfig, PrefillRunner

        cfg = self.cfg
        if first and cfg.chunk_sweep and "triton" in cfg.impls:
            n = cfg.sweep_tokens
            toks, table = m.prompt(n)
            for c in cfg.chunk_sweep:
                row = {"model": m.name, "tokens": n, "impl": f"triton@{c}", "chunk": c}
                if self.time_left():
                    run = PrefillRunner(m.fused, PrefillConfig("triton", cfg.kernels, c))
                    row.update(self.timed(m.fn_for("triton", toks, table, run), n)[0])
                else:
                    row["error"] = "skipped (deadline)"
                self.record(row, m.spec)
        if cfg.attention_sweep:
            attention_sweep(self, m.name, m.spec, m.cache, m.pages)
        if first and cfg.engine:
            engine_ttft(self, m.name, m.spec, m.weights, m.pages)


class _Model:
    """One preset's random bf16 weights (fused, and their unfused views), a cache for the longest prompt, a
    PrefillRunner per attention, and prompts on shuffled block tables."""

    def __init__(self, cfg: PrefillBenchConfig, name: str):
        import torch

        from ..kv.pages import KVLayout, PagedKVCache
        from ..models.spec import get_preset
        from ..models.weights import random_weights
        from ..prefill import FusedWeights, PrefillConfig, PrefillRunner

        self.cfg, self.name, self.spec = cfg, name, get_preset(name)
        self.fused = FusedWeights.from_weights(random_weights(self.spec, cfg.seed, torch.bfloat16, cfg.device))
        self.weights = self.fused.unfused()
        longest = max(cfg.lengths + (cfg.sweep_tokens,) + (cfg.attention_lengths if cfg.attention_sweep else ()))
        self.pages = -(-longest // cfg.page_size) + 1
        self.cache = PagedKVCache(KVLayout.for_spec(self.spec, cfg.page_size, self.pages, torch.bfloat16),
                                  cfg.device)
        self.runners = {i: PrefillRunner(self.fused, PrefillConfig(i, cfg.kernels, cfg.chunk))
                        for i in cfg.impls if i not in ("plain-sdpa", NO_ATTENTION)}
        if NO_ATTENTION in cfg.impls:
            self.runners[NO_ATTENTION] = PrefillRunner(self.fused, PrefillConfig("torch", cfg.kernels, cfg.chunk))
            self.runners[NO_ATTENTION].attention = _NoAttention()
        self.gen = torch.Generator().manual_seed(cfg.seed)

    def prompt(self, n: int):
        import torch

        toks = torch.randint(self.spec.vocab_size, (n,), generator=self.gen).to(self.cfg.device)
        perm = torch.randperm(self.pages, generator=self.gen)
        return toks, tuple(perm[:-(-n // self.cfg.page_size)].tolist())

    def fn_for(self, impl: str, toks, table, runner=None):
        """A prefill of ``toks`` from an empty cache -> the last token's logits."""
        from ..models.reference import Segment
        from .plain_prefill import plain_sdpa_prefill

        if impl == "plain-sdpa":
            return lambda: plain_sdpa_prefill(self.weights, toks)
        run = runner or self.runners[impl]
        return lambda: run.forward(toks, [Segment(table, 0, toks.numel())], self.cache)[0]


class _NoAttention:
    """An attention that returns a copy of q: timing the rest of the runner's pass, not a prefill."""

    def plan(self, batch):
        return lambda q, k_layer, v_layer, k_scale=None, v_scale=None: q.clone()


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
    doc = {"gpu": gpu, "commit": cfg.commit or git_commit(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
           "config": asdict(cfg), "gemm_tflops": gemm_tflops or measure_gemm_tflops(), "rows": [], "attention": []}
    print(f"[prefill] {gpu}: bf16 GEMM {doc['gemm_tflops']:.0f} TFLOP/s", file=sys.stderr, flush=True)

    def save(chart: bool = False) -> None:
        write_json(base.with_suffix(".json"), doc)
        base.with_suffix(".md").write_text(markdown(doc))
        if chart:
            write_chart(doc, base.with_suffix(".png"))

    bench = PrefillBench(cfg, doc, save)
    extras = cfg.attention_sweep or cfg.engine or cfg.chunk_sweep
    for phase in ("main", "extra") if extras else ("main",):  # every model's main rows before any sweep
        for i, model in enumerate(cfg.models):
            if phase == "extra" and not bench.time_left():
                break
            m = None
            try:
                m = bench.setup(model)
                if phase == "main":
                    bench.main_rows(m)
                else:
                    bench.extra_rows(m, first=i == 0)
            except Exception:  # noqa: BLE001 - one model failing keeps the other's rows
                traceback.print_exc()
            del m
            bench.empty_cache()
    save(chart=True)
    print(markdown(doc), flush=True)
    print(summary(doc), flush=True)
    print(f"[prefill] wrote {base}.json, .md, .png", file=sys.stderr, flush=True)
    return 0
