"""The megakernel's weight packing (launch/pack.py), read back the way the loader and the ops walk it (CPU)."""
import pytest
import torch
import torch.nn.functional as F

from mimw.megakernel.launch.pack import interleave_gate_up, pack, tile_major


@pytest.mark.parametrize("tile_rows", [16, 32])
def test_each_tile_holds_half_a_tile_of_gate_then_the_same_rows_of_up(tile_rows):
    g = torch.Generator().manual_seed(0)
    i, d = 96, 40
    gate, up, h = torch.randn(i, d, generator=g), torch.randn(i, d, generator=g), torch.randn(d, generator=g)
    gu = interleave_gate_up(gate, up, tile_rows)
    half = tile_rows // 2
    expect = F.silu(gate @ h) * (up @ h)
    # an MLP_IN block of outputs [row0, row0 + nrows): the loader streams gu rows [2 row0, 2 (row0 + nrows)) in
    # tile_rows-row tiles; tile t yields outputs row0 + t * half + j from its two halves
    for row0, nrows in [(0, half), (half, 3 * half), (4 * half, i - 4 * half)]:
        rows = gu[2 * row0: 2 * (row0 + nrows)]
        got = []
        for t in range(2 * nrows // tile_rows):
            acc = rows[t * tile_rows: (t + 1) * tile_rows] @ h
            got.append(F.silu(acc[:half]) * acc[half:])
        torch.testing.assert_close(torch.cat(got), expect[row0: row0 + nrows])


def unfold(block: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """A packed tile [TK/32 * TR, 32] (chunk-major) back to its [TR, TK] weights."""
    nf = block.shape[0] // tile_rows
    return block.view(nf, tile_rows, 32).permute(1, 0, 2).reshape(tile_rows, nf * 32)


@pytest.mark.parametrize("rows,k,tile_rows,tile_k", [(64, 512, 32, 256), (32, 576, 16, 512)])
def test_tile_major_stores_every_tile_as_one_contiguous_chunk_major_block(rows, k, tile_rows, tile_k):
    m = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    tiled = tile_major(m, tile_rows, tile_k)
    kt = -(-k // tile_k)
    assert tiled.shape == (rows // tile_rows * kt, tile_k // 32 * tile_rows, 32) and tiled.is_contiguous()
    padded = torch.nn.functional.pad(m, (0, kt * tile_k - k))  # the zero columns past K
    for r in range(rows // tile_rows):
        for c in range(kt):
            want = padded[r * tile_rows: (r + 1) * tile_rows, c * tile_k: (c + 1) * tile_k]
            assert torch.equal(unfold(tiled[r * kt + c], tile_rows), want)
            # chunk j of the block: the tile's rows, columns [32j, 32j + 32): the [TR, 32] operands of the step
            assert torch.equal(tiled[r * kt + c][:tile_rows], want[:, :32])


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"])
def test_every_instructions_span_names_the_tiles_of_its_own_weights(name):
    """The packed tile array, read through each instruction's TileSpan as the loader streams it, holds exactly the
    weight rows and columns the instruction's reference solver multiplies (gu interleaved, lm the tied embedding;
    an expert span resolved for the first, a middle and the last expert, as the loader resolves it)."""
    from mimw.megakernel.isa import EXPERT_SPAN
    from mimw.megakernel.ops.attn_in import AttnIn
    from mimw.megakernel.ops.down_proj import DownProj
    from mimw.megakernel.ops.expert_down import ExpertDown
    from mimw.megakernel.ops.expert_in import ExpertIn
    from mimw.megakernel.ops.router import Router
    from mimw.megakernel.ops.lm_head import LmHead
    from mimw.megakernel.ops.mlp_in import MlpIn
    from mimw.megakernel.ops.o_proj import OProj
    from mimw.megakernel.plan import Tuning
    from mimw.megakernel.program import StepShape, build_program
    from mimw.models.spec import get_preset
    from mimw.models.weights import random_weights

    spec = get_preset(name)
    w = random_weights(spec, seed=2)
    cfg = Tuning(tile_rows=16, tile_k=32).program_config()  # several column tiles, so that parts and halves split
    prog = build_program(spec, StepShape((1,), 16), 8, cfg)
    packed = pack(w, prog.tiles, "cpu")
    tiles = packed.tiles.view(-1, 16, 32).float()  # one [TK/32 * TR, 32] block a tile (16 x 32 tiles here)
    hd = spec.head_dim
    checked = 0
    expected = 0
    for ins in prog.instructions():
        experts = [0, spec.num_experts // 2, spec.num_experts - 1] if ins.flags & EXPERT_SPAN else [None]
        expected += len(experts) if ins.tiles.n_tiles else 0
        for e in experts:
            t = ins.tiles if e is None else ins.tiles.for_expert(e)
            if not t.n_tiles:
                continue
            got = torch.cat([torch.cat([unfold(tiles[t.t0 + r * t.kt + k], 16) for k in range(t.k0, t.k1)], 1)
                             for r in range(t.nr)])
            lw = w.layers[ins.layer] if not isinstance(ins, LmHead) else None
            if isinstance(ins, AttnIn):
                full = torch.cat([lw.wq, lw.wk, lw.wv])[ins.head * hd: (ins.head + 1) * hd]
            elif isinstance(ins, OProj):
                full = lw.wo[ins.row0: ins.row0 + ins.nrows]
            elif isinstance(ins, MlpIn):
                full = interleave_gate_up(lw.w_gate, lw.w_up, 16)[2 * ins.row0: 2 * (ins.row0 + ins.nrows)]
            elif isinstance(ins, DownProj):
                full = lw.w_down[ins.row0: ins.row0 + ins.nrows]
            elif isinstance(ins, Router):  # zero rows past E
                full = torch.nn.functional.pad(lw.router, (0, 0, 0, 16))[ins.row0: ins.row0 + ins.nrows]
            elif isinstance(ins, ExpertIn):
                full = interleave_gate_up(lw.e_gate[e], lw.e_up[e], 16)[2 * ins.row0: 2 * (ins.row0 + ins.nrows)]
            elif isinstance(ins, ExpertDown):
                full = lw.e_down[e][ins.rows(16)]
            else:
                full = w.lm_head[ins.row0: ins.row0 + ins.nrows]
            want = torch.nn.functional.pad(full.float(), (0, t.kt * 32 - full.shape[1]))[:, t.k0 * 32: t.k1 * 32]
            assert torch.equal(got, want.to(torch.bfloat16).float()), (ins, e)
            checked += 1
    assert checked == expected
