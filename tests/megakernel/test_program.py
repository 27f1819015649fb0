from dataclasses import replace

import pytest

from mimw.megakernel import isa
from mimw.megakernel.ops.attn_in import AttnIn
from mimw.megakernel.ops.attn_partial import AttnPartial
from mimw.megakernel.ops.down_proj import DownProj
from mimw.megakernel.ops.lm_head import LmHead
from mimw.megakernel.ops.mlp_in import MlpIn
from mimw.megakernel.ops.o_proj import OProj
from mimw.megakernel.plan import Tuning
from mimw.megakernel.program import ProgramConfig, StepShape, build_program, qkv_parts, row_blocks
from mimw.megakernel.state import split_range
from mimw.megakernel.tiles import WeightTiles, column_part
from mimw.models.spec import get_preset


def shipping(name: str) -> ProgramConfig:
    """The program config the GPU kernel runs for this preset (plan.Tuning's defaults)."""
    return Tuning().resolve(get_preset(name)).program_config()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "smollm2-135m", "llama-3.2-1b"])
@pytest.mark.parametrize("num_sms", [1, 7, 132])
@pytest.mark.parametrize("seg_lens", [(1,), (4,), (1, 1, 1, 1)])
def test_program_covers_every_output_once(name, num_sms, seg_lens):
    spec = get_preset(name)
    prog = build_program(spec, StepShape(seg_lens, 100), num_sms, shipping(name))
    prog.validate()
    ins = list(prog.instructions())
    by = lambda t: [i for i in ins if isinstance(i, t)]  # noqa: E731
    n = prog.qkv_parts
    assert sorted((i.layer, i.head, i.part, i.n_parts) for i in by(AttnIn)) == [
        (l, h, p, n) for l in range(spec.num_layers) for h in range(spec.num_heads + 2 * spec.num_kv_heads)
        for p in range(n)]
    for t, total in [(OProj, spec.hidden_size), (MlpIn, spec.intermediate_size), (DownProj, spec.hidden_size)]:
        for l in range(spec.num_layers):
            rows = sorted({(i.row0, i.nrows) for i in by(t) if i.layer == l})
            assert sum(n for _, n in rows) == total
            assert all(a + n == b for (a, n), (b, _) in zip(rows, rows[1:]))
    assert sum(i.nrows for i in by(LmHead)) == spec.vocab_size
    parts = by(AttnPartial)
    assert len(parts) == spec.num_layers * spec.num_kv_heads * sum(prog.n_splits)
    # every weight tile of the model streamed exactly once, by the instruction that owns its rows and columns
    tiles = [t for i in ins for r in range(i.tiles.nr)
             for t in range(i.tiles.t0 + r * i.tiles.kt + i.tiles.k0, i.tiles.t0 + r * i.tiles.kt + i.tiles.k1)]
    assert sorted(tiles) == list(range(prog.tiles.num_tiles))


def test_queues_are_in_stage_order_so_no_wait_cycle_can_form():
    spec = get_preset("tiny-llama")
    prog = build_program(spec, StepShape((1,), 64), 7, shipping("tiny-llama"))
    order = {op: k for k, op in enumerate([isa.Op.ATTN_IN, isa.Op.ATTN_PARTIAL, isa.Op.O_PROJ, isa.Op.MLP_IN,
                                           isa.Op.DOWN_PROJ])}
    for q in prog.queues:
        keys = [(i.layer, order[i.OP]) if i.OP != isa.Op.LM_HEAD else (spec.num_layers, 0) for i in q]
        assert keys == sorted(keys)


def test_cost_model_balances_sms():
    prog = build_program(get_preset("llama-3.2-1b"), StepShape((1,), 1024), 132, shipping("llama-3.2-1b"))
    assert max(prog.costs) / min(prog.costs) < 1.05


