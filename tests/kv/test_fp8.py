import pytest
import torch

from mimw.kv import fp8


def _rows(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 4, 64, generator=g) * torch.tensor([1e-4, 0.1, 3.0, 900.0])[None, :, None]
    x[0, 0] = 0.0  # an all-zero row
    x[1, 1, 5] = 40.0  # one outlier in a row of small values
    return x


def test_scale_is_amax_over_448_in_bf16():
    amax = torch.tensor([448.0, 449.0, 1.0, 0.0, 3e-3, 1e-45])
    s = fp8.row_scale(amax)
    assert s.dtype == torch.bfloat16
    assert torch.equal(s, torch.tensor([1.0, 449.0 / 448, 1 / 448, 1.0, 3e-3 / 448, 2.0 ** -126]).bfloat16())


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


def test_the_row_maximum_comes_back_almost_exactly():
    x = _rows(2)
    y = fp8.dequantize(*fp8.quantize(x))
    i = x.abs().argmax(-1, keepdim=True)
    top, back = x.gather(-1, i), y.gather(-1, i)
    assert float(((back - top).abs() / top.abs().clamp_min(1e-30)).max()) <= 2.0 ** -8  # the bf16 scale's rounding


def test_requantising_dequantised_values_changes_nothing():
    q, scale = fp8.quantize(_rows(1))
    y = fp8.dequantize(q, scale)
    q2, scale2 = fp8.quantize(y)
    assert torch.equal(scale2, scale) and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_overflow_to_nan_at_the_row_maximum(dtype):
    x = torch.tensor([[447.9, -1000.0, 3.0, 0.5]], dtype=dtype)
    y = fp8.dequantize(*fp8.quantize(x))
    assert torch.isfinite(y).all() and float(y[0, 1]) == pytest.approx(-1000.0, rel=2 ** -8)
