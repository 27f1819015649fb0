"""Each instruction's reference solver against the reference decoder's own pieces (rms_norm, RoPE, attention)."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.megakernel import isa
from mimw.megakernel.ops import FINISHERS, SOLVERS, OpContext
from mimw.megakernel.ops.attn_in import AttnIn
from mimw.megakernel.ops.attn_partial import AttnPartial
from mimw.megakernel.ops.common import rms_norm
from mimw.megakernel.ops.o_proj import OProj
from mimw.megakernel.plan import Tuning
from mimw.megakernel.program import ProgramConfig, StepShape, build_program
from mimw.megakernel.state import EMPTY_M, alloc_scratch, alloc_state
from mimw.megakernel.vm import VMDecoder
from mimw.models import reference, rope
from mimw.models.reference import ReferenceDecoder, Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/megakernel/conftest.py


def context(name: str, seg_lens, starts, num_sms: int, page_size: int = 16, dtype=torch.float32, seed: int = 0,
            config: ProgramConfig | None = None):
    """An OpContext over random weights and a random cache; segment s starts at position ``starts[s]``."""
    spec = get_preset(name)
    if spec.num_layers > 3:
        spec = spec.with_(num_layers=2)  # real shapes, fewer layers: CPU time
    w = random_weights(spec, seed, dtype=dtype)
    prog = build_program(spec, StepShape(tuple(seg_lens)), num_sms, config or Tuning().resolve(spec).program_config())
    per_seq = [-(-(p + n) // page_size) for p, n in zip(starts, seg_lens)]
    cache = PagedKVCache(KVLayout.for_spec(spec, page_size, sum(per_seq) + 2, dtype))
    g = torch.Generator().manual_seed(seed)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    pages = torch.randperm(cache.layout.num_pages, generator=g).tolist()
    tables, i = [], 0
    for n in per_seq:
        tables.append(pages[i: i + n])
        i += n
    state = alloc_state(prog, cache.layout.num_pages)
    state.fill(torch.randint(0, spec.vocab_size, (sum(seg_lens),), generator=g).tolist(), starts, tables, seg_lens)
    return OpContext(prog, w, cache, state, alloc_scratch(prog)), tables


def test_rms_norm_rounds_like_the_reference_bit_for_bit_in_bf16():
    x = torch.randn(4, 64).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16)
    assert torch.equal(rms_norm(x.float(), w, 1e-5), reference.rms_norm(x, w, 1e-5).float())


@pytest.mark.parametrize("name,seg_lens,starts,num_sms,has_empty", [
    ("tiny-llama", (4,), (13,), 132, True),  # 32 splits of 1 position: empty ones, ones fully in a token's future
    ("tiny-qwen3", (1, 1, 1), (0, 40, 17), 132, True),  # a first token (context 1): every split but one empty
    ("smollm2-135m", (4, 1), (70, 5), 7, False),  # G = 3, one split per segment
])
def test_partials_then_reduce_equal_causal_softmax_attention(name, seg_lens, starts, num_sms, has_empty):
    # a segment of several tokens splits as finely as one token's (32 positions at the hint), so that splits fall
    # empty or wholly in a token's future
    spec = get_preset(name)
    config = dataclasses.replace(Tuning().resolve(spec).program_config(), min_block_split_tokens=32)
    ctx, tables = context(name, seg_lens, starts, num_sms, config=config)
    spec, sc, prog = ctx.spec, ctx.scratch, ctx.program
    sc.q.copy_(torch.randn(sc.q.shape))
    layer = spec.num_layers - 1
    for k in range(spec.num_kv_heads):
        for s, n in enumerate(prog.n_splits):
            for i in range(n):
                SOLVERS[isa.Op.ATTN_PARTIAL](ctx, AttnPartial(layer=layer, kv_head=k, seg=s, split=i, n_splits=n))
            FINISHERS[isa.Op.ATTN_PARTIAL](ctx, AttnPartial(layer=layer, kv_head=k, seg=s, n_splits=n))
    for s, (t0, n) in enumerate(zip(prog.shape.seg_starts, seg_lens)):
        kc, vc = ctx.cache.gather(layer, tables[s], starts[s] + n)
        pos = torch.arange(starts[s], starts[s] + n)
        want = reference.attention(sc.q[t0: t0 + n], kc, vc, pos).reshape(n, -1)
        torch.testing.assert_close(sc.attn[t0: t0 + n], want, rtol=1e-5, atol=1e-5)
    # the partials' contract: an empty split (or one wholly in a token's future) stores (EMPTY_M, 0) and o = 0
    empty = sc.part_ml[..., 0] == EMPTY_M
    assert bool(empty.any()) == has_empty
    assert (sc.part_ml[..., 1][empty] == 0).all() and (sc.part_o[empty] == 0).all()


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_attn_in_matches_the_reference_projection_and_stores_kv_only_at_the_step_slots(name, parts):
    seg_lens, starts = (4, 1), (14, 33)  # the verify block crosses a page boundary
    ctx, tables = context(name, seg_lens, starts, 7, config=ProgramConfig(tile_rows=16, tile_k=16, qkv_parts=parts, clusters=False))
    spec, layer = ctx.spec, 1
    lw, hq, hkv, hd = ctx.weights.layers[layer], spec.num_heads, spec.num_kv_heads, spec.head_dim
    ctx.scratch.x.copy_(torch.randn(ctx.scratch.x.shape))
    k_before, v_before = ctx.cache.k.clone(), ctx.cache.v.clone()
    for h in range(hq + 2 * hkv):
        for p in random.Random(h).sample(range(parts), parts):  # parts in any order; the finisher sums in order
            SOLVERS[isa.Op.ATTN_IN](ctx, AttnIn(layer=layer, head=h, part=p, n_parts=parts))
        FINISHERS[isa.Op.ATTN_IN](ctx, AttnIn(layer=layer, head=h, part=p, n_parts=parts))
    # the reference decoder's computation, written out
    pos = ctx.state.positions.long()
    hn = reference.rms_norm(ctx.scratch.x, lw.attn_norm, spec.rms_norm_eps)
    q = F.linear(hn, lw.wq, lw.bq).view(-1, hq, hd)
    k = F.linear(hn, lw.wk, lw.bk).view(-1, hkv, hd)
    v = F.linear(hn, lw.wv, lw.bv).view(-1, hkv, hd)
    if spec.qk_norm:
        q, k = reference.rms_norm(q, lw.q_norm, spec.rms_norm_eps), reference.rms_norm(k, lw.k_norm, spec.rms_norm_eps)
    cos, sin = rope.cos_sin(spec, pos)
    q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
    torch.testing.assert_close(ctx.scratch.q, q, rtol=1e-5, atol=1e-5)
    expect_k, expect_v = k_before.clone(), v_before.clone()
    ref_cache = PagedKVCache(ctx.cache.layout)
    ref_cache.k, ref_cache.v = expect_k, expect_v
    for s, (t0, n) in enumerate(zip(ctx.program.shape.seg_starts, seg_lens)):
        ref_cache.write(layer, tables[s], pos[t0: t0 + n], k[t0: t0 + n], v[t0: t0 + n])
    torch.testing.assert_close(ctx.cache.k, expect_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ctx.cache.v, expect_v, rtol=1e-5, atol=1e-5)
    assert (ctx.cache.k != k_before).sum() > 0  # something was stored


def test_layer0_reads_the_embedding_rows_as_the_residual():
    ctx, _ = context("tiny-llama", (2,), (5,), 7)
    emb = ctx.weights.embed[ctx.state.tokens.long()]
    ctx.scratch.attn.zero_()
    SOLVERS[isa.Op.O_PROJ](ctx, OProj(layer=0, row0=16, nrows=32))
    assert torch.equal(ctx.scratch.x[:, 16:48], emb[:, 16:48])
    assert ctx.scratch.x[:, :16].isnan().all()  # scratch starts poisoned; nothing else was touched


def test_the_vm_in_bf16_stays_within_bf16_error_of_the_fp32_reference():
    spec = get_preset("tiny-qwen3")
    w16 = random_weights(spec, 3, dtype=torch.bfloat16)
    layout16 = KVLayout.for_spec(spec, 16, 8, torch.bfloat16)
    ref = ReferenceDecoder(w16.to(dtype=torch.float32))  # the oracle: fp32 over the same bf16-rounded weights
    ref_cache, cache16 = PagedKVCache(dataclasses.replace(layout16, dtype=torch.float32)), PagedKVCache(layout16)
    table = list(range(8))
    prompt = torch.randint(0, spec.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    ref.forward(prompt, [Segment(tuple(table), 0, 30)], ref_cache)
    cache16.k.copy_(ref_cache.k)
    cache16.v.copy_(ref_cache.v)
    ref_cache.k.copy_(cache16.k)  # both start from the same bf16-rounded context
    ref_cache.v.copy_(cache16.v)
    dec = VMDecoder(spec, w16, cache16, 7, StepShape((1,)))
    for step, tok in enumerate([3, 77, 150]):
        want = ref.forward(torch.tensor([tok]), [Segment(tuple(table), 30 + step, 1)], ref_cache)
        got = dec.step([tok], [30 + step], [table], random.Random(step))
        assert float((got - want).abs().max() / want.abs().max()) < 3e-2
        assert int(got.argmax()) == int(want.argmax())


@pytest.mark.parametrize("seg_lens", [(1,), (1, 1, 1), (5,)])
def test_moe_ops_compute_the_reference_moe_block(seg_lens):
    """ROUTER parts and finisher, every slot's EXPERT_IN and EXPERT_DOWN with the row blocks' finishers, on a
    random residual: the residual grows by models/moe.py's MoE block of its normalised rows."""
    from mimw.models.moe import moe_mlp

    ctx, _ = context("tiny-qwen3-moe", seg_lens, [3] * len(seg_lens), 7)
    spec, sc, prog, layer = ctx.spec, ctx.scratch, ctx.program, 2
    sc.x.copy_(torch.randn(sc.x.shape, generator=torch.Generator().manual_seed(4)))
    x0, lw = sc.x.clone(), ctx.weights.layers[layer]
    ins = [i for i in prog.instructions() if i.layer == layer]
    for op in (isa.Op.ROUTER, isa.Op.EXPERT_IN, isa.Op.EXPERT_DOWN):
        parts = [i for i in ins if i.OP == op]
        for i in parts:
            SOLVERS[op](ctx, i)
        if op in FINISHERS:  # each ticket's last part (the finish reads every part)
            for i in {(i.row0 if op == isa.Op.EXPERT_DOWN else 0): i for i in parts}.values():
                FINISHERS[op](ctx, i)
    routings = []
    want = x0 + moe_mlp(reference.rms_norm(x0, lw.mlp_norm, spec.rms_norm_eps), lw, spec, routings)
    assert float((sc.x - want).abs().max() / want.abs().max()) <= 1e-6
    used = [isa.routed_expert(int(v), ctx.state.epoch) for v in sc.routed[layer]]
    assert used[: len(routings[0].experts)] == routings[0].experts
    assert prog.moe_slots == min(spec.num_experts, sum(seg_lens) * spec.num_experts_per_tok)


