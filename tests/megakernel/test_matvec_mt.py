"""CPU: the multi-token matvec's operand arithmetic (device/matvec_mt.py, one wgmma a chunk pair, the pair's two
staged chunks side by side as B) emulated in PyTorch over the tiles launch/pack.py packs, against a plain matmul."""
import pytest
import torch

from mimw.megakernel.device.matvec_mt import dot_tile_torch, fold_torch, staged_torch
from mimw.megakernel.launch.pack import tile_major

TR, TK = 32, 256


@pytest.mark.parametrize("m,mb", [(1, 8), (3, 8), (8, 8), (11, 16), (16, 16), (32, 32)])
@pytest.mark.parametrize("k", [576, 2048])
def test_chunk_pair_products_fold_to_the_row_tiles_matvec(m, mb, k):
    g = torch.Generator().manual_seed(1000 * m + k)
    n_row_tiles = 3
    w = torch.randn(n_row_tiles * TR, k, generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    kt = -(-k // TK)
    tiles = tile_major(w, TR, TK)  # [row tiles * KT, TR * TK / 32, 32]: tile (r, c) at r * KT + c
    xs = staged_torch(x, mb, kt * TK // 32)
    want = w.float() @ x.float().T  # [rows, M]
    for r in range(n_row_tiles):
        got = dot_tile_torch(tiles[r * kt:(r + 1) * kt], xs, mb)
        assert got.shape == (TR, mb)
        torch.testing.assert_close(got[:, :m], want[r * TR:(r + 1) * TR], rtol=1e-5, atol=1e-4)
        assert torch.all(got[:, m:] == 0)  # padding tokens stage zeros


def test_the_fold_reads_only_the_even_chunks_rows_by_even_columns_and_the_odd_by_odd():
    """acc[r, t] (r < 32, t < MB) and acc[32 + r, MB + t] are the pair's products; the other two quarters are the
    chunks' products against the wrong chunk and must not reach the sums: poisoned with NaN here."""
    mb = 16
    acc = torch.randn(64, 2 * mb)
    poisoned = acc.clone()
    poisoned[:32, mb:] = float("nan")
    poisoned[32:, :mb] = float("nan")
    got = fold_torch(poisoned, mb)
    assert torch.equal(got, acc[:32, :mb] + acc[32:, mb:])


def test_a_pair_is_two_consecutive_chunks_of_the_staging_buffer():
    """xs row c * MB + t is chunk c of token t, so the [2 MB, 32] pair p holds chunk 2p's tokens then chunk 2p + 1's
    (the pair view the kernel reinterprets the buffer as)."""
    mb, m, k = 8, 5, 512
    x = torch.randn(m, k).to(torch.bfloat16)
    pairs = staged_torch(x, mb, k // 32).view(-1, 2 * mb, 32)
    p = 3
    assert torch.equal(pairs[p, :m], x[:, 64 * p: 64 * p + 32])
    assert torch.equal(pairs[p, mb:mb + m], x[:, 64 * p + 32: 64 * p + 64])
    assert torch.all(pairs[p, m:mb] == 0) and torch.all(pairs[p, mb + m:] == 0)


@pytest.mark.parametrize("model,m", [("tiny-qwen3-moe-mt", 2), ("tiny-qwen3-moe-mt", 8), ("smollm2-135m", 8),
                                     ("smollm2-135m", 32), ("llama-3.2-1b", 16), ("llama-3.1-8b", 16),
                                     ("qwen3-30b-a3b", 8)])
def test_the_norm_passes_read_only_the_norm_buffer_and_the_staging_buffer(model, m):
    """stage_normed's shared-memory passes go over the hidden size's chunks a pass of ``norm_pass`` chunks at a time,
    reading the norm weights' buffer (wbuf_rows chunks) and the staging buffer at each: the chunks they read, rounded
    up to whole passes, lie inside both. A hidden size of one column tile (the tiny MoE model's 64: 8 chunks, a
    buffer of 8) must not be read in rounds of 16."""
    from mimw.megakernel.device.matvec_mt import norm_reads, wbuf_rows
    from mimw.megakernel.plan import plan
    from mimw.megakernel.program import StepShape
    from mimw.models.spec import get_preset

    c = plan(get_preset(model), 132, StepShape((1,) * m, 1024)).constants
    n = c.KT_D * (c.TK // 32)
    assert n <= norm_reads(c) <= wbuf_rows(c)
    assert norm_reads(c) <= c.KT_ROWS * (c.TK // 32)
