"""Reading a per-instruction trace of one megakernel step (``KernelConfig(trace=True)``).

The kernel records, for every instruction, four %globaltimer stamps (ns): when the compute role reached it, when
its dependency counter was met, when its outputs were stored (before the release), and when it signalled.
``summarize`` turns them into what the performance notes need: per opcode the time spent waiting vs working, per
stage (opcode, layer) the window from the first instruction becoming ready to the last one finishing, and the
critical path per layer: for each stage, the time from the previous stage's last instruction finishing to its own
last one finishing, averaged over the layers after the first (layer 0 starts cold) — the step's dependency chain,
measured, stage by stage.

With ``KernelConfig(trace_tiles=True)`` it also records four stamps per weight tile, indexed by the ring's running
tile counter: when the loader wanted the tile's slot and when it got it (the TMA is issued at once), and when
compute started and stopped waiting for the tile's bytes. ``summarize_tiles`` reads them: per opcode the loader's
wait for a free slot, compute's wait for data, and the load latency (issue -> data) of the tiles compute had to
wait for (only those show when the bytes landed); per stage window the rate at which all loaders issued bytes —
where the step leaves HBM under-requested.
"""
from __future__ import annotations

import bisect
from collections import defaultdict

import torch

from .. import isa
from ..program import Program, column_part


ATTN_PHASES = ("q_and_block0", "later_blocks", "merge_and_store", "ticket", "combine")


def summarize(trace: torch.Tensor, words: torch.Tensor, lengths: torch.Tensor) -> dict:
    """trace [num_sms, max_len, 4 or 8] int64 ns (start, dependency met, outputs stored, signalled; for
    ATTN_PARTIAL also block 0 done, later blocks done, partial stored, ticket drawn (0: no ticket), kernel.py);
    words/lengths: the encoded program. Times in microseconds; per opcode the wait, the busy time and, within it, the
    release (outputs stored -> signalled: the barrier and the counter's release, which waits until the stores are
    visible); with 8 stamps, ``attn_phases_us``: ATTN_PARTIAL's busy time before its release, split into q's round
    trip with block 0, the later blocks, the warps' merge with the partial's stores, the ticket (splits that draw
    one) and the combine (the last split's; 0 for the others), and ``attn_last_split_us`` the same for the splits
    that hold the step's own row (split n_splits - 1, state.split_range). Each phase stamp waits for a cross-warp
    reduction of the phase's results (the stamps after block 0 and after the later blocks, for the softmax sums and
    the P V accumulator both), so a traced split runs a little slower than an untraced one."""
    t, w, n = trace.cpu(), words.cpu(), lengths.cpu()
    valid = [(s, i) for s in range(t.shape[0]) for i in range(int(n[s]))]
    t0 = min(int(t[s, i, 0]) for s, i in valid)
    per_op: dict[str, dict] = defaultdict(lambda: dict(count=0, wait_us=0.0, busy_us=0.0, release_us=0.0))
    stages: dict[tuple[int, int], list[float]] = {}
    phases: dict[str, list[float]] = {k: [] for k in ATTN_PHASES}
    last: dict[str, list[float]] = {k: [] for k in ATTN_PHASES}  # the splits holding the step's row (the last)
    for s, i in valid:
        op, layer = isa.Op(int(w[s, i, isa.Word.OP])), int(w[s, i, isa.Word.LAYER])
        start, ready, stored, done = (int(x) - t0 for x in t[s, i, :4])
        if op == isa.Op.ATTN_PARTIAL and t.shape[2] >= 8:
            first, rest, part, ticket = (int(x) for x in t[s, i, 4:8])
            first, rest, part = first - t0, rest - t0, part - t0
            to = last if int(w[s, i, isa.Word.C]) == int(w[s, i, isa.Word.D]) - 1 else phases
            to["q_and_block0"].append((first - ready) / 1e3)
            to["later_blocks"].append((rest - first) / 1e3)
            to["merge_and_store"].append((part - rest) / 1e3)
            if ticket:  # a combining split drew its ticket; the last one then combined
                to["ticket"].append((ticket - t0 - part) / 1e3)
                to["combine"].append((stored - (ticket - t0)) / 1e3)
        d = per_op[op.name]
        d["count"] += 1
        d["wait_us"] += (ready - start) / 1e3
        d["busy_us"] += (done - ready) / 1e3
        d["release_us"] += (done - stored) / 1e3
        win = stages.setdefault((int(op), layer), [ready / 1e3, done / 1e3])
        win[0], win[1] = min(win[0], ready / 1e3), max(win[1], done / 1e3)
    end = max(int(t[s, i, 3]) for s, i in valid) - t0
    ops = {k: dict(v, mean_wait_us=v["wait_us"] / v["count"], mean_busy_us=v["busy_us"] / v["count"],
                   mean_release_us=v["release_us"] / v["count"])
           for k, v in per_op.items()}
    windows = [dict(op=isa.Op(o).name, layer=l, first_ready_us=a, last_done_us=b)
               for (o, l), (a, b) in sorted(stages.items(), key=lambda kv: kv[1][0])]
    out = dict(step_us=end / 1e3, ops=ops, stages=windows, critical_path_us=critical_path(windows), origin_ns=t0)
    if phases["q_and_block0"] or last["q_and_block0"]:
        out["attn_phases_us"] = {k: sum(v + last[k]) / len(v + last[k]) for k, v in phases.items() if v + last[k]}
        out["attn_last_split_us"] = {k: sum(v) / len(v) for k, v in last.items() if v}
    return out


