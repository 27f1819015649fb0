"""Small-shape megakernel run for compute-sanitizer (racecheck / synccheck / memcheck):

    compute-sanitizer --tool racecheck python3 -m mimw.megakernel.gpu.sanitize
Two small shapes on 8 SMs, two decode steps each, no CUDA graph: a tiny Qwen3 (16-row tiles, one ATTN_IN part) and
a 2-layer SmolLM2 with ATTN_IN in 2 column parts (the ticket and finisher path), each with both matvec consumers
(first, on 72 SMs, SmolLM2 with the per-warp releases and DOWN_PROJ's cluster pairs; then its ATTN_IN pairs alone)
(tensor cores and CUDA cores), the SmolLM2 twice more with every versioned-word flag (the second time with the
stagings probed, vprobe=16), and once with its heads finished by the attention splits and its releases merged
(qkv_in_attn, merge_signals), at context 300 once with its attention's later K/V blocks through shared memory
(kv_pipeline); and the tiny Qwen3 with
O_PROJ in column parts (o_parts 2 and 1: one group a part, two in one; CUDA-core consumer, 128-column tiles so that
a part's 128 columns are one tile). Exits non-zero if logits are wrong.

First it runs ``ws_control``: the smallest ``gl.warp_specialize`` kernel with the megakernel's synchronisation
shape (each partition stores its own slice of a vector; the default partition uses partition-local barriers and
waits on an mbarrier the worker arrives on; no global atomics, no TMA). Whatever racecheck reports for it comes
from the code triton generates around the partitions (the per-warp partition state in shared memory and the named
barrier that hands it over), not from the megakernel; its hazards are the baseline the megakernel's are compared
with. ``python -m mimw.megakernel.gpu.sanitize --control`` runs the control alone.
"""
import dataclasses
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ...models.spec import get_preset
from .check import check_decode
from .config import KernelConfig


@gluon.jit
def _control_default(out_ptr, bar, num_warps: gl.constexpr):
    offs = gl.arange(0, 32 * num_warps, gl.BlockedLayout([1], [32], [num_warps], [0]))
    gl.store(out_ptr + offs, offs)
    gl.thread_barrier()
    mbarrier.wait(bar.index(0), 0)  # the worker's arrival
    gl.thread_barrier()


@gluon.jit
def _control_worker(out_ptr, bar, N0: gl.constexpr):
    offs = gl.arange(0, 32, gl.BlockedLayout([1], [32], [1], [0]))
    gl.store(out_ptr + N0 + offs, N0 + offs)
    mbarrier.arrive(bar.index(0), count=1)


@gluon.jit
def ws_control(out_ptr, num_warps: gl.constexpr):
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    gl.warp_specialize([
        (_control_default, (out_ptr, bar, num_warps)),
        (_control_worker, (out_ptr, bar, 32 * num_warps)),
    ], [1], [24])


def run_control(num_warps: int = 4) -> bool:
    """Launch ``ws_control`` once on poisoned output; True when both partitions stored their slices."""
    n = 32 * (num_warps + 1)
    out = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    ws_control[(1,)](out, num_warps=num_warps)
    return bool(torch.equal(out.cpu(), torch.arange(n, dtype=torch.int32)))


def main() -> int:
    ok = run_control()
    print(f"ws_control: {'ok' if ok else 'WRONG'}", flush=True)
    if "--control" in sys.argv[1:]:
        return 0 if ok else 1
    tiny, small = get_preset("tiny-qwen3"), get_preset("smollm2-135m").with_(num_layers=2)
    # first (racecheck runs out of time after a few cases): ATTN_IN's cluster pairs, their shared-memory exchange
    # through the mate's slots and barriers (gpu/cluster.py), 8 SMs in 4 clusters of two; of the later cases, those
    # on SmolLM2 (two column tiles) without versioned words or qkv_in_attn run the default's pairs, the rest tickets
    # the default kernel with DOWN_PROJ's cluster pairs (they pair where its 36 row blocks are at most half the SMs:
    # 72 here)
    r = check_decode(small, 40, steps=2, graph=False, num_sms=72, kcfg=KernelConfig.for_spec(small))
    print("cluster_down", r, flush=True)
    ok &= r.ok()
    for mode in (2, 1):  # asynchronous stores counted on the mate's barrier; remote stores and release arrivals
        r = check_decode(small, 40, steps=2, graph=False, num_sms=8,
                         kcfg=dataclasses.replace(KernelConfig.for_spec(small), cluster_qkv=mode))
        print(f"cluster_qkv={mode}", r, flush=True)
        ok &= r.ok()
    # both matvec consumers (tensor cores, the default, first), and the versioned words on the tensor cores (all
    # four flags; then the stagings probed one word in 16)
    for spec, parts, mma, flag, probe, late in ((tiny, 0, 1, False, 1, False), (small, 2, 1, False, 1, False),
                                                (small, 2, 1, True, 1, False), (small, 2, 1, True, 16, False),
                                                (small, 2, 1, False, 1, True), (tiny, 0, 0, False, 1, False),
                                                (small, 2, 0, False, 1, False)):
        kcfg = dataclasses.replace(KernelConfig.for_spec(spec), qkv_parts=parts, mma=mma, flag_act=flag,
                                   flag_x=flag, flag_attn=flag, flag_q=flag, vprobe=probe, qkv_in_attn=late,
                                   merge_signals=late)
        r = check_decode(spec, 40, steps=2, graph=False, num_sms=8, kcfg=kcfg)
        print(f"mma={mma} versioned={flag} vprobe={probe} qkv_in_attn={late} merge_signals={late}", r, flush=True)
        ok &= r.ok()
    # the K/V pipeline's shared-memory stages: a context long enough for three blocks a split
    kcfg = dataclasses.replace(KernelConfig.for_spec(small), qkv_parts=2, kv_pipeline=True, ring=0)
    r = check_decode(small, 300, steps=2, graph=False, num_sms=8, kcfg=kcfg)
    print("kv_pipeline", r, flush=True)
    ok &= r.ok()
    for parts in (2, 1):  # O_PROJ blocks that combine the splits themselves; the MLP_IN / DOWN_PROJ sums of parts
        kcfg = dataclasses.replace(KernelConfig.for_spec(tiny), tile_k=128, mma=0, o_parts=parts)
        r = check_decode(tiny, 40, steps=2, graph=False, num_sms=8, kcfg=kcfg)
        print(f"o_parts={parts}", r, flush=True)
        ok &= r.ok()
    # last (opt-in, measured slower): the per-warp releases, inline-asm empty barriers past Triton's shared memory;
    # synccheck reported "Missing wait" on them at c53aa92 (bench/NOTES.md session 19 §2)
    r = check_decode(small, 40, steps=2, graph=False, num_sms=72,
                     kcfg=dataclasses.replace(KernelConfig.for_spec(small), warp_release=True))
    print("warp_release", r, flush=True)
    ok &= r.ok()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
