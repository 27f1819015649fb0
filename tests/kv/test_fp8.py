import pytest
import torch

from mimw.kv import fp8


def _rows(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 4, 64, generator=g) * torch.tensor([1e-4, 0.1, 3.0, 900.0])[None, :, None]
    x[0, 0] = 0.0  # an all-zero row
    x[1, 1, 5] = 40.0  # one outlier in a row of small values
    return x


def test_scales_are_the_smallest_power_of_two_that_fits_448():
    amax = torch.tensor([448.0, 449.0, 224.0, 224.5, 1.0, 0.0, 3e-3])
    s = fp8.pow2_scale(amax)
    assert torch.equal(s, torch.tensor([1.0, 2.0, 0.5, 1.0, 2.0 ** -8, 1.0, 2.0 ** -17]))
    assert bool(((amax / s) <= fp8.E4M3_MAX).all())
    assert bool(((amax / s)[amax > 0] > fp8.E4M3_MAX / 2).all())  # the smallest such power


def test_round_trip_within_e4m3_error():
    x = _rows()
    q, scale = fp8.quantize(x)
    assert q.dtype == fp8.FP8 and q.shape == x.shape
    assert scale.dtype == fp8.SCALE_DTYPE and scale.shape == x.shape[:-1]
    y = fp8.dequantize(q, scale)
    s = scale.float()[..., None]
    normal = x.abs() >= s * 2.0 ** -6  # e4m3's smallest normal is 2^-6: relative error <= 2^-4 above it
    rel = (y - x).abs() / x.abs().clamp_min(1e-30)
    assert float(rel[normal].max()) <= 2.0 ** -4
    assert float(((y - x).abs() / s)[~normal].max()) <= 2.0 ** -10  # half the subnormal spacing 2^-9
    assert torch.equal(y[0, 0], torch.zeros(64))
    assert float(rel.mean()) < 0.03


def test_dequantised_values_are_exact_in_bf16_and_requantise_unchanged():
    q, scale = fp8.quantize(_rows(1))
    y = fp8.dequantize(q, scale)
    assert torch.equal(fp8.dequantize(q, scale, torch.bfloat16).float(), y)
    q2, scale2 = fp8.quantize(y.bfloat16())
    assert torch.equal(fp8.dequantize(q2, scale2), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_saturation_at_the_row_maximum(dtype):
    x = torch.tensor([[447.9, -960.0, 3.0, 0.5]], dtype=dtype)
    q, scale = fp8.quantize(x)
    y = fp8.dequantize(q, scale)
    assert torch.isfinite(y).all() and float(y[0, 1]) == -960.0  # -960 = -240 * 4: representable, not clipped
