"""Versioned words: a hop between instructions without a counter (isa.py ``Word.FLAGS``, docs/megakernel.md).

A buffer element is one 64-bit word, ``version << 32 | fp32 bits``. The writer stores it with one
``st.relaxed.gpu.b64``, single-copy atomic, and releases nothing; the reader loads words with
``ld.relaxed.gpu.b64`` (coherent at gpu scope: L2, never a stale L1 line) and loads again only those not yet at the
version it needs, so the load is the wait. A reader that sees its version sees the value stored with it. Versions
are ``epoch * STEP_STRIDE + n`` (65536) in int32, ``n`` the number readiness.py gives the buffer's contents (x:
2l+1 after layer l's O_PROJ, 2l+2 after its DOWN_PROJ; act, attn, q and the new K/V row: l); the buffers start at
-1, no version at all.
PyTorch reference: the VM keeps these buffers in fp32 and models their versions in ``Readiness``
(``versions_ready``); these functions only change how the values travel, never what they are. The word format
itself has its reference at the end of this file (``pack``, ``unpack``, ``step_version``), which the GPU test reads
the kernel's words with.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


STEP_STRIDE: gl.constexpr = gl.constexpr(65536)  # versions of step e are e * STEP_STRIDE + n (n < STEP_STRIDE)


@gluon.jit
def store_masked(ptrs, v, ver, mask):
    """One word per element where ``mask``: (ver << 32 | fp32 bits of v) at ``ptrs``. Elements a layout replicates
    over several threads are stored by each of them, the same word."""
    bits = v.to(gl.int32, bitcast=True)
    gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b64 w; setp.ne.u32 p, $4, 0; mov.b64 w, {$2, $3}; "
        "@p st.relaxed.gpu.global.b64 [$1], w; mov.u32 $0, 0; }",
        "=r,l,r,r,r", [ptrs, bits, gl.zeros_like(bits) + ver, mask.to(gl.int32)], dtype=gl.int32, is_pure=False,
        pack=1)


@gluon.jit
def store(ptrs, v, ver):
    """``store_masked`` of every element."""
    store_masked(ptrs, v, ver, gl.full(ptrs.shape, 1, gl.int32, ptrs.type.layout))


@gluon.jit
def _load(ptrs, old, need):
    """``ld.relaxed.gpu.b64`` of the words where ``need`` != 0, ``old`` elsewhere."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $3, 0; mov.b64 $0, $2; @p ld.relaxed.gpu.global.b64 $0, [$1]; }",
        "=l,l,l,r", [ptrs, old, need], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _spin(ptrs, inb, ver):
    """Returns once every word at ``ptrs`` (where ``inb``) carries version ``ver``, loading only the missing ones
    again; their values are not kept."""
    miss = inb.to(gl.int32)
    words = inb.to(gl.int64) * 0
    while gl.sum(miss, axis=None) > 0:
        words = _load(ptrs, words, miss)
        miss = miss * ((words >> 32).to(gl.int32) != ver).to(gl.int32)


@gluon.jit
def wait(ptrs, inb, ver, probes=None, pinb=None):
    """The fp32 payloads of the words at ``ptrs`` (any rank; where ``inb``, 0.0 elsewhere) once every one carries
    version ``ver``: all are loaded, then only those not yet at ``ver`` again, until none is missing (a
    partition-wide count, so every thread leaves the loop together).

    ``probes`` (a few of the same words, where ``pinb``): when the first load finds words missing, spin on the
    probes first, then load the missing words again: the polling traffic an early reader sends to L2 while its
    producers still stream is the probes', for one more round trip once they land (``probe_ptrs``)."""
    words = (inb.to(gl.int64) * 0 + ver) << 32  # where not inb: a word of version ver holding 0.0
    words = _load(ptrs, words, inb.to(gl.int32))
    ok = (words >> 32).to(gl.int32) == ver
    if probes is not None:
        if gl.sum((~ok).to(gl.int32), axis=None) > 0:
            _spin(probes, pinb, ver)
    while gl.sum((~ok).to(gl.int32), axis=None) > 0:
        words = _load(ptrs, words, (~ok).to(gl.int32))
        ok = (words >> 32).to(gl.int32) == ver
    return words.to(gl.int32).to(gl.float32, bitcast=True)


@gluon.jit
def probe_ptrs(base, lo, n, K, PROBE: gl.constexpr, L1: gl.constexpr):
    """(pointers, in bounds) of the probe words of elements [lo, lo + n) of a K-word vector at ``base``: one word
    in PROBE (n // PROBE of them, a power of two), in the 1-D layout ``L1``."""
    o = lo + gl.arange(0, n // PROBE, L1) * PROBE
    return base + gl.minimum(o, K - 1), o < K


@gluon.jit
def wait_vector(base, o, lo, K, ver, PROBE: gl.constexpr = 1):
    """``wait`` for a staging group of a K-word vector at ``base``: offsets ``o`` ([SG, TK], the group from element
    ``lo``; 0.0 past K); PROBE > 1: a group found incomplete is probed one word in PROBE (``probe_ptrs``)."""
    ptrs = base + gl.minimum(o, K - 1)
    if PROBE > 1:
        pp, pin = probe_ptrs(base, lo, o.shape[0] * o.shape[1], K, PROBE, gl.SliceLayout(0, o.type.layout))
        return wait(ptrs, o < K, ver, pp, pin)
    else:
        return wait(ptrs, o < K, ver)


# --- PyTorch reference of the word format (what ``store`` writes and ``wait_*`` reads) ---------------------------

def pack(values, version: int):
    """int64 words ``version << 32 | fp32 bits of values`` (``store``'s layout; version taken as int32)."""
    import torch

    bits = values.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return (torch.tensor(version, dtype=torch.int32).to(torch.int64) << 32) | bits


def unpack(words):
    """(versions int32, values fp32) of int64 words: the inverse of ``pack``."""
    import torch

    versions = (words >> 32).to(torch.int32)
    values = (words & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    return versions, values


def step_version(epoch: int, n: int) -> int:
    """The int32 version of readiness number ``n`` in step ``epoch``: epoch * STEP_STRIDE + n, wrapped like the
    GPU's."""
    v = (epoch * STEP_STRIDE.value + n) % 2**32
    return v - 2**32 if v >= 2**31 else v
