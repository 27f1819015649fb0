"""The packed tile array's MoE matrices (tiles.py), read back the way a loader resolves the expert spans.

The array is packed here as tiles.py lays it out (router rows padded to whole row tiles, each expert's gate/up rows
interleaved as MLP_IN's, its down rows), with launch/pack.py's tile_major and interleave_gate_up; then every
ROUTER, EXPERT_IN and EXPERT_DOWN instruction of a program, its span resolved for each expert e (TileSpan.for_expert,
the stride in the words), must gather exactly expert e's rows of its block."""
import pytest
import torch
import torch.nn.functional as F

from mimw.megakernel import isa
from mimw.megakernel.launch.pack import interleave_gate_up, tile_major
from mimw.megakernel.program import ProgramConfig, StepShape, build_program
from mimw.megakernel.tiles import WeightTiles, router_rows
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights


def pack_moe(w, wt: WeightTiles) -> torch.Tensor:
    """[num_tiles, TR, TK]: the MoE matrices' tiles in place (the rest zero), each unfolded from its chunk-major
    block back to [TR, TK]."""
    spec, tr, tk = w.spec, wt.tile_rows, wt.tile_k
    out = torch.zeros(wt.num_tiles, tr, tk)
    fk = min(32, tk)
    layers = [w.layers[l] for l in spec.moe_layers]
    blocks = {"router": [F.pad(lw.router, (0, 0, 0, router_rows(spec, tr) - spec.num_experts)) for lw in layers],
              "egu": [interleave_gate_up(lw.e_gate[e], lw.e_up[e], tr) for lw in layers
                      for e in range(spec.num_experts)],
              "edown": [lw.e_down[e] for lw in layers for e in range(spec.num_experts)]}
    for name, mats in blocks.items():
        t = wt[name].base
        for m in mats:
            tiles = tile_major(m, tr, tk)  # [n, TK/FK * TR, FK] chunk-major
            unfolded = tiles.view(len(tiles), tk // fk, tr, fk).permute(0, 2, 1, 3).reshape(-1, tr, tk)
            out[t: t + len(tiles)] = unfolded
            t += len(tiles)
    return out


def gather(tiles: torch.Tensor, span: isa.TileSpan, cols: int) -> torch.Tensor:
    """The rows a resolved span streams, [nr * TR, cols] (its column tiles side by side)."""
    got = tiles[span.tiles()]  # [nr * (k1 - k0), TR, TK]
    nk = span.k1 - span.k0
    rows = got.view(span.nr, nk, *got.shape[1:]).permute(0, 2, 1, 3).reshape(span.nr * got.shape[1], -1)
    return rows[:, :cols]


@pytest.mark.parametrize("tile_rows, tile_k, experts", [(16, 512, 16), (16, 16, 12), (32, 32, 8)])
def test_expert_spans_resolve_to_each_experts_rows_in_the_packed_array(tile_rows, tile_k, experts):
    spec = get_preset("tiny-qwen3-moe").with_(num_experts=experts, num_experts_per_tok=2)
    w = random_weights(spec, seed=3)
    prog = build_program(spec, StepShape((1, 1)), 7, ProgramConfig(tile_rows=tile_rows, tile_k=tile_k,
                                                                     max_block_bytes=4096))
    tiles = pack_moe(w, prog.tiles)
    d, seen = spec.hidden_size, set()
    for ins in prog.instructions():
        lw = w.layers[ins.layer]
        if ins.OP == isa.Op.ROUTER:
            want = F.pad(lw.router, (0, 0, 0, router_rows(spec, tile_rows) - experts))[ins.row0: ins.row0 + ins.nrows]
            assert torch.equal(gather(tiles, ins.tiles, d), want)
        elif ins.OP in (isa.Op.EXPERT_IN, isa.Op.EXPERT_DOWN):
            assert ins.encode()[isa.XS_WORD] == ins.tiles.xs  # the stride travels in the words
            for e in (0, experts // 2, experts - 1):
                span = ins.tiles.for_expert(e)
                if ins.OP == isa.Op.EXPERT_IN:
                    gu = interleave_gate_up(lw.e_gate[e], lw.e_up[e], tile_rows)
                    want = gu[2 * ins.row0: 2 * (ins.row0 + ins.nrows)]
                    assert torch.equal(gather(tiles, span, d), want)
                else:
                    rows = ins.rows(tile_rows)
                    assert torch.equal(gather(tiles, span, spec.moe_intermediate_size), lw.e_down[e][rows])
                seen.add(ins.OP)
            assert ins.tiles.for_expert(isa.NO_EXPERT).n_tiles == 0
    assert seen == {isa.Op.EXPERT_IN, isa.Op.EXPERT_DOWN}


def test_a_dense_model_has_empty_moe_matrices_and_its_layout_unchanged():
    spec = get_preset("llama-3.2-1b")
    wt = WeightTiles.for_spec(spec, 32, 256)
    assert all(wt[m].rows == 0 for m in ("router", "egu", "edown"))
    assert wt.num_tiles == wt["lm"].base + spec.vocab_size // 32 * 8
    with pytest.raises(ValueError, match="expert matrix"):
        wt.expert_stride("egu")


def test_an_expert_whose_rows_are_not_whole_tiles_is_refused():
    spec = get_preset("tiny-qwen3-moe").with_(moe_intermediate_size=20)  # 40 gate/up rows: not 16-row tiles
    with pytest.raises(ValueError, match="whole 16-row tiles"):
        WeightTiles.for_spec(spec, 16, 512)
