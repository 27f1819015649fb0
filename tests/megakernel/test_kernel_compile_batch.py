"""CI (CPU only): the multi-token megakernel (plan.plan with M = 2..32 tokens: swap-AB wgmma, device/matvec_mt.py)
compiles for sm_90a without spills and fits shared memory, for every bucket a shipping preset pads its steps to and
over a bf16 and an fp8 KV cache, and with attention's query blocks (verify blocks over either cache:
ops/attn_query_block.py); the one-token kernel keeps none of its code."""
import functools

import pytest

from mimw.kv.pages import parse_kv_dtype
from mimw.megakernel.launch.compile import compile_sm90a, partition_barrier_errors, ptxas_report
from mimw.megakernel.launch.one_token import bucket_of
from mimw.megakernel.plan import SHARED_BYTES, plan
from mimw.megakernel.program import StepShape
from mimw.models.spec import get_preset

pytestmark = pytest.mark.slow


@functools.lru_cache(maxsize=None)
def _build(model: str, batch: int, blocks: tuple[int, ...] = (), kv: str = "bf16"):
    p = plan(get_preset(model), 132, StepShape((1,) * batch, 1024, blocks), kv_dtype=parse_kv_dtype(kv))
    k = compile_sm90a(p)
    return p, k, ptxas_report(k.asm["ptx"])


def _assert_pair_wgmma(ptx: str, mb: int):
    """The matvecs' wgmmas take a chunk pair of the MB staged tokens as B (N = 2 MB: device/matvec_mt.dot_tile),
    none a single chunk (N = MB)."""
    assert f"wgmma.mma_async.sync.aligned.m64n{2 * mb}k16.f32.bf16.bf16" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{mb}k16." not in ptx


@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b"])
def test_the_decode_batch_kernel_compiles_spill_free_on_wgmma(model):
    p, k, rep = _build(model, 8)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert k.metadata.shared <= SHARED_BYTES and p.exchange_bytes == 0, k.metadata.shared
    ptx = k.asm["ptx"]
    # every matvec on wgmma (swap-AB: m64 n16 k16, a chunk pair of the tokens as B), none on mma.sync; no cluster
    # exchange
    _assert_pair_wgmma(ptx, p.constants.MB)
    assert "st.async.shared::cluster" not in ptx
    # mma.sync only where the one-token groups' ring walk runs on it (ATTN_MMA: the 1B's slots of 64 positions)
    assert ("mma.sync.aligned" in ptx) == p.constants.ATTN_MMA == (model == "llama-3.2-1b")
    assert "cp.async.bulk.tensor" in ptx and "atom.global.gpu.release.add" in ptx
    # the loader streams every segment's past K/V into the ring as a one-token step's: a weight tile's TMA, and a
    # slot's K and V boxes
    c = p.constants
    assert c.KVS > 0 and ptx.count("cp.async.bulk.tensor.2d") == 1 + 2 * c.KVS // c.KVBOX
    assert not partition_barrier_errors(ptx, p.constants.NW)  # no CTA-wide barrier 0 (the loader never arrives)
    # DOWN_PROJ runs in two ticketed column parts (whole rows alone are fewer blocks than SMs; the 8B's input fits
    # no other way); every input staged by 16-byte async copies
    assert p.program.down_parts == 2
    assert "cp.async.cg.shared.global" in ptx and ", 0x10," in ptx


@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b"])
def test_sixteen_tokens_compile_spill_free_on_wgmma_n32(model):
    p, k, rep = _build(model, 16)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert k.metadata.shared <= SHARED_BYTES and p.constants.MB == 16
    _assert_pair_wgmma(k.asm["ptx"], 16)
    assert p.program.down_parts == (4 if model == "llama-3.1-8b" else 2)


def test_thirty_two_tokens_compile_spill_free_on_wgmma_n64_where_they_fit():
    p, k, rep = _build("llama-3.2-1b", 32)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert k.metadata.shared <= SHARED_BYTES and p.constants.MB == 32 and p.program.down_parts == 4
    _assert_pair_wgmma(k.asm["ptx"], 32)


def test_a_smaller_batch_compiles_too():
    p, k, rep = _build("smollm2-135m", 3)
    assert rep["spill_stores"] == 0 and k.metadata.shared <= SHARED_BYTES
    assert p.constants.M == 3 and p.constants.MB == 8


def _buckets():
    """(preset, M) for every bucket a multi-token step of a shipping preset pads to (launch/one_token.bucket_of of
    2 .. plan.max_tokens)."""
    from mimw.megakernel.launch.one_token import bucket_of
    from mimw.megakernel.plan import max_tokens

    out = []
    for name in ("smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"):
        top = max_tokens(get_preset(name))
        out += [(name, m) for m in sorted({bucket_of(n) for n in range(2, top + 1)})]
    return out


@pytest.mark.parametrize("model,batch", _buckets(), ids=[f"{n}-{m}" for n, m in _buckets()])
def test_every_buckets_kernel_compiles_spill_free(model, batch):
    p, k, rep = _build(model, batch)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert k.metadata.shared <= SHARED_BYTES and p.constants.M == batch


def test_the_one_token_kernel_has_no_multi_token_code():
    p, k, _ = _build("llama-3.2-1b", 1)
    ptx = k.asm["ptx"]
    assert p.constants.M == 1 and "wgmma" not in ptx and "mma.sync.aligned.m16n8k16" in ptx


CALL_SPILL_BYTES = 16  # a kernel with a noinline call (the query-block path), at 255 registers, may keep a few of
# its long-lived values in local memory (measured: 4-12 bytes on the 8B shapes, Llama's and Qwen3's; 0 on the 1B
# and SmolLM2)