def test_the_expert_down_finisher_adds_each_tokens_chosen_slots_as_every_slot_in_use_adds_them():
    """The finisher sums each token's chosen slots (in use, weight not 0) in slot order, as the GPU gathers them:
    bit for bit the sum over every slot in use (the others' parts weigh 0). The slots past those in use hold stale
    weights and NaN parts (poison), which no token's sum may touch."""
    from mimw.megakernel.ops.expert_down import active_slots, chosen_slots

    ctx, _ = context("tiny-qwen3-moe", (1, 1, 1), [3] * 3, 7)
    sc, prog, layer = ctx.scratch, ctx.program, 2
    sc.x.copy_(torch.randn(sc.x.shape, generator=torch.Generator().manual_seed(5)))
    ins = [i for i in prog.instructions() if i.layer == layer]
    for op in (isa.Op.ROUTER, isa.Op.EXPERT_IN, isa.Op.EXPERT_DOWN):
        for i in (i for i in ins if i.OP == op):
            SOLVERS[op](ctx, i)
        if op == isa.Op.ROUTER:
            FINISHERS[op](ctx, next(i for i in ins if i.OP == op))
    used = active_slots(ctx, layer, prog.moe_slots)
    assert 0 < len(used) < prog.moe_slots  # three tokens of top-2 of 16 experts: some slots idle
    sc.slot_w[len(used):] = 0.5  # a stale weight, as an earlier layer's router left it
    sc.moe_part[len(used):] = float("nan")
    chosen = chosen_slots(ctx, layer, prog.moe_slots)
    assert all(len(c) == ctx.spec.num_experts_per_tok and c == sorted(c) and set(c) <= set(used) for c in chosen)
    want = sc.x.clone()
    for r in {i.row0: i for i in ins if i.OP == isa.Op.EXPERT_DOWN}.values():
        rows = r.rows(prog.config.tile_rows)
        total = sc.moe_part[used[0], :, rows]
        for j in used[1:]:
            total = total + sc.moe_part[j, :, rows]
        want[:, rows] = want[:, rows] + total
        FINISHERS[isa.Op.EXPERT_DOWN](ctx, r)
    assert torch.isfinite(sc.x).all() and torch.equal(sc.x, want)


def test_router_slots_give_each_distinct_expert_one_slot_and_each_token_its_weight():
    from mimw.megakernel.ops.router import slots

    ids = torch.tensor([[3, 1], [1, 7], [3, 1]])
    w = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5]])
    experts, sw = slots(ids, w, 6)
    assert experts == [1, 3, 7, isa.NO_EXPERT, isa.NO_EXPERT, isa.NO_EXPERT]
    assert torch.equal(sw, torch.tensor([[0.4, 0.9, 0.5], [0.6, 0.0, 0.5], [0.0, 0.1, 0.0], [0.0] * 3,
                                         [0.0] * 3, [0.0] * 3]))
    with pytest.raises(ValueError, match="routing slots"):
        slots(ids, w, 2)
