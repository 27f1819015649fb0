"""``mimw bench decode``: the decode-step benchmark (also ``python -m mimw.bench.main decode ...``); ``mimw bench
prefill`` lives in ``prefill.py``, ``mimw bench serve`` (the serving benchmark) in ``serve.py``.

One run, on one GPU: measure the streaming-read bandwidth (the floor's denominator), then for each model, context
and backend check the backend's logits against the reference decoder and time its decode step. Results land in
``--out`` as ``<date>-<gpu>-<model>.json/.md/.png``, the JSON and markdown rewritten after every backend so that a
run cut short keeps what it measured. ``python -m mimw.bench.readme`` folds the latest JSON files into
bench/README.md.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Sequence

from ..models.spec import PRESETS, SpecError
from .config import DecodeBenchConfig, check_model, model_label, parse_contexts, preset_spec

REPO_ROOT = Path(__file__).resolve().parents[3]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    p = sub.add_parser("decode", help="batch-1 decode step: every backend vs the bandwidth floor",
                       description="Time one batch-1 bf16 decode step for mimw's backends and its peers (torch eager, "
                                   "CUDA graphs, torch.compile, transformers), each checked against the reference "
                                   "decoder, against the floor = bytes per step / measured streaming read.")
    p.add_argument("--model", required=True, metavar="PRESET|PATH[,...]",
                   help="preset name(s) (random weights at real shapes, e.g. llama-3.2-1b,llama-3.1-8b) or checkpoint "
                        "path(s), comma-separated")
    p.add_argument("--context", default="1024,8192", metavar="N[,N...]",
                   help="KV positions already cached when the step runs (default 1024,8192)")
    p.add_argument("--backends", default="all", metavar="NAME[,...]",
                   help="backends to run (default all): mimw-megakernel, mimw-reference, torch-eager, "
                        "torch-eager-graph, torch-compile-reduce-overhead, torch-compile-max-autotune, hf-transformers")
    p.add_argument("--out", default="bench/results", metavar="DIR", help="results directory (default bench/results)")
    p.add_argument("--iters", type=int, default=100, help="timed steps per backend at most (default 100)")
    p.add_argument("--budget-s", type=float, default=2.0, help="timing seconds per backend at most (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend-timeout", type=float, default=300.0, metavar="S",
                   help="kill a backend that makes no progress for S seconds (default 300)")
    p.add_argument("--commit", default=None, metavar="REV",
                   help="commit to record (default: git rev-parse of this tree, or 'unknown' without .git)")
    p.add_argument("--megakernel", default="", metavar="NAME=VALUE[,...]",
                   help="tuning overrides (plan.Tuning) for the mimw-megakernel backend, e.g. inflight=4,quiet=0 "
                        "(default: the defaults); recorded with the results")
    p.add_argument("--in-process", action="store_true",
                   help="run backends in this process (no crash/hang isolation; for debugging)")
    p.add_argument("--layers", type=int, default=0, metavar="N",
                   help="presets cut to their first N layers (real layer shapes; floor and peers over the same "
                        "layers): a model too large for the GPU, e.g. --model qwen3-30b-a3b --layers 12 on 80 GB")
    p.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"),
                   help="KV cache element type of mimw's backends (default bf16); with fp8 the floor counts fp8 KV "
                        "bytes and the peers hold the same values in their own bf16 caches")
    from .kv_accuracy import add_parser as add_kv_accuracy
    from .prefill import add_arguments as add_prefill_arguments
    from .serve import add_arguments as add_serve_arguments
    from .spec import add_arguments as add_spec_arguments

    add_prefill_arguments(sub)
    add_serve_arguments(sub.add_parser(
        "serve", help="a serving load against an OpenAI-compatible server: TTFT, TPOT, ITL, E2E, throughput",
        description="Send a dataset's requests (synthetic or ShareGPT) to a server on this machine (or one it "
                    "starts) at a request rate or a fixed concurrency; report latency percentiles and throughput "
                    "as JSON, markdown and a chart (like `vllm bench serve`)."))
    add_spec_arguments(sub)
    from .trace.main import add_subcommands as add_trace_subcommands

    add_trace_subcommands(sub)
    from .overlap import add_arguments as add_overlap_arguments

    add_overlap_arguments(sub)
    from .engine_host import add_arguments as add_engine_host_arguments

    add_engine_host_arguments(sub)
    add_kv_accuracy(sub)
    from .batch_steps import add_parser as add_steps

    add_steps(sub)


def config_from_args(args: argparse.Namespace) -> DecodeBenchConfig:
    from .peers import parse_backends

    models = tuple(m.strip() for m in args.model.split(",") if m.strip())
    for m in models:
        check_model(m)
    if args.iters < 1:
        raise ValueError("--iters must be >= 1")
    if args.layers:
        for m in models:
            if m not in PRESETS:
                raise ValueError(f"--layers cuts presets (random weights); {m!r} is a checkpoint path")
            preset_spec(m, args.layers)  # out of range: an error now
    from ..megakernel.plan import Tuning

    Tuning.parse(args.megakernel)  # a bad option is an error now, not a failed row later
    return DecodeBenchConfig(models=models, contexts=parse_contexts(args.context),
                             backends=tuple(parse_backends(args.backends)), out_dir=args.out, iters=args.iters,
                             budget_s=args.budget_s, seed=args.seed, backend_timeout_s=args.backend_timeout,
                             in_process=args.in_process, megakernel=args.megakernel, kv_dtype=args.kv_dtype,
                             layers=args.layers)


def git_commit(root: Path = REPO_ROOT) -> str:
    """Short commit of the working tree (+dirty when tracked files changed), or "unknown" without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def slug(text: str) -> str:
    out = "".join(c.lower() if c.isalnum() else "-" for c in text)
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-") or "unknown"


