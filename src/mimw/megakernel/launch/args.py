"""The megakernel's arguments, described once: the launch tuple (decoder.py) and the compile signature
(compile.py) both come from ``GROUPS``.

The kernel (device/kernel.py) takes eleven arguments, most of them tuples, plus the constants ``C``:
    prog      the program: words [num_sms, max_len, NWORDS] int32, queue lengths [num_sms], max_len
    step      the step state (state.py): tokens, positions, seg_ctx, seg_new, block tables and their width, the
              counters
              and how many there are before DONE/EPOCH, the cluster pairs' ready words
    weights   the TMA descriptor of the packed weight tile array (tiles.py), [num_tiles * TR * TK / 32, 32] bf16
    vecs      norms, bias, q/k norms, RoPE inverse frequencies
    kv        the paged cache's K and V pools, their scales and the page count: bf16 pools, or (``Constants.FP8``)
              e4m3 pools with a bf16 scale per (token, head) row, kv/pages.py (a bf16 cache passes a one-element
              dummy for each scale tensor, never read)
    k_desc, v_desc  TMA descriptors of the K and V pools viewed as [rows, head_dim] (a row: one position of one KV
              head of one page of one layer), box [KVBOX, head_dim] unswizzled: the loader's K/V stream
              (device/kv_stream.py: every one-token attention split's past K/V)
    scratch   state.py's scratch buffers, the attention splits' stride, the bf16 staging sources, then the MoE
              buffers (router logits, the routing table, slot weights, experts' activations and parts, and the
              activations' bf16 copy; a dense model's are empty, passed as a one-element stand-in)
    scalars   eps, the attention's q scale (head_dim^-0.5 * log2 e)
    trace     when traced: the instructions' stamps [num_sms, max_len, 4] int64 and the loader's routing waits
              [num_sms, num_layers, 2] int64 (device/route_wait.py; tools/trace.py); one-element dummies otherwise
    peers     tensor parallelism (``Constants.TP`` ranks, device/peer.py): the addresses of every rank's inbox buffer
              and of its counter table, [TP] int64 each, and this rank's number, one int32 in memory (a register held
              through the kernel's loop tipped the 8B's 16-token kernel into spills); one-element dummies on one GPU
"""
from __future__ import annotations

from typing import Any

GROUPS: tuple[tuple[str, tuple[tuple[str, str], ...] | str], ...] = (
    ("prog", (("words", "*i32"), ("lens", "*i32"), ("max_len", "i32"))),
    ("step", (("tokens", "*i32"), ("positions", "*i32"), ("seg_ctx", "*i32"), ("seg_new", "*i32"),
              ("block_tables", "*i32"), ("max_pages", "i32"), ("counters", "*i32"), ("num_counters", "i32"),
              ("ready", "*i32"))),
    ("weights", "desc"),
    ("vecs", (("embed", "*bf16"), ("attn_norm", "*bf16"), ("mlp_norm", "*bf16"), ("final_norm", "*bf16"),
              ("bias", "*fp32"), ("q_norm", "*bf16"), ("k_norm", "*bf16"), ("inv_freq", "*fp32"))),
    ("kv", (("k", "*bf16"), ("v", "*bf16"), ("k_scale", "*bf16"), ("v_scale", "*bf16"), ("num_pages", "i32"))),
    ("k_desc", "kvdesc"),
    ("v_desc", "kvdesc"),
    ("scratch", (("x", "*fp32"), ("qkv_part", "*fp32"), ("q", "*fp32"), ("part_o", "*fp32"), ("part_ml", "*fp32"),
                 ("attn", "*fp32"), ("act", "*fp32"), ("logits", "*fp32"), ("splits", "i32"), ("x16", "*bf16"),
                 ("attn16", "*bf16"), ("act16", "*bf16"), ("router_logits", "*fp32"), ("routed", "*i32"),
                 ("slot_w", "*fp32"), ("moe_act", "*fp32"), ("moe_part", "*fp32"), ("moe_act16", "*bf16"))),
    ("scalars", (("eps", "fp32"), ("qscale", "fp32"))),
    ("trace", (("stamps", "*i64"), ("waits", "*i64"))),
    ("peers", (("peer_boxes", "*i64"), ("peer_counters", "*i64"), ("peer_rank", "*i32"))),
)


