"""The megakernel's gate/up packing, read back the way MLP_IN's loader and ``matvec.gated_rows`` walk it (CPU)."""
import pytest
import torch
import torch.nn.functional as F

from mimw.megakernel.gpu.pack import interleave_gate_up, tile_major


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


@pytest.mark.parametrize("rows,k,tile_rows,tile_k", [(64, 512, 32, 256), (32, 576, 16, 512)])
def test_tile_major_stores_every_tile_contiguously_where_the_loader_addresses_it(rows, k, tile_rows, tile_k):
    m = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    tiled = tile_major(m, tile_rows, tile_k)
    kt = -(-k // tile_k)
    assert tiled.shape == (rows * kt, tile_k) and tiled.is_contiguous()
    padded = torch.nn.functional.pad(m, (0, kt * tile_k - k))  # TMA's zero fill past K, made explicit
    for r in range(rows // tile_rows):
        for c in range(kt):
            row = (r * kt + c) * tile_rows  # the loader's TMA coordinate (orchestration.producer_weight_rows, TILED)
            assert torch.equal(tiled[row: row + tile_rows], padded[r * tile_rows: (r + 1) * tile_rows,
                                                                   c * tile_k: (c + 1) * tile_k])