def environment_meta(gpu: str, read: dict, config: DecodeBenchConfig) -> dict:
    import torch

    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = "unavailable"
    try:
        import transformers
        tf_v = transformers.__version__
    except ImportError:
        tf_v = "unavailable"
    return {"gpu": gpu, "commit": git_commit(), "torch": torch.__version__, "triton": triton_v, "transformers": tf_v,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "read_TBps": read["TBps"],
            "read_bandwidth": read, "command": " ".join(sys.argv), "config": config.__dict__}


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", None) == "prefill":
        from .prefill import run as run_prefill

        return run_prefill(args)
    if getattr(args, "bench_command", None) == "serve":
        from .serve import run as run_serve

        return run_serve(args)
    if getattr(args, "bench_command", None) == "spec":
        from .spec import run as run_spec

        return run_spec(args)
    if getattr(args, "bench_command", None) in ("trace", "trace-gen"):
        from .trace.main import run as run_trace

        return run_trace(args)
    if getattr(args, "bench_command", None) == "steps":
        from .batch_steps import run as run_steps

        return run_steps(args)
    if getattr(args, "bench_command", None) == "overlap":
        from .overlap import run_checked

        return run_checked(args)
    if getattr(args, "bench_command", None) == "engine-host":
        from .engine_host import run_checked as run_engine_host

        return run_engine_host(args)
    if getattr(args, "bench_command", None) == "kv-accuracy":
        from .kv_accuracy import run_args

        return run_args(args)
    if getattr(args, "bench_command", None) != "decode":
        print("mimw bench: choose a benchmark: decode, prefill, serve, spec, steps, trace, trace-gen, kv-accuracy, "
              "overlap, engine-host",
              file=sys.stderr)
        return 2
    try:
        cfg = config_from_args(args)
    except (ValueError, SpecError) as e:
        print(f"mimw bench: error: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("mimw bench decode: needs a CUDA GPU (an H100/H200 for the megakernel); none is available here",
              file=sys.stderr)
        return 1
    return run_decode(cfg, torch.cuda.get_device_name(), commit=args.commit)


def run_decode(cfg: DecodeBenchConfig, gpu: str, measure_bandwidth=None, commit: str | None = None) -> int:
    """Measure the floor's bandwidth, run every model's tasks, write the reports; ``measure_bandwidth`` (a
    ``() -> ReadBandwidth``) replaces the Triton measurement in tests."""
    from .chart import write_chart
    from .report import finalize_rows, markdown, record, write_json
    from .supervisor import run_model

    print(f"[bench] {gpu}: measuring streaming-read bandwidth (4 GiB read-only Triton kernel)", file=sys.stderr,
          flush=True)
    if measure_bandwidth is None:
        from .bandwidth import measure_read_bandwidth as measure_bandwidth
    bw = measure_bandwidth()
    read = bw.to_json()
    print(f"[bench] read {bw.tbps:.3f} TB/s ({bw.config}); torch.sum {bw.torch_sum_bytes_per_s / 1e12:.3f} TB/s",
          file=sys.stderr, flush=True)
    meta = environment_meta(gpu, read, cfg)
    if commit:
        meta["commit"] = commit
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    written = []
    for model in cfg.models:
        base = f"{stamp}-{slug(gpu)}-{model_label(model, cfg.layers)}"  # a model label may hold dots: no with_suffix
        base += f"-kv-{cfg.kv_dtype}" if cfg.kv_dtype != "bf16" else ""
        raw: list[dict] = []
        model_meta = {**meta, "model": model}

        def save(chart: bool = False) -> dict:
            doc = record(model_meta, finalize_rows(raw, bw.bytes_per_s))
            try:
                write_json(out / f"{base}.json", doc)
                (out / f"{base}.md").write_text(markdown(doc))
                if chart:
                    write_chart(doc, out / f"{base}.png")
            except Exception:  # noqa: BLE001 - a report glitch must not end the measurements
                traceback.print_exc()
            return doc

        def on_result(ev: dict) -> None:
            raw.append(ev)
            save(chart=ev["backend"] == cfg.backends[-1])  # the chart once per finished context

        def on_setup(ev: dict) -> None:
            model_meta["spec"] = ev.get("spec")

        run_model(model, cfg, on_result, on_setup)
        doc = save(chart=True)
        print(markdown(doc), flush=True)
        written += [str(out / f"{base}{s}") for s in (".json", ".md", ".png")]
    print("[bench] wrote " + ", ".join(written), file=sys.stderr, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mimw.bench.main")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