def test_row_blocks_are_whole_tiles_and_reject_ragged_rows():
    cfg = ProgramConfig(tile_rows=16)
    blocks = row_blocks(2048, 4096, 132, cfg)
    assert all(n % 16 == 0 for _, n in blocks) and sum(n for _, n in blocks) == 2048
    with pytest.raises(ValueError, match="granule"):
        row_blocks(100, 64, 4, cfg)


def test_mlp_in_blocks_come_in_half_tiles_so_the_8b_stage_balances():
    # a weight tile holds tile_rows/2 gate + tile_rows/2 up rows: 8B's 14336 outputs make 896 16-row blocks, so
    # 132 SMs run 6 or 7 (makespan 3% over the mean) instead of 448 32-row blocks at 3 or 4 (18% over)
    prog = build_program(get_preset("llama-3.1-8b"), StepShape((1,), 1024), 132, ProgramConfig(max_block_bytes=256 << 10))
    mlp = [i for i in prog.instructions() if isinstance(i, MlpIn) and i.layer == 0]
    assert {i.nrows for i in mlp} == {16} and len(mlp) == 896
    per_sm = [sum(isinstance(i, MlpIn) and i.layer == 0 for i in q) for q in prog.queues]
    assert max(per_sm) == 7


@pytest.mark.parametrize("ctx,n,new", [(1, 16, 1), (17, 4, 1), (1000, 16, 1), (8191, 16, 1), (5, 5, 1),
                                       (1025, 16, 1), (8193, 16, 1), (40, 16, 4), (4, 3, 4)])