LAYER_STAGES = ("ATTN_IN", "ATTN_PARTIAL", "ATTN_REDUCE", "O_PROJ", "MLP_IN", "DOWN_PROJ")


def critical_path(windows: list[dict]) -> dict[str, float]:
    """Mean over layers 1..L-1 of each stage's share of the layer: its last finish minus the previous stage's last
    finish (the previous layer's DOWN_PROJ for ATTN_IN). Keys: the stages, and "layer" (their sum)."""
    done = {(w["op"], w["layer"]): w["last_done_us"] for w in windows}
    layers = sorted({w["layer"] for w in windows if w["op"] == "DOWN_PROJ"})
    shares: dict[str, list[float]] = {op: [] for op in LAYER_STAGES}
    for layer in layers[1:]:
        prev = done[("DOWN_PROJ", layer - 1)]
        for op in LAYER_STAGES:
            if (op, layer) in done:
                shares[op].append(done[(op, layer)] - prev)
                prev = done[(op, layer)]
    out = {op: sum(v) / len(v) for op, v in shares.items() if v}
    if out:
        out["layer"] = sum(out.values())
    return out


def format_summary(s: dict, layers: int = 2) -> str:
    lines = [f"step {s['step_us']:.1f} us", f"{'op':14s} {'count':>6s} {'mean wait us':>13s} {'mean busy us':>13s} "
             f"{'of it release':>14s}"]
    for k, v in s["ops"].items():
        lines.append(f"{k:14s} {v['count']:6d} {v['mean_wait_us']:13.2f} {v['mean_busy_us']:13.2f} "
                     f"{v['mean_release_us']:14.2f}")
    if s.get("attn_phases_us"):
        lines.append("ATTN_PARTIAL busy, mean us: " + ", ".join(f"{k} {v:.2f}" for k, v in s["attn_phases_us"].items()))
    if s.get("attn_last_split_us"):
        lines.append("  of it the last splits (the step's row): " + ", ".join(
            f"{k} {v:.2f}" for k, v in s["attn_last_split_us"].items()))
    if s.get("critical_path_us"):
        lines.append("critical path per layer (mean over layers 1..L-1, us): " + ", ".join(
            f"{k} {v:.1f}" for k, v in s["critical_path_us"].items()))
    lines.append("stage windows (first ready -> last done), first layers:")
    for st in s["stages"]:
        if st["layer"] < layers or st["op"] == "LM_HEAD":
            lines.append(f"  L{st['layer']:<3d} {st['op']:14s} {st['first_ready_us']:9.1f} -> {st['last_done_us']:9.1f}")
    return "\n".join(lines)


