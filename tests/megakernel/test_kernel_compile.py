"""CI (CPU only): the megakernel each plan launches compiles for sm_90a, its PTX streams weights with TMA bulk tensor
copies completing on mbarriers, ptxas reports no register spills, and it fits one CTA's shared memory."""
import functools

import pytest

from mimw.kv.pages import parse_kv_dtype
from mimw.megakernel.launch.compile import compile_sm90a, partition_barrier_errors, ptxas_report
from mimw.megakernel.plan import SHARED_BYTES, Tuning, plan
from mimw.models.spec import get_preset

pytestmark = pytest.mark.slow


@functools.lru_cache(maxsize=None)
def _build(model: str, tuning: Tuning = Tuning(), kv: str = "bf16"):
    """(plan on 132 SMs, compiled kernel, ptxas report) of the kernel a decoder on an H100 or H200 launches over a
    ``kv`` ("bf16" or "fp8") cache."""
    p = plan(get_preset(model), 132, tuning=tuning, kv_dtype=parse_kv_dtype(kv))
    k = compile_sm90a(p)
    return p, k, ptxas_report(k.asm["ptx"])


def _assert_sound(p, k, rep):
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    # Triton's shared memory (the ring as deep as the plan sized it, the staging buffer, the compiler's scratch)
    # and the cluster exchange region the launch adds past it fit in one sm_90 CTA
    assert k.metadata.shared + p.exchange_bytes <= SHARED_BYTES, (k.metadata.shared, p.exchange_bytes)
    ptx = k.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA weight tiles
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive" in ptx  # the ring's ready/empty barriers
    assert "ld.global.gpu.acquire" in ptx and "atom.global.gpu.release.add" in ptx  # dependency counters
    assert "mma.sync.aligned.m16n8k16" in ptx and "ldmatrix" in ptx  # the tiles on the tensor cores
    assert ("st.async.shared::cluster" in ptx) == (p.exchange_bytes > 0)  # the cluster pairs' exchange
    # the loader's K/V stream (device/kv_stream.py): a slot's K and V boxes, one TMA each, beside the weight tile's;
    # over an fp8 cache the scales by cp.async, arriving on the slot's barrier
    c = p.constants
    assert ptx.count("cp.async.bulk.tensor.2d") == 1 + 2 * c.KVS // c.KVBOX
    assert ("cp.async.mbarrier.arrive.shared.b64" in ptx) == c.FP8
    assert not partition_barrier_errors(ptx, p.constants.NW)  # no CTA-wide barrier 0 (the loader never arrives)
    assert 0 < rep["worker_registers"] <= p.tuning.loader_regs, rep["worker_registers"]  # the loader's budget
    # an MoE kernel's routing wait is a plain poll (device/route_wait.py): nothing asks L2 for tiles ahead of the ring
    assert "cp.async.bulk.prefetch.L2" not in ptx


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b", "tiny-qwen3"])
def test_every_shipping_kernel_compiles_spill_free_and_fits_shared_memory(model):
    p, k, rep = _build(model)
    _assert_sound(p, k, rep)
    assert "%globaltimer" not in k.asm["ptx"]  # untraced


def test_the_1b_and_8b_kernels_are_the_planned_ones():
    p1, _, _ = _build("llama-3.2-1b")
    p8, _, _ = _build("llama-3.1-8b")
    # the 1B pairs its DOWN_PROJ (64 row blocks on 132 SMs), stages halves, and so takes a 13-slot ring; the 8B's
    # 128 row blocks stay whole and its 32 KB staging buffer leaves 11 slots
    assert (p1.constants.DOWN_PAIRS, p1.ring, p1.hbuf_rows, p1.constants.SMEM_MERGE) == (True, 13, 16, True)
    assert (p8.constants.DOWN_PAIRS, p8.ring, p8.hbuf_rows, p8.constants.SMEM_MERGE) == (False, 11, 64, True)
    assert p1.exchange_bytes and p8.exchange_bytes and p1.cluster_size == p8.cluster_size == 2


def test_the_tickets_and_the_traced_build_compile_spill_free():
    p, k, rep = _build("llama-3.2-1b", Tuning(clusters=False))
    _assert_sound(p, k, rep)
    assert not p.exchange_bytes and not p.constants.DOWN_PAIRS and p.program.qkv_parts > 1
    p, k, rep = _build("smollm2-135m", Tuning(trace=True))
    _assert_sound(p, k, rep)
    assert "%globaltimer" in k.asm["ptx"]


