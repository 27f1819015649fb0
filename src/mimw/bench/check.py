"""Correctness gate: one step's logits of a backend against the reference decoder's.

Pass when the relative error ||a - r|| / ||r|| is within ``rel_tol`` (2e-2 suits bf16 end to end) and the argmax
agrees. A differing argmax still passes when the reference's own top two logits are closer than the observed
error allows (``r[argmax a] >= max r - tie_tol * std r``): with random weights two vocabulary entries can be
near-tied, and bf16 rounding then decides between them legitimately; such a pass is labelled ``near-tie``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    rel_err: float
    argmax: int
    ref_argmax: int
    detail: str          # "ok", "ok (near-tie)", or why it failed

    def to_json(self) -> dict:
        return asdict(self)


def compare_logits(logits: torch.Tensor, ref: torch.Tensor, rel_tol: float = 2e-2,
                   tie_tol: float = 1e-2) -> CheckResult:
    a = logits.detach().reshape(-1).float().cpu()
    r = ref.detach().reshape(-1).float().cpu()
    if a.shape != r.shape:
        return CheckResult(False, float("nan"), -1, int(r.argmax()), f"shape {tuple(a.shape)} != {tuple(r.shape)}")
    if not torch.isfinite(a).all():
        return CheckResult(False, float("nan"), -1, int(r.argmax()), "non-finite logits")
    rel = float((a - r).norm() / r.norm().clamp_min(1e-30))
    am, rm = int(a.argmax()), int(r.argmax())
    if rel > rel_tol:
        return CheckResult(False, rel, am, rm, f"rel_err {rel:.3g} > {rel_tol:g}")
    if am == rm:
        return CheckResult(True, rel, am, rm, "ok")
    if float(r[am]) >= float(r.max()) - tie_tol * float(r.std()):
        return CheckResult(True, rel, am, rm, "ok (near-tie)")
    return CheckResult(False, rel, am, rm, f"argmax {am} != reference {rm}")
