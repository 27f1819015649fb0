"""Where a hung megakernel launch stopped: per SM, the first instruction it did not finish, and the counters it waits on.

A persistent kernel that deadlocks (a dependency counter that never reaches its target, a ring slot the loader and
compute count differently, a barrier one partition never reaches) only shows as a ``torch.cuda.synchronize`` that
never returns. This tool launches one step of a traced kernel (``Tuning(trace=True)``: every instruction stores its
four timestamps when it ends) on its own stream, waits up to ``--timeout`` seconds, and if the launch has not
finished reads the trace buffer and the counters from a second stream (a device-to-host copy needs no SM, so it
runs beside the hung kernel). ``locate`` turns them into the report: per SM the first instruction with no stamps
(its op, layer, fields, the counter it waits on with that counter's value and target), grouped by what they wait
for; an instruction whose counter is already met is stuck inside its own work (ring, barrier, ticket). The counters
each stuck wait needs are followed to the instructions that signal them and whether those ran. The process then
exits at once (``os._exit``): the driver tears the hung context down.

A hang that needs earlier launches (a counter or ticket left off its step-numbered target by the launch before, the
epoch's move) shows only on a later launch: ``--steps N`` runs up to N launches of the same step one after the other,
the trace cleared before each, and reports the first that does not finish; ``--graph`` runs them as the check
harness does (tools/check.py: a warm-up launch, a CUDA graph captured, then replays). ``--kv-dtype fp8`` runs over an
fp8 cache (e4m3 rows and their scales: check.random_cache).

    PYTHONPATH=src python3 -m mimw.megakernel.tools.hang --model smollm2-135m --context 17 [--batch 8]
        [--verify 1x16 [--per-token]] [--kv-dtype fp8] [--steps 4] [--graph] [--timeout 20]
        [--megakernel quiet=0]

Pure host logic (``locate``) is CPU-tested; the launch needs a Hopper GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass

import torch

from .. import isa
from ..state import counter_slots


@dataclass(frozen=True)
class Stuck:
    sm: int
    index: int  # the first instruction of the SM's queue with no trace stamps
    op: str
    layer: int
    fields: tuple[int, ...]  # words A..E
    wait: int  # the counter it waits on (isa.NO_COUNTER: none)
    value: int  # that counter's value when read (0 for none)
    target: int  # the value the wait needs
    finished: int  # instructions of the queue finished before it
    queue: int  # instructions in the queue

    @property
    def waiting(self) -> bool:
        """Still waiting on its dependency (else stuck inside its own work, or not reached)."""
        return self.wait != isa.NO_COUNTER and self.value < self.target


def locate(words: torch.Tensor, lens: torch.Tensor, trace: torch.Tensor, counters: torch.Tensor,
           num_counters: int) -> list[Stuck]:
    """The first unfinished instruction of every SM whose queue did not finish. ``words`` [S, L, NWORDS] and
    ``lens`` [S] (the encoded program), ``trace`` [S, L, 4] (stamps; an instruction's 4th stamp is nonzero once it
    signalled), ``counters`` [num_counters + 2] (the counters, DONE, EPOCH: the epoch is the launch's, read as it
    started, so a wait's target is (epoch + 1) x its count)."""
    epoch = int(counters[num_counters + 1])
    out = []
    for s in range(words.shape[0]):
        n = int(lens[s])
        done = [bool(trace[s, i, 3] != 0) for i in range(n)]
        if all(done):
            continue
        i = done.index(False)
        w = [int(x) for x in words[s, i]]
        wait = w[isa.Word.WAIT]
        value = int(counters[wait]) if 0 <= wait < num_counters else 0
        out.append(Stuck(s, i, isa.Op(w[isa.Word.OP]).name, w[isa.Word.LAYER],
                         tuple(w[isa.Word.A:isa.Word.E + 1]), wait, value, (epoch + 1) * w[isa.Word.WAIT_COUNT],
                         sum(done), n))
    return out


def signallers(words: torch.Tensor, lens: torch.Tensor, trace: torch.Tensor, counter: int) -> list[tuple[int, int, bool]]:
    """(SM, index, finished) of every instruction that signals ``counter``."""
    return [(s, i, bool(trace[s, i, 3] != 0)) for s in range(words.shape[0]) for i in range(int(lens[s]))
            if int(words[s, i, isa.Word.SIGNAL]) == counter]


def report(words: torch.Tensor, lens: torch.Tensor, trace: torch.Tensor, counters: torch.Tensor,
           num_counters: int) -> str:
    """``locate``'s findings as text: stuck SMs grouped by (op, layer, what they wait for), then for each counter
    that a wait still needs, its signallers and how many of them finished."""
    stuck = locate(words, lens, trace, counters, num_counters)
    if not stuck:
        return "every queue finished"
    lines = [f"{len(stuck)} of {words.shape[0]} SMs did not finish their queue"]
    groups: dict[tuple, list[Stuck]] = {}
    for st in stuck:
        key = (st.op, st.layer, st.wait if st.waiting else None)
        groups.setdefault(key, []).append(st)
    for (op, layer, wait), sts in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        first = sts[0]
        sms = ",".join(str(st.sm) for st in sts[:12]) + (",..." if len(sts) > 12 else "")
        what = (f"waiting on counter {wait} ({first.value} of {first.target})" if wait is not None
                else "inside its work (its dependency met, or none)")
        lines.append(f"  {op} layer {layer}: {len(sts)} SM(s) [{sms}] {what}; e.g. SM {first.sm} instruction "
                     f"{first.index} of {first.queue} fields {first.fields}")
    for c in sorted({st.wait for st in stuck if st.waiting}):
        sig = signallers(words, lens, trace, c)
        pending = [(s, i) for s, i, ok in sig if not ok]
        lines.append(f"  counter {c}: {len(sig)} signallers, {len(sig) - len(pending)} finished; unfinished at "
                     + (", ".join(f"SM {s} #{i}" for s, i in pending[:8]) or "none") + ("..." if len(pending) > 8
                                                                                       else ""))
    return "\n".join(lines)


def verify_step(tables, context: int, k: int, query_blocks: bool = True):
    """The one-token step of verify blocks of ``k`` tokens at ``context``, one a block table of ``tables``
    (one_token.split_segments); its attention in query blocks of any length (the GPU's verify path from
    ``plan.MIN_QUERY_BLOCK`` tokens on), or, with ``query_blocks`` False, every token its own (the path of shorter
    blocks): the two told apart at any ``k``."""
    from dataclasses import replace

    from ...models.reference import Segment
    from ..launch.one_token import split_segments

    one = split_segments([Segment(tuple(t), context, k, k) for t in tables], None, 16, least=2)
    return one if query_blocks else replace(one, blocks=())


def _decoder(args):
    """A traced decoder with its inputs set for one step (M = 1, a decode batch, or verify blocks) over a cache of
    ``args.kv_dtype``."""
    from ...kv.pages import parse_kv_dtype
    from ...models.spec import get_preset
    from ...models.weights import random_weights
    from ..launch.decoder import MegakernelDecoder
    from ..plan import Tuning
    from .check import random_cache

    spec = get_preset(args.model)
    w = random_weights(spec, 0, dtype=torch.bfloat16, device="cuda")
    n_seq, k = (int(x) for x in args.verify.split("x")) if args.verify else (args.batch, 1)
    per = -(-(args.context + k) // 16)  # pages a sequence
    cache, table = random_cache(spec, args.context, k + 1, 16, 1, min_pages=n_seq * (per + 1),
                                kv_dtype=parse_kv_dtype(args.kv_dtype))
    tuning = dataclasses.replace(Tuning.parse(args.megakernel), trace=True)
    dec = MegakernelDecoder(w, cache, max_pages_per_seq=len(table), tuning=tuning,
                            context_hint=max(args.context, 1), use_graph=False)
    if n_seq * k == 1:
        dec.set_inputs(1, args.context, table)
        return dec
    one = verify_step([table[j * per:(j + 1) * per] for j in range(n_seq)], args.context, k, not args.per_token)
    sub = dec.batch_decoder(len(one.positions), one.blocks)
    sub.set_batch([1] * len(one.positions), one.positions, one.block_tables, one.firsts)
    return sub


def _launches(dec, steps: int, graph: bool):
    """The launches ``--steps`` / ``--graph`` make, as callables on the current stream: each clears the trace (a
    finished instruction's stamps from the launch before would read as finished) and launches; with ``graph`` the
    first is the direct warm-up launch, the next captures a CUDA graph of one launch and replays it, the rest replay
    it (tools/check.py's order: ``MegakernelDecoder.capture``)."""
    def direct():
        dec.trace.zero_()
        dec.launch()

    def replay():
        if dec.graph is None:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                dec.launch()
            dec.graph = g
        dec.trace.zero_()
        dec.graph.replay()

    return [direct] + [replay if graph else direct] * (steps - 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=17)
    p.add_argument("--batch", type=int, default=1, help="decode tokens a step (one-token segments)")
    p.add_argument("--verify", default="", help="SxK: S verify blocks of K tokens (replaces --batch)")
    p.add_argument("--per-token", action="store_true",
                   help="verify blocks' attention per token, not in query blocks (ops/attn_query_block.py)")
    p.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"), help="the KV cache's element type")
    p.add_argument("--steps", type=int, default=1, help="launches of the step, one after the other (at least 1)")
    p.add_argument("--graph", action="store_true", help="after the first launch, replay a captured CUDA graph")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for each launch")
    p.add_argument("--megakernel", default="", metavar="NAME=VALUE[,...]",
                   help="tuning overrides (plan.Tuning.parse, e.g. quiet=0); the trace is always on")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if not torch.cuda.is_available():
        print("hang: needs a CUDA GPU", file=sys.stderr)
        return 2
    dec = _decoder(args)
    torch.cuda.synchronize()
    run, read = torch.cuda.Stream(), torch.cuda.Stream()
    finished = True
    for k, launch in enumerate(_launches(dec, args.steps, args.graph)):
        with torch.cuda.stream(run):
            launch()
            done = torch.cuda.Event()
            done.record(run)
        t0 = time.monotonic()
        while not done.query() and time.monotonic() - t0 < args.timeout:
            time.sleep(0.05)
        finished = done.query()
        if not finished:
            break
    trace = torch.empty(dec.trace.shape, dtype=dec.trace.dtype, pin_memory=True)
    counters = torch.empty(dec.state.counters.shape, dtype=dec.state.counters.dtype, pin_memory=True)
    with torch.cuda.stream(read):  # beside the launch: no wait on its stream
        trace.copy_(dec.trace, non_blocking=True)
        counters.copy_(dec.state.counters, non_blocking=True)
    read.synchronize()
    n = counter_slots(dec.program)  # the table the kernel keeps: DONE and EPOCH follow these
    how = "graph replay" if args.graph and k > 0 else "launch"
    print(f"{how} {k + 1} of {args.steps} {'finished' if finished else f'still running after {args.timeout:.0f} s'}: "
          f"{args.model}, context {args.context}, {dec.shape.num_tokens} token(s), query blocks "
          f"{dec.shape.attn_blocks or 'none'}, {args.kv_dtype} cache, epoch {int(counters[n + 1])}")
    print(report(dec.plan.words, dec.plan.lens, trace, counters, n))  # the host's copy of the program
    sys.stdout.flush()
    if not finished:
        os._exit(1)  # the hung launch would block any further CUDA call, interpreter shutdown included
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
