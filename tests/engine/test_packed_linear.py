"""PackedLinear: oneDNN-prepacked weights for the CPU's few-row steps; everything else stays F.linear, bit for bit."""
import pytest
import torch
import torch.nn.functional as F

from mimw.engine.backends import packed_linear
from mimw.engine.backends.packed_linear import PackedLinear
from mimw.engine.backends.reference import ReferenceBackend
from mimw.engine.sampling import SamplingParams
from mimw.models.reference import Segment

from mimw.engine.engine import Engine, EngineConfig
from mimw.engine.spec.config import SpecConfig
from mimw.engine.spec.speculator import Speculator, make_drafter

from engine_helpers import ByteTokenizer, greedy_alone

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="torch without oneDNN linear")


def test_few_rows_take_the_packed_weight_and_the_rest_stays_f_linear(tiny_weights):
    pl = PackedLinear(tiny_weights, min_rows=4, max_rows=16)
    lw = tiny_weights.layers[0]
    assert pl.num_packed == 1 + 7 * len(tiny_weights.layers)  # the LM head and each layer's 7 matrices
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 3, 4, 9, 16, 17, 40):
        x = torch.randn(rows, lw.w_gate.shape[1], generator=g)
        want = F.linear(x, lw.w_gate)
        got = pl(x, lw.w_gate)
        if 4 <= rows <= 16:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(got, want)  # outside the packed range: F.linear itself
    x = torch.randn(5, tiny_weights.lm_head.shape[1], generator=g)
    torch.testing.assert_close(pl(x, tiny_weights.lm_head), F.linear(x, tiny_weights.lm_head), rtol=1e-4, atol=1e-5)
    other = lw.w_gate.clone()  # a weight it did not pack: F.linear
    assert torch.equal(pl(torch.ones(5, other.shape[1]), other), F.linear(torch.ones(5, other.shape[1]), other))


def test_rejects_what_it_cannot_pack(tiny_weights):
    with pytest.raises(ValueError, match="min_rows"):
        PackedLinear(tiny_weights, min_rows=1)
    assert ReferenceBackend(tiny_weights.to(dtype=torch.bfloat16), packed_linear=True).packed is None


def test_verify_block_logits_match_the_unpacked_backend(tiny_weights):
    plain, packed = ReferenceBackend(tiny_weights), ReferenceBackend(tiny_weights, packed_linear=True)
    assert packed.packed is not None and plain.packed is None
    toks = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1))
    out = []
    for be in (plain, packed):
        cache = be.make_cache(8, 8)
        table = tuple(range(8))
        be.forward(toks[:30], [Segment(table, 0, 30, 1)], cache)  # prefill
        one = be.forward(toks[30:31], [Segment(table, 30, 1, 1)], cache)  # a decode step: 1 row
        block = be.forward(toks[31:40], [Segment(table, 31, 9, 9)], cache)  # a verify block: 9 rows
        out.append((one, block))
    assert torch.equal(out[0][0], out[1][0])  # one-row steps are bit for bit the same
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-4, atol=1e-4)


def test_speculative_greedy_output_on_the_packed_backend_equals_plain(tiny_weights):
    cfg = SpecConfig("suffix", num_tokens=8)
    eng = Engine(ReferenceBackend(tiny_weights, packed_linear=True), ByteTokenizer(), EngineConfig(),
                 speculator=Speculator(make_drafter(cfg), cfg))
    prompts = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 8 + [7]]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while eng.has_work():
        for ev in eng.step():
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
    assert [got[f"r{i}"] for i in range(2)] == [greedy_alone(tiny_weights, p, 24) for p in prompts]
    assert eng.stats().spec.verify_steps > 0