def test_split_ranges_partition_the_context(ctx, n, new):
    ranges = [split_range(ctx, s, n, new) for s in range(n)]
    covered = [p for lo, hi in ranges for p in range(lo, hi)]
    assert covered == list(range(ctx))
    assert all(p in range(*ranges[-1]) for p in range(ctx - new, ctx))  # the last split holds the step's tokens
    past = -(-(ctx - new) // n)  # and no split more than its share of the past
    assert all(min(hi, ctx - new) - lo <= past for lo, hi in ranges)


def test_split_ranges_keep_the_past_in_whole_blocks():
    """Context 1024 (+1 new) on 16 splits: 64 past positions a split, one 64-position block on the GPU (the new row
    in the last split, read after the wait), not 65 positions and two blocks in every split."""
    assert [split_range(1025, s, 16) for s in (0, 1, 15)] == [(0, 64), (64, 128), (960, 1025)]


@pytest.mark.parametrize("k,tile_k,n", [(2048, 256, 3), (4096, 256, 3), (576, 256, 2), (64, 16, 3), (4096, 256, 16)])
def test_column_parts_are_whole_tiles_covering_every_column_once(k, tile_k, n):
    ranges = [column_part(k, tile_k, p, n) for p in range(n)]
    assert ranges[0][0] == 0 and ranges[-1][1] == k
    assert all(a1 == b0 for (_, a1), (b0, _) in zip(ranges, ranges[1:]))
    assert all(c0 % tile_k == 0 and c1 > c0 for c0, c1 in ranges)


def test_attn_in_is_split_so_that_a_layers_heads_cover_the_sms():
    cfg = ProgramConfig(clusters=False)  # the tickets' cost model (with clusters: two parts, a pair)
    for name in ("llama-3.2-1b", "llama-3.1-8b"):  # 48 heads per layer for 132 SMs
        n = qkv_parts(get_preset(name), 132, cfg)
        assert 1 < n and 48 * n <= 132  # split, and every part of a layer runs at once (one round)
        assert qkv_parts(get_preset(name), 132, ProgramConfig()) == 2
    assert qkv_parts(get_preset("llama-3.1-8b"), 1, cfg) == 1  # one SM: splitting only adds fixed costs
    with pytest.raises(ValueError, match="qkv_parts"):
        build_program(get_preset("tiny-llama"), StepShape((1,)), 7, ProgramConfig(tile_rows=16, qkv_parts=2))


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b"])
def test_cluster_pairs_put_each_head_of_a_layer_on_its_own_cluster(name):
    """The shipping program at the real shapes on 132 SMs: a layer's 48 heads on 48 of the 66 clusters (one pair
    each, part 0 on the even SM), the mates' k-th pair instructions the same head, and no ticket counters."""
    spec = get_preset(name)
    prog = build_program(spec, StepShape((1,), 1024), 132, ProgramConfig())
    heads = spec.num_heads + 2 * spec.num_kv_heads
    for layer in range(spec.num_layers):
        where = {}
        for s, q in enumerate(prog.queues):
            for ins in q:
                if ins.OP == isa.Op.ATTN_IN and ins.layer == layer:
                    assert ins.part == s % 2 and ins.flags & isa.CLUSTER_PAIR
                    where.setdefault(ins.head, []).append(s)
        assert len(where) == heads and all(len(v) == 2 and v[1] == v[0] + 1 for v in where.values())
        assert len({v[0] for v in where.values()}) == heads  # one head a cluster
    assert not any("qkv_ticket" in c.name for c in prog.counters)


@pytest.mark.parametrize("name,paired", [("llama-3.2-1b", True), ("llama-3.1-8b", False)])
def test_down_proj_pairs_where_its_row_blocks_leave_half_the_sms_idle(name, paired):
    """On 132 SMs the 1B's 64 DOWN_PROJ row tiles a layer become 64 pairs of column halves on 64 of the 66
    clusters (128 SMs); the 8B's 128 row tiles fill the SMs already and stay whole."""
    spec = get_preset(name)
    prog = build_program(spec, StepShape((1,), 1024), 132, ProgramConfig())
    from mimw.megakernel.program import cluster_mate_errors

    assert cluster_mate_errors(prog.queues) == []
    for layer in (0, spec.num_layers - 1):
        downs = [(s, i) for s, q in enumerate(prog.queues) for i in q if i.OP == isa.Op.DOWN_PROJ and i.layer == layer]
        sms = {s for s, _ in downs}
        if paired:
            assert len(downs) == 128 and len(sms) == 128 and all(i.part == s % 2 and i.n_parts == 2 for s, i in downs)
        else:
            assert len(downs) == 128 and all(not i.flags & isa.CLUSTER_PAIR and i.n_parts == 0 for _, i in downs)
    count = next(c.count for c in prog.counters if c.name == "L0.down_proj")
    assert count == (64 if paired else 128)


def test_no_cluster_pairs_where_the_shape_cannot_form_them():
    spec = get_preset("llama-3.2-1b")
    for sms, cfg in ((131, ProgramConfig()), (132, ProgramConfig(clusters=False))):
        prog = build_program(spec, StepShape((1,), 1024), sms, cfg)
        assert not prog.attn_pairs and not prog.down_pairs and prog.qkv_parts > 1
        assert any("qkv_ticket" in c.name for c in prog.counters)  # the parts join through tickets instead


def test_shipping_config_is_the_scheduler_default_at_32_row_tiles():
    assert shipping("llama-3.2-1b") == ProgramConfig() == shipping("llama-3.1-8b")
    assert shipping("tiny-qwen3") == ProgramConfig(tile_rows=16, tile_k=512)  # a head of 32 rows: 16-row tiles


def test_weight_tiles_span_rows_and_columns_of_each_matrix():
    spec = get_preset("llama-3.2-1b")
    wt = WeightTiles.for_spec(spec, 32, 256)
    qkv, o = wt["qkv"], wt["o"]
    assert qkv.base == 0 and qkv.kt == 8 and o.base == qkv.rows // 32 * 8
    assert wt.span("o", 64, 96) == isa.TileSpan(o.base + 2 * o.kt, 3, 0, o.kt, o.kt)
    assert wt.span("qkv", 0, 64, 4, 8).n_tiles == 8
    assert wt.num_tiles * wt.tile_bytes == 2 * sum(m.rows * m.kt * 256 for _, m in wt.matrices)
    with pytest.raises(ValueError, match="whole"):
        wt.span("o", 16, 32)


# --- MoE programs ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "qwen3-30b-a3b"])
@pytest.mark.parametrize("num_sms", [1, 7, 132])
@pytest.mark.parametrize("seg_lens", [(1,), (4,), (1, 1, 1, 1)])
def test_moe_program_covers_every_slot_and_row_once(name, num_sms, seg_lens):
    from mimw.megakernel.ops.expert_down import ExpertDown
    from mimw.megakernel.ops.expert_in import ExpertIn
    from mimw.megakernel.ops.router import Router

    spec = get_preset(name)
    if name == "qwen3-30b-a3b":
        spec = spec.with_(num_layers=2)  # the real widths, fewer layers: CPU time
        if num_sms != 132:
            return
    prog = build_program(spec, StepShape(seg_lens, 100), num_sms, Tuning().resolve(spec).program_config())
    prog.validate()
    s = prog.moe_slots
    assert s == min(spec.num_experts, sum(seg_lens) * spec.num_experts_per_tok)
    ins = list(prog.instructions())
    by = lambda t, l: [i for i in ins if isinstance(i, t) and i.layer == l]  # noqa: E731
    tr = prog.config.tile_rows
    for l in range(spec.num_layers):
        if not spec.is_moe_layer(l):
            assert not by(Router, l) and by(MlpIn, l) and by(DownProj, l)
            continue
        assert not by(MlpIn, l) and not by(DownProj, l)
        routers = by(Router, l)
        assert sum(i.nrows for i in routers) >= spec.num_experts and {i.n_parts for i in routers} == {len(routers)}
        assert len({i.signal for i in routers}) == 1 and prog.counters[routers[0].signal].count == 1
        for j in range(s):
            rows_in = sorted((i.row0, i.nrows) for i in by(ExpertIn, l) if i.slot == j)
            assert sum(n for _, n in rows_in) == spec.moe_intermediate_size
            assert all(a + n == b for (a, n), (b, _) in zip(rows_in, rows_in[1:]))
            downs = sorted((i.row0, i.tiles.nr * tr) for i in by(ExpertDown, l) if i.slot == j)
            assert sum(n for _, n in downs) == spec.hidden_size
        for i in by(ExpertIn, l) + by(ExpertDown, l):
            assert i.flags & isa.EXPERT_SPAN and i.tiles.xs > 0
        assert all(i.n_slots == s and (i.ticket == isa.NO_COUNTER) == (s == 1) for i in by(ExpertDown, l))
    # every weight tile streamed exactly once, the expert matrices' once per expert by a slot's spans
    tiles = []
    for i in ins:
        if i.flags & isa.EXPERT_SPAN:
            if i.slot == 0:
                tiles += [t for e in range(spec.num_experts) for t in i.tiles.for_expert(e).tiles()]
        else:
            tiles += i.tiles.tiles()
    assert sorted(tiles) == list(range(prog.tiles.num_tiles))


def test_moe_queues_are_in_stage_order_so_no_wait_cycle_can_form():
    spec = get_preset("tiny-qwen3-moe")
    prog = build_program(spec, StepShape((1, 1), 64), 7, Tuning().resolve(spec).program_config())
    order = {op: k for k, op in enumerate([isa.Op.ATTN_IN, isa.Op.ATTN_PARTIAL, isa.Op.O_PROJ, isa.Op.MLP_IN,
                                           isa.Op.DOWN_PROJ, isa.Op.ROUTER, isa.Op.EXPERT_IN, isa.Op.EXPERT_DOWN])}
    for q in prog.queues:
        keys = [(i.layer, order[i.OP]) if i.OP != isa.Op.LM_HEAD else (spec.num_layers, 0) for i in q]
        assert keys == sorted(keys)
    # a slot's down projection waits for its own slot's gate/up only
    for i in prog.instructions():
        if i.OP == isa.Op.EXPERT_DOWN:
            assert prog.counters[i.wait].name == f"L{i.layer}.expert_in.s{i.slot}"


def test_row_blocks_price_copies_of_a_stage():
    cfg = ProgramConfig()
    one = row_blocks(768, 2 * 2048 * 2, 132, cfg, 16)
    eight = row_blocks(768, 2 * 2048 * 2, 132, cfg, 16, copies=8)
    assert len(eight) < len(one)  # eight slots fill the SMs with fewer, larger blocks each
    assert sum(n for _, n in eight) == 768


@pytest.mark.parametrize("name,num_sms,seg_lens", [("tiny-qwen3-moe", 8, (1,)), ("tiny-qwen3-moe", 5, (1, 1, 1)),
                                                   ("qwen3-30b-a3b", 132, (1,))])
def test_no_loader_can_wait_on_a_router_that_waits_for_it(name, num_sms, seg_lens):
    """The GPU loader stops at an expert span until its layer's router has stored the routing entry (device/ring.py):
    every queue places all of a layer's ROUTER parts, and all they wait for, before its expert instructions."""
    from mimw.megakernel.program import loader_wait_errors

    prog = build_program(get_preset(name), StepShape(seg_lens), num_sms)
    assert any(ins.flags & isa.EXPERT_SPAN for ins in prog.instructions())
    assert loader_wait_errors(prog.queues, prog.spec.num_layers) == []
    # a queue whose ROUTER part came after one of its own layer's expert instructions is caught
    q = next(q for q in prog.queues if any(i.OP == isa.Op.ROUTER for i in q)
             and any(i.flags & isa.EXPERT_SPAN for i in q))
    r = next(k for k, i in enumerate(q) if i.OP == isa.Op.ROUTER)
    x = next(k for k, i in enumerate(q) if i.flags & isa.EXPERT_SPAN and i.layer == q[r].layer)
    q[r], q[x] = q[x], q[r]
    assert loader_wait_errors(prog.queues, prog.spec.num_layers)


def test_query_blocks_are_one_attention_instruction_per_block_kv_head_and_split():
    spec = get_preset("llama-3.2-1b")
    shape = StepShape((1,) * 16, 1024, (1, 5, 1, 6, 3))
    prog = build_program(spec, shape, 132, Tuning().resolve(spec).program_config())
    attn = [i for i in prog.instructions() if isinstance(i, AttnPartial) and i.layer == 0]
    assert shape.attn_groups == ((0, 1), (1, 5), (6, 1), (7, 6), (13, 3))
    assert shape.query_tokens(7, 6) == slice(7, 13) and shape.query_tokens(2) == slice(2, 3)
    assert sorted({(i.seg, i.tokens) for i in attn}) == list(shape.attn_groups)
    assert len(prog.n_splits) == 5 and len(attn) == spec.num_kv_heads * sum(prog.n_splits)
    o_proj = next(i for i in prog.instructions() if isinstance(i, OProj) and i.layer == 0)
    assert o_proj.wait_count == spec.num_kv_heads * 5  # one combine a (block, KV head) signals
    # one block alone: the SMs a KV head as M = 1 has them (16), capped by 256-position splits at the 1024 hint
    cfg = Tuning().resolve(spec).program_config()
    one = build_program(spec, StepShape((1,) * 16, 1024, (16,)), 132, cfg)
    assert one.n_splits == (4,) and build_program(spec, StepShape((1,), 1024), 132).n_splits == (16,)
    fine = build_program(spec, StepShape((1,) * 16, 1024, (16,)), 132, replace(cfg, min_block_split_tokens=32))
    assert fine.n_splits == (16,)
    for bad in ((4, 4), (16, 1), (0, 16)):
        with pytest.raises(ValueError, match="attn_blocks"):
            StepShape((1,) * 16, 1024, bad)
    with pytest.raises(ValueError, match="attn_blocks"):
        StepShape((2, 1), 1024, (2,))
