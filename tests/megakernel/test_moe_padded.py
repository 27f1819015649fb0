"""A mixture-of-experts model's multi-token step as the engine's megakernel backend runs it: decode tokens padded to
the bucket of their count by padding rows on a page no sequence owns (launch/one_token.split_segments), every row
routed, the padding's too. CPU only: the plans, the buffers the MoE instructions index at the padded width, and the
VM running the padded step over poisoned scratch against the reference decoder over the real tokens."""
import random

import pytest
import torch

from mimw.megakernel import isa
from mimw.megakernel.launch.one_token import bucket_of, split_segments
from mimw.megakernel.plan import MAX_MOE_BATCH, max_tokens, plan
from mimw.megakernel.program import StepShape
from mimw.megakernel.state import alloc_scratch
from mimw.megakernel.tiles import router_rows
from mimw.megakernel.vm import VMDecoder
from mimw.models.moe import top_k
from mimw.models.reference import Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights

from vm_helpers import prefill, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/megakernel/conftest.py

MT = "tiny-qwen3-moe-mt"


def test_only_the_mt_preset_of_the_tiny_moe_models_plans_multi_token_steps():
    """tiny-qwen3-moe's heads of 32 take [16, 512] tiles, which the multi-token step refuses; the -mt preset's heads
    of 64 take [32, 256] tiles and plan every bucket up to plan.MAX_MOE_BATCH, and no more."""
    assert max_tokens(get_preset("tiny-qwen3-moe")) == 1
    with pytest.raises(ValueError, match=r"\[32, 256\]-style tiles"):
        plan(get_preset("tiny-qwen3-moe"), 132, StepShape((1, 1)))
    spec = get_preset(MT)
    assert max_tokens(spec) == MAX_MOE_BATCH == 8
    for m in (2, 4, 8):
        c = plan(spec, 132, StepShape((1,) * m, 1024)).constants
        assert (c.M, c.MB, c.TR, c.TK, c.KT_D, c.KT_F) == (m, 8, 32, 256, 1, 3)
        assert c.S == min(spec.num_experts, m * spec.num_experts_per_tok) and c.EP == 32 and c.EP2 == 16
    with pytest.raises(ValueError, match="at most 8 tokens"):
        plan(spec, 132, StepShape((1,) * 16, 1024))


@pytest.mark.parametrize("real", [2, 3, 5, 6, 7, 8])
def test_a_padded_steps_buffers_hold_the_routing_of_every_row_it_runs(real):
    """The plan of a padded step is the bucket's (N rows, the padding's included), so every buffer an MoE instruction
    indexes is sized for N routed rows: S = min(E, N k) slots (the most distinct experts N rows choose), the routing
    table [L, S], slot_w [S, N], moe_act(16) [S, N, F], moe_part [S, N, D], router_logits [N, Ep]; each slot's
    EXPERT_IN / EXPERT_DOWN blocks cover F and D in whole row tiles, and their spans stay inside their expert."""
    spec = get_preset(MT)
    tables = [tuple(range(4 * i, 4 * i + 4)) for i in range(real)]
    one = split_segments([Segment(t, 5 + i, 1) for i, t in enumerate(tables)], pad_page=4 * real)
    n = one.num_tokens
    assert n == bucket_of(real) and one.padding == n - real
    p = plan(spec, 132, StepShape((1,) * n, 1024, one.blocks))
    s, e, k = p.program.moe_slots, spec.num_experts, spec.num_experts_per_tok
    assert s == p.constants.S == min(e, n * k) >= min(e, real * k)
    x = alloc_scratch(p.program)
    d, f = spec.hidden_size, spec.moe_intermediate_size
    assert tuple(x.routed.shape) == (spec.num_layers, s)
    assert tuple(x.slot_w.shape) == (s, n)
    assert tuple(x.moe_act.shape) == tuple(x.moe_act16.shape) == (s, n, f)
    assert tuple(x.moe_part.shape) == (s, n, d)
    assert tuple(x.router_logits.shape) == (n, router_rows(spec, 32)) == (n, p.constants.EP)
    wt = p.program.tiles
    for layer in spec.moe_layers:
        ins = [i for i in p.program.instructions() if i.layer == layer]
        for op, rows, mat in ((isa.Op.EXPERT_IN, f, "egu"), (isa.Op.EXPERT_DOWN, d, "edown")):
            blocks = [i for i in ins if i.OP == op]
            assert {i.slot for i in blocks} == set(range(s))
            for j in range(s):
                covered = sorted((i.row0, i.tiles.nr) for i in blocks if i.slot == j)
                assert sum(nr for _, nr in covered) * 32 == (2 * rows if op == isa.Op.EXPERT_IN else rows)
            m, li = wt[mat], spec.moe_layers.index(layer)
            per_expert = m.rows // 32 * m.kt // (len(spec.moe_layers) * e)
            layer_end = m.base + (li + 1) * e * per_expert  # the layer's experts' tiles end here
            for i in blocks:
                last_expert_end = i.tiles.t0 + (e - 1) * i.tiles.xs + i.tiles.nr * i.tiles.kt
                assert i.tiles.xs == per_expert and last_expert_end <= layer_end


