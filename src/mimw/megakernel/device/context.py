"""The megakernel's state inside the kernel, bundled so that device functions take a handful of arguments.

``Smem``  the shared-memory ring (slots, ``empty``/``ready`` barriers), the release hold's barrier ``rel`` and the
          staging buffer ``hbuf`` [KT_ROWS, TK] bf16 (an instruction's input vector, one [TK] row per column tile;
          with C.M > 1 [KT_ROWS * TK / 32, MB, 32], the tokens' chunks: device/matvec_mt.py), and ``wbuf``, a norm's
          weights as [*, 32] chunks (C.M > 1; hbuf itself where M = 1, which never uses it), and ``sbuf``
          [NB, 2 * KVS / KVBOX, KVBOX] bf16, the scales of the K/V rows a ring slot holds (C.KVS > 0 over an fp8
          cache: device/kv_stream.py; hbuf itself otherwise, never read).
``Step``  this launch's step: counter and ready-word pointers, the epoch, and the one token's id, position,
          context, cache page and embedding row (M = 1), and the step arrays a multi-token step reads per token.
``Bufs``  everything else in global memory the instructions read or write: norm/bias/rope vectors, the paged KV
          cache (K and V pools, and their per-row scales where ``C.FP8``), the scratch buffers of state.py (the MoE
          ones included: the routing table, slot weights, experts' activations and parts), the scalars eps and
          qscale, and (tensor parallelism, ``C.TP`` > 1: device/peer.py) the addresses of every rank's inboxes and
          counters and this rank's number.
``Ins``   one instruction's words, decoded field by field on demand (isa.Word) with masked reductions.
Compile-time constants travel as one frozen dataclass, ``plan.Constants`` (the kernel's ``C``). Integer arguments
the launch may specialize (Triton compiles an int argument equal to 1 as a constant) are fields that hold either.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function
from triton.language.core import _aggregate as aggregate

from .. import isa

# the instruction words' fields and flags (isa.py, the single source of truth), as the kernel's constexprs
_C = isa.kernel_constants()
W_OP: gl.constexpr = gl.constexpr(_C["W_OP"])
W_LAYER: gl.constexpr = gl.constexpr(_C["W_LAYER"])
W_A: gl.constexpr = gl.constexpr(_C["W_A"])
W_B: gl.constexpr = gl.constexpr(_C["W_B"])
W_C: gl.constexpr = gl.constexpr(_C["W_C"])
W_D: gl.constexpr = gl.constexpr(_C["W_D"])
W_E: gl.constexpr = gl.constexpr(_C["W_E"])
W_WAIT: gl.constexpr = gl.constexpr(_C["W_WAIT"])
W_WAIT_COUNT: gl.constexpr = gl.constexpr(_C["W_WAIT_COUNT"])
W_SIGNAL: gl.constexpr = gl.constexpr(_C["W_SIGNAL"])
W_FLAGS: gl.constexpr = gl.constexpr(_C["W_FLAGS"])
W_T0: gl.constexpr = gl.constexpr(_C["W_T0"])
W_NR: gl.constexpr = gl.constexpr(_C["W_NR"])
W_K0: gl.constexpr = gl.constexpr(_C["W_K0"])
W_K1: gl.constexpr = gl.constexpr(_C["W_K1"])
W_KT: gl.constexpr = gl.constexpr(_C["W_KT"])
NWORDS: gl.constexpr = gl.constexpr(_C["NWORDS"])
HOLD_ARRIVE: gl.constexpr = gl.constexpr(_C["HOLD_ARRIVE"])
HOLD_WAIT: gl.constexpr = gl.constexpr(_C["HOLD_WAIT"])
OP_ATTN_IN: gl.constexpr = gl.constexpr(_C["OP_ATTN_IN"])
OP_ATTN_PARTIAL: gl.constexpr = gl.constexpr(_C["OP_ATTN_PARTIAL"])
OP_O_PROJ: gl.constexpr = gl.constexpr(_C["OP_O_PROJ"])
OP_MLP_IN: gl.constexpr = gl.constexpr(_C["OP_MLP_IN"])
OP_DOWN_PROJ: gl.constexpr = gl.constexpr(_C["OP_DOWN_PROJ"])
OP_LM_HEAD: gl.constexpr = gl.constexpr(_C["OP_LM_HEAD"])
OP_ROUTER: gl.constexpr = gl.constexpr(_C["OP_ROUTER"])
OP_EXPERT_IN: gl.constexpr = gl.constexpr(_C["OP_EXPERT_IN"])
OP_EXPERT_DOWN: gl.constexpr = gl.constexpr(_C["OP_EXPERT_DOWN"])
OP_REDUCE: gl.constexpr = gl.constexpr(_C["OP_REDUCE"])
PEER: gl.constexpr = gl.constexpr(_C["PEER"])
EXPERT_SPAN: gl.constexpr = gl.constexpr(_C["EXPERT_SPAN"])
XS_WORD: gl.constexpr = gl.constexpr(_C["XS_WORD"])
SLOT_WORD: gl.constexpr = gl.constexpr(_C["SLOT_WORD"])
ROUTE_BITS: gl.constexpr = gl.constexpr(_C["ROUTE_BITS"])
PACK_SHIFT: gl.constexpr = gl.constexpr(_C["PACK_SHIFT"])
NO_EXPERT: gl.constexpr = gl.constexpr(_C["NO_EXPERT"])
ROUTE_TAG_MASK: gl.constexpr = gl.constexpr(_C["ROUTE_TAG_MASK"])
ROUTE_TAG_SET: gl.constexpr = gl.constexpr(_C["ROUTE_TAG_SET"])


@constexpr_function
def _int_arg(v):
    """A kernel's int argument as an aggregate field: the tensor, or the constant the launch specialized it to."""
    return v if isinstance(v, gl.tensor) else gl.constexpr(v)


