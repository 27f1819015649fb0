"""CI (CPU only): every megakernel specialisation compiles for sm_90a, its PTX streams weights with TMA bulk tensor
copies completing on mbarriers, and ptxas reports no register spills."""
import pytest

from mimw.megakernel.gpu.config import KernelConfig, compile_sm90a, ptxas_report
from mimw.models.spec import get_preset


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"])
def test_megakernel_compiles_for_sm90a_with_tma_and_no_spills(model):
    k = compile_sm90a(get_preset(model), KernelConfig(), max_splits=16)
    ptx = k.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA weight tiles
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive" in ptx  # the ring's ready/empty barriers
    assert "ld.global.gpu.acquire" in ptx and "atom.global.gpu.release.add" in ptx  # dependency counters
    rep = ptxas_report(ptx)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert k.metadata.shared <= 227 * 1024


def test_kernel_config_rejects_shapes_it_cannot_tile():
    with pytest.raises(ValueError, match="head_dim"):
        KernelConfig(tile_rows=16).check(get_preset("tiny-llama"))  # head_dim 16 < 2 * tile_rows


def test_standalone_gemv_compiles_for_sm90a():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from mimw.megakernel.gpu.gemv import ws_gemv

    lay = gl.NVMMASharedLayout.get_default_for([64, 256], gl.bfloat16)
    sig = {"w_desc": f"tensordesc<bf16[64, 256],{lay!r}>", "x_ptr": "*bf16", "y_ptr": "*bf16", "K": "i32",
           "NB": "constexpr", "num_warps": "constexpr"}
    k = triton.compile(GluonASTSource(ws_gemv, sig, {"NB": 4, "num_warps": 4}), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    assert "cp.async.bulk.tensor" in k.asm["ptx"]
    assert ptxas_report(k.asm["ptx"])["spill_stores"] == 0


@pytest.mark.slow
def test_l2_look_ahead_of_mlp_in_tiles_is_in_the_loader_only_when_asked_for():
    spec = get_preset("llama-3.2-1b")
    assert "cp.async.bulk.prefetch.L2" in compile_sm90a(spec, KernelConfig(l2_mlp_ahead=6)).asm["ptx"]
    assert "cp.async.bulk.prefetch.L2" not in compile_sm90a(spec, KernelConfig()).asm["ptx"]
    with pytest.raises(ValueError, match="tile-major"):
        KernelConfig(l2_mlp_ahead=6, tile_major=False).check(spec)
    with pytest.raises(ValueError, match="0..32"):
        KernelConfig(l2_mlp_ahead=33).check(spec)


def test_ring_is_as_deep_as_shared_memory_allows_and_an_explicit_one_must_fit():
    assert KernelConfig(ring=0).ring_slots(get_preset("llama-3.2-1b")) == 12  # 16 KB staging buffer (32 rows)
    assert KernelConfig(ring=0).ring_slots(get_preset("llama-3.1-8b")) == 11  # 32 KB staging buffer (14336 -> 64)
    assert KernelConfig(ring=10).ring_slots(get_preset("llama-3.1-8b")) == 10
    with pytest.raises(ValueError, match="ring=12"):
        KernelConfig(ring=12).ring_slots(get_preset("llama-3.1-8b"))


def test_default_tiles_fit_every_preset_with_a_head_of_32_or_more():
    from mimw.models.spec import PRESETS

    for spec in PRESETS.values():
        if spec.head_dim >= 32:
            KernelConfig.for_spec(spec).check(spec)
