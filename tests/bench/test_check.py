"""The correctness gate compares logits by relative error and argmax, tolerating genuine near-ties."""
import pytest
import torch

from mimw.bench.check import compare_logits, noise_tolerance, rel_err


def _ref() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    r = torch.randn(1000, generator=g)
    r[7] = 10.0   # a clear winner
    return r


def test_identical_and_small_noise_pass():
    r = _ref()
    assert compare_logits(r, r).ok and compare_logits(r, r).rel_err == 0.0
    noisy = (r + 1e-3 * torch.randn(1000)).to(torch.bfloat16).unsqueeze(0)  # [1, V] in bf16 is accepted
    c = compare_logits(noisy, r)
    assert c.ok and c.detail == "ok" and c.argmax == c.ref_argmax == 7 and c.rel_err < 2e-2


def test_large_error_fails():
    r = _ref()
    c = compare_logits(r * 1.1, r)
    assert not c.ok and "rel_err" in c.detail


def test_different_argmax_fails_unless_near_tie():
    r = _ref()
    wrong = r.clone()
    wrong[3] = 10.5                                   # peer prefers token 3; the reference has it far below
    c = compare_logits(wrong, r, rel_tol=1.0)
    assert not c.ok and "argmax" in c.detail
    tied = r.clone()
    tied[3] = 10.0 - 1e-4                              # the reference's top two nearly equal
    peer = tied.clone()
    peer[3] += 2e-4                                    # rounding flips the order
    c = compare_logits(peer, tied)
    assert c.ok and c.detail == "ok (near-tie)" and c.argmax == 3 and c.ref_argmax == 7


def test_non_finite_and_shape_mismatch_fail():
    r = _ref()
    bad = r.clone()
    bad[0] = float("nan")
    assert not compare_logits(bad, r).ok
    assert not compare_logits(r[:10], r).ok


def test_near_tie_within_measured_noise():
    r = _ref()
    r[3] = 10.0 - 0.05                                 # a gap far above tie_tol * std, but below the noise
    g = torch.Generator().manual_seed(1)
    peer = r + 0.05 * torch.randn(1000, generator=g)
    peer[3], peer[7] = 10.02, 9.98
    c = compare_logits(peer, r, rel_tol=0.1)
    assert c.ok and c.detail == "ok (near-tie)"


def test_noise_tolerance_and_rel_err():
    assert noise_tolerance(None) == 2e-2 and noise_tolerance(float("nan")) == 2e-2
    assert noise_tolerance(5e-3) == 2e-2 and noise_tolerance(1.5e-2) == 3e-2
    r = _ref()
    assert rel_err(r * 1.01, r) == pytest.approx(0.01, rel=1e-4)
    c = compare_logits(r * 1.025, r, rel_tol=noise_tolerance(1.5e-2))
    assert c.ok and c.rel_tol == 3e-2
