"""The multi-token matvec measured alone (tools/skinny_gemm.py, both operand orders): compiles for sm_90a to wgmma
on the CPU; on a Hopper GPU, Y = X W^T matches torch for M = 1 .. 64 tokens, rows past M untouched."""
import pytest
import torch


@pytest.mark.slow
def test_skinny_gemm_compiles_to_wgmma_on_the_chunk_major_tiles_without_spills():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from mimw.megakernel.launch.compile import ptxas_report
    from mimw.megakernel.tools.skinny_gemm import skinny_gemm

    lay = gl.NVMMASharedLayout.get_default_for([256, 32], gl.bfloat16)
    sig = {"w_desc": f"tensordesc<bf16[256, 32],{lay!r}>", "x_ptr": "*fp32", "y_ptr": "*fp32", "M": "i32",
           "K": "i32", "N": "i32", "NRT": "i32", "KT": "i32", "GK": "constexpr", "NB": "constexpr",
           "num_warps": "constexpr"}
    k = triton.compile(GluonASTSource(skinny_gemm, sig, {"GK": 2, "NB": 8, "num_warps": 4}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    assert ptx.count("wgmma.mma_async") == 16  # 8 chunks of a tile x two k16 steps
    assert "cp.async.bulk.tensor" in ptx and ptxas_report(ptx)["spill_stores"] == 0
    assert k.metadata.shared <= 227 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("m", [1, 5, 17, 64])
@pytest.mark.parametrize("n,k", [(2048, 2048), (4096, 14336), (1024, 576)])
def test_skinny_gemm_matches_torch(m, n, k, swap):
    from mimw.megakernel.launch.pack import tile_major
    from mimw.megakernel.tools.skinny_gemm import run

    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g)
    y = run(tile_major(w, 32, 256).reshape(-1, 32).contiguous(), x, n, k, grid=37, swap=swap)
    ref = x.to(torch.bfloat16).float() @ w.float().t()
    assert torch.isfinite(y).all()
    assert float((y - ref).abs().max() / ref.abs().max()) < 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("m,k", [(8, 2048), (64, 14336)])
def test_swap_ab_compiles_to_wgmma_without_spills(m, k):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from mimw.megakernel.launch.compile import ptxas_report
    from mimw.megakernel.tools.skinny_gemm import skinny_gemm_swap, swap_plan

    mb, gk, nb = swap_plan(m, k)
    assert mb % 8 == 0 and mb >= m and nb >= 3
    lay = gl.NVMMASharedLayout.get_default_for([256, 32], gl.bfloat16)
    sig = {"w_desc": f"tensordesc<bf16[256, 32],{lay!r}>", "x_ptr": "*fp32", "y_ptr": "*fp32", "M": "i32",
           "K": "i32", "N": "i32", "NRT": "i32", "KT": "i32", "GK": "constexpr", "MB": "constexpr",
           "NB": "constexpr", "num_warps": "constexpr"}
    kern = triton.compile(GluonASTSource(skinny_gemm_swap, sig, {"GK": gk, "MB": mb, "NB": nb, "num_warps": 4}),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = kern.asm["ptx"]
    assert ptx.count("wgmma.mma_async") == 16  # 4 chunk pairs x 2 accumulators x two k16 steps
    assert ptx.count("wgmma.commit_group") >= 8  # one group a warpgroup_mma: the in-flight count waits on groups
    assert "cp.async.bulk.tensor" in ptx and ptxas_report(ptx)["spill_stores"] == 0
    assert kern.metadata.shared <= 227 * 1024


def test_swap_plan_stages_x_whole_when_it_fits():
    from mimw.megakernel.tools.skinny_gemm import swap_plan

    assert swap_plan(1, 2048)[:2] == (8, 8)  # 8 x 2048 bf16 = 32 KB: whole
    mb, gk, nb = swap_plan(64, 14336)
    assert mb == 64 and gk < 56 and gk * 64 * 256 * 2 <= 227 * 1024 // 2 and nb >= 3
