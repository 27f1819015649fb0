"""``mimw bench engine-host`` (also ``python -m mimw.bench.engine_host``): the engine's own host work per step,
by context length and batch, with a backend that costs nothing (``FreeBackend``).

What it answers: how much of a step's wall time is the engine's (scheduler, prefix cache, host tier, sessions,
sampling, stop checks, detokenisation) rather than the backend's, and whether it grows with the context or the
number of running requests. The engine runs at the trace benchmark's configuration (``scripts/trace_bench_gpu.sh``:
page size 16, 32 requests at most, 2048-token steps, prefix cache; ``lru``: device pool only, ``session+host``:
session retention and a host tier holding the whole pool). Per setup, context C and batch B: the pool is first
filled with parked pages (finished requests' pages kept for reuse, as in a replay whose working set exceeds the
pool), so that allocations evict and the host tier backs pages up as it does in a replay; then B session requests
of C-token prompts prefill and decode, and the wall time of ``Engine.step`` over ``--steps`` decode steps (after 8
untimed ones) is the engine's host cost at that context and batch. ``--profile N`` adds each row's N costliest
functions (cProfile, own time per step). The model preset only gives the vocabulary and the limits: no weights
are built. Prints a table and writes ``engine-host-<device>-<model>.json`` to ``--out``.

On the CPU the "device" is the CPU, so a step also pays its sampling there (on a GPU a kernel): the free
backend's logits are 256 columns wide, so that this stays a few microseconds. ``--device cuda`` puts the logits
(the model's whole vocabulary), the sampling and the overlap's copies on the GPU: the host then pays each CUDA call
as a serving step does, the GPU's own work being a few small kernels.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from ..kv.pages import KVLayout, PagedKVCache
from .overlap import FixedLogits

SETUPS = {"lru": ("lru", False), "session+host": ("session", True)}
LOGIT_COLUMNS = 256


class FreeBackend(FixedLogits):
    """``FixedLogits`` over a pool of one-element pages (one layer, one KV head, head_dim 1): the engine's page
    accounting, prefix cache and host tier work on page ids and never read what a page holds, so their cost is
    the same as with a real pool, without the memory of one."""

    def __init__(self, spec, device: torch.device):
        super().__init__(spec, device)
        if device.type == "cpu":  # the CPU samples inline: a narrow row keeps that cost out of the engine's
            self.logits = self.logits[:, :LOGIT_COLUMNS].contiguous()

    @staticmethod
    def layout(page_size: int, num_pages: int) -> KVLayout:
        return KVLayout(1, 1, 1, page_size, num_pages, torch.float32)

    def make_cache(self, page_size: int, num_pages: int) -> PagedKVCache:
        return PagedKVCache(self.layout(page_size, num_pages), torch.device("cpu"))


def add_arguments(sub) -> None:
    p = sub.add_parser("engine-host", help="the engine's host work per step (a backend that costs nothing), by "
                       "context and batch", description=__doc__.split("\n\n")[0])
    _options(p)


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.2-1b", metavar="PRESET", help="preset (its vocabulary and limits)")
    p.add_argument("--setups", default="lru,session+host", help=f"comma list of {', '.join(SETUPS)}")
    p.add_argument("--contexts", default="2048,6144", metavar="C[,C...]", help="prompt tokens per request")
    p.add_argument("--batches", default="1,8", metavar="B[,B...]", help="running requests")
    p.add_argument("--steps", type=int, default=200, help="decode steps timed per row (default 200)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-step-tokens", type=int, default=2048)
    p.add_argument("--parked-pages", type=int, default=None,
                   help="pages parked in the pool before the requests run, at least (default: twice the host tier's "
                        "backup window, max-step-tokens / page-size + max-batch)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print each row's N costliest functions")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the logits, the sampling and "
                   "the token copies run (default cpu)")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/results/engine-host", metavar="DIR")


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be a comma list of integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"--{name} must list integers >= 1, got {text!r}")
    return vals


def make_engine(spec, setup: str, num_pages: int, page_size: int, max_batch: int, max_step_tokens: int,
                device: torch.device = torch.device("cpu")):
    """An engine with ``FreeBackend`` at the trace benchmark's configuration; ``session+host``'s host tier holds
    as many pages as the device pool."""
    from ..engine.engine import Engine, EngineConfig
    from ..server.main import ByteTokenizer

    policy, host = SETUPS[setup]
    backend = FreeBackend(spec, device)
    page_bytes = FreeBackend.layout(page_size, 1).bytes_per_page()
    cfg = EngineConfig(num_pages=num_pages, page_size=page_size, max_batch=max_batch,
                       max_step_tokens=max_step_tokens, kv_eviction=policy,
                       host_kv_bytes=num_pages * page_bytes if host else 0)
    return Engine(backend, ByteTokenizer(), cfg)


def decode_tokens(steps: int, context: int, batch: int) -> int:
    """Tokens a timed request may generate: its first, those it decodes while the others still prefill (at most one
    a prefill step; more than enough: a step prefills 64 tokens or more), 8 untimed decode steps, ``steps`` timed
    ones, and slack."""
    return 1 + batch * context // 64 + 8 + steps + 8


def decode_steps(eng, context: int, batch: int, steps: int, profile: int = 0) -> dict:
    """Fill ``eng``'s pool with parked pages but for the prompts' pages, run ``batch`` session requests of
    ``context``-token prompts until each decodes, then time ``steps`` decode steps (after 8 untimed ones): the
    pages they take are parked pages evicted."""
    from ..engine.sampling import SamplingParams

    ps = eng.config.page_size
    parked_pages = eng.allocator.num_pages - batch * -(-context // ps)
    run = decode_tokens(steps, context, batch)
    filler = 0
    one = SamplingParams(temperature=0.0, max_tokens=1)
    while parked_pages > 0:  # finished requests' pages, parked for reuse (distinct prompts: no sharing)
        n = min(parked_pages, eng.max_model_len // ps - 1)
        eng.add_request(f"fill{filler}", [filler % 200 + 3] + [7] * (n * ps), one)
        while eng.has_work():
            eng.step()
        parked_pages -= n
        filler += 1
    params = SamplingParams(temperature=0.0, max_tokens=run, ignore_eos=True)
    reqs = [eng.add_request(f"r{b}", [b % 200 + 3, 5] + [9] * (context - 2), params, session_id=f"s{b}")
            for b in range(batch)]
    while any(r.num_output_tokens == 0 for r in reqs):
        eng.step()
    for _ in range(8):
        eng.step()
    prof = cProfile.Profile() if profile else None
    times = []
    for _ in range(steps):
        if prof is not None:
            prof.enable()
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
        if prof is not None:
            prof.disable()
    if any(r.is_finished for r in reqs):
        raise RuntimeError("a request finished before the timed steps ended")
    st = eng.stats()
    row = {"ms_mean": 1e3 * statistics.fmean(times), "ms_p50": 1e3 * statistics.median(times),
           "ms_p90": 1e3 * sorted(times)[int(0.9 * (len(times) - 1))], "pages_free": eng.allocator.num_free,
           "pages_parked": st.pages_cached, "host_pages_used": st.host_pages_used}
    if prof is not None:
        row["profile"] = top_functions(prof, steps, profile)
    eng.abort_all()
    return row


def top_functions(prof: cProfile.Profile, steps: int, n: int) -> list[dict]:
    """The ``n`` functions with the most own time: (name, calls a step, own ms a step, cumulative ms a step)."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [{"function": f"{Path(f).name}:{line}({name})", "calls": nc / steps, "own_ms": 1e3 * tt / steps,
             "cum_ms": 1e3 * ct / steps} for (f, line, name), (_, nc, tt, ct, _) in rows]


