"""The prefill Triton and Gluon kernels compile for Hopper (sm_90a) on a CPU-only machine (ptxas ships in the triton
wheel), at the shapes and tiles the 1B and 8B models launch: the attention's dots become wgmma, its K/V gathers are
pipelined (cp.async; the Gluon kernel's are TMA boxes into mbarrier rings), nothing spills to local memory and
shared memory fits the SM's 227 KB."""
import re

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mimw.models.spec import get_preset
from mimw.prefill import activation, gluon_attention, norm, paged_attention, rope_append

pytestmark = pytest.mark.slow


def compile_sm90(fn, args: dict[str, str], constexprs: dict, num_warps: int, num_stages: int = 3):
    """args: name -> Triton type ("*bf16", "i32", ...); pointers and strides get the 16-divisibility the launcher
    specialises real (aligned) tensors and strides on."""
    sig = {**args, **{k: "constexpr" for k in constexprs}}
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in args.items()
             if t.startswith("*") or n.startswith("stride")}
    src = ASTSource(fn, sig, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


@pytest.mark.parametrize("preset,scaled,rows", [("llama-3.2-1b", False, None), ("llama-3.1-8b", False, None),
                                                ("llama-3.1-8b", True, None), ("llama-3.2-1b", False, 1),
                                                ("llama-3.1-8b", False, 1)])
def test_paged_attention_compiles_to_pipelined_wgmma(preset, scaled, rows):
    """The tiles of prompt chunks (rows None) and of decode batches (one row a piece)."""
    spec = get_preset(preset)
    tiles = paged_attention.AttentionTiles.for_head_dim(spec.head_dim, rows)
    kv = "*fp8e4nv" if scaled else "*bf16"
    sc = "*bf16"  # an fp8 cache's per-(page, head, row) scales; unread without SCALED
    args = {"Q": "*bf16", "O": "*bf16", "K": kv, "V": kv, "KS": sc, "VS": sc, "BT": "*i32", "Q_START": "*i32",
            "SEQ_START": "*i32", "SEQ_CTX": "*i32", "WORK": "*i32", "stride_qt": "i32", "stride_qh": "i32",
            "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32", "qk_scale": "fp32"}
    ce = {"GROUP": spec.group_size, "HKV": spec.num_kv_heads, "HD": spec.head_dim, "PS": 16,
          "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "SCALED": scaled, "HP": 1}
    k = compile_sm90(paged_attention._paged_prefill_kernel, args, ce, tiles.num_warps, tiles.num_stages)
    ptx = k.asm["ptx"]
    assert count(ptx, r"wgmma\.mma_async") > 0
    assert count(ptx, r"cp\.async\.c[ag]") > 0  # the gathers run ahead of the dots
    assert count(ptx, r"(ld|st)\.local") == 0
    assert k.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("preset,max_len,scaled", [("llama-3.2-1b", 1, False), ("llama-3.1-8b", 1, False),
                                                   ("llama-3.1-8b", 16, False), ("qwen3-8b", 4, False),
                                                   ("llama-3.1-8b", 4, True)])
def test_paged_attention_compiles_grouped_for_short_pieces(preset, max_len, scaled):
    """Decode tokens and verify blocks: a KV head's query heads in one program (``query_rows``), no spills."""
    spec = get_preset(preset)
    tiles = paged_attention.AttentionTiles.for_head_dim(spec.head_dim)
    hp, block_m = paged_attention.query_rows(spec.group_size, max_len, tiles.block_m)
    assert hp > 1
    kv = "*fp8e4nv" if scaled else "*bf16"
    args = {"Q": "*bf16", "O": "*bf16", "K": kv, "V": kv, "KS": "*bf16", "VS": "*bf16", "BT": "*i32",
            "Q_START": "*i32", "SEQ_START": "*i32", "SEQ_CTX": "*i32", "WORK": "*i32", "stride_qt": "i32",
            "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32", "qk_scale": "fp32"}
    ce = {"GROUP": spec.group_size, "HKV": spec.num_kv_heads, "HD": spec.head_dim, "PS": 16, "BLOCK_M": block_m,
          "BLOCK_N": tiles.block_n, "SCALED": scaled, "HP": hp}
    k = compile_sm90(paged_attention._paged_prefill_kernel, args, ce, 4, tiles.num_stages)
    ptx = k.asm["ptx"]
    assert count(ptx, r"(ld|st)\.local") == 0
    assert count(ptx, r"mma") > 0  # the dots on the tensor cores
    assert k.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("preset,kv", [("llama-3.1-8b", "bf16"), ("qwen3-0.6b", "bf16"), ("llama-3.1-8b", "fp8"),
                                       ("qwen3-0.6b", "fp8")])
def test_elementwise_kernels_compile(preset, kv):
    spec = get_preset(preset)
    d = spec.hidden_size
    compile_sm90(norm._rms_norm_kernel, {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "stride_x": "i32",
                                         "stride_y": "i32", "D": "i32", "eps": "fp32"},
                 {"BLOCK_D": triton.next_power_of_2(d)}, 8)
    compile_sm90(activation._silu_mul_kernel, {"GU": "*bf16", "OUT": "*bf16", "I": "i32", "stride_gu": "i32",
                                               "stride_out": "i32"}, {"BLOCK": activation.BLOCK}, 4)
    cache = "*fp8e4nv" if kv == "fp8" else "*bf16"
    args = {"QKV": "*bf16", "Q_OUT": "*bf16", "K_CACHE": cache, "V_CACHE": cache, "K_SCALE": "*bf16",
            "V_SCALE": "*bf16", "SLOTS": "*i64", "COS": "*fp32", "SIN": "*fp32", "QN": "*bf16", "KN": "*bf16",
            "T": "i32", "stride_qkv": "i32", "stride_qt": "i32", "stride_qh": "i32", "eps": "fp32"}
    k = compile_sm90(rope_append._rope_append_kernel, args,
                     {"HQ": spec.num_heads, "HKV": spec.num_kv_heads, "HD": spec.head_dim, "PS": 16,
                      "QK_NORM": spec.qk_norm, "FP8": kv == "fp8", "BLOCK_T": rope_append.BLOCK_T}, 4)
    ptx = k.asm["ptx"]
    assert count(ptx, r"(ld|st)\.local") == 0
    if kv == "fp8":  # the quantising divisions are IEEE (fp8.quantize's; Triton's "/" is div.full, used only by
        # the head norm's mean, which the bf16 path computes alike), the fp8 conversion rounds to nearest even
        assert count(ptx, r"div\.rn\.f32") > 0 and count(ptx, r"div\.(full|approx)") == int(spec.qk_norm)
        assert count(ptx, r"cvt\.rn\.satfinite\.e4m3x2\.f32") > 0


def compile_gluon_sm90(tiles: gluon_attention.GluonTiles):
    """The Gluon attention kernel as ``gluon_prefill_attention`` launches it (pointers and strides 16-divisible)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = gluon_attention.gluon_prefill_kernel
    lay = repr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    kv = f"tensordesc<bf16[{tiles.PS}, 64],{lay}>"
    args = {"q_desc": f"tensordesc<bf16[64, 64],{lay}>", "k_desc": kv, "v_desc": kv, "O": "*bf16", "BT": "*i32",
            "Q_START": "*i32", "SEQ_START": "*i32", "SEQ_CTX": "*i32", "WORK": "*i32", "stride_ot": "i32",
            "stride_oh": "i32", "stride_bt": "i32", "qk_scale": "fp32"}
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in args.items()
             if t.startswith("*") or n.startswith("stride")}
    src = GluonASTSource(fn, {**args, "C": "constexpr"}, {"C": tiles}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b"])
def test_gluon_attention_compiles_to_tma_rings_and_async_wgmma(preset):
    """hd 64 (1B: three consumer warpgroups) and 128 (8B, Qwen3-0.6B: two): one TMA box per page and 64-column
    chunk (Q's warpgroup parts, a tile's K and V boxes, unrolled once each), wgmma in every consumer warpgroup with
    S_j awaited while PV_{j-1} runs (wait_group HC in both loops of each), register budgets set per role
    (setmaxnreg), no spills, shared memory within the SM's 227 KB, and every barrier 0 the default partition's."""
    from mimw.megakernel.launch.compile import partition_barrier_errors, ptxas_report

    spec = get_preset(preset)
    tiles = gluon_attention.GluonTiles.for_head_dim(spec.head_dim, spec.group_size, spec.num_kv_heads)
    k = compile_gluon_sm90(tiles)
    ptx = k.asm["ptx"]
    boxes = tiles.WGS * tiles.HC + 2 * (tiles.BLOCK_N // tiles.PS) * tiles.HC
    assert count(ptx, r"cp\.async\.bulk\.tensor\.2d") == boxes
    waits = count(ptx, rf"wgmma\.wait_group\.sync\.aligned {tiles.HC};")
    assert count(ptx, r"wgmma\.mma_async") > 0 and waits == 2 * tiles.WGS  # both loops of every consumer
    regs = sorted({int(r) for r in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx)})
    consumer = {2: gluon_attention.CONSUMER_REGS_2, 3: gluon_attention.CONSUMER_REGS_3}[tiles.WGS]
    assert gluon_attention.PRODUCER_REGS.value in regs and consumer.value in regs
    assert count(ptx, r"(ld|st)\.local") == 0
    rep = ptxas_report(ptx)
    assert rep["spill_stores"] == rep["spill_loads"] == rep["stack"] == 0
    assert partition_barrier_errors(ptx, 4) == []
    assert tiles.shared_bytes <= k.metadata.shared <= 227 * 1024
    print(f"{preset}: hd {tiles.HD}, BLOCK_N {tiles.BLOCK_N}, {tiles.NB} stages: shared "
          f"{k.metadata.shared} B, "
          f"launch registers {rep['registers']}, setmaxnreg {regs}, spills 0")
