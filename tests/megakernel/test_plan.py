"""The launch plan (plan.py): host logic on the CPU."""
import pytest
import torch

from mimw.megakernel.plan import (MIN_RING_MT, SCRATCH_BYTES, SHARED_BYTES, Tuning, exchange_bytes, max_tokens,
                                  norm_buffer_bytes, plan, query_block)
from mimw.megakernel.program import StepShape
from mimw.models.spec import get_preset


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"])
def test_the_ring_is_as_deep_as_shared_memory_allows(model):
    p = plan(get_preset(model), 132)
    slot = p.tuning.tile_rows * p.tuning.tile_k * 2
    room = SHARED_BYTES - SCRATCH_BYTES - p.hbuf_rows * p.tuning.tile_k * 2 - p.exchange_bytes
    assert p.ring == room // slot >= 2
    with pytest.raises(ValueError, match="do not fit"):
        plan(get_preset(model), 132, tuning=Tuning(ring=p.ring + 1))
    assert plan(get_preset(model), 132, tuning=Tuning(ring=4)).ring == 4


def test_shapes_force_their_fallbacks_in_the_plan():
    one_b = get_preset("llama-3.2-1b")
    assert plan(one_b, 132).constants.DOWN_PAIRS  # 64 row blocks pair on 128 of 132 SMs
    assert not plan(one_b, 114).constants.DOWN_PAIRS  # an H100 PCIe's 114 SMs: too few to pair every block
    odd = plan(one_b, 131)  # an odd SM count: no clusters, tickets
    assert odd.exchange_bytes == 0 and odd.cluster_size == 1 and not odd.constants.DOWN_PAIRS
    assert plan(one_b, 132).exchange_bytes == exchange_bytes(64)
    small = plan(get_preset("smollm2-135m"), 132)  # a 9-row staging buffer (D = 576) is too small for the merge
    assert not small.constants.SMEM_MERGE and plan(one_b, 132).constants.SMEM_MERGE
    tiny = plan(get_preset("tiny-qwen3"), 8)  # a 32-row head: 16-row tiles of 512 columns
    assert (tiny.tuning.tile_rows, tiny.tuning.tile_k) == (16, 512)


def test_the_plan_rejects_tunings_it_cannot_tile():
    spec = get_preset("llama-3.2-1b")
    with pytest.raises(ValueError, match="head_dim"):
        plan(spec, 132, tuning=Tuning(tile_rows=64, tile_k=256))
    with pytest.raises(ValueError, match="fold"):
        plan(spec, 132, tuning=Tuning(tile_rows=32, tile_k=96))
    with pytest.raises(ValueError, match="qkv_parts"):
        plan(spec, 132, tuning=Tuning(qkv_parts=9))
    with pytest.raises(ValueError, match="quiet"):
        plan(spec, 132, tuning=Tuning(quiet=-2))