def run(args: argparse.Namespace) -> int:
    from ..models.spec import PRESETS
    from .config import preset_spec

    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    bad = [s for s in setups if s not in SETUPS]
    if bad or not setups:
        raise ValueError(f"--setups: unknown {bad or 'empty'}; choose from {', '.join(SETUPS)}")
    contexts, batches = _ints(args.contexts, "contexts"), _ints(args.batches, "batches")
    if args.model not in PRESETS:
        raise ValueError(f"--model must be a preset, got {args.model!r}")
    for name in ("steps", "page_size", "max_batch", "max_step_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if max(batches) > args.max_batch:
        raise ValueError(f"--batches: {max(batches)} requests exceed --max-batch {args.max_batch}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU here")
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    spec = preset_spec(args.model)
    ps = args.page_size
    window = -(-args.max_step_tokens // ps) + args.max_batch  # the engine's backup window (Engine._backup_window)
    parked = 2 * window if args.parked_pages is None else args.parked_pages
    rows = []
    for setup in setups:
        for c in contexts:
            for b in batches:
                # the prompts' pages, and parked ones (at least ``parked``) for the decode steps' pages to evict
                pages = b * -(-c // ps) + max(parked, b * (-(-decode_tokens(args.steps, c, b) // ps) + 1))
                if c + decode_tokens(args.steps, c, b) > spec.max_position_embeddings:
                    raise ValueError(f"--contexts: {c} tokens and the decode steps exceed {args.model}'s context")
                eng = make_engine(spec, setup, pages, ps, args.max_batch, args.max_step_tokens, device)
                row = {"setup": setup, "context": c, "batch": b, "pages": pages,
                       **decode_steps(eng, c, b, args.steps, args.profile)}
                rows.append(row)
                print(_line(row), file=sys.stderr, flush=True)
    dev = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    doc = {"bench": "engine-host", "model": args.model, "device": dev, "torch": torch.__version__,
           "page_size": ps, "max_batch": args.max_batch, "max_step_tokens": args.max_step_tokens,
           "parked_pages": parked, "steps": args.steps, "rows": rows,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    from .report import publish

    publish(args.out, f"engine-host-{device.type}-{args.model}.json", doc, table(rows))
    return 0


def _line(row: dict) -> str:
    head = (f"[engine-host] {row['setup']}, context {row['context']}, batch {row['batch']}: {row['ms_mean']:.3f} ms "
            f"a step (p50 {row['ms_p50']:.3f}, p90 {row['ms_p90']:.3f})")
    return head + "".join(f"\n    {f['own_ms']:7.3f} ms own {f['cum_ms']:7.3f} ms cum {f['calls']:8.1f} calls  "
                          f"{f['function']}" for f in row.get("profile", ()))


def table(rows: Sequence[dict]) -> str:
    lines = ["| setup | context | batch | ms a step (mean) | p50 | p90 |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['context']} | {r['batch']} | {r['ms_mean']:.3f} | {r['ms_p50']:.3f} | "
                     f"{r['ms_p90']:.3f} |")
    return "\n".join(lines)


def run_checked(args: argparse.Namespace) -> int:
    """``run`` with a bad option reported in one line (exit code 2)."""
    try:
        return run(args)
    except ValueError as e:
        print(f"mimw bench engine-host: error: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mimw bench engine-host", description=__doc__.split("\n\n")[0])
    _options(p)
    return run_checked(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
