"""Correctness gate: one step's logits of a backend against the reference decoder's.

Pass when the relative error ||a - r|| / ||r|| is within ``rel_tol`` and the argmax agrees. ``rel_tol`` is 2e-2
(bf16 end to end) unless bf16 itself is noisier at this model's depth: the run measures that noise as the bf16
reference's own error against an fp32 reference (``noise_tolerance``) and allows twice it. Two bf16 implementations
that differ only in rounding order then pass; a wrong one (a bad mask, a missing bias, a swapped RoPE half) is off by
far more.

A differing argmax still passes when the reference's top two logits are closer than the observed error can resolve:
``r[argmax a] >= max r - max(tie_tol * std r, 3 * rms(a - r))``. With random weights two vocabulary entries can be
near-tied and bf16 rounding then decides between them legitimately; such a pass is labelled ``near-tie``.

An MoE step has one reference per routing it may legitimately take (``mimw.bench.routes``: near-ties of a router's
top k, where rounding decides which expert runs): ``compare_routes`` passes the logits when they pass against one of
them, and otherwise fails them against the closest.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch

REL_TOL = 2e-2


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    rel_err: float
    argmax: int
    ref_argmax: int
    detail: str          # "ok", "ok (near-tie)", or why it failed
    rel_tol: float = REL_TOL

    def to_json(self) -> dict:
        return asdict(self)


def rel_err(a: torch.Tensor, r: torch.Tensor) -> float:
    a, r = a.detach().reshape(-1).float().cpu(), r.detach().reshape(-1).float().cpu()
    return float((a - r).norm() / r.norm().clamp_min(1e-30))


def noise_tolerance(noise: float | None, base: float = REL_TOL, factor: float = 2.0) -> float:
    """The relative-error bound: ``base``, or ``factor`` x the measured bf16 noise when that is larger."""
    if noise is None or not noise == noise:  # None or NaN: no measurement
        return base
    return max(base, factor * noise)


def compare_logits(logits: torch.Tensor, ref: torch.Tensor, rel_tol: float = REL_TOL,
                   tie_tol: float = 1e-2) -> CheckResult:
    a = logits.detach().reshape(-1).float().cpu()
    r = ref.detach().reshape(-1).float().cpu()
    if a.shape != r.shape:
        return CheckResult(False, float("nan"), -1, int(r.argmax()), f"shape {tuple(a.shape)} != {tuple(r.shape)}",
                           rel_tol)
    if not torch.isfinite(a).all():
        return CheckResult(False, float("nan"), -1, int(r.argmax()), "non-finite logits", rel_tol)
    rel = rel_err(a, r)
    am, rm = int(a.argmax()), int(r.argmax())
    if rel > rel_tol:
        return CheckResult(False, rel, am, rm, f"rel_err {rel:.3g} > {rel_tol:.3g}", rel_tol)
    if am == rm:
        return CheckResult(True, rel, am, rm, "ok", rel_tol)
    rms = float((a - r).pow(2).mean().sqrt())
    if float(r[am]) >= float(r.max()) - max(tie_tol * float(r.std()), 3.0 * rms):
        return CheckResult(True, rel, am, rm, "ok (near-tie)", rel_tol)
    return CheckResult(False, rel, am, rm, f"argmax {am} != reference {rm}", rel_tol)


def compare_routes(logits: torch.Tensor, refs: Sequence[torch.Tensor],
                   rel_tol: float = REL_TOL) -> tuple[CheckResult, int]:
    """``compare_logits`` against each of ``refs`` (an MoE step's references, one per legitimate routing, the
    reference's own first): the passing result of least error, or, when none passes, the result against the closest
    reference (least error, then the first); and that reference's index."""
    results = [compare_logits(logits, r, rel_tol) for r in refs]
    err = [c.rel_err if c.rel_err == c.rel_err else float("inf") for c in results]
    passing = [i for i, c in enumerate(results) if c.ok]
    best = min(passing or range(len(results)), key=lambda i: (err[i], i))
    return results[best], best
