"""CI (CPU only): every megakernel specialisation compiles for sm_90a, its PTX streams weights with TMA bulk tensor
copies completing on mbarriers, and ptxas reports no register spills."""
import dataclasses
import re

import pytest

from mimw.megakernel.gpu.config import SHARED_BYTES, KernelConfig, compile_sm90a, ptxas_report
from mimw.models.spec import get_preset


def _ptx(spec, kcfg: KernelConfig = KernelConfig()) -> str:
    """The megakernel's PTX for ``spec`` and ``kcfg``, compiled for sm_90a on the CPU."""
    return compile_sm90a(spec, kcfg).asm["ptx"]


def _assert_fits_shared(spec, kcfg: KernelConfig, compiled) -> None:
    """Triton's shared memory (the ring as ``KernelConfig.ring_slots`` sized it, the staging buffer, the compiler's
    scratch) and the dynamic region past it that the launch adds fit in one sm_90 CTA."""
    need = compiled.metadata.shared + kcfg.region_bytes(spec)
    assert need <= SHARED_BYTES, (spec.name, kcfg, compiled.metadata.shared, kcfg.region_bytes(spec))


def _spill_free_ptx(spec, kcfg: KernelConfig) -> str:
    """``_ptx``, asserting that ptxas stores no register to the stack for it and that it fits in shared memory."""
    k = compile_sm90a(spec, kcfg)
    ptx = k.asm["ptx"]
    rep = ptxas_report(ptx)
    assert rep["spill_stores"] == 0, rep
    _assert_fits_shared(spec, kcfg, k)
    return ptx


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b"])
def test_megakernel_compiles_for_sm90a_with_tma_and_no_spills(model):
    k = compile_sm90a(get_preset(model), KernelConfig(), max_splits=16)
    ptx = k.asm["ptx"]
    _assert_fits_shared(get_preset(model), KernelConfig(), k)  # the ring as deep as shared memory allows
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
@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"])
def test_tensor_core_matvec_consumer_compiles_to_ldmatrix_and_mma_sync_without_spills(model):
    spec = get_preset(model)
    kcfg = dataclasses.replace(KernelConfig.for_spec(spec), mma=True)
    ptx = compile_sm90a(spec, kcfg).asm["ptx"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx
    assert "cvt.f32.bf16" in ptx  # attention and staging still convert on the CUDA cores
    rep = ptxas_report(ptx)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    fma = dataclasses.replace(KernelConfig.for_spec(spec), mma=0)
    assert "mma.sync" not in compile_sm90a(spec, fma).asm["ptx"]


def test_tensor_core_consumer_folds_a_tile_major_block_into_32_column_rows():
    assert KernelConfig(mma=1).tile_box() == (256, 32)  # [32, 256] tile: 8 folds of 32 columns a row
    assert KernelConfig(tile_rows=16, tile_k=512, mma=1).tile_box() == (256, 32)
    assert KernelConfig(mma=0).tile_box() == (32, 256)
    spec = get_preset("llama-3.2-1b")
    with pytest.raises(ValueError, match="tile-major"):
        KernelConfig(mma=1, tile_major=False).check(spec)
    with pytest.raises(ValueError, match="fold"):
        KernelConfig(mma=1, tile_k=128).check(spec)  # 4 folds: fewer than one mma n8 block


def test_folded_view_of_a_tile_major_block_is_the_tile_row_by_row():
    """The bytes dot_tile_mma reads: tile-major block t viewed as [TR * TK / 32, 32] has row NF r + j = W_tile[r,
    32 j .. 32 j + 32) (NF = TK / 32 folds), and the staged chunk as [NF, 32] has row j = h[32 j ..)."""
    import torch

    from mimw.megakernel.gpu.pack import tile_major

    tr, tk = 32, 256
    nf = tk // 32
    m = torch.randn(2 * tr, 3 * tk)
    folded = tile_major(m, tr, tk).view(-1, 32)
    h = torch.randn(3 * tk)
    for t in range(6):
        rt, kt = divmod(t, 3)
        blk = folded[t * tr * nf:(t + 1) * tr * nf]  # what one TMA box [TR * NF, 32] loads
        d = blk @ h[kt * tk:(kt + 1) * tk].view(nf, 32).T  # [TR * NF, NF] = A B
        rows = d.view(tr, nf, nf).diagonal(dim1=1, dim2=2).sum(1)  # sum_j D[NF r + j, j]
        ref = m[rt * tr:(rt + 1) * tr, kt * tk:(kt + 1) * tk] @ h[kt * tk:(kt + 1) * tk]
        torch.testing.assert_close(rows, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_early_dispatch_is_the_default_and_compiles_without_spills_either_way():
    spec = get_preset("llama-3.2-1b")
    assert KernelConfig().dispatch
    ptx = compile_sm90a(spec, KernelConfig()).asm["ptx"]
    rep = ptxas_report(ptx)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    off = compile_sm90a(spec, KernelConfig(dispatch=False)).asm["ptx"]
    assert ptxas_report(off)["spill_stores"] == 0
    assert ptx.count("ld.global") > off.count("ld.global")  # the early fetch


def test_ring_is_as_deep_as_shared_memory_allows_and_an_explicit_one_must_fit():
    assert KernelConfig().ring == 0  # the default since session 21
    one_b, eight_b = get_preset("llama-3.2-1b"), get_preset("llama-3.1-8b")
    # as launched on 132 SMs: the 1B's staging buffer sized for DOWN_PROJ's halves (8 KB, 16 rows; half_hbuf, the
    # default since session 22), the 8B's for a whole unpaired DOWN_PROJ (32 KB: 14336 -> 28 column tiles -> 32)
    assert KernelConfig(ring=0).for_launch(one_b, 132).ring_slots(one_b) == 13
    assert KernelConfig(ring=0, half_hbuf=False).ring_slots(one_b) == 12  # 16 KB (32 rows)
    assert KernelConfig(ring=0).for_launch(eight_b, 132).ring_slots(eight_b) == 11
    assert KernelConfig(ring=10).for_launch(eight_b, 132).ring_slots(eight_b) == 10
    with pytest.raises(ValueError, match="ring=12"):
        KernelConfig(ring=12).for_launch(eight_b, 132).ring_slots(eight_b)
    # the per-warp releases: at most 10 slots (wrong logits at 12 and 13 on the H200, session 22)
    assert KernelConfig(warp_release=True).for_launch(one_b, 132).ring_slots(one_b) == 10
    with pytest.raises(ValueError, match="warp_release"):
        KernelConfig(warp_release=True, ring=12).ring_slots(one_b)


def test_default_tiles_fit_every_preset_with_a_head_of_32_or_more():
    from mimw.models.spec import PRESETS

    for spec in PRESETS.values():
        if spec.head_dim >= 32:
            KernelConfig.for_spec(spec).check(spec)


@pytest.mark.slow
def test_inflight_cap_compiles_without_spills_and_a_cap_past_the_ring_is_the_ring():
    spec = get_preset("llama-3.2-1b")
    ptx = _spill_free_ptx(spec, KernelConfig(inflight=4))
    assert ptx != _ptx(spec, KernelConfig(inflight=0))  # the loader's wait for tile it - 4
    # the default ring has 13 slots on the 1B (the staging buffer sized for DOWN_PROJ's halves): no cap at 13
    assert KernelConfig(inflight=13).inflight_cap(spec) == 0 and KernelConfig(inflight=12).inflight_cap(spec) == 12
    assert KernelConfig(ring=10, inflight=10).inflight_cap(spec) == 0
    assert KernelConfig(inflight=10).inflight_cap(spec) == 10
    assert KernelConfig(inflight=9).inflight_cap(spec) == 9 and KernelConfig(ring=4).inflight_cap(spec) == 0
    with pytest.raises(ValueError, match="inflight=-1"):
        KernelConfig(inflight=-1).check(spec)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b"])
def test_release_hold_compiles_without_spills(model):
    """KernelConfig(quiet=N): compute arrives once more (after a streaming release), the loader waits once more
    (before tile N of a new stage's instruction) than with the hold off (-1)."""
    spec = get_preset(model)
    assert KernelConfig().quiet == 2  # the default since session 17
    base = _ptx(spec, dataclasses.replace(KernelConfig.for_spec(spec), quiet=-1))
    for q in (0, 2):
        ptx = _spill_free_ptx(spec, dataclasses.replace(KernelConfig.for_spec(spec), quiet=q))
        assert ptx.count("mbarrier.arrive") == base.count("mbarrier.arrive") + 1
        assert ptx.count("mbarrier.try_wait") > base.count("mbarrier.try_wait")
    with pytest.raises(ValueError, match="quiet=-2"):
        KernelConfig(quiet=-2).check(spec)
    # quiet_ops: the held ops as a bit mask over isa.Op (every streaming op by default), streaming ops only
    from mimw.megakernel import isa

    assert KernelConfig().held_ops() == sum(1 << int(op) for op in isa.STREAMING_OPS)
    assert KernelConfig(quiet_ops=("MLP_IN", "DOWN_PROJ")).held_ops() == (1 << 5) | (1 << 6)
    with pytest.raises(ValueError, match="streaming ops only"):
        KernelConfig(quiet_ops=("ATTN_PARTIAL",)).check(spec)
    # quiet_early: the same arrivals, moved before the release's fenced add
    early = _spill_free_ptx(spec, dataclasses.replace(KernelConfig.for_spec(spec), quiet_early=True))
    late = _ptx(spec, KernelConfig.for_spec(spec))
    assert early.count("mbarrier.arrive") == late.count("mbarrier.arrive") and early != late
    # hold_marks=False: compute announces every signalling streaming release and the loader applies the rule itself
    # (sessions 17-20), against the default's marks on the words (gpu/hold.py): the same arrive and wait sites
    unmarked = _spill_free_ptx(spec, dataclasses.replace(KernelConfig.for_spec(spec), hold_marks=False))
    assert unmarked.count("mbarrier.arrive") == late.count("mbarrier.arrive") and unmarked != late
    assert unmarked.count("mbarrier.try_wait") == late.count("mbarrier.try_wait")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b"])
def test_deeper_in_flight_cap_for_some_ops_compiles_without_spills(model):
    """KernelConfig(inflight_deep=N, deep_ops=...): those ops' loads under the cap N (the loader's compare with N
    appears in the PTX), the default kernel untouched (inflight_deep 0: no run-time choice of cap)."""
    from mimw.megakernel import isa

    spec = get_preset(model)
    base = _ptx(spec, KernelConfig.for_spec(spec))
    deep = dataclasses.replace(KernelConfig.for_spec(spec), deep_ops=("DOWN_PROJ",), inflight_deep=8)
    ptx = _spill_free_ptx(spec, deep)
    assert re.search(r"setp\.lt\.s32\s+%p\d+, %r\d+, 8;", ptx) and not re.search(
        r"setp\.lt\.s32\s+%p\d+, %r\d+, 8;", base)
    assert deep.deep_cap(spec) == (8, 1 << int(isa.Op.DOWN_PROJ))
    assert KernelConfig().deep_cap(spec) == (0, 0) and KernelConfig(inflight_deep=8).deep_cap(spec) == (0, 0)
    assert KernelConfig(inflight=0, deep_ops=("DOWN_PROJ",), inflight_deep=8).deep_cap(spec) == (0, 0)  # no cap
    with pytest.raises(ValueError, match="streaming ops only"):
        KernelConfig(deep_ops=("ATTN_PARTIAL",), inflight_deep=8).check(spec)
    with pytest.raises(ValueError, match="inflight_deep=10"):
        KernelConfig(deep_ops=("DOWN_PROJ",), inflight_deep=10, ring=10).check(spec)  # the ring's 10 slots
    slots = KernelConfig().for_launch(spec, 132).ring_slots(spec)  # the default ring: 13 (1B) or 11 (8B) slots
    with pytest.raises(ValueError, match=f"inflight_deep={slots}"):
        KernelConfig(deep_ops=("DOWN_PROJ",), inflight_deep=slots).for_launch(spec, 132).check(spec)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b"])
def test_per_warp_releases_compile_without_spills(model):
    """KernelConfig(warp_release=True): every tile loop's release is one arrive per warp on the barriers past
    Triton's shared memory (no partition barrier before it: fewer bar.sync than the default), the default kernel
    has none of it, and the barriers' bytes come before the cluster exchange region."""
    spec = get_preset(model)
    base = _ptx(spec, KernelConfig.for_spec(spec))
    kcfg = dataclasses.replace(KernelConfig.for_spec(spec), warp_release=True)
    ptx = _spill_free_ptx(spec, kcfg)
    arrive = "mbarrier.arrive.release.cta.shared::cta.b64 _"
    assert ptx.count(arrive) >= 5 and arrive not in base  # one per matvec tile loop (ATTN_IN .. LM_HEAD)
    assert ptx.count("bar.sync") < base.count("bar.sync") and "bar.warp.sync" in ptx
    nb = kcfg.ring_slots(spec)
    assert kcfg.release_bytes(nb) == -(-8 * nb // 16) * 16 and KernelConfig().release_bytes(nb) == 0
    assert kcfg.region_bytes(spec) == kcfg.release_bytes(nb) + KernelConfig.for_spec(spec).region_bytes(spec)
    with pytest.raises(ValueError, match="warp_release"):
        KernelConfig(warp_release=True, mma=0).check(spec)


def test_hold_count_takes_one_word_past_tritons_shared_memory_only_with_the_hold():
    spec = get_preset("llama-3.2-1b")
    kcfg = dataclasses.replace(KernelConfig.for_spec(spec), hold_count=True)
    assert kcfg.hold_bytes() == 16 and KernelConfig.for_spec(spec).hold_bytes() == 0
    assert dataclasses.replace(kcfg, quiet=-1).hold_bytes() == 0  # no hold, nothing to count
    assert kcfg.region_bytes(spec) == 16 + KernelConfig.for_spec(spec).region_bytes(spec)
    assert kcfg.ring_slots(spec) == KernelConfig.for_spec(spec).ring_slots(spec)  # 16 bytes cost no ring slot


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b"])
def test_hold_count_compiles_without_spills_and_without_the_holds_barrier(model):
    """KernelConfig(hold_count=True): compute's thread 0 adds one to a shared-memory word after each streaming
    release (red.shared.add), the loader spins on it with atomic reads (one site a streaming op's producer loop), and
    the hold's mbarrier and its arrive (with the partition barrier before Triton's single-thread arrive) are gone;
    the default kernel has none of it."""
    spec = get_preset(model)
    base = _ptx(spec, KernelConfig.for_spec(spec))
    ptx = _spill_free_ptx(spec, dataclasses.replace(KernelConfig.for_spec(spec), hold_count=True))
    assert ptx.count("red.shared.add.u32") == 1 and "red.shared.add" not in base
    assert ptx.count("atom.shared.add.u32") >= 5 and "atom.shared.add" not in base
    assert ptx.count("mbarrier.arrive") == base.count("mbarrier.arrive") - 1
    assert ptx.count("bar.sync") < base.count("bar.sync")


@pytest.mark.slow
def test_down_half_stage_compiles_without_spills_in_effect_only_with_the_pairs():
    """KernelConfig.down_half_stage (the default): a spill-free 1B kernel, different from the one staging all of
    act's columns; no effect where DOWN_PROJ has no pairs (cluster_down off)."""
    spec = get_preset("llama-3.2-1b")
    kcfg = KernelConfig.for_spec(spec)
    assert kcfg.down_half_stage
    assert _spill_free_ptx(spec, kcfg) != _ptx(spec, dataclasses.replace(kcfg, down_half_stage=False))
    off = dataclasses.replace(kcfg, cluster_down=False)
    assert _ptx(spec, off) == _ptx(spec, dataclasses.replace(off, down_half_stage=False))


@pytest.mark.slow
@pytest.mark.parametrize("opts", [{}, {"qkv_in_attn": True}, {"flag_q": True, "flag_x": True}])
def test_attention_row_as_one_position_compiles_without_spills(opts):
    """KernelConfig.attn_row (the default) on the 1B, with the step's row from the cache, the finished parts or
    versioned words: a shorter kernel than the one adding the row as a masked 64-position block, and spill-free."""
    spec = get_preset("llama-3.2-1b")
    kcfg = dataclasses.replace(KernelConfig.for_spec(spec), **opts)
    assert kcfg.attn_row
    base = _ptx(spec, dataclasses.replace(kcfg, attn_row=False))
    ptx = _spill_free_ptx(spec, kcfg)
    assert ptx != base and len(ptx) < len(base)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b"])
def test_down_proj_pairs_compile_without_spills(model):
    """KernelConfig.cluster_down (the default): DOWN_PROJ's column halves swap a row tile's sums with one more
    st.async exchange (beside ATTN_IN's), in effect only with cluster_qkv 2 and without O_PROJ parts or merged
    releases (the program pairs the 1B's row blocks, not the 8B's: ProgramConfig.cluster_down)."""
    from mimw.megakernel.program import StepShape, build_program

    spec = get_preset(model)
    kcfg = KernelConfig.for_spec(spec)
    base = _ptx(spec, dataclasses.replace(kcfg, cluster_down=False))
    ptx = _spill_free_ptx(spec, kcfg)
    assert ptx.count("st.async") == base.count("st.async") + 1
    assert kcfg.down_pairs() and kcfg.program_config().cluster_down
    for other in ({"cluster_qkv": 0}, {"cluster_qkv": 1}, {"o_parts": 8}, {"merge_signals": True},
                  {"flag_act": True}, {"cluster_down": False}):
        off = dataclasses.replace(kcfg, **other)
        off.check(spec)  # the default's pairs never make another setting invalid
        assert not off.down_pairs() and not off.program_config().cluster_down
    prog = build_program(spec, StepShape((1,), 1024), 132, kcfg.program_config())
    paired = any(i.OP.name == "DOWN_PROJ" and i.n_parts == 2 for i in prog.instructions())
    assert paired == (model == "llama-3.2-1b")


def test_the_kernels_streaming_ops_are_the_isa_list():
    """kernel._streams spells out isa.STREAMING_OPS as comparisons (what the GPU runs measured); they must agree."""
    import inspect
    import re

    from mimw.megakernel import isa
    from mimw.megakernel.gpu import kernel

    src = inspect.getsource(kernel._streams.fn)
    assert set(re.findall(r"op == OP_(\w+)", src)) == {op.name for op in isa.STREAMING_OPS}
    assert isa.kernel_constants()["STREAMING"] == sum(1 << int(op) for op in isa.STREAMING_OPS)


@pytest.mark.slow
def test_versioned_words_compile_without_spills():
    every = dict(flag_act=True, flag_x=True, flag_attn=True, flag_q=True)
    for name, kw in (("llama-3.2-1b", dict(flag_act=True)), ("llama-3.2-1b", dict(flag_act=True, flag_x=True)),
                     ("llama-3.2-1b", dict(flag_q=True)), ("llama-3.2-1b", every), ("smollm2-135m", every),
                     ("qwen3-8b", every)):
        spec = get_preset(name)
        ptx = _spill_free_ptx(spec, KernelConfig(**kw))
        assert "st.relaxed.gpu.global.b64" in ptx and "ld.relaxed.gpu.global.b64" in ptx
        base = _ptx(spec)
        assert "relaxed.gpu.global.b64" not in base  # the default kernel is untouched by them


@pytest.mark.slow
def test_versioned_x_compiles_for_a_row_wider_than_one_staging_group():
    # hidden 8192 = 32 column tiles > SG = 16: stage_normed's two passes over x, both waiting on versions
    spec = get_preset("llama-3.1-8b").with_(hidden_size=8192, num_layers=2)
    kcfg = KernelConfig(flag_act=True, flag_x=True, flag_attn=True)  # (with flag_q too this shape spills 4 bytes)
    _spill_free_ptx(spec, kcfg)


@pytest.mark.slow
def test_probed_versioned_stagings_compile_without_spills_and_add_a_probe_loop():
    spec = get_preset("llama-3.2-1b")
    plain = _ptx(spec, KernelConfig(flag_act=True, flag_x=True))
    for kw in (dict(flag_act=True), dict(flag_act=True, flag_x=True)):  # (with flag_attn too: 4 bytes of spill,
        ptx = _spill_free_ptx(spec, KernelConfig(vprobe=16, **kw))  # all four flags: 88)
    # the probe loops are more relaxed loads than the unprobed kernel has
    assert ptx.count("ld.relaxed.gpu.global.b64") > plain.count("ld.relaxed.gpu.global.b64")
    with pytest.raises(ValueError, match="vprobe=3"):
        KernelConfig(flag_act=True, vprobe=3).check(spec)


@pytest.mark.slow
def test_qkv_finished_in_attention_compiles_without_spills_and_drops_attn_ins_ticket():
    for name in ("llama-3.2-1b", "qwen3-8b"):  # qwen3: the q/k norm in the splits' finish
        spec = get_preset(name)
        ptx = _spill_free_ptx(spec, KernelConfig(qkv_in_attn=True))
    base = _ptx(spec, KernelConfig(cluster_qkv=0))  # (qkv_in_attn runs without cluster pairs: KernelConfig.clusters)
    ticket = "atom.global.gpu.acq_rel.add"  # ATTN_IN's ticket and the combining splits' ticket; only the latter
    assert ptx.count(ticket) == base.count(ticket) - 1
    with pytest.raises(ValueError, match="qkv_in_attn and flag_q"):
        KernelConfig(qkv_in_attn=True, flag_q=True).check(spec)


@pytest.mark.slow
def test_merged_releases_compile_without_spills_and_add_the_runs_length():
    spec = get_preset("llama-3.1-8b")
    ptx = _spill_free_ptx(spec, KernelConfig(merge_signals=True))
    base = _ptx(spec)
    assert ptx != base  # the release adds the word's SIGNAL_N, and a zero skips it
    rel = "atom.global.gpu.release.add"
    assert ptx.count(rel) == base.count(rel) > 0  # the same release sites


@pytest.mark.slow
def test_kv_pipeline_compiles_to_cp_async_without_spills_and_takes_ring_room():
    for name, slots in (("llama-3.2-1b", 11), ("llama-3.1-8b", 9)):
        spec = get_preset(name)
        kcfg = KernelConfig(kv_pipeline=True, ring=0).for_launch(spec, 132)
        full = KernelConfig(ring=0).for_launch(spec, 132).ring_slots(spec)
        assert kcfg.ring_slots(spec) == slots == full - 2  # 32 KB: two slots
        ptx = _spill_free_ptx(spec, kcfg)
        assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx
    assert "cp.async.cg" not in _ptx(spec)
    with pytest.raises(ValueError, match="do not fit"):
        KernelConfig(kv_pipeline=True, ring=10).for_launch(spec, 132).check(spec)  # the 8B: no room for it at 10


@pytest.mark.slow
def test_o_proj_in_column_parts_compiles_without_spills_and_drops_the_combining_ticket():
    for name, parts in (("llama-3.2-1b", 8), ("llama-3.1-8b", 4)):  # one KV group a part; two (a static loop)
        spec = get_preset(name)
        ptx = _spill_free_ptx(spec, KernelConfig(o_parts=parts))
    base = _ptx(spec)
    ticket = "atom.global.gpu.acq_rel.add"  # ATTN_IN's ticket and the combining splits' ticket; only the former
    assert ptx.count(ticket) == base.count(ticket) - 1


@pytest.mark.slow
def test_fold_shuffle_epilogue_compiles_without_spills_and_with_fewer_barriers():
    spec = get_preset("llama-3.2-1b")
    ptx = _spill_free_ptx(spec, KernelConfig(fold_shuffle=True))
    base = _ptx(spec)
    # two layout conversions (a barrier each) leave every inlined copy of the tensor-core epilogue (seven with
    # DOWN_PROJ's cluster pairs, the default: its half's row tiles have their own)
    assert ptx.count("bar.sync") == base.count("bar.sync") - 14
    assert ptx.count("shfl.sync") > base.count("shfl.sync")


def test_o_parts_must_fit_the_kernel():
    with pytest.raises(ValueError, match="must divide the 8 KV heads"):
        KernelConfig(o_parts=3).check(get_preset("llama-3.2-1b"))
    with pytest.raises(ValueError, match="power-of-two number of heads, not 3"):  # 24 query heads on 8 KV heads
        KernelConfig(tile_k=128, o_parts=8).check(get_preset("llama-3.2-3b"))
    with pytest.raises(ValueError, match="o_parts excludes flag_x"):
        KernelConfig(o_parts=8, flag_act=True, flag_x=True).check(get_preset("llama-3.2-1b"))


def test_versioned_attn_needs_versioned_x():
    with pytest.raises(ValueError, match="flag_attn needs flag_x"):
        KernelConfig(flag_attn=True).check(get_preset("llama-3.2-1b"))


def test_min_split_tokens_reaches_the_scheduler():
    from mimw.megakernel.program import StepShape, build_program

    spec = get_preset("llama-3.2-1b")
    splits = [build_program(spec, StepShape((1,), 1024), 132, KernelConfig(min_split_tokens=m).program_config())
              .n_splits for m in (32, 128, 256)]
    assert splits == [(16,), (8,), (4,)]


def test_qkv_parts_beyond_the_finishers_unrolled_sum_are_refused():
    spec = get_preset("llama-3.2-1b")
    KernelConfig(qkv_parts=8).check(spec)
    with pytest.raises(ValueError, match="qkv_parts=9"):
        KernelConfig(qkv_parts=9).check(spec)


CLUSTER_PTX = {  # cluster_qkv mode -> what its exchange compiles to, and what it must not
    1: (("st.shared::cluster.f32", "mbarrier.arrive.release.cluster.shared::cluster.b64"), ("st.async",)),
    2: (("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32", "mbarrier.arrive.expect_tx.shared::cta.b64"),
        ("mbarrier.arrive.release.cluster",)),
}


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.1-8b"])
def test_cluster_pairs_compile_to_a_distributed_shared_memory_exchange_without_spills(model, mode):
    """KernelConfig(cluster_qkv=1 | 2): ATTN_IN's parts store into the mate's shared memory (mapa; plain remote
    stores and a release arrival on the mate's barrier, or asynchronous stores that count their bytes there) and
    wait on their own barrier at cluster scope (gpu/cluster.py); the default kernel has none of it, and no cluster
    barrier is used (Triton's padding warps never reach one)."""
    spec = get_preset(model)
    ptx = _spill_free_ptx(spec, dataclasses.replace(KernelConfig.for_spec(spec), cluster_qkv=mode))
    present, absent = CLUSTER_PTX[mode]
    for needle in ("mapa.shared::cluster.u32", "fence.mbarrier_init.release.cluster",
                   "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64", "%dynamic_smem_size") + present:
        assert needle in ptx, needle
    assert not any(needle in ptx for needle in absent + ("barrier.cluster",))
    tickets = _ptx(spec, dataclasses.replace(KernelConfig.for_spec(spec), cluster_qkv=0))
    assert "mapa" not in tickets and "%dynamic_smem_size" not in tickets


def test_cluster_pair_exchange_region_is_taken_from_the_ring_room():
    from mimw.megakernel.gpu.cluster import pair_region_bytes
    from mimw.megakernel.gpu.config import constexprs, exchange_bytes

    spec = get_preset("llama-3.1-8b")
    assert KernelConfig().cluster_qkv == 2  # the default since session 16
    assert exchange_bytes(spec, KernelConfig(cluster_qkv=0)) == 0 and constexprs(spec, KernelConfig(cluster_qkv=0),
                                                                                 16)["XB"] == 0
    assert exchange_bytes(spec, KernelConfig()) == pair_region_bytes(128) == 16 + 2 * 2 * 128 * 4
    with pytest.raises(ValueError, match="cluster_qkv=3"):
        KernelConfig(cluster_qkv=3).check(spec)


def test_cluster_pairs_are_off_where_no_pair_can_form():
    """No two parts a head (qkv_parts 1 or 3, or qkv_in_attn's finisherless parts), the versioned words, an odd SM
    count, or a hidden size of one column tile: the launch runs tickets, and its kernel has no exchange."""
    spec, tiny = get_preset("llama-3.2-1b"), get_preset("tiny-qwen3")
    for kw in (dict(qkv_parts=1), dict(qkv_parts=3), dict(qkv_in_attn=True), dict(flag_act=True), dict(flag_q=True)):
        kcfg = KernelConfig(**kw)
        assert kcfg.clusters() == 0 and not kcfg.program_config().cluster_qkv
    assert KernelConfig().for_launch(spec, 132).clusters() == 2
    assert KernelConfig().for_launch(spec, 131).clusters() == 0
    assert KernelConfig.for_spec(tiny).for_launch(tiny, 8).clusters() == 0  # 64 columns: one 512-column tile


@pytest.mark.slow
def test_half_hbuf_compiles_without_spills_and_gives_the_1b_ring_a_thirteenth_slot():
    """KernelConfig.half_hbuf (the default since session 22): the staging buffer holds the widest of D, q_size and
    half of I (the 1B: 16 column tiles, 8 KB, instead of 32), and the ring takes the bytes: 13 slots, still within
    shared memory; ``for_launch`` turns it off where a DOWN_PROJ runs unpaired (the 8B; the 1B on 72 SMs)."""
    from mimw.megakernel.gpu.config import down_halves_only
    from mimw.megakernel.program import StepShape, build_program

    spec = get_preset("llama-3.2-1b")
    kcfg = KernelConfig.for_spec(spec)
    whole = dataclasses.replace(kcfg, half_hbuf=False)
    assert kcfg.half_hbuf and kcfg.compact_hbuf() and kcfg.for_launch(spec, 132) == kcfg
    assert (kcfg.hbuf_rows(spec), whole.hbuf_rows(spec)) == (16, 32)
    assert (kcfg.ring_slots(spec), whole.ring_slots(spec)) == (13, 12)
    ptx = _spill_free_ptx(spec, kcfg)  # and fits with the 13 slots
    assert ptx != _spill_free_ptx(spec, whole)
    # in effect only with the halves staging their own columns
    assert not dataclasses.replace(kcfg, down_half_stage=False).compact_hbuf()
    assert not dataclasses.replace(kcfg, cluster_qkv=0).compact_hbuf()
    assert dataclasses.replace(kcfg, down_half_stage=False).hbuf_rows(spec) == 32
    # SmolLM2: I = 1536 (6 column tiles, halves of 3) under D = 576 (3): 4 rows either way
    small = get_preset("smollm2-135m")
    assert KernelConfig.for_spec(small).hbuf_rows(small) == 4
    # every DOWN_PROJ a half on 132 SMs; on 72 the 1B's 64 row blocks are not paired, nor the 8B's 128 on 132:
    # the launch stages them whole, and the 8B compiles to the kernel it had before (the same PTX)
    prog = lambda sms: build_program(spec, StepShape((1,), 1024), sms, kcfg.program_config())  # noqa: E731
    assert down_halves_only(prog(132)) and not down_halves_only(prog(72))
    assert kcfg.for_launch(spec, 72) == whole
    eight_b = get_preset("llama-3.1-8b")
    k8 = KernelConfig.for_spec(eight_b)
    assert k8.for_launch(eight_b, 132) == dataclasses.replace(k8, half_hbuf=False)
    assert _ptx(eight_b, k8) == _ptx(eight_b, dataclasses.replace(k8, half_hbuf=False))


@pytest.mark.slow
def test_attn_smem_merge_is_the_default_where_the_staging_buffer_holds_the_warps_states():
    """KernelConfig.attn_smem_merge (the default since session 22): ATTN_PARTIAL's warps merge through the staging
    buffer with one barrier (attention._merge_smem), in effect where the buffer holds NW x GP x (HD + 2) fp32 (the
    1B's 8 KB, the 8B's and Qwen3-8B's 16 KB; not SmolLM2's 2 KB); fewer partition barriers, spill-free, and the
    same shared memory (the buffer is reused)."""
    for name, fits in (("llama-3.2-1b", True), ("llama-3.1-8b", True), ("qwen3-8b", True), ("smollm2-135m", False)):
        spec = get_preset(name)
        kcfg = KernelConfig.for_spec(spec).for_launch(spec, 132)
        assert kcfg.attn_smem_merge and kcfg.smem_merge(spec) == fits, name
    spec = get_preset("llama-3.2-1b")
    kcfg = KernelConfig.for_spec(spec)
    off = dataclasses.replace(kcfg, attn_smem_merge=False)
    on_k, off_k = compile_sm90a(spec, kcfg), compile_sm90a(spec, off)
    assert ptxas_report(on_k.asm["ptx"])["spill_stores"] == 0
    _assert_fits_shared(spec, kcfg, on_k)
    assert on_k.metadata.shared == off_k.metadata.shared
    assert on_k.asm["ptx"].count("bar.sync") < off_k.asm["ptx"].count("bar.sync")
    small = get_preset("smollm2-135m")
    assert _ptx(small) == _ptx(small, dataclasses.replace(KernelConfig.for_spec(small), attn_smem_merge=False))