def tile_box(tile_rows: int, tile_k: int) -> list[int]:
    """The TMA box (= ring slot shape) of one weight tile: the tile-major block's TR * TK elements as a row-major
    [TR * TK / 32, 32] matrix, which device/matvec.dot_tile reads folded."""
    return [tile_rows * tile_k // 32, 32]


def desc_type(tile_rows: int, tile_k: int) -> str:
    """The compile signature's type of the weight descriptor."""
    from triton.experimental.gluon import language as gl

    box = tile_box(tile_rows, tile_k)
    return f"tensordesc<bf16[{box[0]}, {box[1]}],{gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)!r}>"


def kv_layout(fp8: bool):
    """The K/V descriptors' shared layout: unswizzled, so a slot holds the rows in plain row-major order
    (device/kv_stream.py reads them so)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 if fp8 else 16, rank=2)


def kv_desc_type(box_rows: int, head_dim: int, fp8: bool) -> str:
    """The compile signature's type of the K and V pool descriptors (box [box_rows, head_dim])."""
    return f"tensordesc<{'fp8e4nv' if fp8 else 'bf16'}[{box_rows}, {head_dim}],{kv_layout(fp8)!r}>"


FP8_POOLS = ("k", "v")  # the pools whose element type an fp8 cache changes (to e4m3: triton's fp8e4nv)


def signature(tile_rows: int, tile_k: int, fp8: bool = False, kv_box: tuple[int, int] = (16, 64)) -> dict[str, Any]:
    """The compile signature: each argument's type string, or a tuple of them; ``fp8``: e4m3 K/V pools;
    ``kv_box``: the K/V descriptors' box (plan.Constants' KVBOX, HD)."""
    kv = lambda name, t: "*fp8e4nv" if fp8 and name in FP8_POOLS else t  # noqa: E731
    types = {"desc": desc_type(tile_rows, tile_k), "kvdesc": kv_desc_type(*kv_box, fp8)}
    return {name: types[fields] if fields in types else
            (fields if isinstance(fields, str) else tuple(kv(n, t) for n, t in fields)) for name, fields in GROUPS}


def pointer_paths() -> list[tuple[int, ...]]:
    """The argument paths ((group,) or (group, field)) of every pointer: each is 16-byte aligned, as the launch
    specializes torch's allocations."""
    out = []
    for g, (_, fields) in enumerate(GROUPS):
        if isinstance(fields, str):
            if fields.startswith("*"):
                out.append((g,))
        else:
            out += [(g, f) for f, (_, t) in enumerate(fields) if t.startswith("*")]
    return out


def int_paths() -> list[tuple[int, int]]:
    """The (group, field) paths of every int argument: the launch specializes one that equals 1 to a constant."""
    return [(g, f) for g, (_, fields) in enumerate(GROUPS) if not isinstance(fields, str)
            for f, (_, t) in enumerate(fields) if t == "i32"]


def values(sources: dict[str, Any]) -> tuple:
    """The launch's arguments from every field's value by name (``weights`` the descriptor, ``k_desc`` and
    ``v_desc`` the K/V pools' descriptors)."""
    missing = [n for n, f in GROUPS if isinstance(f, str) and n not in sources]
    missing += [k for _, f in GROUPS if not isinstance(f, str) for k, _ in f if k not in sources]
    if missing:
        raise KeyError(f"kernel arguments missing: {missing}")
    return tuple(sources[name] if isinstance(fields, str) else tuple(sources[k] for k, _ in fields)
                 for name, fields in GROUPS)