@aggregate
class Smem:
    bufs: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    rel: gl.shared_memory_descriptor
    hbuf: gl.shared_memory_descriptor
    wbuf: gl.shared_memory_descriptor
    sbuf: gl.shared_memory_descriptor

    @constexpr_function
    def __init__(self, bufs, empty, ready, rel, hbuf, wbuf, sbuf):
        self.bufs = bufs
        self.empty = empty
        self.ready = ready
        self.rel = rel
        self.hbuf = hbuf
        self.wbuf = wbuf
        self.sbuf = sbuf


@aggregate
class Step:
    cnt: gl.tensor  # counters (state.py), then DONE and EPOCH
    ncnt: gl.tensor | gl.constexpr
    rdy: gl.tensor  # the cluster pairs' ready words, one a CTA
    bt: gl.tensor  # block tables [S, MAXP]
    maxp: gl.tensor | gl.constexpr
    epoch: gl.tensor
    pos: gl.tensor
    ctx: gl.tensor
    tok_page: gl.tensor  # the page holding position pos
    emb_row: gl.tensor  # the token's embedding row: layer 0's residual
    toks: gl.tensor  # the step arrays (state.py): tokens [M], positions [M], seg_ctx [S]; a multi-token step (C.M > 1)
    poss: gl.tensor  # reads each token's and segment's entries from them (the scalars above are token 0's)
    ctxs: gl.tensor
    news: gl.tensor  # seg_new [S] (state.py): where a multi-token step's one-token segment's ring past ends

    @constexpr_function
    def __init__(self, cnt, ncnt, rdy, bt, maxp, epoch, pos, ctx, tok_page, emb_row, toks, poss, ctxs, news):
        self.cnt = cnt
        self.ncnt = _int_arg(ncnt)
        self.rdy = rdy
        self.bt = bt
        self.maxp = _int_arg(maxp)
        self.epoch = epoch
        self.pos = pos
        self.ctx = ctx
        self.tok_page = tok_page
        self.emb_row = emb_row
        self.toks = toks
        self.poss = poss
        self.ctxs = ctxs
        self.news = news


@aggregate
class Bufs:
    emb: gl.tensor
    anorm: gl.tensor
    mnorm: gl.tensor
    fnorm: gl.tensor
    bias: gl.tensor
    qn: gl.tensor
    kn: gl.tensor
    invf: gl.tensor
    kc: gl.tensor  # [L, pages, Hkv, PS, HD] bf16, or e4m3 where C.FP8
    vc: gl.tensor
    ksc: gl.tensor  # [L, pages, Hkv, PS] bf16 scales of kc's rows where C.FP8 (else a dummy)
    vsc: gl.tensor
    num_pages: gl.tensor | gl.constexpr
    x: gl.tensor
    qkvp: gl.tensor
    q: gl.tensor
    po: gl.tensor
    pml: gl.tensor
    attn: gl.tensor
    act: gl.tensor
    logits: gl.tensor
    splits: gl.tensor | gl.constexpr
    x16: gl.tensor
    attn16: gl.tensor
    act16: gl.tensor
    router_logits: gl.tensor  # the MoE scratch (state.py): router_logits [M, Ep], routed [L, S] int32,
    routed: gl.tensor  # slot_w [S, M], moe_act [S, M, F], moe_part [S, M, D]
    slot_w: gl.tensor
    moe_act: gl.tensor
    moe_part: gl.tensor
    moe_act16: gl.tensor
    eps: gl.tensor
    qscale: gl.tensor
    pbox: gl.tensor  # [TP] int64: each rank's inbox buffer (device/peer.py; a one-element dummy where C.TP == 1)
    pcnt: gl.tensor  # [TP] int64: each rank's counter table
    prank: gl.tensor  # [1] int32: this rank's number (read where used, not held in a register)

    @constexpr_function
    def __init__(self, vecs, kv, scratch, scalars, peers):
        self.emb, self.anorm, self.mnorm, self.fnorm, self.bias, self.qn, self.kn, self.invf = vecs
        self.kc, self.vc, self.ksc, self.vsc, num_pages = kv
        self.num_pages = _int_arg(num_pages)
        self.x, self.qkvp, self.q, self.po, self.pml, self.attn, self.act, self.logits, splits, self.x16, \
            self.attn16, self.act16, self.router_logits, self.routed, self.slot_w, self.moe_act, self.moe_part, \
            self.moe_act16 = scratch
        self.splits = _int_arg(splits)
        self.eps, self.qscale = scalars
        self.pbox, self.pcnt, self.prank = peers


@aggregate
class Ins:
    w: gl.tensor  # [16] int32: the instruction's words (isa.NWORDS of them)
    offs: gl.tensor

    @constexpr_function
    def __init__(self, w, offs):
        self.w = w
        self.offs = offs

    @gluon.jit
    def field(self, k: gl.constexpr):
        """Word ``k`` (isa.Word) as a scalar."""
        return gl.sum(gl.where(self.offs == k, self.w, 0), axis=0)
