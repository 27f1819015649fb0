"""Correctness harness for the megakernel on the GPU, shared by the `gpu` tests and the bench scripts.

For one model shape and context: random bf16 weights, a bf16 paged KV cache whose first ``context`` positions hold
random K/V (the values past tokens would have left there — the kernel cannot tell), then ``steps`` consecutive
decode steps. The oracle is the reference decoder in fp32 on the same bf16-rounded weights, over an fp32 copy of
the same cache; each step feeds both the oracle's greedy token. After every step the rows the kernel appended are
compared with the oracle's (bf16: ``row_error``, relative to the cache's max|value|; fp8: ``kv_row_check``) and
then copied into both references' caches, so that every step reads the same past as the kernel: a row that
differs within rounding would otherwise feed the references' later steps something the kernel never read (an
e4m3 step flipped by bf16 rounding is 2^-4 of an element; an MoE step routed to a near-tie appends rows made by
other experts, and random routers are flat enough for such a row to move a later step's routing past the
bf16 bound). With ``kv_dtype`` fp8 the cache holds the random K/V quantised (e4m3 + a bf16 scale per row,
kv/fp8.py) and both references run over copies of that very fp8 cache, storing their own new rows through
``PagedKVCache.store`` as the kernel stores its own. Scratch is poisoned (NaN) before every
launch. Every step also relaunches once more and compares logits bit for bit (a moving result would be a race).

``check_batch`` does the same for a decode batch (``MegakernelDecoder.step_batch``): B sequences, each with its own
random past in the shared cache and its own shuffled pages, all advanced by one launch a step; every sequence's
logits are compared with the oracle's for it, and after the run the K/V rows the kernel appended (each sequence's
new positions) with the oracle's. ``check_segments`` generalises it to verify blocks (one-token segments); both
take ``kv_dtype`` fp8 as check_decode does (the rows then compared step by step, ``kv_row_check``).

An MoE model (``check_decode``, ``check_batch``) is also checked for its routing, twice after every step (a batch:
the union of its tokens' experts, what its routing table names). Exactly: the last MoE
layer's router logits and slot weights are still in the scratch, and its routing table row must name the top k of
those very logits (``models.moe.top_k``) with their weights (within one bf16 rounding): the router finisher checked
on its own input, whatever the numerics before it (``route_self_ok``). Against the oracle: each MoE layer's row
must carry the step's tag (isa.route_tag) and name the oracle's k experts, or a near-tie of them. A near-tie:
every expert the kernel chose and the oracle did not has an oracle probability at least the oracle's k-th minus
``route_tie``, and every expert the oracle chose and the kernel did not at most its (k+1)-th plus ``route_tie``,
where ``route_tie`` is twice the bf16 reference's largest probability error against the oracle over the run (what
bf16 arithmetic itself does to the router, as ``tie`` below is for the logits). On random weights
the k-th and (k+1)-th of many experts are often close (their gap shrinks as the router's spread and the bf16 error
grow alike), so near-ties are expected. A step whose routing took such a near-tie elsewhere than the oracle is
left out of the logits' error and argmax (its MoE output legitimately differs by a swapped expert's share) and
counted in ``route_tie_steps`` (``ok``: at most half the steps). A later MoE layer of such a step is judged
against nothing (``route_after_ties``): its input already holds another expert's share, so the oracle's routing is
no longer what a faithful kernel computes there. Any other difference is a ``route_mismatches`` and fails the check.

Argmax agreement is reported twice: exact, and exact-or-near-tie. The near-tie bound is not a constant and not
the kernel's own error (a bound taken from the step's own error would excuse every flip: a flip always implies
max|error| >= gap / 2). It comes from a third decoder run alongside: the same reference in bf16 with Hugging Face
transformers' numerics (bf16 weights, activations and KV cache) over its own copy of the cache. Its largest error
against the fp32 oracle over the run, e, is what bf16 inference itself does on these weights; two tokens whose
oracle logits are closer than 2e can be ordered either way by a faithful bf16 implementation, so a different
argmax counts as a near-tie only when the oracle's gap is within ``tie`` = 2e. Everything is relative to
max|logit|. Every mismatch is listed in ``flips`` with its gap and the step's error.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

import torch

from ...kv import fp8
from ...kv.pages import KVLayout, PagedKVCache
from ...models.reference import ReferenceDecoder, Segment
from ...models.spec import ModelSpec
from ...models.weights import random_weights
from ..launch.decoder import MegakernelDecoder
from ..launch.tp import DistributedRank, SharedGPUGroup
from ..tensor_parallel import TensorParallel, shard_cache
from ..plan import Tuning


@dataclass
class CheckResult:
    model: str
    context: int
    steps: int
    max_rel_err: float
    argmax_agree: float  # steps whose argmax equals the oracle's
    argmax_agree_or_tie: float  # ... or where the oracle's gap to the kernel's pick is within ``tie``
    bit_identical: bool
    finite: bool
    bf16_rel_err: float = float("nan")  # the bf16 (transformers-numerics) reference's largest error
    bf16_argmax_agree: float = float("nan")  # ... and its own exact argmax agreement with the oracle
    tie: float = 0.0  # near-tie bound: 2 x bf16_rel_err
    flips: list = None  # [(step, oracle gap / max|logit|, step error / max|logit|)] for every argmax mismatch
    kv_rows: dict = None  # fp8: the K/V rows the kernel wrote this run against the oracle's (``kv_row_check``)
    kv_rel_err: float = float("nan")  # the rows the kernel appended vs the oracle's (bf16: ``row_error``; fp8:
    # kv_rows' max_err), near-tie steps left out
    bf16_kv_rel_err: float = float("nan")  # ... the bf16 reference's rows likewise
    # MoE (zero for a dense model): (step, layer) routings that equal the oracle's, that are near-ties of it, that
    # are neither; steps left out of the logits' checks for a near-tie; whether every entry carried its step's tag
    route_exact: int = 0
    route_ties: int = 0
    route_mismatches: int = 0
    route_tie_steps: int = 0
    route_after_ties: int = 0  # routings other than the oracle's after a near-tie earlier in their step
    route_tags_ok: bool = True
    route_self_ok: bool = True  # every step's last MoE layer routed the top k of its own logits (module doc)
    route_tie: float = 0.0  # 2 x the bf16 reference's largest router probability error
    route_gap: float = 0.0  # the largest near-tie bound a mismatch would have needed (``route_gap``; 0: none)
    tp: int = 1  # tensor-parallel ranks (on one GPU: launch/tp.py)
    tp_disagreements: int = 0  # steps whose ranks' logits were not bit-identical

    def ok(self, tol: float = 2e-2, agree: float = 0.99, max_tie_steps: float = 0.5, kv_tol: float = 1e-2) -> bool:
        """Logits and routing as the module doc says; a bf16 cache's appended rows within ``kv_tol`` of the
        oracle's, or twice the bf16 reference's own rows' error where that is larger (fp8 rows: ``kv_rows``)."""
        rows_ok = self.kv_rows is not None or self.kv_rel_err <= max(kv_tol, 2 * self.bf16_kv_rel_err)
        return (self.finite and self.bit_identical and self.max_rel_err <= tol and self.argmax_agree_or_tie >= agree
                and self.tp_disagreements == 0
                and rows_ok and self.route_tags_ok and self.route_self_ok and self.route_mismatches == 0
                and self.route_tie_steps <= max_tie_steps * self.steps)

    def as_dict(self) -> dict:
        return asdict(self)