def test_the_kernel_compiles_with_its_int_arguments_specialized_to_one():
    """The launch compiles an int argument equal to 1 as a constant (one attention split at context 1, a one-page
    cache, a one-instruction queue): the kernel's state structs take either."""
    p = plan(get_preset("smollm2-135m"), 132)
    k = compile_sm90a(p, ones=True)
    assert ptxas_report(k.asm["ptx"])["spill_stores"] == 0


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b", "tiny-qwen3"])
def test_the_fp8_kv_kernels_compile_spill_free_and_fit_shared_memory(model):
    """The kernel over an fp8 cache: e4m3 K/V loads widened in registers (cvt from e4m3x2), the finisher's rows
    quantised with round-to-nearest divisions and a saturating round-to-nearest-even e4m3 conversion (what torch's
    quantiser computes); the same ring as the bf16 kernel."""
    p, k, rep = _build(model, kv="fp8")
    _assert_sound(p, k, rep)
    ptx = k.asm["ptx"]
    assert p.constants.FP8 and "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "div.rn.f32" in ptx
    # the ring as bf16's but for the K/V scales beside each slot: one slot fewer where they do not fit in what the
    # slots leave (the 1B: 12 x 512 bytes against 2 KB)
    assert p.ring == _build(model)[0].ring - (model in ("llama-3.2-1b", "tiny-qwen3"))


def test_the_fp8_kernel_compiles_with_its_int_arguments_specialized_to_one():
    p = plan(get_preset("smollm2-135m"), 132, kv_dtype=parse_kv_dtype("fp8"))
    assert ptxas_report(compile_sm90a(p, ones=True).asm["ptx"])["spill_stores"] == 0


@pytest.mark.parametrize("model,kv", [("smollm2-135m", "bf16"), ("smollm2-135m", "fp8"), ("tiny-qwen3-moe", "bf16")])
def test_every_mbarrier_the_kernel_initialises_is_one_it_uses(model, kv):
    """The ring's empty/ready pairs, the release hold, the cluster pairs' two exchange barriers (XB) and, in an MoE
    kernel only, the loader's epoch barrier: nothing else. A barrier initialised and then dead has its bytes reused
    by Triton's allocator for live data (a dense kernel's epoch barrier sat on smollm2's staging buffer, overwritten
    by its stores without mbarrier.inval)."""
    p, k, _ = _build(model, kv=kv)
    c = p.constants
    expect = 2 * c.NB + 1 + (2 if c.XB else 0) + (1 if c.S > 0 else 0)
    assert k.asm["ptx"].count("mbarrier.init") == expect, (k.asm["ptx"].count("mbarrier.init"), expect)


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "qwen3-30b-a3b"])
def test_the_moe_kernels_compile_spill_free_and_fit_shared_memory(model):
    """One token a step through ROUTER, EXPERT_IN and EXPERT_DOWN: the loader's poll of the routing table
    (volatile loads) and the router finisher's tag, beside everything the dense kernels check. The 30B-A3B's
    eight query heads per KV head take the attention's head-split layout, a 16-position block, 16 splits at most
    and the staging buffer widened for the warps' merge (plan.py)."""
    p, k, rep = _build(model)
    _assert_sound(p, k, rep)
    assert "ld.volatile.global" in k.asm["ptx"]  # the loader's routing poll
    if model == "qwen3-30b-a3b":
        c = p.constants
        assert (c.GP, c.BT, c.SMEM_MERGE, c.S, c.K, c.E) == (8, 16, True, 8, 8, 128)
        assert p.program.max_splits <= 16


@functools.lru_cache(maxsize=None)
def _build_batch(model: str, batch: int, trace: bool):
    """(plan on 132 SMs, compiled kernel, ptxas report) of ``model``'s decode step of ``batch`` tokens at context
    1024, traced or not."""
    from mimw.megakernel.program import StepShape

    p = plan(get_preset(model), 132, StepShape((1,) * batch, 1024), tuning=Tuning(trace=trace))
    k = compile_sm90a(p)
    return p, k, ptxas_report(k.asm["ptx"])