def tile_counts(program: Program, tile_rows: int, tile_k: int) -> list[list[int]]:
    """Weight tiles each instruction streams, per SM queue, in the loader's order (kernel.py ``_loader``): the
    host-side mirror of the ring's tile counter."""
    spec = program.spec
    hd = spec.head_dim
    kt = lambda k: -(-k // tile_k)  # noqa: E731
    kt_d, kt_q, kt_i = kt(spec.hidden_size), kt(spec.q_size), kt(spec.intermediate_size)

    def part(k: int, p: int, n: int) -> int:  # column tiles of part p of n over k columns
        c0, c1 = column_part(k, tile_k, p, n)
        return kt(c1 - c0)
    out = []
    for q in program.queues:
        row = []
        for ins in q:
            if isinstance(ins, isa.AttnIn):
                row.append(hd // tile_rows * part(spec.hidden_size, ins.part, ins.n_parts))
            elif isinstance(ins, isa.OProj):  # with n_parts: its part's columns (ProgramConfig.o_parts)
                cols = part(spec.q_size, ins.part, ins.n_parts) if ins.n_parts else kt_q
                row.append(ins.nrows // tile_rows * cols)
            elif isinstance(ins, isa.MlpIn):
                row.append(2 * ins.nrows // tile_rows * kt_d)
            elif isinstance(ins, isa.DownProj):  # a cluster pair's half: its column tiles (ProgramConfig.cluster_down)
                cols = part(spec.intermediate_size, ins.part, ins.n_parts) if ins.n_parts > 1 else kt_i
                row.append(ins.nrows // tile_rows * cols)
            elif isinstance(ins, isa.LmHead):
                row.append(ins.nrows // tile_rows * kt_d)
            else:
                row.append(0)
        out.append(row)
    return out


def _pct(v: list[float], p: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))] if v else float("nan")


def summarize_tiles(tiles: torch.Tensor, program: Program, tile_rows: int, tile_k: int,
                    windows: list[dict] | None = None, origin_ns: int | None = None,
                    trace: torch.Tensor | None = None) -> dict:
    """tiles [num_sms, max_tiles, 4] int64 ns (loader wants slot, gets it = issues the TMA, compute wants data,
    has it); ``windows``: the stage windows of ``summarize`` from the same launch (instruction trace), for the
    issue rate per stage, with its ``origin_ns`` (default: the first tile's request). Times in microseconds;
    fractions of the SMs' total time over the traced span. With the instruction trace itself (``trace``, [num_sms,
    max_len, 4]: start, dependency met, outputs stored, signalled), each matvec instruction's busy time is split
    into ``phases``: staging (dependency met -> compute asks for its first tile), data wait (compute waiting for
    tiles' bytes), work (compute holding a tile until it asks for the next one: loads, arithmetic, the slot's
    release, row-tile epilogues), epilogue (last tile's bytes -> outputs stored) and release (-> signalled: the
    barrier and the counter's release); ``tail_us`` is the last two; per-instruction means, and
    ``work_per_tile_us``."""
    t = tiles.cpu().tolist()  # plain lists: an 8B step has ~10^6 tiles
    counts = tile_counts(program, tile_rows, tile_k)
    tile_bytes = tile_rows * tile_k * 2
    ins_t = trace.cpu().tolist() if trace is not None else None
    rec = []  # (op name, want slot, issued, compute wants, compute has) per tile
    ph: dict[str, list[list[float]]] = defaultdict(list)  # op -> [staging, data wait, work, epilogue, release,
    # tiles] per instruction
    for s, q in enumerate(program.queues):
        k = 0
        for i, (ins, n) in enumerate(zip(q, counts[s])):
            rec.extend((ins.OP.name, *t[s][j]) for j in range(k, k + n))
            if ins_t is not None and n:
                _, ready, stored, done = ins_t[s][i][:4]
                wait = sum(t[s][j][3] - t[s][j][2] for j in range(k, k + n))
                work = sum(t[s][j + 1][2] - t[s][j][3] for j in range(k, k + n - 1))
                ph[ins.OP.name].append([(t[s][k][2] - ready) / 1e3, wait / 1e3, work / 1e3,
                                        (stored - t[s][k + n - 1][3]) / 1e3, (done - stored) / 1e3, n])
            k += n
    if not rec:
        return dict(ops={}, slot_wait_fraction=0.0, data_wait_fraction=0.0, issue_tbps={})
    t0 = min(r[1] for r in rec) if origin_ns is None else origin_ns
    span = max(r[4] for r in rec) - min(r[1] for r in rec)
    per_op: dict[str, dict[str, list[float]]] = defaultdict(lambda: dict(slot=[], data=[], latency=[]))
    for op, want, issued, c_want, c_has in rec:
        d = per_op[op]
        d["slot"].append((issued - want) / 1e3)
        d["data"].append((c_has - c_want) / 1e3)
        if c_has - c_want > 100:  # compute waited (> 0.1 us): c_has is when the bytes landed
            d["latency"].append((c_has - issued) / 1e3)
    ops = {op: dict(tiles=len(v["slot"]), mean_slot_wait_us=sum(v["slot"]) / len(v["slot"]),
                    mean_data_wait_us=sum(v["data"]) / len(v["data"]),
                    waited_fraction=len(v["latency"]) / len(v["slot"]),
                    latency_p50_us=_pct(v["latency"], 0.5), latency_p90_us=_pct(v["latency"], 0.9))
           for op, v in per_op.items()}
    total = len(program.queues) * span if span else 1
    issue: dict[str, list[float]] = defaultdict(list)
    if windows:
        issued = sorted((r[2] - t0) / 1e3 for r in rec)
        for w in windows:
            if w["layer"] == 0 and w["op"] != "LM_HEAD":
                continue  # layer 0 starts cold, as in critical_path
            a, b = w["first_ready_us"], w["last_done_us"]
            if b > a:
                n = bisect.bisect_right(issued, b) - bisect.bisect_left(issued, a)
                issue[w["op"]].append(n * tile_bytes / ((b - a) * 1e-6) / 1e12)
    phases = {}
    for op, v in ph.items():
        m = [sum(x[c] for x in v) / len(v) for c in range(5)]
        gaps = sum(x[5] - 1 for x in v)
        phases[op] = dict(staging_us=m[0], data_wait_us=m[1], work_us=m[2], epilogue_us=m[3], release_us=m[4],
                          tail_us=m[3] + m[4], work_per_tile_us=sum(x[2] for x in v) / gaps if gaps else float("nan"))
    return dict(ops=ops, slot_wait_fraction=sum(r[2] - r[1] for r in rec) / total,
                data_wait_fraction=sum(r[4] - r[3] for r in rec) / total,
                issue_tbps={op: sum(v) / len(v) for op, v in issue.items()}, phases=phases)


def issue_series(tiles: torch.Tensor, program: Program, tile_rows: int, tile_k: int, bin_us: float = 1.0,
                 origin_ns: int | None = None) -> tuple[list[float], list[float]]:
    """(bin start us, TB/s) of the weight bytes all loaders issued in each ``bin_us`` bin of the step, from the tile
    trace; time 0 is ``origin_ns`` (``summarize``'s, to share its stage windows' clock) or the first request."""
    t = tiles.cpu().tolist()
    counts = tile_counts(program, tile_rows, tile_k)
    issued = [t[s][j][1] for s in range(len(counts)) for j in range(sum(counts[s]))]
    if not issued:
        return [], []
    t0 = min(issued) if origin_ns is None else origin_ns
    n = int((max(issued) - t0) / 1e3 / bin_us) + 1
    hist = [0] * n
    for x in issued:
        hist[max(0, int((x - t0) / 1e3 / bin_us))] += 1
    per = tile_rows * tile_k * 2 / (bin_us * 1e-6) / 1e12
    return [k * bin_us for k in range(n)], [c * per for c in hist]


def format_tiles(s: dict) -> str:
    lines = [f"tiles: loaders waited for a free slot {100 * s['slot_wait_fraction']:.0f}% of the time, compute for "
             f"data {100 * s['data_wait_fraction']:.0f}%; latency: issue -> data of the tiles compute waited for; "
             "issued TB/s: bytes all loaders issued during the stage's window (layers 1..L-1)",
             f"{'op':14s} {'tiles':>7s} {'slot wait us':>13s} {'data wait us':>13s} {'waited':>7s} "
             f"{'lat p50 us':>11s} {'lat p90 us':>11s} {'issued TB/s':>12s}"]
    for k in dict.fromkeys([*s["issue_tbps"], *s["ops"]]):  # stages without weight tiles (attention) too
        rate = s["issue_tbps"].get(k)
        rate = "" if rate is None else f"{rate:12.2f}"
        if k in s["ops"]:
            v = s["ops"][k]
            lines.append(f"{k:14s} {v['tiles']:7d} {v['mean_slot_wait_us']:13.2f} {v['mean_data_wait_us']:13.2f} "
                         f"{100 * v['waited_fraction']:6.0f}% {v['latency_p50_us']:11.2f} {v['latency_p90_us']:11.2f} "
                         f"{rate}")
        else:
            lines.append(f"{k:14s} {0:7d} {'':13s} {'':13s} {'':7s} {'':11s} {'':11s} {rate}")
    if s.get("phases"):
        lines.append("busy time of one instruction (mean, us): staging, waiting for data, work on tiles, last "
                     "epilogue, release of the counter; work per tile")
        for k, v in s["phases"].items():
            lines.append(f"{k:14s} {v['staging_us']:7.2f} {v['data_wait_us']:7.2f} {v['work_us']:7.2f} "
                         f"{v['epilogue_us']:7.2f} {v['release_us']:7.2f}   {v['work_per_tile_us']:6.3f}")
    return "\n".join(lines)