def step_error(got: torch.Tensor, expect: torch.Tensor) -> tuple[bool, float, float]:
    """One step against the oracle: (same argmax, oracle's gap between its best and ``got``'s pick, max|error|),
    the last two relative to max|logit| of the oracle."""
    scale = expect.abs().max()
    err = ((got - expect).abs().max() / scale).item()
    choice = int(got.argmax())
    gap = ((expect.max() - expect[choice]) / scale).item()
    return choice == int(expect.argmax()), gap, err


def argmax_verdicts(steps: list[tuple[bool, float, float]], tie: float) -> tuple[int, int, list]:
    """(exact agreements, near-ties, flips) over ``step_error`` results; a mismatch is a near-tie when its gap is
    at most ``tie``; ``flips`` lists every mismatch as (step, gap, error)."""
    agree = sum(same for same, _, _ in steps)
    near = sum((not same) and gap <= tie for same, gap, _ in steps)
    flips = [(i, round(gap, 5), round(err, 5)) for i, (same, gap, err) in enumerate(steps) if not same]
    return agree, near, flips


def random_cache(spec: ModelSpec, context: int, steps: int, page_size: int, seed: int, device="cuda",
                 kv_dtype: torch.dtype = torch.bfloat16, min_pages: int = 0):
    """A cache with ``context`` random positions of one sequence (bf16, or fp8: the same values quantised row by row
    as ``PagedKVCache.store`` quantises them); its block table is a shuffled page list. ``min_pages``: a pool at
    least this large (a long pool with a short context puts the last layers' rows past 2^31 elements)."""
    n_pages = max(-(-(context + steps) // page_size) + 3, min_pages)
    cache = PagedKVCache(KVLayout.for_spec(spec, page_size, n_pages, torch.bfloat16), device)
    g = torch.Generator(device=device).manual_seed(seed)
    cache.k.normal_(0, 1, generator=g)
    cache.v.normal_(0, 1, generator=g)
    table = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    return as_kv_dtype(cache, kv_dtype), table


def as_kv_dtype(cache: PagedKVCache, kv_dtype: torch.dtype) -> PagedKVCache:
    """A bf16 ``cache`` itself (``kv_dtype`` bf16), or an fp8 cache of the same pages holding its rows quantised
    row by row as ``PagedKVCache.store`` quantises them (kv/fp8.py)."""
    if kv_dtype == torch.bfloat16:
        return cache
    if kv_dtype != fp8.FP8:
        raise ValueError(f"a check's KV cache is bf16 or fp8 (e4m3), not {kv_dtype}")
    out = PagedKVCache(dataclasses.replace(cache.layout, dtype=fp8.FP8), cache.device)
    for name, scale in (("k", out.k_scale), ("v", out.v_scale)):
        q, s = fp8.quantize(getattr(cache, name))
        getattr(out, name).view(torch.uint8).copy_(q.view(torch.uint8))
        scale.copy_(s)
    return out


def copy_cache(cache: PagedKVCache) -> PagedKVCache:
    """A second cache of the same layout holding the same bytes (scales included)."""
    out = PagedKVCache(cache.layout, cache.device)
    for dst, src in zip(out.page_tensors(), cache.page_tensors()):
        dst.copy_(src)
    return out


def kv_row_check(got: PagedKVCache, expect: PagedKVCache, table, positions) -> dict:
    """fp8 rows at ``positions`` (every layer, K and V, every KV head) that the kernel wrote (``got``) against the
    oracle's (``expect``): ``requant_exact``: re-quantising the kernel's dequantised rows gives back its very bytes
    and scales (what a row quantised by kv/fp8.py's rule satisfies: its largest element sits at +-448; a row scaled
    by another amax breaks it; the rounding itself is checked bit for bit by the GPU test of ``store_row``);
    ``max_err``: the largest |kernel - oracle| relative to the row's amax, after dequantising (the two rows differ
    by bf16 activation rounding, which may move an element by one e4m3 step: 2^-3 relative near the amax);
    ``bytes_equal``: the fraction of rows equal to the oracle's after dequantising (for information: bf16 rounding
    of the activations moves most rows' scales by a bf16 step)."""
    pos = torch.as_tensor(list(positions), device=got.device)
    pages, rows = got.slots(table, pos)
    requant, err, equal, n = True, 0.0, 0, 0
    for layer in range(got.layout.num_layers):
        for name in ("k", "v"):
            x = got.load(name, layer, pages, rows)  # [T, Hkv, hd] fp32
            y = expect.load(name, layer, pages, rows)
            q, s = fp8.quantize(x)
            pool = getattr(got, name).view(torch.uint8)[layer, pages, :, rows]  # [T, Hkv, hd]
            scales = (got.k_scale if name == "k" else got.v_scale)[layer, pages, :, rows]
            requant &= bool(torch.equal(q.view(torch.uint8), pool)) and bool(torch.equal(s, scales))
            amax = y.abs().amax(-1, keepdim=True).clamp_min(1e-30)
            err = max(err, ((x - y).abs() / amax).max().item())
            equal += int((x == y).all(-1).sum())
            n += x.shape[0] * x.shape[1]
    return {"requant_exact": requant, "max_err": err, "bytes_equal": equal / max(n, 1), "rows": n}


def merge_row_checks(a: dict | None, b: dict) -> dict:
    """Two ``kv_row_check`` results over disjoint positions (weighted by their row counts) as one."""
    if a is None:
        return b
    n_a, n_b = a.get("rows", 1), b.get("rows", 1)
    return {"requant_exact": a["requant_exact"] and b["requant_exact"], "max_err": max(a["max_err"], b["max_err"]),
            "bytes_equal": (a["bytes_equal"] * n_a + b["bytes_equal"] * n_b) / (n_a + n_b), "rows": n_a + n_b}


def copy_rows(dst: PagedKVCache, src: PagedKVCache, table, positions) -> None:
    """Positions' rows (every layer, K and V, every KV head, scales included) copied from ``src`` into ``dst``."""
    pos = torch.as_tensor(list(positions), device=src.device)
    pages, rows = src.slots(table, pos)
    for d, t in zip(dst.page_tensors(), src.page_tensors()):
        d[:, pages, :, rows] = t[:, pages, :, rows].to(d.dtype)


def row_scales(cache: PagedKVCache) -> tuple[float, float]:
    """max|K| and max|V| of a (bf16 or fp32) cache: what ``row_error`` divides by."""
    return float(cache.k.abs().max()), float(cache.v.abs().max())


def row_error(got: PagedKVCache, expect: PagedKVCache, table, positions, scales: tuple[float, float]) -> float:
    """The largest |got - expect| over the rows at ``positions`` (every layer, K and V, every KV head) of two
    unquantised caches, relative to ``scales`` (``row_scales`` of the oracle's cache)."""
    pos = torch.as_tensor(list(positions), device=got.device)
    pages, rows = got.slots(table, pos)
    return max(float((g[:, pages, :, rows].float() - e[:, pages, :, rows].float()).abs().max() / sc)
               for g, e, sc in zip((got.k, got.v), (expect.k, expect.v), scales))


def distributed() -> bool:
    """torch.distributed is initialised (a torchrun process)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def oracles(w, cache: PagedKVCache):
    """The two references a check compares the kernel with, each over its own copy of ``cache`` (bf16 weights
    ``w``): the fp32 oracle and the bf16 (transformers-numerics) reference. A bf16 cache: the oracle's copy is fp32,
    the reference's bf16. An fp8 cache: both read (and append to) copies of that very fp8 cache, storing their new
    rows through ``PagedKVCache.store`` (quantised as the kernel quantises its own), so that all three read the
    same dequantised past. Returns (oracle, its cache, bf16 reference, its cache)."""
    if cache.layout.quantized:
        ref_cache = copy_cache(cache)
    else:
        ref_cache = PagedKVCache(dataclasses.replace(cache.layout, dtype=torch.float32), cache.device)
        ref_cache.k.copy_(cache.k)
        ref_cache.v.copy_(cache.v)
    return ReferenceDecoder(w.to(dtype=torch.float32)), ref_cache, ReferenceDecoder(w), copy_cache(cache)


def check_decode(spec: ModelSpec, context: int, steps: int = 64, seed: int = 0, tuning: Tuning = Tuning(),
                 graph: bool = True, num_sms: int | None = None, page_size: int = 16,
                 kv_dtype: torch.dtype = torch.bfloat16, min_pages: int = 0, tp: int = 1) -> CheckResult:
    """``steps`` decode steps of one sequence (module doc); an MoE model's routing checked too, an fp8 cache's rows
    (``kv_dtype``) step by step. ``tp`` > 1: that many tensor-parallel ranks (launch/tp.py, launched without
    graphs): on this one GPU, or, where torch.distributed is initialised with ``tp`` processes (torchrun), this
    process's rank on its GPU, every rank running the same check; ``tp_disagreements`` counts the steps whose ranks'
    logits differed."""
    w = random_weights(spec, seed, dtype=torch.bfloat16, device="cuda")
    cache, table = random_cache(spec, context, steps, page_size, seed + 1, kv_dtype=kv_dtype, min_pages=min_pages)
    ref, ref_cache, bf16_ref, bf16_cache = oracles(w, cache)
    if tp > 1 and distributed():  # this process's rank of a group across GPUs (torchrun)
        if torch.distributed.get_world_size() != tp:
            raise ValueError(f"tp={tp} under torch.distributed with {torch.distributed.get_world_size()} processes")
        dec = DistributedRank(w, shard_cache(cache, TensorParallel(spec, torch.distributed.get_rank(), tp,
                                                                   tuning.resolve(spec).tile_rows)),
                              max_pages_per_seq=len(table), tuning=tuning, num_sms=num_sms,
                              context_hint=max(context, 1))
    elif tp > 1:
        dec = SharedGPUGroup(w, cache, tp, max_pages_per_seq=len(table), tuning=tuning, num_sms=num_sms,
                             context_hint=max(context, 1))
    else:
        dec = MegakernelDecoder(w, cache, max_pages_per_seq=len(table), tuning=tuning, num_sms=num_sms,
                                context_hint=max(context, 1), use_graph=graph)
    tok = int(torch.randint(spec.vocab_size, (1,), generator=torch.Generator().manual_seed(seed)))
    same, finite, kernel_steps, bf16_steps, rows, row_errs = True, True, [], [], None, []
    scales = None if cache.layout.quantized else row_scales(ref_cache)
    log = RouteLog(spec.num_experts_per_tok)
    for i in range(steps):
        seg = [Segment(tuple(table), context + i, 1)]
        r_ref, r_bf16 = ([], []) if spec.is_moe else (None, None)
        expect = ref.forward(torch.tensor([tok]), seg, ref_cache, routings=r_ref)[0]
        bf16_steps.append(step_error(bf16_ref.forward(torch.tensor([tok]), seg, bf16_cache, routings=r_bf16)[0],
                                     expect))
        got = []
        for _ in range(2):  # the second launch rewrites the same K/V row: results must not move
            dec.poison() if tp > 1 else dec.scratch.poison()
            got.append(dec.step(tok, context + i, table)[0].clone())
        torch.cuda.synchronize()
        if tp > 1:  # the ranks' rows into the whole cache the row checks read
            dec.gather(cache)
        same &= bool(torch.equal(got[0], got[1]))
        finite &= bool(torch.isfinite(got[0]).all())
        kernel_steps.append(step_error(got[0], expect))
        if spec.is_moe:
            log.record(dec, spec, i, r_ref, r_bf16)
        tok = int(expect.argmax())
        # the step's row: the kernel's (and the bf16 reference's) against the oracle's, then the kernel's for both
        # references (module doc: every step reads the kernel's past)
        if cache.layout.quantized:
            rows = merge_row_checks(rows, kv_row_check(cache, ref_cache, table, [context + i]))
        else:
            row_errs.append((row_error(cache, ref_cache, table, [context + i], scales),
                             row_error(bf16_cache, ref_cache, table, [context + i], scales)))
        copy_rows(ref_cache, cache, table, [context + i])
        copy_rows(bf16_cache, cache, table, [context + i])
    verdicts, tie_steps = log.judge()
    bf16_err = max(e for _, _, e in bf16_steps)
    tie = 2 * bf16_err
    numbers = [i for i in range(steps) if i not in tie_steps]
    kept = [kernel_steps[i] for i in numbers]
    agree, near_ties, flips = argmax_verdicts(kept, tie)
    flips = [(numbers[i], gap, err) for i, gap, err in flips]  # by step number
    worst = max([e if e == e else float("inf") for _, _, e in kept] + [0.0])
    if rows is not None:
        kv_err, bf16_kv_err = rows["max_err"], float("nan")
    else:
        kv_err = max([row_errs[i][0] for i in numbers] + [0.0])
        bf16_kv_err = max([row_errs[i][1] for i in numbers] + [0.0])
    n = max(1, len(kept))
    return CheckResult(spec.name, context, steps, worst, agree / n, (agree + near_ties) / n, same, finite,
                       bf16_err, sum(s for s, _, _ in bf16_steps) / steps, tie, flips, kv_rows=rows,
                       kv_rel_err=kv_err, bf16_kv_rel_err=bf16_kv_err,
                       route_exact=verdicts.count("exact"), route_ties=verdicts.count("tie"),
                       route_mismatches=verdicts.count("mismatch"), route_tie_steps=len(tie_steps),
                       route_after_ties=verdicts.count("after_tie"),
                       route_tags_ok=log.tags_ok, route_self_ok=log.self_ok, route_tie=log.route_tie,
                       route_gap=log.worst_gap(verdicts), tp=tp, tp_disagreements=dec.disagreements if tp > 1 else 0)


@dataclass
class RouteLog:
    """An MoE run's routing, step by step (module doc): every MoE layer's oracle routing beside the experts the
    kernel's routing table names, whether every entry carried its step's tag, whether each step's last MoE layer
    routed its own logits as the reference does, and the bf16 reference's largest router-probability error."""

    k: int  # experts a token
    routes: list = field(default_factory=list)  # (step, oracle routing, the kernel's experts) an MoE layer
    tags_ok: bool = True
    self_ok: bool = True
    prob_err: float = 0.0

    def record(self, dec: MegakernelDecoder, spec: ModelSpec, step: int, oracle: list, bf16: list) -> None:
        """The step just run by ``dec``, whose oracle and bf16 reference routings are ``oracle`` and ``bf16``."""
        self.tags_ok &= _collect_routes(dec, spec, step, oracle, self.routes)
        self.self_ok &= own_routing_ok(dec, spec)
        self.prob_err = max([self.prob_err] + [float((b.probs - r.probs).abs().max()) for r, b in zip(oracle, bf16)])

    @property
    def route_tie(self) -> float:
        return 2 * self.prob_err

    def worst_gap(self, verdicts: list[str]) -> float:
        """The largest near-tie bound (``route_gap``) any routing judged a mismatch would have needed (0: none):
        against ``route_tie``, whether a mismatch is a near-tie just past the bound or a wrong expert."""
        return max([route_gap(r, experts, self.k) for (_, r, experts), v in zip(self.routes, verdicts)
                    if v == "mismatch"] + [0.0])

    def judge(self) -> tuple[list[str], set[int]]:
        """(each recorded routing's verdict, the steps routed to a near-tie elsewhere than the oracle). The routes are
        recorded step by step in layer order: a routing other than the oracle's after a near-tie earlier in its step
        is "after_tie" (module doc), not a mismatch."""
        verdicts, tied = [], set()
        for step, r, experts in self.routes:
            v = _route_verdict(r, experts, self.k, self.route_tie)
            if step in tied and v != "exact":
                v = "after_tie"
            elif v == "tie":
                tied.add(step)
            verdicts.append(v)
        return verdicts, tied


def _collect_routes(dec: MegakernelDecoder, spec: ModelSpec, step: int, oracle: list, out: list) -> bool:
    """Append (step, the oracle's routing, the experts the kernel's routing table names) for every MoE layer of the
    step just run; True when every entry carries the tag of that launch's epoch (the last one)."""
    from .. import isa

    epoch = dec.state.epoch - 1  # the launch that wrote the table moved the epoch on as it finished
    table = dec.scratch.routed.cpu().tolist()
    ok = True
    for li, r in zip(spec.moe_layers, oracle):
        entries = table[li]
        ok &= all(isa.routed_expert(e, epoch) is not None for e in entries)
        out.append((step, r, {e & isa.NO_EXPERT for e in entries} - {isa.NO_EXPERT}))
    return ok


def own_routing_ok(dec: MegakernelDecoder, spec: ModelSpec) -> bool:
    """The step just run (its M tokens): the last MoE layer's routing table row and slot weights are what the
    router's reference finisher (``ops.router``: ``models.moe.top_k`` and ``slots``) makes of the router logits the
    kernel left in the scratch: the same experts in the same slots, the weights within one bf16 step (the kernel sums
    the softmax in another order)."""
    from ...models.moe import top_k
    from .. import isa
    from ..ops.router import slots

    li = spec.moe_layers[-1]
    w, ids = top_k(dec.scratch.router_logits[:, : spec.num_experts].float(), spec)
    want_ids, want_w = slots(ids, w.to(torch.bfloat16).float(), dec.scratch.routed.shape[1])
    got_ids = [int(e) & isa.NO_EXPERT for e in dec.scratch.routed[li].tolist()]
    used = [j for j, e in enumerate(want_ids) if e != isa.NO_EXPERT]
    return got_ids == want_ids and bool(torch.allclose(dec.scratch.slot_w[used].float(), want_w[used], rtol=2 ** -7,
                                                       atol=0.0))


def route_gap(r, got: set[int], k: int) -> float:
    """The smallest ``route_tie`` for which ``_route_verdict`` calls the kernel's experts ``got`` a near-tie of the
    oracle's routing ``r`` (inf where no bound does: a count of experts outside [k, M x k])."""
    ids, p = r.ids.cpu(), r.probs.float().cpu()
    want = set(ids.flatten().tolist())
    if not k <= len(got) <= ids.numel():
        return float("inf")
    order = torch.sort(p, dim=-1, descending=True).values
    kth = order[:, k - 1]
    next_ = order[:, k] if k < p.shape[1] else torch.full_like(kth, float("-inf"))
    need = [float((kth - p[:, e]).min()) for e in got - want]  # some token's k-th within reach
    need += [float(p[m, e] - next_[m]) for e in want - got for m in range(ids.shape[0]) if e in ids[m].tolist()]
    return max(need + [0.0])


def _route_verdict(r, got: set[int], k: int, route_tie: float) -> str:
    """"exact", "tie" or "mismatch" for one step's routing of one MoE layer: the experts the kernel's table names
    ``got`` (the step's M tokens' distinct experts) against the oracle's routing ``r`` (ids [M, k], probs [M, E]).
    A near-tie (module doc): every expert only the kernel chose is within ``route_tie`` of some token's k-th oracle
    probability, and every expert only the oracle chose is, for every token that chose it, within ``route_tie`` of
    that token's (k+1)-th."""
    ids, p = r.ids.cpu(), r.probs.float().cpu()
    want = set(ids.flatten().tolist())
    if got == want:
        return "exact"
    order = torch.sort(p, dim=-1, descending=True).values  # [M, E]
    kth = order[:, k - 1]
    next_ = order[:, k] if k < p.shape[1] else torch.full_like(kth, float("-inf"))
    extra = all(bool((p[:, e] >= kth - route_tie).any()) for e in got - want)
    missing = all(bool((p[m, e] <= next_[m] + route_tie)) for e in want - got for m in range(ids.shape[0])
                  if e in ids[m].tolist())
    return "tie" if k <= len(got) <= ids.numel() and extra and missing else "mismatch"


@dataclass
class BatchResult:
    model: str
    batch: int
    context: int
    steps: int
    max_rel_err: float  # over every step and sequence, relative to that row's max|logit|
    argmax_agree: float  # (step, sequence) pairs whose argmax equals the oracle's
    argmax_agree_or_tie: float  # ... or where the oracle's gap to the kernel's pick is within ``tie``
    bit_identical: bool
    finite: bool
    kv_rel_err: float  # the rows the kernel appended vs the oracle's, relative to the oracle cache's max|value|
    bf16_rel_err: float = float("nan")  # the bf16 (transformers-numerics) reference's largest logit error
    bf16_kv_rel_err: float = float("nan")  # ... and its appended rows' (its own bf16 cache against the oracle's)
    tie: float = 0.0  # near-tie bound: 2 x bf16_rel_err
    others_intact: bool = True  # every cache row the step does not append (nor the padding's page) unchanged
    kv_rows: dict = None  # fp8: the appended rows against the oracle's, step by step (``kv_row_check``)
    route_self_ok: bool = True  # MoE: every step's last MoE layer routed its own logits as the reference does
    # MoE (zero for a dense model), as CheckResult's: (step, layer) routings equal to the oracle's, near-ties of it,
    # neither; steps left out of the logits' and appended rows' checks for a near-tie; every entry tagged
    route_exact: int = 0
    route_ties: int = 0
    route_mismatches: int = 0
    route_tie_steps: int = 0
    route_after_ties: int = 0  # routings other than the oracle's after a near-tie earlier in their step
    route_tags_ok: bool = True
    route_tie: float = 0.0  # the near-tie bound (CheckResult's)
    route_gap: float = 0.0  # the largest bound a mismatch would have needed (CheckResult's)

    def ok(self, tol: float = 2e-2, agree: float = 0.99, kv_tol: float = 1e-2, fp8_kv_tol: float = 0.2) -> bool:
        """Within ``tol`` / ``kv_tol`` of the oracle, or within twice the bf16 reference's own error where bf16
        arithmetic alone is further off, and the argmax the oracle's up to near-ties; no other row touched; an MoE
        model's routing as CheckResult.ok judges it. An fp8 cache's rows instead: kv/fp8.py rows (``requant_exact``)
        within ``fp8_kv_tol`` of the row's amax of the oracle's (about one e4m3 step: the kernel quantises
        bf16-rounded activations, the oracle fp32 ones)."""
        rows_ok = (self.kv_rows["requant_exact"] and self.kv_rel_err <= fp8_kv_tol if self.kv_rows is not None
                   else self.kv_rel_err <= max(kv_tol, 2 * self.bf16_kv_rel_err))
        return (self.others_intact and self.route_self_ok and self.finite and self.bit_identical
                and self.max_rel_err <= max(tol, 2 * self.bf16_rel_err) and self.argmax_agree_or_tie >= agree
                and rows_ok and self.route_tags_ok and self.route_mismatches == 0
                and self.route_tie_steps <= self.steps // 2)

    def as_dict(self) -> dict:
        return asdict(self)


def check_batch(spec: ModelSpec, batch: int, context: int, steps: int = 16, seed: int = 0,
                tuning: Tuning = Tuning(), graph: bool = True, num_sms: int | None = None,
                page_size: int = 16, kv_dtype: torch.dtype = torch.bfloat16) -> BatchResult:
    """``batch`` sequences whose contexts spread around ``context`` (context + 3b, so their pages and splits differ),
    ``steps`` decode steps of all of them in one launch each, against the fp32 oracle per sequence; the bf16
    (transformers-numerics) reference beside it, fed the same tokens, gives the error bf16 arithmetic alone makes."""
    return check_segments(spec, (1,) * batch, context, steps, seed, tuning, graph, num_sms, page_size,
                          kv_dtype=kv_dtype)


def check_segments(spec: ModelSpec, lens: tuple[int, ...], context: int, steps: int = 16, seed: int = 0,
                   tuning: Tuning = Tuning(), graph: bool = True, num_sms: int | None = None,
                   page_size: int = 16, padded: bool = False, kv_dtype: torch.dtype = torch.bfloat16) -> BatchResult:
    """Sequences s = 0, 1, .. with contexts context + 3s, each advanced by ``lens[s]`` tokens a step (1: a decode
    token; more: a verify block, every token's logits) in one launch (``MegakernelDecoder.step_segments``: one-token
    segments), ``steps`` steps, against the fp32 oracle and the bf16 reference run over the real segments. The next
    step's tokens are the oracle's argmax at every position. ``batch`` in the result is the step's token count.
    ``padded``: the step padded to its bucket by rows on a page of its own (launch/one_token.py), whose rows are
    then left out of the cache comparison, every other page compared. ``kv_dtype`` fp8: the random past quantised
    (``as_kv_dtype``), both references over copies of that fp8 cache (``oracles``); after every step the rows it
    appended are checked against the oracle's (``kv_row_check``: ``kv_rows``, its ``max_err`` as ``kv_rel_err``;
    the bf16 reference's rows likewise give ``bf16_kv_rel_err``) and then copied into both references' caches, so
    that every step reads the kernel's past, as check_decode does. An MoE model's routing: the last MoE layer's
    routing of its own logits after every step (``own_routing_ok``), the rest through the logits (plan.py refuses
    an MoE model over an fp8 cache, so the two never meet here)."""
    w = random_weights(spec, seed, dtype=torch.bfloat16, device="cuda")
    contexts = [context + 3 * b for b in range(len(lens))]
    m = sum(lens)
    per_seq = [-(-(c + steps * n) // page_size) for c, n in zip(contexts, lens)]
    n_pages = sum(per_seq) + 3 + int(padded)
    pad_page = n_pages - 1 if padded else None
    cache = PagedKVCache(KVLayout.for_spec(spec, page_size, n_pages, torch.bfloat16), "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    cache.k.normal_(0, 1, generator=g)
    cache.v.normal_(0, 1, generator=g)
    cache = as_kv_dtype(cache, kv_dtype)
    pages = torch.randperm(n_pages - int(padded), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    tables, i = [], 0
    for n in per_seq:
        tables.append(tuple(pages[i: i + n]))
        i += n
    ref, ref_cache, bf16_ref, bf16_cache = oracles(w, cache)
    before = tuple(t.clone() for t in cache.page_tensors())  # fp8: the pools' bytes and the scales
    dec = MegakernelDecoder(w, cache, max_pages_per_seq=max(per_seq), tuning=tuning, num_sms=num_sms,
                            context_hint=max(context, 1), use_graph=graph)
    toks = torch.randint(spec.vocab_size, (m,), generator=torch.Generator().manual_seed(seed)).tolist()
    same, finite, kernel_steps, bf16_steps, rows, bf16_rows, row_errs = True, True, [], [], None, None, []
    scales = None if cache.layout.quantized else row_scales(ref_cache)
    moe = spec.is_moe and not padded  # (a padded step routes its padding tokens too, in a bigger decoder)
    log = RouteLog(spec.num_experts_per_tok)
    starts = list(contexts)
    for i in range(steps):
        segs = [Segment(t, p, n, n) for t, p, n in zip(tables, starts, lens)]
        r_ref, r_bf16 = ([], []) if moe else (None, None)
        expect = ref.forward(torch.tensor(toks), segs, ref_cache, routings=r_ref)  # [M, V]: every token's logits
        bf16 = bf16_ref.forward(torch.tensor(toks), segs, bf16_cache, routings=r_bf16)
        got = []
        for _ in range(2):  # the second launch rewrites the same K/V rows: results must not move
            dec.segments_decoder(segs, pad_page).scratch.poison()
            got.append(dec.step_segments(toks, segs, pad_page)[0][:m].clone())
        torch.cuda.synchronize()
        if moe:
            log.record(dec.segments_decoder(segs, pad_page), spec, i, r_ref, r_bf16)
        same &= bool(torch.equal(got[0], got[1]))
        finite &= bool(torch.isfinite(got[0]).all())
        for b in range(m):
            kernel_steps.append(step_error(got[0][b], expect[b]))
            bf16_steps.append(step_error(bf16[b], expect[b]))
        toks = [int(t) for t in expect.argmax(-1)]
        # the step's rows: the kernel's (and the bf16 reference's) against the oracle's, then the kernel's for both
        # references (module doc: every step reads the kernel's past)
        for t, p, n in zip(tables, starts, lens):
            new = range(p, p + n)
            if cache.layout.quantized:
                rows = merge_row_checks(rows, kv_row_check(cache, ref_cache, t, new))
                bf16_rows = merge_row_checks(bf16_rows, kv_row_check(bf16_cache, ref_cache, t, new))
            else:
                row_errs.append((i, row_error(cache, ref_cache, t, new, scales),
                                 row_error(bf16_cache, ref_cache, t, new, scales)))
            copy_rows(ref_cache, cache, t, new)
            copy_rows(bf16_cache, cache, t, new)
        starts = [p + n for p, n in zip(starts, lens)]
    # a step routed to a near-tie elsewhere than the oracle is left out: its logits and the rows it appended
    # follow other experts (the references' later steps read the kernel's rows too)
    verdicts, tie_steps = log.judge()
    bf16_err = max(e for _, _, e in bf16_steps)
    tie = 2 * bf16_err
    kept = [e for j, e in enumerate(kernel_steps) if j // m not in tie_steps]
    agree, near_ties, _ = argmax_verdicts(kept, tie)
    worst = max([e if e == e else float("inf") for _, _, e in kept] + [0.0])
    # the rows this run appended, compared step by step above (near-tie steps' rows follow other experts)
    if cache.layout.quantized:
        kv_err, bf16_kv_err = rows["max_err"], bf16_rows["max_err"]
    else:
        kv_err = max([e for step, e, _ in row_errs if step not in tie_steps] + [0.0])
        bf16_kv_err = max([e for step, _, e in row_errs if step not in tie_steps] + [0.0])
    # every sequence's positions context .. context + steps * n - 1 (and the padding's page) may change, no other row
    written = torch.zeros(n_pages, page_size, dtype=torch.bool)
    if padded:
        written[pad_page] = True
    for t, c, n in zip(tables, contexts, lens):
        for p in range(c, c + steps * n):
            written[t[p // page_size], p % page_size] = True
    # [pages, rows]: the pools are [layers, pages, heads, rows, hd], the scales [layers, pages, heads, rows]
    keep = ~written.to(cache.k.device)
    intact = all(bool(torch.equal(a.movedim((1, 3), (0, 1))[keep], b.movedim((1, 3), (0, 1))[keep]))
                 for a, b in zip(cache.page_tensors(), before))
    n = max(1, len(kept))
    return BatchResult(spec.name, m, context, steps, worst, agree / n, (agree + near_ties) / n, same, finite,
                       kv_err, bf16_err, bf16_kv_err, tie, intact, kv_rows=rows, route_self_ok=log.self_ok,
                       route_exact=verdicts.count("exact"), route_ties=verdicts.count("tie"),
                       route_mismatches=verdicts.count("mismatch"), route_tie_steps=len(tie_steps),
                       route_after_ties=verdicts.count("after_tie"),
                       route_tags_ok=log.tags_ok, route_tie=log.route_tie, route_gap=log.worst_gap(verdicts))