def _block_cases():
    """(preset, bucket, query blocks): a verify block of 16 at bucket 16 and two at 32 (where plan.max_tokens
    allows), and the mixes the engine pads to: decode tokens, verify blocks and the padding's block."""
    from mimw.megakernel.plan import max_tokens

    out = []
    for name in ("smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"):
        out.append((name, 16, (16,)))
        if max_tokens(get_preset(name)) >= 32:
            out.append((name, 32, (16, 16)))
    out += [("llama-3.2-1b", 16, (1, 5, 1, 6, 3)), ("llama-3.1-8b", 8, (4, 4)), ("smollm2-135m", 8, (1, 6, 1))]
    return out


@pytest.mark.parametrize("model,batch,blocks", _block_cases(),
                         ids=[f"{n}-{m}-{'.'.join(map(str, b))}" for n, m, b in _block_cases()])
def test_the_query_block_kernels_compile_spill_free_on_mma_sync(model, batch, blocks):
    p, k, rep = _build(model, batch, blocks)
    block_fns = [f for f in rep["functions"] if "attn_query_block" in f]
    # the query-block path, allocated apart (noinline): the requests before the wait, the partial, the combine
    assert len(block_fns) == 3, sorted(rep["functions"])
    for f in block_fns:
        assert rep["functions"][f]["spill_stores"] == 0 and rep["functions"][f]["spill_loads"] == 0, (f, rep)
    assert rep["spill_stores"] <= CALL_SPILL_BYTES and rep["spill_loads"] <= CALL_SPILL_BYTES, rep
    assert k.metadata.shared <= SHARED_BYTES and p.constants.QT == min(16, bucket_of(batch))
    ptx = k.asm["ptx"]
    assert not partition_barrier_errors(ptx, p.constants.NW)  # noinline parts hold the partition's barriers
    # S = Q K^T and P V on mma.sync beside the matvecs' wgmma; K/V and the partials staged by 16-byte cp.async
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx and "wgmma.mma_async" in ptx
    assert "cp.async.cg.shared.global" in ptx
    # one attention instruction per (query block, KV head, split); a block alone splits its 1024 positions into
    # 256-position splits (Tuning.min_block_split_tokens), or as many as the combine stages (SmolLM2's small staging
    # buffer), fewer than M = 1's 32-position ones
    attn = [i for i in p.program.instructions() if i.OP.name == "ATTN_PARTIAL" and i.layer == 0]
    assert sorted({(i.seg, i.tokens) for i in attn}) == list(p.program.shape.attn_groups)
    if len(blocks) == 1:
        m1 = plan(get_preset(model), 132, StepShape((1,), 1024)).program.n_splits[0]
        assert p.program.n_splits == (min(4, p.program.config.max_splits),) and m1 > 4
        assert p.constants.SP2 >= 4


@pytest.mark.parametrize("model,batch,blocks", [("llama-3.2-1b", 16, (16,)), ("llama-3.1-8b", 16, (16,)),
                                                ("smollm2-135m", 8, (1, 6, 1))])
def test_the_query_block_kernels_compile_spill_free_over_an_fp8_cache(model, batch, blocks):
    """Over an fp8 cache the query blocks copy e4m3 rows (16-byte vectors) and widen them to bf16 in shared memory
    before the same mma.sync math."""
    p, k, rep = _build(model, batch, blocks, "fp8")
    assert p.constants.FP8 and p.constants.QT == min(16, bucket_of(batch))
    block_fns = [f for f in rep["functions"] if "attn_query_block" in f]
    assert len(block_fns) == 3, sorted(rep["functions"])
    for f in block_fns:
        assert rep["functions"][f]["spill_stores"] == 0 and rep["functions"][f]["spill_loads"] == 0, (f, rep)
    assert rep["spill_stores"] <= CALL_SPILL_BYTES and rep["spill_loads"] <= CALL_SPILL_BYTES, rep
    assert k.metadata.shared <= SHARED_BYTES
    ptx = k.asm["ptx"]
    assert not partition_barrier_errors(ptx, p.constants.NW)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx and "e4m3x2" in ptx


def test_a_decode_batch_kernel_has_no_query_block_code():
    p, k, rep = _build("llama-3.2-1b", 16)
    assert p.constants.QT == 1 and not [f for f in rep["functions"] if "compute_block" in f]
    # mma.sync only in the ring walk of its one-token groups (f32 accumulators of bf16 products, as M = 1's)
    assert p.constants.ATTN_MMA and "mma.sync.aligned.m16n8k16" in k.asm["ptx"]


@pytest.mark.parametrize("model,batch", [("llama-3.2-1b", 8), ("llama-3.1-8b", 16)])
def test_the_fp8_decode_batch_kernels_compile_spill_free_on_wgmma(model, batch):
    """The multi-token kernel over an fp8 cache (the GPU-tested shapes of test_batch_gpu.py): e4m3 K/V widened in
    registers (attention's blocks, requested a round trip each: no ring at M > 1 over fp8, and its late reload of
    block 0 with their scales), the finisher's rows quantised
    with round-to-nearest divisions and saturating e4m3 conversions; the same plan as the bf16 kernel's (attention
    blocks of bf16's positions: fp8's twice as many spill here) but for the rows' bytes."""
    p, k, rep = _build(model, batch, kv="fp8")
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert k.metadata.shared <= SHARED_BYTES and p.exchange_bytes == 0, k.metadata.shared
    c, ptx = p.constants, k.asm["ptx"]
    assert c.FP8 and c.M == batch and c.MB == batch
    _assert_pair_wgmma(ptx, batch)
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx
    b16 = plan(get_preset(model), 132, StepShape((1,) * batch, 1024))
    assert (p.ring, p.hbuf_rows, p.program.down_parts) == (b16.ring, b16.hbuf_rows, b16.program.down_parts)
    assert c.BT == b16.constants.BT
