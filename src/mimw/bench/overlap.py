"""``mimw bench overlap`` (also ``python -m mimw.bench.overlap``): what the engine adds to the backend's decode step,
with the overlap scheduler (``engine/overlap.py``) off and on.

For each batch size B: the backend's own decode step over B sequences (``forward`` called back to back with the
same inputs, timed on the device: the step the engine cannot beat; for the megakernel also its bare graph replay,
the kernel's step at batch 1) and the engine's inter-token latency, measured as a server sees it - B greedy
requests submitted to an ``EngineLoop`` (the server's engine thread), every token event time-stamped by its
callback, the mean gap between a request's consecutive tokens once all B decode. ``host share`` = 1 - step / ITL:
the part of each token's time the device idles for the host; ``engine host ms`` = the engine's own work per step
with a backend that costs nothing (``FixedLogits``): what overlap has to hide. A backend that picks its path by
measuring (the megakernel's ``StepRouter``) serves both engines (one backend, a cache each), so both run a batch
the same way. In-process (no HTTP), random weights at the preset's shape, a byte-level tokenizer. Prints a table and
writes ``overlap-<device>-<model>.json`` to ``--out``. On a shared CPU, ``--threads 1`` gives steadier numbers.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import torch

from ..engine.backends.base import Backend
from ..engine.heap import frozen_heap
from ..kv.pages import KVLayout, PagedKVCache
from . import profile_gaps


def add_arguments(sub) -> None:
    p = sub.add_parser("overlap", help="engine inter-token latency vs the backend's step, overlap off and on",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b", metavar="PRESET", help="preset (random weights; default "
                   "llama-3.2-1b)")
    p.add_argument("--backend", default="auto", choices=("auto", "megakernel", "reference"),
                   help="auto: megakernel on a Hopper GPU, else reference")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--batches", default="1,8,32", metavar="B[,B...]")
    p.add_argument("--tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per request (default 32)")
    p.add_argument("--step-iters", type=int, default=50, help="back-to-back backend steps timed (default 50)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--profile", action="store_true", help="also profile each engine's timed requests at each batch "
                   "(torch.profiler): the host calls that wait for the device, by CPU time, where the device idles "
                   "(gaps by host call and engine phase, by the device ops around them), and a Chrome trace per mode "
                   "and batch in --out")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/results/overlap", metavar="DIR")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, iters: int, device: torch.device) -> float:
    """Mean ms of ``fn()`` over ``iters`` back-to-back calls (device events on a GPU, so launch queues fill),
    after 3 untimed calls (compilation, graph capture, first touch of the pages)."""
    for _ in range(3):
        fn()
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1e3 / iters


def backend_step_ms(engine, batch: int, context: int, iters: int) -> dict:
    """The backend's decode step over ``batch`` sequences at ``context`` positions, in free pages of the engine's
    cache (no request runs meanwhile), back to back, after a prefill of those positions (real K/V: no zeros)."""
    from ..models.reference import Segment

    ps = engine.config.page_size
    per = -(-(context + 1) // ps)
    dev = engine.backend.device
    tables = [tuple(range(b * per, (b + 1) * per)) for b in range(batch)]
    prompt = torch.randint(3, 256, (batch * context,), generator=torch.Generator().manual_seed(batch)).to(dev)
    engine.backend.forward(prompt, [Segment(t, 0, context) for t in tables], engine.cache)
    segs = [Segment(t, context, 1) for t in tables]
    tokens = torch.randint(0, 256, (batch,), device=dev)
    for _ in range(8):  # a backend that picks its path by measuring (the megakernel's StepRouter) learns here
        engine.backend.forward(tokens, segs, engine.cache)
        _sync(dev)
    out = {"backend_step_ms": _timed(lambda: engine.backend.forward(tokens, segs, engine.cache), iters, dev)}
    dec = getattr(engine.backend, "_dec", None)
    if dec is not None and dec.graph is not None:  # the megakernel's own launch (M = 1), graph replay only
        out["kernel_ms"] = _timed(dec.run, iters, dev)
    return out


def engine_itl_ms(engine, batch: int, prompt: int, tokens: int, seed: int) -> dict:
    """B greedy requests through an EngineLoop; the mean gap between a request's consecutive token events once
    every request decodes (from the second token after the last request's first), averaged over the requests."""
    from ..engine.loop import EngineLoop
    from ..engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    times: dict[str, list[float]] = {}
    done = threading.Event()
    left = [batch]
    lock = threading.Lock()

    def on_output(e) -> None:
        now = time.perf_counter()
        times.setdefault(e.request_id, []).extend([now] * len(e.token_ids))
        if e.finished:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    pauses: list[float] = []  # the garbage collector's pauses in the measure (any thread), ms
    began = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append(1e3 * (time.perf_counter() - began[0]))

    loop = EngineLoop(engine, max_queue=batch + 1).start()
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    gc.callbacks.append(on_gc)
    try:
        for b in range(batch):
            ids = torch.randint(3, 256, (prompt,), generator=g).tolist()
            loop.submit(f"s{seed}-r{b}", ids, params, on_output)
        if not done.wait(600):
            raise RuntimeError("the engine did not finish in 600 s")
    finally:
        loop.stop()
        gc.callbacks.remove(on_gc)
    wall = time.perf_counter() - t0
    # every request decodes from the step after the last first token (before it, steps carry other requests'
    # prompt chunks); each request's gaps from there, after one more token
    start = max(ts[0] for ts in times.values())
    gaps, each = [], []  # each request's mean gap; every gap between two of its tokens in the window
    for ts in times.values():
        after = [t for t in ts if t > start][1:]
        if len(after) > 1:
            gaps.append((after[-1] - after[0]) / (len(after) - 1))
            each += [b - a for a, b in zip(after, after[1:])]
    if not gaps:
        raise RuntimeError("no request decoded two tokens after every request's first: raise --tokens")
    q = statistics.quantiles(each, n=10, method="inclusive") if len(each) > 1 else each * 9
    p50 = statistics.median(each)
    # stalls: the time past the median of gaps longer than 3 medians (an eager step, a capture, the host late),
    # as a share of all the gaps' time: a mean ITL well above the median is a few stalls, not a slower step
    stall = sum(g - p50 for g in each if g > 3 * p50) / sum(each)
    return {"itl_ms": 1e3 * statistics.fmean(gaps), "itl_p50_ms": 1e3 * p50, "itl_p90_ms": 1e3 * q[8],
            "itl_max_ms": 1e3 * max(each), "stall_share": stall, "wall_s": wall,
            "tokens": sum(len(t) for t in times.values()),
            "gc": {"pauses": len(pauses), "ms": sum(pauses), "max_ms": max(pauses, default=0.0)}}


def all_threads():
    """The profiler's setting that records every thread's ops and ranges (the engine steps on its loop thread), or
    None (the main thread's only) where this torch lacks it."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


def profile_itl(engine, batch: int, prompt: int, tokens: int, out: Path, name: str) -> None:
    """``engine_itl_ms`` profiled twice (after an unprofiled run: compiled, captured). First the device alone
    (CUPTI's kernel and copy records, the host's pace untouched): where the device idles, by the ops around each
    gap, and its time a decode step by op. Then every thread's host ops and the engine's phases beside the device
    (the profiler slows the host several-fold here, so its gaps are larger than a real run's): the operators and
    runtime calls by self CPU time (a host that waits for the device shows as cudaStreamSynchronize,
    cudaEventSynchronize or a blocking copy) and the gaps charged to them; writes ``profile-<name>-b<batch>.json``
    (Chrome trace)."""
    from torch.profiler import ProfilerActivity, profile

    engine_itl_ms(engine, batch, prompt, tokens, seed=3000 + batch)  # the backend back on this engine's cache
    tag = f"[overlap] profile {name}, batch {batch}"
    if torch.cuda.is_available():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            r = engine_itl_ms(engine, batch, prompt, tokens, seed=2500 + batch)
        device, _ = profile_gaps.spans(prof)
        steps = max(1, r["tokens"] // batch)  # about one decode step a request's token
        per = profile_gaps.busy_by_op(device, steps)
        gaps = profile_gaps.format_summary(profile_gaps.summary(device, []))
        print(f"{tag}, device only: ITL {r['itl_ms']:.3f} ms; {gaps}\ndevice us a step by op: " +
              ", ".join(f"{k} {v:.1f}" for k, v in list(per.items())[:8]), file=sys.stderr, flush=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, experimental_config=all_threads()) as prof:
        r = engine_itl_ms(engine, batch, prompt, tokens, seed=2000 + batch)
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"profile-{name}-b{batch}.json"))
    print(f"{tag}, host ops recorded (host slowed): ITL {r['itl_ms']:.3f} ms; by self CPU time:", file=sys.stderr)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr, flush=True)
    device, host = profile_gaps.spans(prof)
    if device:  # where the GPU idled inside the run, and the host calls that overlap those gaps
        print(f"{tag}, host ops recorded (host slowed): "
              f"{profile_gaps.format_summary(profile_gaps.summary(device, host))}", file=sys.stderr, flush=True)


class FixedLogits(Backend):
    """A backend that costs (almost) nothing: the same logits rows every step, already on the device. With it a
    step's time is the engine's own host work (and the sampling kernels): what overlap has to hide."""

    def __init__(self, spec, device: torch.device):
        self.spec = spec
        self._device = device
        g = torch.Generator().manual_seed(0)
        self.logits = torch.randn(64, spec.vocab_size, generator=g).to(device)

    @property
    def device(self) -> torch.device:
        return self._device

    def make_cache(self, page_size: int, num_pages: int) -> PagedKVCache:
        """A pool that is never read, on the CPU whatever the device (the engine's page accounting needs one)."""
        return PagedKVCache(KVLayout.for_spec(self.spec, page_size, num_pages, torch.float32), torch.device("cpu"))

    def forward(self, tokens, segments, cache) -> torch.Tensor:
        return self.logits[:len(segments)]


def engine_host_ms(spec, device: torch.device, batch: int, prompt: int, tokens: int) -> dict:
    """Mean ms of ``Engine.step`` (called in a loop, as the engine thread does) with ``FixedLogits``, once every
    request decodes, overlap off and on: the engine's per-step host cost at this batch."""
    from ..engine.sampling import SamplingParams

    out = {}
    for mode in (False, True):
        eng = _engine(FixedLogits(spec, device), mode, batch, batch * (-(-(prompt + tokens + 1) // 16) + 1) + 8)
        for b in range(batch):
            eng.add_request(f"h{b}", [5] * prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        for _ in range(3):
            eng.step()
        _sync(device)
        t, n = time.perf_counter(), 0
        while eng.has_work():
            eng.step()
            n += 1
        _sync(device)
        out["overlap" if mode else "sync"] = (time.perf_counter() - t) * 1e3 / max(1, n)
    return out


def _engine(backend, overlap: bool, max_batch: int, pages: int):
    from ..engine.engine import Engine, EngineConfig
    from ..server.main import ByteTokenizer

    cfg = EngineConfig(num_pages=pages, page_size=16, max_batch=max_batch, max_step_tokens=max(512, max_batch),
                       overlap=overlap, enable_prefix_cache=False)
    return Engine(backend, ByteTokenizer(), cfg)


def run(args: argparse.Namespace) -> int:
    from ..models.checkpoint import load_model
    from ..server.main import _backend

    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if not batches or min(batches) < 1 or args.tokens < 8 or args.prompt < 1:
        raise ValueError("--batches must list sizes >= 1, --tokens be >= 8 and --prompt >= 1")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.backend
    if name == "auto":
        name = "megakernel" if device.type == "cuda" and torch.cuda.get_device_capability() == (9, 0) else "reference"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    loaded = load_model(args.model, dtype=dtype, device=device, progress=False)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu ({torch.get_num_threads()} threads)"
    ps = 16
    pages = max(batches) * (-(-(args.prompt + args.tokens + 1) // ps) + 1) + 8
    # one backend for both engines (each its own cache): the same compiled kernels and one router's estimates, so
    # both run a batch the same way; the megakernel backend's decoder and graphs follow the cache they are given,
    # rebuilt at a switch: ``prepare`` compiles every kernel and rebuilds them at each switch, before the measures
    # on that cache, as a server does at start (a path the router first takes inside a measure must not build its
    # decoder and capture its graph there)
    backend = _backend(name, loaded.weights, None)
    engines = {mode: _engine(backend, mode, max(batches), pages) for mode in (False, True)}
    router = getattr(backend, "router", None)
    print(f"[overlap] {args.model} on {dev_name}, {name} backend; {args.tokens} tokens a request after a "
          f"{args.prompt}-token prompt", file=sys.stderr, flush=True)
    rows = []
    for b in batches:
        backend.prepare(engines[False].cache, max(batches))  # the backend's own step and the sync engine's measure
        row: dict = {"batch": b, **backend_step_ms(engines[False], b, args.prompt + args.tokens // 2, args.step_iters)}
        row["engine_host_ms"] = engine_host_ms(loaded.spec, device, b, args.prompt, args.tokens)
        for mode, eng in engines.items():
            if mode:  # the switch to the overlap engine's cache
                backend.prepare(eng.cache, max(batches))
            with frozen_heap():  # as a server's: a collection in the measure skips the start-up heap
                # warm-up: the measure's workload twice, so that every step pattern it repeats (the prompt steps'
                # mixes, the decode batches shrinking as requests finish) has been seen twice and captured before
                # the measure (a pass pattern runs eager when first seen and is captured when seen again)
                for w in range(2):
                    engine_itl_ms(eng, b, args.prompt, args.tokens, seed=1000 * (w + 1) + b)
                before = graph_work(backend)
                r = engine_itl_ms(eng, b, args.prompt, args.tokens, seed=b)
            # graph captures and eager first sightings inside the measure (each capture drains the GPU's queue)
            r["graph_work"] = {k: v - before.get(k, 0) for k, v in graph_work(backend).items()}
            row["overlap" if mode else "sync"] = r
        if router is not None:
            row["router"] = router.estimates()
        step = row["backend_step_ms"]
        for k in ("sync", "overlap"):
            itl = row[k]["itl_ms"]
            row[k]["itl_over_step"] = itl / step
            row[k]["host_share"] = max(0.0, 1 - step / itl)
        rows.append(row)
        print(_line(row), file=sys.stderr, flush=True)
    if args.profile:
        for b in batches:
            for mode, eng in engines.items():
                profile_itl(eng, b, args.prompt, args.tokens, Path(args.out), "overlap" if mode else "sync")
    doc = {"bench": "overlap", "model": args.model, "backend": name, "device": dev_name,
           "torch": torch.__version__, "tokens": args.tokens, "prompt": args.prompt, "rows": rows,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    from .report import publish

    publish(args.out, f"overlap-{_slug(dev_name)}-{args.model}.json", doc, table(rows))
    return 0


def _slug(text: str) -> str:
    return "-".join("".join(c.lower() if c.isalnum() else " " for c in text).split()) or "device"


def graph_work(backend) -> dict:
    """The megakernel backend's short-step graphs so far: captures and steps run eager as a first sighting
    (``StepGraphs``), ``pinned_waits``: the times a step's inputs found their pinned buffer still being copied
    (the host waited for the GPU there: the graphs' and the megakernel decoders' input rings), and ``path_<p>``:
    the steps each path ran (``MegakernelBackend.steps_by_path``), ``kernel_decoders`` / ``kernel_graphs``: the
    megakernel's decoders built for this cache (one a step layout: the one-token step, each multi-token bucket) and
    those with their CUDA graph captured (a first build or capture inside a measure stalls the queue); empty for a
    backend without graphs."""
    graphs = getattr(backend, "_graphs", None)
    if graphs is None:
        return {}
    dec = getattr(backend, "_dec", None)
    decoders = [] if dec is None else [dec, *dec._batches.values()]
    waits = sum(g.inputs.ring.stalls for g in graphs.patterns.graphs.values()) + \
        sum(d.state.inputs.ring.stalls for d in decoders)
    paths = {f"path_{p}": n for p, n in getattr(backend, "steps_by_path", {}).items()}
    return {"captures": graphs.patterns.captures, "eager": graphs.patterns.eager, "pinned_waits": waits,
            "kernel_decoders": len(decoders), "kernel_graphs": sum(d.graph is not None for d in decoders), **paths}


def _line(row: dict) -> str:
    k = f", kernel {row['kernel_ms']:.3f} ms" if "kernel_ms" in row else ""
    h = row["engine_host_ms"]
    return (f"[overlap] batch {row['batch']}: step {row['backend_step_ms']:.3f} ms{k}; ITL sync "
            f"{row['sync']['itl_ms']:.3f} ms, overlap {row['overlap']['itl_ms']:.3f} ms (token gaps p50 / p90 / max "
            f"{_gaps(row['sync'])} sync, {_gaps(row['overlap'])} overlap); engine host work "
            f"{h['sync']:.3f} / {h['overlap']:.3f} ms a step; in the measure, graph captures / eager steps / "
            f"pinned-buffer waits (steps by path): sync {_work(row['sync'])}, overlap {_work(row['overlap'])}; "
            f"gc pauses: sync {_gc(row['sync'])}, overlap {_gc(row['overlap'])}")


def _gaps(r: dict) -> str:
    return (f"{r['itl_p50_ms']:.3f} / {r['itl_p90_ms']:.3f} / {r['itl_max_ms']:.1f} ms, "
            f"{100 * r['stall_share']:.1f}% in stalls")


def _gc(r: dict) -> str:
    g = r["gc"]
    return f"{g['pauses']} ({g['ms']:.1f} ms, longest {g['max_ms']:.2f})"


def _work(r: dict) -> str:
    w = r.get("graph_work") or {}
    if not w:
        return "-"
    paths = " ".join(f"{k.removeprefix('path_')} {v}" for k, v in w.items() if k.startswith("path_") and v)
    return (f"{w['captures']} / {w['eager']} / {w['pinned_waits']} (steps: {paths or 'none'}; megakernel decoders "
            f"built / graphs captured {w['kernel_decoders']} / {w['kernel_graphs']})")


def table(rows: Sequence[dict]) -> str:
    head = ("| batch | backend step ms | kernel ms | engine host ms | ITL sync ms | ITL overlap ms | overlap p50 ms "
            "| overlap stalls | overlap / step | overlap / kernel | host share sync | host share overlap |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        k = f"{r['kernel_ms']:.3f}" if "kernel_ms" in r else "-"
        kr = f"{r['overlap']['itl_ms'] / r['kernel_ms']:.3f}" if "kernel_ms" in r and r["batch"] == 1 else "-"
        lines.append(f"| {r['batch']} | {r['backend_step_ms']:.3f} | {k} | {r['engine_host_ms']['overlap']:.3f} | "
                     f"{r['sync']['itl_ms']:.3f} | {r['overlap']['itl_ms']:.3f} | {r['overlap']['itl_p50_ms']:.3f} | "
                     f"{r['overlap']['stall_share']:.1%} | {r['overlap']['itl_over_step']:.3f} | {kr} | "
                     f"{r['sync']['host_share']:.1%} | {r['overlap']['host_share']:.1%} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mimw.bench.overlap")
    add_arguments(parser.add_subparsers(dest="bench_command", required=True))
    return run_checked(parser.parse_args(["overlap", *(argv if argv is not None else sys.argv[1:])]))


def run_checked(args: argparse.Namespace) -> int:
    """``run`` with a bad option reported in one line (exit code 2)."""
    from ..models.spec import SpecError

    try:
        return run(args)
    except (ValueError, SpecError) as e:
        print(f"mimw bench overlap: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
