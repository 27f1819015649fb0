"""The reference decoder's memory-safe attention (blocks of queries) against the plain formula."""
import pytest
import torch

from mimw.models import reference


def plain_attention(q, k, v, q_pos):
    """The definition: one [Hq, T, S] fp32 score matrix, causal mask, softmax, weighted sum (GQA by repetition)."""
    t, hq, hd = q.shape
    g = hq // k.shape[1]
    kk = k.repeat_interleave(g, dim=1).transpose(0, 1).float()  # [Hq, S, hd]
    vv = v.repeat_interleave(g, dim=1).transpose(0, 1).float()
    s = torch.einsum("thd,hsd->hts", q.float(), kk) * hd ** -0.5
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hts,hsd->thd", torch.softmax(s, dim=-1), vv).to(q.dtype)


def _inputs(t, s, hq, hkv, hd, start, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, hd, generator=g)
    k = torch.randn(s, hkv, hd, generator=g)
    v = torch.randn(s, hkv, hd, generator=g)
    return q, k, v, torch.arange(start, start + t)


@pytest.mark.parametrize("budget", [1, 100, 5000, reference.MAX_SCORE_ELEMENTS])
@pytest.mark.parametrize("t,s,hq,hkv,start", [(37, 37, 4, 2, 0), (13, 50, 9, 3, 37), (1, 20, 8, 8, 19),
                                               (64, 64, 6, 1, 0)])
def test_blockwise_attention_matches_the_plain_formula(budget, t, s, hq, hkv, start):
    q, k, v, pos = _inputs(t, s, hq, hkv, 16, start)
    got = reference.attention(q, k, v, pos, max_score_elements=budget)
    assert torch.allclose(got, plain_attention(q, k, v, pos), rtol=1e-5, atol=1e-5)


def test_blockwise_attention_in_bf16_matches_the_plain_formula():
    q, k, v, pos = _inputs(40, 90, 8, 2, 32, 50, seed=3)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = reference.attention(q, k, v, pos, max_score_elements=1000)
    want = plain_attention(q, k, v, pos)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 1e-2


def test_score_blocks_stay_within_the_budget(monkeypatch):
    """An 8k context at the default model's 9 heads: every softmax sees at most the budget's scores, never the
    [9, T, S] matrix (9 x 2048 x 2048 here, scaled down from 8k to keep the test fast)."""
    sizes = []
    real = torch.softmax

    def spy(x, *a, **kw):
        sizes.append(x.numel())
        return real(x, *a, **kw)

    monkeypatch.setattr(torch, "softmax", spy)
    q, k, v, pos = _inputs(2048, 2048, 9, 3, 8, 0, seed=1)
    reference.attention(q, k, v, pos, max_score_elements=1 << 20)
    assert sizes and max(sizes) <= 1 << 20
    assert sum(sizes) < 9 * 2048 * 2048  # causal: later blocks only see the keys they need
