"""The greedy-pick kernel (engine/argmax.py) against torch.argmax, run by Triton's interpreter on the CPU. Collected
everywhere, run only in the TRITON_INTERPRET=1 process that ``tests/test_interpreter.py`` starts."""
import pytest
import torch
from interpret import ONLY_INTERPRETED, with_fixes  # noqa: F401 (an autouse fixture)

from mimw.engine.argmax import BLOCK, DeviceArgmax, argmax_torch

pytestmark = ONLY_INTERPRETED


def _rows(b, v, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, v, generator=g).to(dtype)
    top = x.float().max().item() + 1
    x[0, v - 1] = top  # the last entry of the last chunk
    if b > 1:  # the maximum twice, in two chunks: the lower index
        x[1, 3] = x[1, v - 2] = top
    if b > 2:  # NaNs beat any value, the first NaN wins
        x[2, v // 2] = x[2, v - 1] = float("nan")
        x[2, 0] = float("inf")
    if b > 3:  # nothing but -inf: index 0
        x[3] = float("-inf")
    if b > 4:  # +inf beats the rest
        x[4, 5] = float("inf")
    return x


@pytest.mark.parametrize("b,v", [(1, 100), (5, 2 * BLOCK + 3), (6, 3 * BLOCK)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_picks_match_torch_argmax(b, v, dtype):
    pick = DeviceArgmax()
    for seed in range(3):  # the same object again: its tickets were left at 0
        x = _rows(b, v, seed + 10 * b, dtype)
        got = pick(x)
        assert got.dtype == torch.int64 and got.shape == (b,)
        assert got.tolist() == argmax_torch(x).tolist()
    assert not pick._tickets.any()


def test_a_strided_view_and_a_growing_batch():
    pick = DeviceArgmax()
    x = _rows(2, 700, 1, torch.float32)
    assert pick(x).tolist() == argmax_torch(x).tolist()
    wide = _rows(70, 2 * 700, 2, torch.float32)[:, ::2]  # not contiguous: copied first
    assert pick(wide).tolist() == argmax_torch(wide).tolist()
    assert pick._tickets.numel() == 128