@pytest.mark.parametrize("model,batch", [("tiny-qwen3-moe", 1), ("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 8)])
@pytest.mark.parametrize("trace", [False, True], ids=["untraced", "traced"])
def test_the_routing_wait_polls_and_traces_within_the_loaders_registers(model, batch, trace):
    """The loader's routing wait (device/route_wait.py), traced and not: spill-free, the loader's code within its
    register budget, the same shared memory either way (the trace fills no slot); a volatile poll of the routing
    entry and no L2 prefetch; traced, the loader also reads the globaltimer."""
    p, k, rep = _build_batch(model, batch, trace)
    ptx = k.asm["ptx"]
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert 0 < rep["worker_registers"] <= p.tuning.loader_regs, rep["worker_registers"]
    assert "ld.volatile.global" in ptx and "cp.async.bulk.prefetch.L2" not in ptx
    assert ("%globaltimer" in ptx) == trace
    assert k.metadata.shared == _build_batch(model, batch, False)[1].metadata.shared <= SHARED_BYTES


def test_the_moe_decode_batch_kernel_compiles_spill_free():
    """Eight tokens of the 30B-A3B a step (64 routing slots; MB = 8, a chunk pair wgmma's N = 16): the router
    finisher routes eight tokens at once and scans the union of their experts into slots."""
    from mimw.megakernel.program import StepShape

    p = plan(get_preset("qwen3-30b-a3b"), 132, StepShape((1,) * 8, 1024))
    k = compile_sm90a(p)
    rep = ptxas_report(k.asm["ptx"])
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert k.metadata.shared + p.exchange_bytes <= SHARED_BYTES, (k.metadata.shared, p.exchange_bytes)
    assert "wgmma.mma_async" in k.asm["ptx"] and "ld.volatile.global" in k.asm["ptx"]
    assert (p.constants.M, p.constants.S) == (8, 64)


@pytest.mark.parametrize("blocks", [(), (1, 1, 1, 1, 1, 3)], ids=["batch8", "5-padded-by-3"])
def test_the_tiny_moe_decode_batch_kernel_compiles_spill_free(blocks):
    """tiny-qwen3-moe-mt's decode batch of 8, and of 5 tokens beside a query block of 3 (the query-block path): a hidden
    size of one column tile (64), 16 routing slots, experts of three column tiles."""
    from mimw.megakernel.program import StepShape

    p = plan(get_preset("tiny-qwen3-moe-mt"), 132, StepShape((1,) * 8, 1024, blocks))
    k = compile_sm90a(p)
    rep = ptxas_report(k.asm["ptx"])
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert k.metadata.shared <= SHARED_BYTES and p.exchange_bytes == 0, k.metadata.shared
    assert "wgmma.mma_async" in k.asm["ptx"] and "ld.volatile.global" in k.asm["ptx"]
    assert (p.constants.M, p.constants.S, p.constants.KT_D, p.constants.KT_F) == (8, 16, 1, 3)


MMA_F16 = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
MMA_BF16 = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b", "tiny-qwen3"])
def test_the_one_token_ring_walk_runs_on_mma_sync_where_a_slot_holds_16_positions_a_warp(model):
    """The one-token ring walk on mma.sync (ops/attn_ring_mma.py) in every kernel whose slot holds 16 positions a
    warp: per slot instantiation (whole, masked) PW / 16 x HD / 16 products for S^T and HD / 16 x PW / 16 for O^T,
    f16 over an fp8 cache (the matvec's are bf16), bf16 over a bf16 one (counted past the fp8 kernel's bf16
    products: the same matvec code). A head_dim-128 bf16 slot (32 positions, 8 a warp) walks on the CUDA cores: no
    mma.sync past the matvec's. Both kernels compile spill-free (``_assert_sound``)."""
    bf, f8 = _build(model), _build(model, kv="fp8")
    for p, k, rep in (bf, f8):
        _assert_sound(p, k, rep)

    def steps(c):
        return 2 * 2 * (c.KVS // c.NW // 16) * (c.HD // 16) if c.ATTN_MMA else 0

    c8, cb = f8[0].constants, bf[0].constants
    ptx8, ptxb = f8[1].asm["ptx"], bf[1].asm["ptx"]
    matvec = ptx8.count(MMA_BF16)
    assert c8.ATTN_MMA and ptx8.count(MMA_F16) == steps(c8) > 0
    assert ptx8.count("mma.sync.aligned") == matvec + steps(c8)
    assert cb.ATTN_MMA == (cb.HD < 128) == (cb.KVS // cb.NW >= 16)
    assert ptxb.count(MMA_F16) == 0 and ptxb.count("mma.sync.aligned") == ptxb.count(MMA_BF16) == matvec + steps(cb)
