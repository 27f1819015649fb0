"""Small-shape megakernel run for compute-sanitizer (racecheck / synccheck / memcheck):

    compute-sanitizer --tool synccheck python3 -m mimw.megakernel.tools.sanitize [--case NAME] [--list]
Named cases (``cases``), two decode steps each, no CUDA graph: the default kernel on a 2-layer SmolLM2 on 72 SMs
(DOWN_PROJ's cluster pairs beside ATTN_IN's), a 2-layer Llama-1B shape on 72 SMs (its staging buffer holds the
attention warps' states: the shared-memory merge), ATTN_IN's pairs alone on 8 SMs, the tickets (no clusters) with
two column parts a head, a tiny Qwen3 (16-row tiles, one part a head, q/k norms), a decode batch of three
sequences on the 2-layer SmolLM2 (swap-AB wgmma, device/matvec_mt.py), a verify block, a decode batch of eight
1B-shaped sequences whose one split each walks five K/V blocks through the cp.async stages, a 1B-shaped verify block
of sixteen as one query block (mma.sync, its K/V and partials through the cp.async stages), the loader's K/V
stream of a one-token step (2-layer 1B shape on 16 SMs at context 1000: two splits a KV head of eight slots each,
the second starting inside a box; over a bf16 and an fp8 cache, whose scales arrive by cp.async on the slots'
barriers), and the MoE layers: the tiny Qwen3-MoE and two 30B-A3B-shaped layers with 32 experts (router tickets,
the loader's wait on the routing table, the experts' tickets; two 16-position blocks a K/V slot), one token and a
decode batch of three. Exits non-zero if logits (or an MoE step's routing)
are wrong.

First it runs ``ws_control``: the smallest ``gl.warp_specialize`` kernel with the megakernel's synchronisation
shape (each partition stores its own slice of a vector; the default partition uses partition-local barriers and
waits on an mbarrier the worker arrives on; no global atomics, no TMA). Whatever racecheck reports for it comes
from the code triton generates around the partitions (the per-warp partition state in shared memory and the named
barrier that hands it over), not from the megakernel; its hazards are the baseline the megakernel's are compared
with. ``--control`` runs the control alone.
"""
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ...kv import fp8
from ...models.spec import get_preset
from ..plan import Tuning
from .check import check_decode, check_segments


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


def cases() -> dict[str, tuple]:
    """The named cases, in order: name -> (spec, context, num_sms, tuning, the step's segment lengths: (1,) one
    token, more a multi-token step, the KV cache's element type)."""
    tiny, small = get_preset("tiny-qwen3"), get_preset("smollm2-135m").with_(num_layers=2)
    one_b = get_preset("llama-3.2-1b").with_(num_layers=2, vocab_size=4096)
    moe = get_preset("tiny-qwen3-moe")
    a3b = get_preset("qwen3-30b-a3b").with_(num_layers=2, vocab_size=4096, num_experts=32)
    bf16 = torch.bfloat16
    named = {
        "cluster_down": (small, 40, 72, Tuning(), (1,)),  # DOWN_PROJ's 36 row blocks pair over cluster mates
        "attn_smem_merge": (one_b, 40, 72, Tuning(), (1,)),  # SmolLM2's staging buffer is too small for the merge
        "cluster_qkv": (small, 40, 8, Tuning(), (1,)),  # ATTN_IN's pairs alone, 4 clusters of two
        "tickets": (small, 40, 8, Tuning(clusters=False, qkv_parts=2), (1,)),
        "tiny_qwen3": (tiny, 40, 8, Tuning(), (1,)),
        "decode_batch": (small, 40, 8, Tuning(), (1, 1, 1)),  # three sequences a launch: the multi-token code
        "verify_block": (small, 40, 8, Tuning(), (3, 1)),  # a verify block of three beside a decode token
        # eight sequences of 1B-shaped layers at context 300 on 16 SMs: each sequence's one split a KV head walks
        # five 64-position ring slots that the loader streamed from the sequence's own block table and context
        "kv_ring_batch": (one_b, 300, 16, Tuning(), (1,) * 8),
        # a verify block of seventeen at context 300 on 16 SMs: a query block of sixteen, then one token whose ring
        # past ends at the block's first position and whose block rows (this step's) are read after the wait
        "kv_ring_tail": (one_b, 300, 16, Tuning(), (17,)),
        # a verify block of sixteen as one query block (ops/attn_query_block.py) on 32 SMs at context 1000: four
        # splits a KV head, each over eight 32-position K/V blocks through the cp.async stages (the last one's also
        # the block's own rows, read after the wait), q staged beside them, the combine's partials through the stages
        "query_block": (one_b, 1000, 32, Tuning(), (16,)),
        # one token at context 1000 on 16 SMs: a KV head's two splits stream ~500 past positions each through the
        # ring (eight 64-position slots; the second split's first slot starts at position 496, inside a box)
        "kv_ring": (one_b, 1000, 16, Tuning(), (1,)),
        "moe": (moe, 40, 8, Tuning(), (1,)),  # ROUTER, EXPERT_IN, EXPERT_DOWN; the loader's routing poll
        "moe_a3b": (a3b, 40, 16, Tuning(), (1,)),  # the 30B-A3B's layer (eight heads a KV group), 32 experts
        "moe_batch": (a3b, 40, 16, Tuning(), (1, 1, 1)),  # three tokens: 24 slots, the union of their experts
    }
    out = {name: case + (bf16,) for name, case in named.items()}
    # the same over an fp8 cache: four 128-position slots a split, their scales copied by the loader's lanes
    out["kv_ring_fp8"] = (one_b, 1000, 16, Tuning(), (1,), fp8.FP8)
    return out


def main() -> int:
    """``--control``: the control kernel alone; ``--list``: the case names; ``--case NAME``: that case alone (a
    synccheck error aborts the launch and leaves the process's CUDA context unusable: scripts/gpu_check.sh runs
    each case in its own process where one errs)."""
    argv = sys.argv[1:]
    todo = cases()
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
    for name, (spec, context, num_sms, tuning, lens, kv_dtype) in todo.items():
        if sum(lens) > 1:
            r = check_segments(spec, lens, context, steps=2, graph=False, num_sms=num_sms, tuning=tuning,
                               kv_dtype=kv_dtype)
        else:
            r = check_decode(spec, context, steps=2, graph=False, num_sms=num_sms, tuning=tuning, kv_dtype=kv_dtype)
        print(name, r, flush=True)
        ok &= r.ok()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
