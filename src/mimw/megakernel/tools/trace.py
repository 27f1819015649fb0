"""Reading a per-instruction trace of one megakernel step (``Tuning(trace=True)``).

The kernel records, for every instruction, four %globaltimer stamps (ns): when the compute role reached it, when
its dependency counter was met, when its outputs were stored (before the release), and when it signalled.
``summarize`` turns them into what the performance notes need: per opcode the time spent waiting vs working, per
stage (opcode, layer) the window from the first instruction becoming ready to the last one finishing, and the
critical path per layer: for each stage, the time from the previous stage's last instruction finishing to its own
last one finishing, averaged over the layers after the first (layer 0 starts cold) — the step's dependency chain,
measured, stage by stage. ``tile_counts`` gives the weight tiles each instruction streams (its isa.TileSpan), the
host's mirror of the ring's tile counter.

An MoE model's loaders also record their routing waits (device/route_wait.py): per SM and layer, at the layer's first
expert span, [the globaltimer once the routing entry was tagged, the ns since the first poll] (zeros where an SM
streams no expert of that layer). ``routing_waits`` turns them into each MoE layer's mean and longest wait over the
SMs that waited: the cost of the one wait the loader makes on step data (issue 31).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from .. import isa
from ..program import Program

LAYER_STAGES = ("ATTN_IN", "ATTN_PARTIAL", "O_PROJ", "MLP_IN", "DOWN_PROJ")  # a dense layer's, in order
MOE_STAGES = ("ATTN_IN", "ATTN_PARTIAL", "O_PROJ", "ROUTER", "EXPERT_IN", "EXPERT_DOWN")  # an MoE layer's


def summarize(trace: torch.Tensor, words: torch.Tensor, lengths: torch.Tensor,
              waits: torch.Tensor | None = None) -> dict:
    """trace [num_sms, max_len, 4] int64 ns (start, dependency met, outputs stored, signalled); words/lengths: the
    encoded program; ``waits`` [num_sms, num_layers, 2] the loaders' routing waits (an MoE model's; else None or a
    dummy). Times in microseconds; per opcode the wait, the busy time and, within it, the release (outputs stored ->
    signalled: the barrier and the counter's release, which waits until the stores are visible)."""
    t, w, n = trace.cpu(), words.cpu(), lengths.cpu()
    valid = [(s, i) for s in range(t.shape[0]) for i in range(int(n[s]))]
    t0 = min(int(t[s, i, 0]) for s, i in valid)
    per_op: dict[str, dict] = defaultdict(lambda: dict(count=0, wait_us=0.0, busy_us=0.0, release_us=0.0))
    stages: dict[tuple[int, int], list[float]] = {}
    for s, i in valid:
        op, layer = isa.Op(int(w[s, i, isa.Word.OP])), int(w[s, i, isa.Word.LAYER])
        start, ready, stored, done = (int(x) - t0 for x in t[s, i, :4])
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
    if waits is not None and waits.dim() == 3:
        out["routing_waits"] = routing_waits(waits, t0)
    return out


def routing_waits(waits: torch.Tensor, origin_ns: int = 0) -> dict:
    """waits [num_sms, num_layers, 2] int64 (tagged ns, ns waited; both zero where an SM waited on no routing entry
    of the layer). Per layer with a wait, over the SMs that waited: ``sms``, ``mean_us`` and ``max_us`` of the wait,
    ``tagged_us`` when the last of them saw the entry (from ``origin_ns``, the compute trace's first stamp); and
    over those layers ``mean_us`` (of the layers' means) and ``max_us``."""
    w = waits.cpu()
    layers = {}
    for layer in range(w.shape[1]):
        seen = w[:, layer, 0] != 0
        if not bool(seen.any()):
            continue
        us = w[seen, layer, 1].double() / 1e3
        layers[layer] = dict(sms=int(seen.sum()), mean_us=float(us.mean()), max_us=float(us.max()),
                             tagged_us=(int(w[seen, layer, 0].max()) - origin_ns) / 1e3)
    if not layers:
        return dict(layers={}, mean_us=0.0, max_us=0.0)
    return dict(layers=layers, mean_us=sum(v["mean_us"] for v in layers.values()) / len(layers),
                max_us=max(v["max_us"] for v in layers.values()))


def critical_path(windows: list[dict]) -> dict[str, float]:
    """Mean over layers 1..L-1 of each stage's share of the layer: its last finish minus the previous stage's last
    finish (for ATTN_IN, the previous layer's last stage: DOWN_PROJ, or an MoE layer's EXPERT_DOWN). A stage's mean
    is over the layers that have it (an MoE model's dense layers have MLP_IN, its MoE layers ROUTER and the expert
    stages). Keys: the stages, and "layer" (the mean of each layer's sum)."""
    done = {(w["op"], w["layer"]): w["last_done_us"] for w in windows}
    layers = sorted({w["layer"] for w in windows if w["op"] == "ATTN_IN"})
    shares: dict[str, list[float]] = {op: [] for op in dict.fromkeys(LAYER_STAGES + MOE_STAGES)}
    totals = []
    for layer in layers[1:]:
        before = [done[(op, layer - 1)] for op in LAYER_STAGES[3:] + MOE_STAGES[3:] if (op, layer - 1) in done]
        if not before:
            continue
        prev = start = max(before)
        for op in shares:
            if (op, layer) in done:
                shares[op].append(done[(op, layer)] - prev)
                prev = done[(op, layer)]
        totals.append(prev - start)
    out = {op: sum(v) / len(v) for op, v in shares.items() if v}
    if out:
        out["layer"] = sum(totals) / len(totals)
    return out


def format_summary(s: dict, layers: int = 2) -> str:
    lines = [f"step {s['step_us']:.1f} us", f"{'op':14s} {'count':>6s} {'mean wait us':>13s} {'mean busy us':>13s} "
             f"{'of it release':>14s}"]
    for k, v in s["ops"].items():
        lines.append(f"{k:14s} {v['count']:6d} {v['mean_wait_us']:13.2f} {v['mean_busy_us']:13.2f} "
                     f"{v['mean_release_us']:14.2f}")
    if s.get("critical_path_us"):
        lines.append("critical path per layer (mean over layers 1..L-1, us): " + ", ".join(
            f"{k} {v:.1f}" for k, v in s["critical_path_us"].items()))
    rw = s.get("routing_waits")
    if rw and rw["layers"]:
        lines.append(f"loader routing wait (us, over the SMs that waited): mean {rw['mean_us']:.2f}, longest "
                     f"{rw['max_us']:.2f}; per layer mean/max: " + ", ".join(
                         f"L{k} {v['mean_us']:.1f}/{v['max_us']:.1f}" for k, v in rw["layers"].items()))
    lines.append("stage windows (first ready -> last done), first layers:")
    for st in s["stages"]:
        if st["layer"] < layers or st["op"] == "LM_HEAD":
            lines.append(f"  L{st['layer']:<3d} {st['op']:14s} {st['first_ready_us']:9.1f} -> {st['last_done_us']:9.1f}")
    return "\n".join(lines)


def tile_counts(program: Program) -> list[list[int]]:
    """Weight tiles each instruction streams, per SM queue, in the loader's order (its isa.TileSpan)."""
    return [[ins.tiles.n_tiles for ins in q] for q in program.queues]
