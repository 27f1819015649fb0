"""The GPU check's per-step argmax verdict (pure torch, runs on the CPU)."""
import torch

from mimw.megakernel.gpu.check import NEAR_TIE, compare_argmax


def test_same_argmax_agrees_and_reports_the_error():
    expect = torch.tensor([1.0, 5.0, 2.0])
    verdict, gap, err = compare_argmax(expect + torch.tensor([0.0, 0.1, 0.0]), expect)
    assert verdict == "agree" and gap == 0.0 and abs(err - 0.02) < 1e-6


def test_a_flip_between_logits_closer_than_near_tie_is_a_near_tie():
    expect = torch.tensor([0.0, 10.0, 9.97])  # oracle gap 0.3% of max|logit|
    verdict, gap, _ = compare_argmax(torch.tensor([0.0, 9.98, 9.99]), expect)
    assert verdict == "near_tie" and abs(gap - 0.003) < 1e-6 < NEAR_TIE - gap


def test_a_flip_wider_than_near_tie_fails_even_when_the_error_explains_it():
    # the kernel is 1% off on two logits (within the 2e-2 error bound) and that flips a 1%-wide gap: with random
    # weights bf16 can do this, but the check must not excuse it (otherwise no flip could ever fail)
    expect = torch.tensor([0.0, 10.0, 9.9])
    verdict, gap, err = compare_argmax(torch.tensor([0.0, 9.9, 10.0]), expect)
    assert verdict == "flip" and abs(gap - 0.01) < 1e-6 and abs(err - 0.01) < 1e-6
