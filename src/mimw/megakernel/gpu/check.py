"""Correctness harness for the megakernel on the GPU, shared by the `gpu` tests and the bench scripts.

For one model shape and context: random bf16 weights, a bf16 paged KV cache whose first ``context`` positions hold
random K/V (the values past tokens would have left there — the kernel cannot tell), then ``steps`` consecutive
decode steps. The oracle is the reference decoder in fp32 on the same bf16-rounded weights, over an fp32 copy of
the same cache; each step feeds both the oracle's greedy token. Scratch is poisoned (NaN) before every launch.
Every step also relaunches once more and compares logits bit for bit (a moving result would be a race).

Argmax agreement is reported twice: exact, and exact-or-near-tie, where a different argmax counts only when the
oracle's logit for the kernel's choice is within NEAR_TIE (0.5%) of max|logit| of the oracle's best — random
weights make such ties common, and bf16 weights/activations (relative error ~1e-2) cannot order them. (A bound
taken from the step's own error would excuse every flip: a flip always implies max|error| >= gap / 2.) Every
mismatch is listed in ``flips`` with its gap and the step's error, both relative to max|logit|.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ...kv.pages import KVLayout, PagedKVCache
from ...models.reference import ReferenceDecoder, Segment
from ...models.spec import ModelSpec
from ...models.weights import random_weights
from .config import KernelConfig
from .decoder import MegakernelDecoder

NEAR_TIE = 5e-3


@dataclass
class CheckResult:
    model: str
    context: int
    steps: int
    max_rel_err: float
    argmax_agree: float  # steps whose argmax equals the oracle's
    argmax_agree_or_tie: float  # ... or where the kernel picked a token within NEAR_TIE of the oracle's best
    bit_identical: bool
    finite: bool
    flips: list = None  # [(step, oracle gap / max|logit|, step error / max|logit|)] for every argmax mismatch

    def ok(self, tol: float = 2e-2, agree: float = 0.99) -> bool:
        return self.finite and self.bit_identical and self.max_rel_err <= tol and self.argmax_agree_or_tie >= agree

    def as_dict(self) -> dict:
        return asdict(self)


def compare_argmax(got: torch.Tensor, expect: torch.Tensor) -> tuple[str, float, float]:
    """One step's verdict: ("agree" | "near_tie" | "flip", oracle gap / max|logit|, max|error| / max|logit|).
    A different argmax is a near-tie when the oracle's logit for the kernel's choice is within NEAR_TIE of
    max|logit| below the oracle's best."""
    scale = expect.abs().max()
    err_abs = (got - expect).abs().max()
    err = (err_abs / scale).item()
    choice = int(got.argmax())
    if choice == int(expect.argmax()):
        return "agree", 0.0, err
    gap = expect.max() - expect[choice]
    verdict = "near_tie" if gap <= NEAR_TIE * scale else "flip"
    return verdict, (gap / scale).item(), err


def random_cache(spec: ModelSpec, context: int, steps: int, page_size: int, seed: int, device="cuda"):
    """A bf16 cache with ``context`` random positions of one sequence; its block table is a shuffled page list."""
    n_pages = -(-(context + steps) // page_size) + 3
    layout = KVLayout.for_spec(spec, page_size, n_pages, torch.bfloat16)
    cache = PagedKVCache(layout, device)
    g = torch.Generator(device=device).manual_seed(seed)
    cache.k.normal_(0, 1, generator=g)
    cache.v.normal_(0, 1, generator=g)
    table = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    return cache, table


def check_decode(spec: ModelSpec, context: int, steps: int = 64, seed: int = 0,
                 kcfg: KernelConfig | None = None, graph: bool = True, num_sms: int | None = None) -> CheckResult:
    kcfg = kcfg or KernelConfig.for_spec(spec)
    w = random_weights(spec, seed, dtype=torch.bfloat16, device="cuda")
    cache, table = random_cache(spec, context, steps, kcfg.page_size, seed + 1)
    ref_cache = PagedKVCache(KVLayout.for_spec(spec, kcfg.page_size, cache.layout.num_pages, torch.float32), "cuda")
    ref_cache.k.copy_(cache.k)
    ref_cache.v.copy_(cache.v)
    ref = ReferenceDecoder(w.to(dtype=torch.float32))
    dec = MegakernelDecoder(w, cache, max_pages_per_seq=len(table), kcfg=kcfg, num_sms=num_sms,
                            context_hint=max(context, 1), use_graph=graph)
    tok = int(torch.randint(spec.vocab_size, (1,), generator=torch.Generator().manual_seed(seed)))
    worst, agree, near_ties, same, finite, flips = 0.0, 0, 0, True, True, []
    for i in range(steps):
        pos = context + i
        expect = ref.forward(torch.tensor([tok]), [Segment(tuple(table), pos, 1)], ref_cache)[0]
        got = []
        for _ in range(2):  # the second launch rewrites the same K/V row: results must not move
            dec.scratch.poison()
            got.append(dec.step(tok, pos, table)[0].clone())
        torch.cuda.synchronize()
        same &= bool(torch.equal(got[0], got[1]))
        finite &= bool(torch.isfinite(got[0]).all())
        verdict, gap, err = compare_argmax(got[0], expect)
        worst = max(worst, err if err == err else float("inf"))
        agree += verdict == "agree"
        near_ties += verdict == "near_tie"  # the oracle's own top two are closer than bf16 can resolve
        if verdict != "agree":
            flips.append((i, round(gap, 5), round(err, 5)))
        tok = int(expect.argmax())
    return CheckResult(spec.name, context, steps, worst, agree / steps, (agree + near_ties) / steps, same, finite,
                       flips)