@pytest.mark.parametrize("real,num_sms", [(3, 132), (5, 132), (7, 7), (2, 132)])
def test_the_vm_runs_a_padded_moe_decode_batch_as_the_reference_runs_its_tokens(real, num_sms):
    """Decode tokens of ``real`` sequences padded to their bucket (one-token padding rows on a page of its own, as
    the engine's backend pads them), two steps, scratch poisoned (NaN, the routing table never written) before each:
    the real rows' logits and every sequence's cache rows are the reference's; the last MoE layer's routing table
    holds exactly the distinct experts of all N rows, padding rows included, ascending, within its S slots."""
    spec = get_preset(MT)
    w = random_weights(spec, seed=3)
    contexts = (37, 15, 60, 23, 9, 44, 30, 2)[:real]
    spec, w, ref, ref_cache, vm_cache, tables, g = prefill(spec, w, 16, contexts, 2, 13)
    pad_page = min(set(range(vm_cache.layout.num_pages)) - {p for t in tables for p in t})
    one = split_segments([Segment(t, c, 1) for t, c in zip(tables, contexts)], pad_page)
    shape = StepShape((1,) * one.num_tokens, 1024, one.blocks)
    p = plan(spec, num_sms, shape)
    dec = VMDecoder(spec, w, vm_cache, num_sms, shape, p.program.config)
    starts = list(contexts)
    for step in range(2):
        segs = [Segment(t, c, 1) for t, c in zip(tables, starts)]
        tokens = torch.randint(0, spec.vocab_size, (real,), generator=g)
        want = ref.forward(tokens, segs, ref_cache)
        one = split_segments(segs, pad_page)
        dec.scratch.poison()
        dec.state.fill(tokens.tolist() + [0] * one.padding, one.positions, one.block_tables,
                       dec.program.shape.seg_lens, one.firsts)
        dec.vm.run_step(dec.state, dec.scratch, random.Random(step))
        got = dec.scratch.logits[list(one.logit_rows)]
        assert torch.isfinite(got).all() and rel_err(got, want) <= 1e-5, rel_err(got, want)
        last = spec.moe_layers[-1]
        _, ids = top_k(dec.scratch.router_logits[:, : spec.num_experts], spec)  # the last MoE layer's, all N rows
        union = sorted(set(ids.flatten().tolist()))
        epoch = dec.state.epoch - 1
        table = [isa.routed_expert(int(v), epoch) for v in dec.scratch.routed[last]]
        assert len(union) <= dec.program.moe_slots == len(table)
        assert table[: len(union)] == union and set(table[len(union):]) <= {isa.NO_EXPERT}
        starts = [c + 1 for c in starts]
    pages = sorted({p for t in tables for p in t})  # the sequences' pages (the padding wrote only its own)
    for a, b in ((vm_cache.k, ref_cache.k), (vm_cache.v, ref_cache.v)):
        assert rel_err(a[:, pages], b[:, pages]) <= 1e-5
