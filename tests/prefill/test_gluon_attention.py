"""The Gluon attention's host side on the CPU: its PyTorch walk (``attend_torch``: the kernel's programs, block-table
reads, boxes, masks, zeroed V rows and pipelined rescale) against the reference decoder's attention over a cache
whose unwritten rows are NaN; its tiles; the passes it hands to the Triton kernel (short ones, an fp8 cache);
and its refusal on the CPU. The kernel itself runs in the GPU
tests (test_prefill_gpu.py) and compiles in test_compile_sm90.py."""
import pytest
import torch

from mimw.kv import fp8
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights
from mimw.prefill import PrefillConfig, PrefillRunner
from mimw.prefill.batch import Piece, PrefillBatch
from mimw.prefill.gathered_attention import torch_attention
from mimw.prefill.gluon_attention import GROUPED_ROWS, GluonTiles, attend_torch

PS = 16


def _case(hd: int, hq: int, hkv: int, seed: int):
    """A pass of four pieces over shuffled pages, every position past a piece's context NaN (never written): one
    with a 300-token prefix in the cache (context not a multiple of a page), one fresh whose length is not a
    multiple of a tile, a 5-token verify block after a prefix, and a fresh 130-token one (two query blocks)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(300, 221), (0, 333), (640, 5), (0, 130)]  # (start, length)
    need = [-(-(s + n) // PS) for s, n in shapes]
    pages = sum(need) + 3
    perm = torch.randperm(pages, generator=g).tolist()
    pieces, i = [], 0
    for (s, n), k in zip(shapes, need):
        pieces.append(Piece(tuple(perm[i:i + k]), s, n))
        i += k
    batch = PrefillBatch.build(pieces, PS, "cpu")
    k_layer = torch.full((pages, hkv, PS, hd), float("nan"), dtype=torch.bfloat16)
    v_layer = torch.full_like(k_layer, float("nan"))
    for p in pieces:
        pos = torch.arange(p.ctx)
        pg = torch.tensor(p.block_table)[pos // PS]
        k_layer[pg, :, pos % PS] = (2 * torch.randn(p.ctx, hkv, hd, generator=g)).bfloat16()
        v_layer[pg, :, pos % PS] = torch.randn(p.ctx, hkv, hd, generator=g).bfloat16()
    q = torch.randn(batch.num_tokens, hq, hd, generator=g).bfloat16()
    return q, k_layer, v_layer, batch


@pytest.mark.parametrize("hd,hq,hkv,block_n,block_m", [(64, 4, 2, 128, None), (128, 6, 2, 128, None),
                                                        (64, 2, 1, 64, None), (64, 4, 2, 128, 128)])
def test_the_kernels_walk_is_the_reference_attention(hd, hq, hkv, block_n, block_m):
    """Every tiling the kernel takes: hd 64's three warpgroups (192 rows a program; also two), hd 128's two."""
    q, k, v, batch = _case(hd, hq, hkv, seed=hd + hq)
    want = torch_attention(q, k, v, batch)
    got = attend_torch(q, k, v, batch, block_n, block_m)
    assert torch.isfinite(got).all()  # every row written, no NaN from the unwritten rows past a context
    # P in bf16 (as the kernel's PV wgmma takes it) against the reference's fp32 softmax
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_rows_past_the_context_never_count():
    """The last tile's rows past the context (zeroed V, masked K) contribute nothing, whatever the pages hold."""
    q, k, v, batch = _case(64, 2, 1, seed=3)
    v2 = v.clone()
    k2 = k.clone()
    v2[torch.isnan(v2)] = 1e4  # finite garbage instead of NaN
    k2[torch.isnan(k2)] = 1e4
    assert torch.equal(attend_torch(q, k2, v2, batch), attend_torch(q, k, v, batch))


