"""The GPU check's argmax verdicts (pure torch, runs on the CPU)."""
import torch

from mimw.megakernel.tools.check import argmax_verdicts, step_error


def test_same_argmax_agrees_and_reports_the_error():
    expect = torch.tensor([1.0, 5.0, 2.0])
    same, gap, err = step_error(expect + torch.tensor([0.0, 0.1, 0.0]), expect)
    assert same and gap == 0.0 and abs(err - 0.02) < 1e-6


def test_a_different_argmax_reports_the_oracles_gap_to_the_pick():
    expect = torch.tensor([0.0, 10.0, 9.97])  # the oracle's best is 0.3% of max|logit| above the kernel's pick
    same, gap, err = step_error(torch.tensor([0.0, 9.98, 9.99]), expect)
    assert not same and abs(gap - 0.003) < 1e-6 and abs(err - 0.002) < 1e-6


def test_a_mismatch_within_the_tie_bound_is_a_near_tie_and_one_beyond_it_a_flip():
    steps = [(True, 0.0, 0.01), (False, 0.004, 0.01), (False, 0.012, 0.01), (True, 0.0, 0.02)]
    agree, near, flips = argmax_verdicts(steps, tie=0.01)
    assert (agree, near) == (2, 1)
    assert flips == [(1, 0.004, 0.01), (2, 0.012, 0.01)]  # every mismatch is listed, near-tie or not


def test_the_tie_bound_does_not_follow_the_kernels_own_error():
    # the kernel is 1% off and that flips a 1%-wide gap: its own error explains the flip, but with a tie bound
    # from a bf16 reference that erred by 0.25% (tie 0.5%) it is a flip
    expect = torch.tensor([0.0, 10.0, 9.9])
    step = step_error(torch.tensor([0.0, 9.9, 10.0]), expect)
    agree, near, _ = argmax_verdicts([step], tie=2 * 0.0025)
    assert (agree, near) == (0, 0) and abs(step[2] - 0.01) < 1e-6
