"""``mimw bench trace`` (replay a trace) and ``mimw bench trace-gen`` (write a synthetic agent trace).

In-process (the default): the model is loaded once and each setup of ``--setups`` replays the whole trace on a
fresh engine with the same device pool, so the setups differ only in their KV policy:

    lru            device pool only, least-recently-used eviction (the baseline)
    session        device pool only, live sessions' pages evicted last
    lru+host       device pool + host tier, LRU in both
    session+host   device pool + host tier, live sessions' pages evicted last in both

The device pool defaults to the trace's working set (distinct prompt tokens) divided by ``--working-set-ratio``
(at least what its largest request needs); the host tier defaults to room for the whole working set.

``--url`` replays against a running ``mimw serve`` on this machine instead (its own configuration is the one
setup). Results: ``<date>-<device>-<model>-<trace>.json/.md/.png`` in ``--out`` and a short table on stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path

SETUPS = {"lru": ("lru", False), "session": ("session", False), "lru+host": ("lru", True),
          "session+host": ("session", True)}


def add_subcommands(sub) -> None:
    p = sub.add_parser("trace", help="replay a request trace (agent sessions, Mooncake rows) and compare KV policies",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, metavar="PATH", help="trace file (.jsonl/.json) or directory of .json")
    p.add_argument("--url", default=None, help="replay against a running mimw serve at this loopback URL")
    p.add_argument("--served-model", default=None, help="model id to send with --url (default: the server's)")
    p.add_argument("--model", default=None, metavar="PATH|PRESET", help="default: the embedded SmolLM2-135M")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "megakernel", "free"],
                   help="auto (default): megakernel on a Hopper GPU, else reference; free: a backend that costs "
                        "nothing (mimw.bench.engine_host.FreeBackend; a preset's shape, on the CPU): the steps' "
                        "times are the engine's own host work")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "bf16", "fp8"],
                   help="KV cache element type, as `mimw serve --kv-dtype` (auto: the weights' dtype)")
    p.add_argument("--setups", default="lru,session+host", help=f"comma list of {', '.join(SETUPS)}")
    p.add_argument("--kv-pages", type=int, default=None, help="device pool pages (default: working set / ratio)")
    p.add_argument("--working-set-ratio", type=float, default=4.0,
                   help="size the device pool so that the working set is this many times larger (default 4)")
    p.add_argument("--host-kv-gb", type=float, default=None,
                   help="host tier GiB (default: 1.25x the trace's KV working set, at most half the memory available)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-step-tokens", type=int, default=512)
    p.add_argument("--session-ttl", type=float, default=300.0)
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every gap of the trace (default 1)")
    p.add_argument("--max-delay", type=float, default=60.0, help="cap every gap at this many trace seconds")
    p.add_argument("--stagger", type=float, default=0.0, help="seconds between conversations without a start")
    p.add_argument("--block-size", type=int, default=None, help="override the trace format's block size")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds per setup at most (default 600)")
    p.add_argument("--max-inflight", type=int, default=64, help="open HTTP requests at most (with --url)")
    p.add_argument("--vocab-size", type=int, default=49152,
                   help="with --url: the served model's vocabulary, for the synthesised token ids (default: the "
                        "embedded SmolLM2's 49152)")
    p.add_argument("--seed", type=int, default=0, help="token synthesis seed")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 avoids oversubscription on a shared machine)")
    p.add_argument("--out", default="bench/results/trace", metavar="DIR")
    p.add_argument("--commit", default=None)

    from . import synth

    g = sub.add_parser("trace-gen", help="write a synthetic agent trace (kv-cache-tester format, JSON lines)",
                       description=synth.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--out", required=True, metavar="FILE")
    for f in dataclasses.fields(synth.AgentTraceConfig):
        g.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       help=f"(default {f.default})")


def run(args: argparse.Namespace) -> int:
    from .readers import TraceFormatError

    try:
        if args.bench_command == "trace-gen":
            return _generate(args)
        return _replay(args)
    except (TraceFormatError, ValueError) as e:
        print(f"mimw bench {args.bench_command}: error: {e}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from .readers import Timing, agent_trace, write_jsonl
    from .synth import AgentTraceConfig, generate

    cfg = AgentTraceConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(AgentTraceConfig)})
    convs = generate(cfg)
    write_jsonl(args.out, convs)
    st = agent_trace(Path(args.out).stem, convs, Timing()).stats()
    print(f"wrote {args.out}: {st['requests']} requests, {st['sessions']} sessions, {st['prompt_tokens']} prompt "
          f"tokens, working set {st['working_set_tokens']} tokens, ideal hit rate {st['ideal_hit_rate']:.1%}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from .readers import Timing, read_trace

    for name in ("page_size", "max_batch", "max_step_tokens"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.working_set_ratio <= 0 or args.max_duration <= 0 or args.time_scale < 0:
        raise ValueError("--working-set-ratio and --max-duration must be positive, --time-scale >= 0")
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    bad = [s for s in setups if s not in SETUPS]
    if bad or not setups:
        raise ValueError(f"--setups: unknown {bad or 'empty'}; choose from {', '.join(SETUPS)}")
    trace = read_trace(args.trace, Timing(args.time_scale, args.max_delay, args.stagger), args.block_size)
    if args.max_requests is not None:
        trace = trace.head(args.max_requests)
    if args.url is not None:
        from .remote import check_loopback

        check_loopback(args.url)
        return _over_http(args, trace)
    return _in_process(args, trace, setups)


def _meta(args: argparse.Namespace, trace, model: str, device: str) -> dict:
    import torch

    from ..main import git_commit

    return {"model": model, "device": device, "commit": args.commit or git_commit(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
            "trace": trace.stats(), "config": {k: v for k, v in vars(args).items() if k != "func"}}


def _progress(name: str, total: int):
    state = {"n": 0, "t": time.perf_counter()}

    def tick(o) -> None:
        state["n"] += 1
        if time.perf_counter() - state["t"] > 10 or state["n"] == total:
            state["t"] = time.perf_counter()
            print(f"[trace] {name}: {state['n']}/{total} requests done", file=sys.stderr, flush=True)
    return tick


def _in_process(args: argparse.Namespace, trace, setups: list[str]) -> int:
    import torch

    from ...engine.engine import Engine, EngineConfig
    from ...kv.host_tier import available_host_bytes
    from ...kv.pages import KVLayout
    from ...models.checkpoint import load_model
    from ...server.main import ByteTokenizer, _backend
    from .replay import replay_engine
    from .tokens import TokenSynth

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if args.threads is not None:
        if args.threads <= 0:
            raise ValueError("--threads must be positive")
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    name = args.backend
    if name == "auto":
        name = "megakernel" if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0) \
            else "reference"
    if name == "free":
        from ...models.spec import PRESETS
        from ..engine_host import FreeBackend

        if args.model not in PRESETS:
            raise ValueError(f"--backend free needs a preset --model (its shape), got {args.model!r}")
        device = torch.device("cpu")
        spec, tok = PRESETS[args.model], ByteTokenizer()
        backend = FreeBackend(spec, device)
    else:
        from ...kv.pages import parse_kv_dtype

        loaded = load_model(args.model, dtype=dtype, device=device, progress=False)
        spec, tok = loaded.spec, loaded.tokenizer or ByteTokenizer()
        backend = _backend(name, loaded.weights, parse_kv_dtype(args.kv_dtype))
    ps = args.page_size
    one_page = backend.layout(ps, 1) if name == "free" else KVLayout.for_spec(spec, ps, 1, backend.kv_dtype)
    page_bytes = one_page.bytes_per_page()
    st = trace.stats()
    ws_pages = -(-st["working_set_tokens"] // ps)
    need = max(-(-(r.input_length + r.output_length) // ps) for r in trace.requests) + args.max_batch
    pages = args.kv_pages or max(int(ws_pages / args.working_set_ratio), need)
    host_bytes = int(args.host_kv_gb * (1 << 30)) if args.host_kv_gb is not None else default_host_bytes(
        ws_pages * page_bytes, available_host_bytes())
    max_len = min(spec.max_position_embeddings, pages * ps)
    model = args.model or "SmolLM2-135M-Instruct"
    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"cpu ({torch.get_num_threads()} threads)")
    doc = {**_meta(args, trace, model, dev_name), "backend": name, "device_pool_tokens": pages * ps,
           "working_set_ratio": st["working_set_tokens"] / (pages * ps), "host_pool_tokens": 0,
           "page_bytes": page_bytes, "max_model_len": max_len, "setups": []}
    print(f"[trace] {trace.name}: {st['requests']} requests, {st['sessions']} sessions, working set "
          f"{st['working_set_tokens']} tokens, ideal hit rate {st['ideal_hit_rate']:.1%}; {model} on {dev_name}, "
          f"{name} backend; "
          f"device pool {pages} pages ({doc['working_set_ratio']:.1f}x smaller than the working set)",
          file=sys.stderr, flush=True)
    synth = TokenSynth(spec.vocab_size, args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = _base_name(dev_name, model, trace.name)
    for name in setups:
        policy, host = SETUPS[name]
        cfg = EngineConfig(num_pages=pages, page_size=ps, max_batch=args.max_batch,
                           max_step_tokens=max(args.max_step_tokens, args.max_batch), max_model_len=max_len,
                           session_ttl_s=args.session_ttl, kv_eviction=policy, host_kv_bytes=host_bytes if host else 0)
        engine = Engine(backend, tok, cfg, tok.eos_token_ids)
        if engine.host is not None:
            doc["host_pool_tokens"] = engine.host.num_pages * ps
        _warm_up(engine, synth, spec.vocab_size)
        steps: list[tuple[float, int]] = []
        outcomes = replay_engine(engine, trace, synth, sessions=True, max_duration_s=args.max_duration,
                                 progress=_progress(name, len(trace.requests)), steps=steps)
        _add_setup(doc, name, outcomes, engine.stats().__dict__, _step_detail(steps, backend))
        _save(doc, out_dir, base, chart=False)
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return _finish(doc, out_dir, base)


def default_host_bytes(working_set_bytes: int, available: int | None) -> int:
    """The host tier of a setup with one: 1.25x the trace's KV working set, at most half the memory the machine
    has available (the 8B's long agent trace needs ~88 GB at 1.25x: more than a 128 GB machine can pin beside the
    loaded model)."""
    want = int(1.25 * working_set_bytes)
    return want if available is None else min(want, available // 2)


def _warm_up(engine, synth, vocab: int) -> None:
    """Every kernel compiled (``Backend.prepare``), then requests through every code path before timing
    (first-call allocations, kernel selection, and on the megakernel backend each decode batch bucket's graphs for
    this engine's cache): rounds of 1, 2, 4 ... up to the engine's batch (at most 32) concurrent requests of
    distinct 32-token prompts, 4 tokens each."""
    from ...engine.sampling import SamplingParams

    import numpy as np

    engine.backend.prepare(engine.cache, engine.config.max_batch)

    rng = np.random.default_rng(12345)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    n = 1
    while n <= min(32, engine.config.max_batch):
        for i in range(n):
            prompt = [int(t) for t in rng.integers(synth.lo, synth.hi, 32)]
            engine.add_request(f"warm-up-{n}-{i}", prompt, params)
        while engine.has_work():
            engine.step()
        n *= 2


def _over_http(args: argparse.Namespace, trace) -> int:
    import httpx

    from .remote import replay_http, tier_hits
    from .tokens import TokenSynth

    url = args.url.rstrip("/")
    cards = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    model = args.served_model or cards[0]["id"]
    before = tier_hits(httpx.get(url + "/metrics", timeout=10).text)
    synth = TokenSynth(args.vocab_size, args.seed)
    outcomes = replay_http(url, model, trace, synth, True, args.max_duration, args.max_inflight,
                           _progress("server", len(trace.requests)))
    after = tier_hits(httpx.get(url + "/metrics", timeout=10).text)
    doc = {**_meta(args, trace, model, f"server at {url}"), "setups": []}
    _add_setup(doc, "server", outcomes, None)
    if before is not None and after is not None:
        m = doc["setups"][0]["summary"]
        prompt = m["prompt_tokens"] or 1
        m["host_hit_rate"] = (after.get("host", 0) - before.get("host", 0)) / prompt
        m["device_hit_rate"] = (after.get("device", 0) - before.get("device", 0)) / prompt
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    return _finish(doc, out_dir, _base_name("server", model, trace.name))


def _step_detail(steps: list[tuple[float, int]], backend) -> dict:
    """The replay's step log summarised (``report.step_summary``), with the backend's own step times by token bucket
    (``Backend.step_costs``: device time where the GPU is timed) and, on the megakernel backend, its router's
    estimates per path; the steps' summary also goes to stderr."""
    from .report import step_summary

    out = step_summary(steps)
    out["backend_step_ms"] = {str(b): ms for b, ms in sorted(backend.step_costs.ms.items())}
    router = getattr(backend, "router", None)
    if router is not None:
        out["router"] = router.estimates()
    if out["steps"]:
        print(f"[trace] {out['steps']} steps: wall p50 {out['wall_p50_ms']:.2f} / p90 {out['wall_p90_ms']:.2f} ms, "
              f"{out['tokens_p50']:.0f} tokens p50; by tokens: " + ", ".join(
                  f"{b}: {v['steps']} x {v['mean_ms']:.2f} ms ({v['share']:.0%})" for b, v in out["by_tokens"].items()),
              file=sys.stderr, flush=True)
    return out


def _add_setup(doc: dict, name: str, outcomes, engine_stats: dict | None, steps: dict | None = None) -> None:
    from .report import compare, per_session, summarize

    doc["setups"].append({"name": name, "summary": summarize(outcomes), "sessions": per_session(outcomes),
                          "engine": engine_stats, "steps": steps, "requests": [o.to_json() for o in outcomes]})
    compare(doc["setups"])


def _base_name(device: str, model: str, trace: str) -> str:
    from ..main import slug

    return f"{time.strftime('%Y%m%d-%H%M', time.gmtime())}-{slug(device)}-{slug(Path(model).name)}-{slug(trace)}"


def _save(doc: dict, out_dir: Path, base: str, chart: bool) -> list[Path]:
    from ..report import write_json
    from .report import markdown, write_chart

    paths = [out_dir / f"{base}.json", out_dir / f"{base}.md"]
    write_json(paths[0], doc)
    paths[1].write_text(markdown(doc))
    if chart:
        paths.append(out_dir / f"{base}.png")
        write_chart(doc, paths[2])
    return paths


def _finish(doc: dict, out_dir: Path, base: str) -> int:
    from .report import short_table

    paths = _save(doc, out_dir, base, chart=True)
    print(short_table(doc), flush=True)
    print("[trace] wrote " + ", ".join(str(p) for p in paths), file=sys.stderr, flush=True)
    return 0
