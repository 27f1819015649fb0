"""Small-shape megakernel run for compute-sanitizer (racecheck / synccheck / memcheck):

    compute-sanitizer --tool racecheck python3 -m mimw.megakernel.gpu.sanitize [--case NAME] [--hold-count]
Named cases (``cases``; ``--list``), two decode steps each, no CUDA graph: first the default kernel on a 2-layer
SmolLM2 on 72 SMs (DOWN_PROJ's cluster pairs beside ATTN_IN's), then its ATTN_IN pairs alone on 8 SMs (both
exchange modes); a tiny Qwen3 (16-row tiles, one ATTN_IN part) and the SmolLM2 with ATTN_IN in 2 column parts, each
with both matvec consumers (tensor cores and CUDA cores), the SmolLM2 twice more with every versioned-word flag
(the second time with the stagings probed, vprobe=16), and once with its heads finished by the attention splits
and its releases merged (qkv_in_attn, merge_signals), at context 300 once with its attention's later K/V blocks
through shared memory (kv_pipeline); the tiny Qwen3 with O_PROJ in column parts (o_parts 2 and 1: one group a
part, two in one; CUDA-core consumer, 128-column tiles so that a part's 128 columns are one tile); last the per-warp
releases. Exits non-zero if logits are wrong.

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


def cases(hold_count: bool = False) -> dict[str, tuple]:
    """The named cases, in order: name -> (spec, context, num_sms, kcfg). ``hold_count``: every kernel with the
    release hold's count (KernelConfig.hold_count) instead of its mbarrier."""
    tiny, small = get_preset("tiny-qwen3"), get_preset("smollm2-135m").with_(num_layers=2)

    def cfg(spec, **kw):
        return dataclasses.replace(KernelConfig.for_spec(spec), hold_count=hold_count, **kw)

    out = {}
    # first (racecheck runs out of time after a few cases): the default kernel on 72 SMs, where DOWN_PROJ's 36 row
    # blocks pair over cluster mates beside ATTN_IN's heads; then ATTN_IN's pairs alone, 8 SMs in 4 clusters of two,
    # with asynchronous stores counted on the mate's barrier and with remote stores and release arrivals
    out["cluster_down"] = (small, 40, 72, cfg(small))
    # then ATTN_PARTIAL's warps merged through the staging buffer (the default since session 22) on a 2-layer
    # Llama-1B shape with a small vocabulary: SmolLM2's buffer is too small for it (KernelConfig.smem_merge)
    one_b = get_preset("llama-3.2-1b").with_(num_layers=2, vocab_size=4096)
    out["attn_smem_merge"] = (one_b, 40, 72, cfg(one_b))
    for mode in (2, 1):
        out[f"cluster_qkv={mode}"] = (small, 40, 8, cfg(small, cluster_qkv=mode))
    # both matvec consumers (tensor cores, the default, first), and the versioned words on the tensor cores (all
    # four flags; then the stagings probed one word in 16); of these, those on SmolLM2 (two column tiles) without
    # versioned words or qkv_in_attn run the default's pairs, the rest tickets
    for spec, parts, mma, flag, probe, late in ((tiny, 0, 1, False, 1, False), (small, 2, 1, False, 1, False),
                                                (small, 2, 1, True, 1, False), (small, 2, 1, True, 16, False),
                                                (small, 2, 1, False, 1, True), (tiny, 0, 0, False, 1, False),
                                                (small, 2, 0, False, 1, False)):
        name = f"{spec.name}:mma={mma},versioned={flag},vprobe={probe},qkv_in_attn={late}"
        out[name] = (spec, 40, 8, cfg(spec, qkv_parts=parts, mma=mma, flag_act=flag, flag_x=flag, flag_attn=flag,
                                      flag_q=flag, vprobe=probe, qkv_in_attn=late, merge_signals=late))
    # the K/V pipeline's shared-memory stages: a context long enough for three blocks a split
    out["kv_pipeline"] = (small, 300, 8, cfg(small, qkv_parts=2, kv_pipeline=True, ring=0))
    for parts in (2, 1):  # O_PROJ blocks that combine the splits themselves; the MLP_IN / DOWN_PROJ sums of parts
        out[f"o_parts={parts}"] = (tiny, 40, 8, cfg(tiny, tile_k=128, mma=0, o_parts=parts))
    # the staging buffer sized for a whole DOWN_PROJ beside the halves (the default before session 22)
    out["whole_hbuf"] = (small, 40, 72, cfg(small, half_hbuf=False))
    # last (opt-in, measured slower): the per-warp releases, inline-asm empty barriers past Triton's shared memory
    out["warp_release"] = (small, 40, 72, cfg(small, warp_release=True))
    return out


def main() -> int:
    """``--control``: the control kernel alone; ``--list``: the case names; ``--case NAME``: that case alone (a
    synccheck error aborts the launch and leaves the process's CUDA context unusable: scripts/gpu_check.sh runs
    each case in its own process); ``--hold-count``: every case with KernelConfig.hold_count."""
    argv = sys.argv[1:]
    todo = cases("--hold-count" in argv)
    if "--list" in argv:
        print("\n".join(todo))
        return 0
    if "--case" in argv:  # checked before anything touches the GPU
        name = argv[argv.index("--case") + 1] if argv.index("--case") + 1 < len(argv) else ""
        if name not in todo:
            print(f"no case {name!r}; --list names them", file=sys.stderr)
            return 2
        todo = {name: todo[name]}
    ok = run_control()
    print(f"ws_control: {'ok' if ok else 'WRONG'}", flush=True)
    if "--control" in argv:
        return 0 if ok else 1
    for name, (spec, context, num_sms, kcfg) in todo.items():
        r = check_decode(spec, context, steps=2, graph=False, num_sms=num_sms, kcfg=kcfg)
        print(name, r, flush=True)
        ok &= r.ok()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
