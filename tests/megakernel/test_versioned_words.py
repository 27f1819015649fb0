"""The versioned-word format (gpu/versioned.py's PyTorch reference): what the kernel's ``store`` writes and its
``wait_*`` read back, checked on CPU; the GPU test reads the kernel's own words against it."""
import torch

from mimw.megakernel.gpu.versioned import pack, step_version, unpack


def test_pack_and_unpack_round_trip_values_and_versions_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    values = torch.cat([torch.randn(64, generator=g) * 1e3, torch.tensor([0.0, -0.0, float("inf"), float("nan")])])
    for version in (0, 7, 65536 * 3 + 5, -1, -(2**31), 2**31 - 1):
        versions, back = unpack(pack(values, version))
        assert versions.tolist() == [version] * len(values)
        assert torch.equal(back.view(torch.int32), values.view(torch.int32))  # NaN and -0.0 included


def test_step_versions_wrap_like_int32_and_never_repeat_within_65536_steps():
    assert step_version(0, 0) == 0 and step_version(2, 3) == 2 * 65536 + 3
    assert step_version(32768, 0) == -(2**31)  # epoch * 65536 wraps past 2^31 as the GPU's int32 does
    assert step_version(65536, 4) == step_version(0, 4)  # the period: 65536 steps
    seen = {step_version(e, n) for e in range(0, 65536, 997) for n in range(0, 130)}
    assert len(seen) == len(range(0, 65536, 997)) * 130
    assert -1 not in seen  # -1 is "never written": no step's version is