def test_tiles_fit_shared_memory_and_refuse_other_head_dims():
    for hd in (64, 128):
        t = GluonTiles.for_head_dim(hd, 4, 8)
        assert t.shared_bytes <= 227 * 1024 and t.BLOCK_N % t.PS == 0
        assert t.HC == hd // 64
    assert GluonTiles.for_head_dim(64, 4, 8).NB == 8 and GluonTiles.for_head_dim(128, 4, 8).NB == 2
    assert GluonTiles.for_head_dim(64, 4, 8).block_m == 192 and GluonTiles.for_head_dim(128, 4, 8).block_m == 128
    with pytest.raises(ValueError, match="3 at head_dim 64"):
        GluonTiles(128, 4, 8, WGS=3)
    with pytest.raises(ValueError, match="head_dim 64 or 128"):
        GluonTiles.for_head_dim(96, 4, 8)
    with pytest.raises(ValueError, match="page_size"):
        GluonTiles(64, 4, 8, PS=12)
    assert GROUPED_ROWS == 128


def test_each_paged_kernel_takes_its_own_tiles():
    from mimw.prefill import AttentionTiles

    PrefillConfig("gluon", tiles=GluonTiles.for_head_dim(64, 4, 8))
    PrefillConfig("triton", tiles=AttentionTiles())
    with pytest.raises(ValueError, match="takes GluonTiles"):
        PrefillConfig("gluon", tiles=AttentionTiles())
    with pytest.raises(ValueError, match="takes AttentionTiles"):
        PrefillConfig("triton", tiles=GluonTiles.for_head_dim(64, 4, 8))


def test_gluon_is_the_serving_attention_and_is_refused_on_the_cpu():
    assert PrefillConfig().attention == "gluon"
    w = random_weights(get_preset("smollm2-135m").with_(num_layers=1), seed=0)
    with pytest.raises(ValueError, match="runs on CUDA only"):
        PrefillRunner(w, PrefillConfig("gluon"))


class _Triton:
    """Stands in for the paged Triton kernel: records the passes planned on it and what their runs were given."""

    def __init__(self):
        self.planned, self.ran = [], []

    def plan(self, batch):
        self.planned.append(batch)
        return lambda *args: self.ran.append(args) or "triton"


def test_short_passes_and_an_fp8_cache_run_on_the_triton_kernel():
    """The Gluon attention's plan: a pass of pieces of at most GROUPED_ROWS rows is the Triton kernel's run itself; a
    longer pass runs the Gluon kernel over a bf16 cache and the Triton kernel where the layer comes with its fp8
    scales."""
    from mimw.prefill.gluon_attention import GluonAttention

    att = GluonAttention()
    att._triton = _Triton()
    short_batch = type("B", (), {"pieces": [Piece(tuple(range(8)), 0, GROUPED_ROWS, 1)]})()
    assert att.plan(short_batch)() == "triton"
    long_batch = type("B", (), {"pieces": [Piece(tuple(range(16)), 0, GROUPED_ROWS + 1, 1)]})()
    run = att.plan(long_batch)
    q, k, v, ks, vs = (torch.zeros(1) for _ in range(5))
    assert run(q, k, v, ks, vs) == "triton" and att._triton.ran[-1] == (q, k, v, ks, vs)
    assert len(att._triton.planned) == 2


def test_the_megakernel_backend_takes_an_fp8_cache_with_the_gluon_attention():
    """No flag error for the serving attention over an fp8 cache (its long passes run on the Triton kernel): the
    backend gets as far as its GPU check."""
    from mimw.engine.backends.megakernel import MegakernelBackend

    w = random_weights(get_preset("smollm2-135m").with_(num_layers=1), seed=0)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("on a Hopper GPU the backend builds: the GPU tests run it")
    with pytest.raises(RuntimeError, match="Hopper"):
        MegakernelBackend(w, prefill=PrefillConfig("gluon"), kv_dtype=fp8.FP8)


def test_gluon_is_refused_on_a_gpu_other_than_hopper(monkeypatch):
    from mimw.prefill.runner import make_attention

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"Hopper \(sm_90\) GPU, not NVIDIA A100; use attention 'triton'"):
        make_attention("gluon", None, torch.device("cuda"))
    make_attention("triton", None, torch.device("cuda"))  # the Triton kernel takes any GPU Triton compiles for