def test_the_words_carry_the_hold_marks_and_the_constants_the_shape():
    from mimw.megakernel import isa

    spec = get_preset("llama-3.1-8b")
    p = plan(spec, 132, StepShape((1,), 1024))
    flags = p.words[..., isa.Word.FLAGS]
    assert bool((flags & isa.HOLD_WAIT).any()) and bool((flags & isa.HOLD_ARRIVE).any())
    assert not (plan(spec, 132, tuning=Tuning(quiet=-1)).words[..., isa.Word.FLAGS] & isa.HOLD_WAIT).any()
    c = p.constants
    assert (c.D, c.HQ, c.HKV, c.HD, c.I, c.NL) == (4096, 32, 8, 128, 14336, 32)
    assert (c.KT_D, c.KT_I, c.SP2, c.GP, c.NB) == (16, 56, 16, 4, p.ring)


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "qwen3-30b-a3b"])
def test_an_moe_model_plans_its_routing_constants_and_decode_batches_of_eight_at_most(model):
    spec = get_preset(model)
    p = plan(spec, 132)
    c = p.constants
    assert (c.E, c.S, c.K, c.F, c.NORM_TOPK) == (spec.num_experts, spec.num_experts_per_tok,
                                                   spec.num_experts_per_tok, spec.moe_intermediate_size, True)
    assert c.EP2 >= c.E and c.EP2 & (c.EP2 - 1) == 0
    # the staging buffer holds the widest staged input: RMSNorm(x), the attention output, an expert's activation
    # (the 30B-A3B's 6144-wide dense intermediate size has no dense layer to stage it), and where a KV group has
    # more than four heads the attention warps' states (the 30B-A3B's eight heads of 128: 16.3 KB, 64 rows)
    kt = lambda k: -(-k // c.TK)  # noqa: E731
    assert p.hbuf_rows >= max(kt(spec.hidden_size), kt(spec.q_size), c.KT_F)
    if model == "qwen3-30b-a3b":
        assert (p.hbuf_rows, c.SMEM_MERGE) == (64, True)
    if model == "tiny-qwen3-moe":  # 16-row tiles: no multi-token step at all
        with pytest.raises(ValueError, match="16, 512"):
            plan(spec, 132, StepShape((1, 1), 1024))
        return
    # a decode batch of up to eight tokens: min(E, M k) slots, each distinct expert once
    assert max_tokens(spec) == 8
    p = plan(spec, 132, StepShape((1,) * 3, 1024))
    assert (p.constants.M, p.constants.S, p.constants.S2, p.constants.EP) == (3, 24, 32, 128)
    with pytest.raises(ValueError, match="at most 8 tokens"):
        plan(spec, 132, StepShape((1,) * 16, 1024))


def test_a_dense_model_plans_no_routing():
    c = plan(get_preset("smollm2-135m"), 132).constants
    assert (c.E, c.S, c.K, c.F) == (0, 0, 0, 0)


@pytest.mark.parametrize("model,batch", [("tiny-qwen3-moe", 1), ("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 8)])
def test_the_routing_wait_trace_changes_no_other_constant(model, batch):
    """The loader's routing wait (device/route_wait.py) is a plain poll with no tuning of its own: a traced plan
    (the wait's stamps) differs from the untraced one in TRACE alone, same ring and words, so a traced step runs
    the same program."""
    spec, shape = get_preset(model), StepShape((1,) * batch, 1024)
    on, off = plan(spec, 132, shape, tuning=Tuning(trace=True)), plan(spec, 132, shape)
    assert on.constants.TRACE and not off.constants.TRACE and on.constants.S == off.constants.S > 0
    assert {k: v for k, v in vars(on.constants).items() if k != "TRACE"} == \
        {k: v for k, v in vars(off.constants).items() if k != "TRACE"}
    assert on.ring == off.ring and bool((on.words == off.words).all())


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"])
@pytest.mark.parametrize("batch", [2, 5, 8, 11, 16, 32])
def test_a_decode_batch_plans_tickets_and_a_staging_buffer_of_eight_or_sixteen_tokens(model, batch):
    from mimw.megakernel import isa

    spec = get_preset(model)
    if batch > max_tokens(spec):  # the 8B shapes: 32 tokens of 4096 columns do not fit beside the ring
        assert model in ("llama-3.1-8b", "qwen3-8b") and max_tokens(spec) == 16
        return
    p = plan(spec, 132, StepShape((1,) * batch, 1024))
    c, slot = p.constants, p.tuning.tile_rows * p.tuning.tile_k * 2
    mb = 8 if batch <= 8 else 16 if batch <= 16 else 32  # wgmma's N
    assert (c.M, c.MB, p.cluster_size, p.exchange_bytes, c.DOWN_PAIRS) == (batch, mb, 1, 0, False)
    assert not (p.words[..., isa.Word.FLAGS] & isa.CLUSTER_PAIR).any()
    assert p.staging_bytes == p.hbuf_rows * p.tuning.tile_k * 2 * mb
    norm = norm_buffer_bytes(spec, p.tuning)  # a norm's weights as 32-column chunks, a power of two of them
    chunks = norm // 64
    assert chunks & (chunks - 1) == 0 and chunks * 32 >= spec.hidden_size > chunks * 16
    assert p.ring >= 4 and p.staging_bytes + norm + p.ring * slot + SCRATCH_BYTES <= SHARED_BYTES
    kt_i = -(-spec.intermediate_size // p.tuning.tile_k)
    parts = p.program.down_parts
    assert p.hbuf_rows >= max(c.KT_D, c.KT_Q, -(-kt_i // parts))
    # at least two ticketed parts (whole rows alone are fewer blocks than SMs), and as few as fit: two at MB = 8 on
    # every shape (the 8B's 56 column tiles: 28 a part, 32 staged rows = 128 KB); at MB = 16 the 8B's take four (14
    # tiles: 16 staged rows = 128 KB) and Qwen3-8B's 48 three; at MB = 32 the 1B's 32 take four
    expect = {8: {}, 16: {"llama-3.1-8b": 4, "qwen3-8b": 3}, 32: {"llama-3.2-1b": 4}}[mb]
    assert parts == expect.get(model, 2)
    # the GPU keeps ticketed parts' sums [parts, M, D] in qkv_part's buffer: it has the room
    from mimw.megakernel.state import alloc_scratch

    assert alloc_scratch(p.program, "meta").qkv_part.numel() >= parts * batch * spec.hidden_size
    downs = [i for i in p.program.instructions() if i.OP == isa.Op.DOWN_PROJ]
    assert all((i.ticket != isa.NO_COUNTER) == (parts > 1) and i.n_parts == (parts if parts > 1 else 0)
               for i in downs)


def test_the_single_token_plan_keeps_its_settings():
    one_b = plan(get_preset("llama-3.2-1b"), 132)
    assert (one_b.constants.M, one_b.constants.MB, one_b.ring, one_b.cluster_size) == (1, 1, 13, 2)
    assert one_b.staging_bytes == one_b.hbuf_rows * one_b.tuning.tile_k * 2


def test_the_plan_refuses_multi_token_steps_the_gpu_kernel_cannot_run():
    with pytest.raises(ValueError, match="one-token segments"):
        plan(get_preset("llama-3.2-1b"), 132, StepShape((4,)))
    with pytest.raises(ValueError, match="2..32 one-token segments"):
        plan(get_preset("llama-3.2-1b"), 132, StepShape((1,) * 33))
    with pytest.raises(ValueError, match="do not fit in shared memory"):  # 32 tokens of the 8B's 4096 columns
        plan(get_preset("llama-3.1-8b"), 132, StepShape((1,) * 32))
    with pytest.raises(ValueError, match="chunk pair"):  # 32-dim heads: 16-row tiles
        plan(get_preset("tiny-qwen3"), 8, StepShape((1, 1)))


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"])
def test_query_blocks_fit_the_staging_buffer(model):
    """A query block's q, two stages of K/V blocks, and its combine's partials all live in the staging buffer
    (ops/attn_query_block.py): QBT and the splits' cap are what fits it."""
    spec = get_preset(model)
    for m, blocks in ((16, (16,)), (8, (4, 4)), (16, (1, 5, 1, 6, 3))):
        p = plan(spec, 132, StepShape((1,) * m, 1024, blocks))
        c = p.constants
        gp, hd, rows = c.GP, c.HD, max(16 * c.NW, c.QT * c.GP)
        assert c.QT == m and c.QBT in (16, 32)  # the bucket's longest block: one kernel for all its layouts
        # ... and the splits of a block alone, whatever this layout's
        assert c.SP2 == plan(spec, 132, StepShape((1,) * m, 1024, (m,))).constants.SP2 >= p.program.max_splits
        assert (-(-rows // c.QBT) + 4) * c.QBT * hd * 2 <= p.staging_bytes  # q and two stages
        assert gp * c.SP2 * hd * 4 + c.QT * gp * c.SP2 * 8 <= p.staging_bytes  # a token's partials, the (m, l)
        assert p.program.max_splits <= p.program.config.max_splits <= 32
        assert plan(spec, 132, StepShape((1,) * m, 1024)).constants.QT == 1  # a decode batch: none of it
    with pytest.raises(ValueError, match="at most 16 tokens"):
        plan(spec, 132, StepShape((1,) * 17, 1024, (17,)))
    with pytest.raises(ValueError, match="does not fit"):
        query_block(spec, Tuning().resolve(spec), 16, 4096)


def test_query_blocks_plan_over_an_fp8_cache_as_over_bf16():
    """Attention's query blocks stage an fp8 cache's e4m3 rows in the upper half of their bf16 blocks' bytes and
    widen them in place (ops/attn_query_block.py): the same QT, QBT and splits as over bf16."""
    from mimw.kv import fp8

    spec = get_preset("llama-3.2-1b")
    shape = StepShape((1,) * 16, 1024, (16,))
    c8, c16 = plan(spec, 132, shape, kv_dtype=fp8.FP8), plan(spec, 132, shape)
    assert (c8.constants.QT, c8.constants.QBT, c8.constants.FP8) == (c16.constants.QT, c16.constants.QBT, True)
    assert c8.program.n_splits == c16.program.n_splits and c8.constants.QT == 16


@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b", "smollm2-135m"])
def test_the_query_blocks_combine_keeps_as_many_tokens_in_flight_as_the_staging_buffer_holds(model):
    """The combining split's token stages (ops/attn_query_block.combine_stages): every stage and the block's (m, l)
    fit in the staging buffer, one more would not (or the cap: 8, the block's tokens), and at least one."""
    from mimw.megakernel.ops.attn_query_block import combine_stages

    for blocks in ((16,), (4, 4)):
        c = plan(get_preset(model), 132, StepShape((1,) * sum(blocks), 1024, blocks)).constants
        hbuf = c.KT_ROWS * (c.TK // 32) * c.MB * 32 * 2  # kernel.py's hbuf for M > 1
        stage, ml = c.GP * c.SP2 * c.HD * 4, c.QT * c.GP * c.SP2 * 8
        n = combine_stages(hbuf, stage, ml, c.QT)
        assert 1 <= n <= min(8, c.QT) and n * stage + ml <= hbuf
        assert n == min(8, c.QT) or (n + 1) * stage + ml > hbuf
    assert combine_stages(100, 30, 10, 16) == 3 and combine_stages(10_000, 30, 10, 4) == 4
    assert combine_stages(40, 30, 10, 16) == 1


def test_an_fp8_cache_sets_the_kernels_fp8_constants_and_halves_the_cost_models_kv_bytes():
    """The KV element type is the cache's (never a tuning knob): Constants.FP8, an attention block of 8 KB of K
    (twice the positions at fp8), and K/V bytes in the scheduler's cost model at e4m3 + a bf16 scale a row."""
    from mimw.kv import fp8
    from mimw.megakernel.ops.attn_partial import AttnPartial, kv_bytes

    for model, bt in (("llama-3.2-1b", 64), ("llama-3.1-8b", 32)):
        spec = get_preset(model)
        b16, f8 = plan(spec, 132), plan(spec, 132, kv_dtype=fp8.FP8)
        assert (b16.constants.FP8, b16.constants.BT) == (False, bt)
        assert (f8.constants.FP8, f8.constants.BT) == (True, 2 * bt)
        assert f8.program.config.kv_row_bytes == spec.head_dim + 2
        assert b16.program.config.kv_row_bytes == 2 * spec.head_dim
        ins = AttnPartial(n_splits=16)
        assert kv_bytes(spec, ins, 131071, 1, f8.program.config.kv_row_bytes) == 8192 * (spec.head_dim + 2) * 2
        assert kv_bytes(spec, ins, 131071, 1) == 8192 * spec.head_dim * 2 * 2
    with pytest.raises(ValueError, match="bf16 or an fp8"):
        plan(get_preset("llama-3.2-1b"), 132, kv_dtype=torch.float16)


def test_an_moe_model_over_an_fp8_cache_is_refused_and_eight_head_groups_keep_bf16_blocks():
    """MoE layers and an fp8 cache have not been checked together: plan refuses the pair by name (bf16 plans). A KV
    group of more than four query heads takes bf16's shrunk block at fp8 too (the 30B-A3B's eight: 16 positions)."""
    from mimw.kv import fp8
    from mimw.megakernel.plan import attn_block

    for model in ("tiny-qwen3-moe", "qwen3-30b-a3b"):
        spec = get_preset(model)
        assert plan(spec, 132).constants.FP8 is False
        with pytest.raises(ValueError, match="mixture-of-experts model over a bf16 KV cache only"):
            plan(spec, 132, kv_dtype=fp8.FP8)
    a3b = get_preset("qwen3-30b-a3b")
    assert attn_block(a3b) == attn_block(a3b, fp8.FP8) == 16
    assert attn_block(get_preset("llama-3.2-1b"), fp8.FP8) == 128 and attn_block(get_preset("llama-3.2-1b")) == 64


@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b"])
def test_long_contexts_split_attention_over_the_sms(model):
    """At 32k and 128k every KV head's context is cut into as many splits as the SMs allow (132 // Hkv = 16 for 8
    KV heads): 8192 positions a split at 128k."""
    spec = get_preset(model)
    for ctx in (32768, 131072):
        p = plan(spec, 132, StepShape((1,), ctx))
        assert p.program.max_splits == 132 // spec.num_kv_heads == 16
        assert p.constants.SP2 == 16


@pytest.mark.parametrize("model,batch", [("llama-3.2-1b", 8), ("llama-3.2-1b", 32), ("llama-3.1-8b", 16)])
def test_an_fp8_multi_token_plan_differs_from_the_bf16_one_only_in_its_kv_settings(model, batch):
    """Decode batches and verify blocks over an fp8 cache: the same multi-token plan (tokens padded to wgmma's N,
    ring, staging buffer, DOWN_PROJ parts, splits, and attention blocks of bf16's positions: twice as many spill
    registers there) with Constants.FP8 and the cost model's K/V rows at e4m3 + a bf16 scale."""
    import dataclasses

    from mimw.kv import fp8

    spec = get_preset(model)
    shape = StepShape((1,) * batch, 1024)
    b16, f8 = plan(spec, 132, shape), plan(spec, 132, shape, kv_dtype=fp8.FP8)
    assert (f8.constants.FP8, f8.constants.M, f8.constants.BT) == (True, batch, b16.constants.BT)
    # its splits request each block with its scales (no ring: the e4m3 slots' walk spills the 8B), the bf16 plan's
    # stream their past through the ring
    c16 = b16.constants
    assert f8.constants.KVS == 0 and not f8.constants.ATTN_MMA and c16.KVS > 0
    assert dataclasses.replace(f8.constants, FP8=False, KVS=c16.KVS, KVBOX=c16.KVBOX, ATTN_MMA=c16.ATTN_MMA) == c16
    assert plan(spec, 132, kv_dtype=fp8.FP8).constants.BT == 2 * b16.constants.BT  # one token: 8 KB of K
    assert (f8.ring, f8.hbuf_rows, f8.program.down_parts, f8.program.max_splits) == \
        (b16.ring, b16.hbuf_rows, b16.program.down_parts, b16.program.max_splits)
    assert f8.program.config.kv_row_bytes == spec.head_dim + 2


def test_a_one_token_steps_past_kv_fills_whole_ring_slots_in_boxes_of_one_page():
    """plan.kv_ring: a slot holds KVS positions of K then V, exactly its 16 KB at every shipping shape (the
    attention block, or two of the 30B-A3B's 16-position blocks), in TMA boxes of gcd(page size, KVS) rows of one
    page and head; an fp8 cache's scales beside each slot cost the 1B one slot of its ring (13 -> 12: 12 * 512 bytes
    of scales do not fit in the 2 KB the 13 slots leave); a multi-token step's one-token groups stream theirs in the
    same slots, at least MIN_RING_MT of them, over a bf16 cache."""
    from math import gcd

    from mimw.kv import fp8
    from mimw.megakernel.plan import kv_ring, kv_scale_bytes

    shapes = {"smollm2-135m": (64, 128), "llama-3.2-1b": (64, 128), "llama-3.1-8b": (32, 64),
              "qwen3-8b": (32, 64), "tiny-qwen3": (128, 256), "qwen3-30b-a3b": (32, None)}
    for model, (kvs16, kvs8) in shapes.items():
        spec = get_preset(model)
        for kvs, dtype in ((kvs16, None), (kvs8, fp8.FP8)):
            if kvs is None:  # an MoE model over an fp8 cache is refused
                continue
            p = plan(spec, 132, kv_dtype=dtype) if dtype else plan(spec, 132)
            c = p.constants
            assert (c.KVS, c.KVBOX) == (kvs, 16) and c.KVS % c.BT == 0
            assert 2 * c.KVS * c.HD * (1 if c.FP8 else 2) == p.tuning.tile_rows * p.tuning.tile_k * 2
            assert c.BT == (16 if model == "qwen3-30b-a3b" else c.KVS)
            for ps in (16, 24, 64, 256):
                assert kv_ring(spec, p.tuning, ps, dtype or torch.bfloat16)[1] == gcd(ps, kvs)
    one_b = get_preset("llama-3.2-1b")
    b16, f8 = plan(one_b, 132), plan(one_b, 132, kv_dtype=fp8.FP8)
    assert (b16.ring, f8.ring, kv_scale_bytes(128, fp8.FP8), kv_scale_bytes(64, torch.bfloat16)) == (13, 12, 512, 0)
    room = SHARED_BYTES - SCRATCH_BYTES - f8.hbuf_rows * f8.tuning.tile_k * 2 - f8.exchange_bytes
    assert f8.ring == room // (16384 + 512)
    assert plan(get_preset("llama-3.1-8b"), 132, kv_dtype=fp8.FP8).ring == 11  # 11 * 256 bytes fit beside
    for model, batches in (("llama-3.2-1b", (8, 16, 32)), ("llama-3.1-8b", (8, 16)), ("smollm2-135m", (8,))):
        for batch in batches:
            m1 = plan(get_preset(model), 132).constants
            p = plan(get_preset(model), 132, StepShape((1,) * batch, 1024))
            c = p.constants
            assert (c.KVS, c.KVBOX, c.ATTN_MMA, c.BT) == (m1.KVS, m1.KVBOX, m1.ATTN_MMA, m1.BT) and c.M == batch
            assert p.ring >= MIN_RING_MT
            # over an fp8 cache a multi-token step's splits keep requesting their blocks (plan.py)
            assert plan(get_preset(model), 132, StepShape((1,) * batch, 1024), kv_dtype=fp8.FP8).constants.KVS == 0


def test_a_page_size_whose_kv_boxes_tma_cannot_place_is_refused_by_name():
    from mimw.kv import fp8
    from mimw.megakernel.plan import kv_ring

    one_b = get_preset("llama-3.2-1b")
    assert plan(one_b, 132, page_size=1).constants.KVBOX == 1  # a bf16 row of head_dim 64 is 128 bytes: a box
    for ps in (1, 3, 5):  # e4m3 rows of 64 bytes: a box of gcd(ps, 128) = 1 row is half TMA's 128-byte alignment
        with pytest.raises(ValueError, match=f"page_size={ps}: the loader streams K/V in boxes"):
            plan(one_b, 132, page_size=ps, kv_dtype=fp8.FP8)
    assert plan(one_b, 132, page_size=6, kv_dtype=fp8.FP8).constants.KVBOX == 2  # two rows: 128 bytes
    t = Tuning().resolve(one_b)
    assert kv_ring(one_b, t, 8, fp8.FP8) == (128, 8)
    small = Tuning(tile_rows=16, tile_k=256).resolve(one_b)  # an 8 KB slot: the block shrinks to the slot
    assert kv_ring(one_b, small, 16) == (32, 16) and plan(one_b, 132, tuning=small).constants.BT == 32


def test_the_ring_walk_runs_on_the_tensor_cores_where_a_slot_holds_16_positions_a_warp():
    """Constants.ATTN_MMA, derived from the shape: a one-token step whose ring slot holds 16 positions a warp or
    more (the 1B's and SmolLM2's 64 bf16 / 128 fp8 positions, every head_dim-128 fp8 slot of 64) walks it on the
    tensor cores, a multi-token step's one-token groups as the one-token step's; the head_dim-128 bf16 slots of 32
    (the 8B, Qwen3, the 30B-A3B), a slot shrunk by a smaller tile and more warps a slot do not."""
    from mimw.kv import fp8
    from mimw.megakernel.ops import attn_ring_mma

    def c(model, kv=torch.bfloat16, t=Tuning(), shape=StepShape()):
        return plan(get_preset(model), 132, shape, tuning=t, kv_dtype=kv).constants

    for model in ("smollm2-135m", "llama-3.2-1b"):
        assert c(model).ATTN_MMA and c(model, fp8.FP8).ATTN_MMA
        assert (c(model).KVS, c(model, fp8.FP8).KVS) == (64, 128)
    for model in ("llama-3.1-8b", "qwen3-8b", "qwen3-0.6b"):
        assert c(model, fp8.FP8).ATTN_MMA and c(model, fp8.FP8).KVS == 64
        assert not c(model).ATTN_MMA and c(model).KVS == 32  # 8 positions a warp: the lanes' walk
    assert not c("qwen3-30b-a3b").ATTN_MMA
    small = Tuning(tile_rows=16, tile_k=256)  # an 8 KB slot: 32 bf16 positions at head_dim 64, 64 fp8 ones
    assert not c("llama-3.2-1b", t=small).ATTN_MMA and c("llama-3.2-1b", fp8.FP8, t=small).ATTN_MMA
    assert not c("llama-3.2-1b", t=Tuning(num_warps=8)).ATTN_MMA  # 64 positions over 8 warps
    assert c("llama-3.2-1b", shape=StepShape((1,) * 8, 1024)).ATTN_MMA  # a decode batch walks as one token does
    assert not c("llama-3.1-8b", shape=StepShape((1,) * 8, 1024)).ATTN_MMA
    for kvs, nw, on in ((64, 4, True), (128, 4, True), (128, 8, True), (32, 4, False), (64, 8, False), (0, 4, False)):
        assert attn_ring_mma.applies(kvs, nw) == on, (kvs, nw)
