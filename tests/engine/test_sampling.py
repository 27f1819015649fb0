import pytest
import torch

from mimw.engine.sampling import SamplingParams, filtered_probs, make_generator, sample, sample_batch


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(seed="x"), "seed"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(stop=("",)), "stop"),
    (dict(stop_token_ids=(-3,)), "stop_token_ids"),
])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_normalise_stop_to_tuples():
    p = SamplingParams(stop="\n", stop_token_ids=[5, 6])
    assert p.stop == ("\n",) and p.stop_token_ids == (5, 6)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    hash(p)  # frozen and hashable


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    p = SamplingParams(temperature=0)
    assert p.greedy and make_generator(p) is None
    assert sample(logits, p, None) == 1


def test_top_k_one_is_greedy_and_top_k_restricts_support():
    torch.manual_seed(0)
    logits = torch.randn(50)
    top3 = set(torch.topk(logits, 3).indices.tolist())
    p1 = SamplingParams(temperature=1.0, top_k=1, seed=1)
    g = make_generator(p1)
    assert all(sample(logits, p1, g) == int(logits.argmax()) for _ in range(20))
    p3 = SamplingParams(temperature=5.0, top_k=3, seed=2)
    g = make_generator(p3)
    assert {sample(logits, p3, g) for _ in range(200)} <= top3


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    kept = filtered_probs(logits, SamplingParams(top_p=0.8))
    assert torch.allclose(kept, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    kept = filtered_probs(logits, SamplingParams(top_p=0.81))
    assert kept[2] > 0 and kept[3] == 0
    # the most likely token always survives, however small top_p is
    kept = filtered_probs(logits, SamplingParams(top_p=1e-6))
    assert torch.equal(kept, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_temperature_sharpens_distribution():
    logits = torch.tensor([1.0, 0.0])
    hot = filtered_probs(logits, SamplingParams(temperature=2.0))
    cold = filtered_probs(logits, SamplingParams(temperature=0.5))
    assert cold[0] > hot[0] > 0.5


def test_same_seed_same_tokens_different_seed_differs():
    logits = torch.zeros(1000)  # uniform: any divergence shows up quickly
    p = SamplingParams(temperature=1.0, seed=1234)
    g1, g2 = make_generator(p), make_generator(p)
    a = [sample(logits, p, g1) for _ in range(16)]
    b = [sample(logits, p, g2) for _ in range(16)]
    assert a == b
    g3 = make_generator(SamplingParams(temperature=1.0, seed=4321))
    assert a != [sample(logits, p, g3) for _ in range(16)]


def test_empirical_frequencies_follow_probabilities():
    probs = torch.tensor([0.6, 0.3, 0.1])
    p = SamplingParams(temperature=1.0, seed=0)
    g = make_generator(p)
    counts = torch.bincount(torch.tensor([sample(probs.log(), p, g) for _ in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_non_greedy_without_generator_is_an_error():
    with pytest.raises(ValueError, match="generator"):
        sample(torch.zeros(4), SamplingParams(temperature=1.0), None)


def test_sample_batch_mixes_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 0.0]])
    ps = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1, seed=0)]
    assert sample_batch(logits, ps, [make_generator(p) for p in ps]) == [1, 0]
    with pytest.raises(ValueError):
        sample_batch(logits, ps[:1], [None])


# --- processors and the distribution ----------------------------------------------------------------------------
from mimw.engine.sampling import TokenContext, distribution  # noqa: E402


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(logit_bias={"7": 1}), "logit_bias"),
    (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
])
def test_invalid_processor_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_logit_bias_is_stored_sorted_and_frozen():
    p = SamplingParams(logit_bias={9: -1.5, 3: 100})
    assert p.logit_bias == ((3, 100), (9, -1.5)) and p.has_processors
    hash(p)


def test_logit_bias_forces_and_bans_tokens_even_when_greedy():
    logits = torch.tensor([[5.0, 0.0, 0.0, 1.0]])
    assert sample_batch(logits, [SamplingParams(temperature=0, logit_bias={2: 100})], [None]) == [2]
    assert sample_batch(logits, [SamplingParams(temperature=0, logit_bias={0: -100})], [None]) == [3]


def test_frequency_and_presence_penalties_follow_openai_formula():
    logits = torch.zeros(1, 5)
    ctx = [TokenContext(prompt_ids=[4, 4], output_ids=[1, 1, 1, 2])]
    p = SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25)
    probs = distribution(logits, [p], ctx)[0]
    expect = torch.softmax(torch.tensor([0.0, -1.5 - 0.25, -0.5 - 0.25, 0.0, 0.0]), -1)  # prompt not counted
    assert torch.allclose(probs, expect, atol=1e-6)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    ctx = [TokenContext(prompt_ids=[0], output_ids=[1])]
    p = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    probs = distribution(logits, [p], ctx)[0]
    assert torch.allclose(probs, torch.softmax(torch.tensor([1.0, -4.0, 2.0, -2.0]), -1), atol=1e-6)


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filtered_probs(probs.log(), SamplingParams(min_p=0.35))  # threshold 0.175
    assert torch.allclose(kept, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)


def test_grammar_bitmask_allows_only_its_tokens():
    V = 70
    words = torch.zeros((V + 31) // 32, dtype=torch.int32)
    for t in (3, 40, 65):
        words[t // 32] |= 1 << (t % 32)
    logits = torch.randn(2, V)
    ctx = [TokenContext(allowed=words), TokenContext()]
    probs = distribution(logits, [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)], ctx)
    assert set(torch.nonzero(probs[0]).flatten().tolist()) == {3, 40, 65}
    assert (probs[1] > 0).all()
    g = make_generator(SamplingParams(temperature=1.0, seed=0))
    assert {sample_batch(logits[:1], [SamplingParams(temperature=1.0)], [g], ctx[:1])[0] for _ in range(50)} \
        <= {3, 40, 65}
    # bit 31 of a word is the sign bit of the int32: it must still count
    words = torch.zeros(3, dtype=torch.int32)
    words[1] = -(1 << 31)  # token 63 only
    assert sample_batch(torch.randn(1, V), [SamplingParams(temperature=0)], [None], [TokenContext(allowed=words)]) \
        == [63]


def test_distribution_is_what_sample_batch_draws_from_and_rows_ignore_their_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 200)
    ps = [SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, seed=5, frequency_penalty=1.0),
          SamplingParams(temperature=0, presence_penalty=2.0),
          SamplingParams(temperature=1.3, repetition_penalty=1.3, logit_bias={7: 3.0}, seed=9)]
    ctx = [TokenContext([1, 2], [3, 3, 4]), TokenContext([], [int(logits[1].argmax())]), TokenContext([7], [])]
    d = distribution(logits, ps, ctx)
    assert torch.allclose(d.sum(-1), torch.ones(3))
    assert d[1].max() == 1 and int(d[1].argmax()) != int(logits[1].argmax())  # greedy: one-hot after penalties
    for b in range(3):  # a row alone gives the same distribution as in its batch
        assert torch.equal(distribution(logits[b:b + 1], ps[b:b + 1], ctx[b:b + 1])[0], d[b])
    g = [make_generator(p) for p in ps]
    draws = [sample_batch(logits, ps, g, ctx) for _ in range(100)]
    for b in range(3):
        support = set(torch.nonzero(d[b]).flatten().tolist())
        assert {row[b] for row in draws} <= support
    # seeded rows repeat exactly
    g2 = [make_generator(p) for p in ps]
    assert [sample_batch(logits, ps, g2, ctx) for _ in range(100)] == draws


@pytest.mark.gpu
def test_processors_run_on_the_logits_device_and_match_the_cpu():
    torch.manual_seed(0)
    V = 49152
    logits = torch.randn(4, V) * 3
    words = torch.full(((V + 31) // 32,), -1, dtype=torch.int32)
    words[:100] = 0  # tokens 0..3199 banned
    ps = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, frequency_penalty=0.5, seed=1),
          SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={5: 20.0}),
          SamplingParams(temperature=1.0, presence_penalty=1.0, seed=2),
          SamplingParams(temperature=0.5, seed=3)]
    ctx = [TokenContext([1, 2, 3], [4, 4, 9]), TokenContext([5], [5]), TokenContext([], [7], words), TokenContext()]
    cpu = distribution(logits, ps, ctx)
    gpu = distribution(logits.cuda(), ps, ctx)
    assert gpu.device.type == "cuda"
    assert torch.allclose(gpu.cpu(), cpu, atol=1e-5)
    one = logits[1:2]
    assert sample_batch(one.cuda(), ps[1:2], [None], ctx[1:2]) == sample_batch(one, ps[1:2], [None], ctx[1:2])
    g = [make_generator(p) for p in ps]
    toks = sample_batch(logits.cuda(), ps, g, ctx)
    assert toks[2] >= 3200 and all(cpu[b, t] > 0 for b, t in enumerate(toks))


def _hard_rows(vocab: int) -> torch.Tensor:
    """Rows where a greedy pick can go wrong: ties inside a kernel's chunk and across chunks, the first and the last
    entry, NaN (the first wins), rows of -inf, many ties."""
    from mimw.engine.argmax import BLOCK

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    c = min(BLOCK, vocab // 4)
    x[1, 3] = x[1, 3 + c] = x[1, vocab - 1] = 50.0  # ties in different chunks
    x[2, 5] = x[2, 6] = 50.0  # a tie inside a chunk
    x[3, vocab - 1] = 50.0  # the last entry
    x[4, 0] = 50.0  # the first
    x[5, 7] = x[5, 2 * c + 1] = float("nan")  # NaN wins, its first
    x[6] = float("-inf")  # no finite entry: index 0
    x[7, : vocab // 2] = float("-inf")
    x[8] = x[8].round()  # many ties
    return x


def test_device_argmax_off_cuda_is_torch_argmax():
    from mimw.engine.argmax import DeviceArgmax

    x = _hard_rows(1009)
    assert torch.equal(DeviceArgmax()(x), torch.argmax(x, dim=-1))
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        DeviceArgmax()(x[0])


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [128256, 49152, 151936, 32000, 1009, 96])
def test_device_argmax_is_torch_argmax_with_ties_nan_and_infinities(vocab):
    """The one-launch kernel picks what torch.argmax picks, fp32 and bf16, every row count from one to many, the
    same object again and again (its tickets reset by each launch)."""
    from mimw.engine.argmax import DeviceArgmax

    pick = DeviceArgmax()
    x = _hard_rows(vocab).cuda()
    for y in (x, x.to(torch.bfloat16)):
        for _ in range(3):
            assert torch.equal(pick(y), torch.argmax(y, dim=-1))
        for row in range(y.shape[0]):
            assert torch.equal(pick(y[row:row + 1]), torch.argmax(y[row:row + 1], dim=-1)), row
    big = torch.randn(70, vocab, device="cuda")
    assert torch.equal(pick(big), torch.argmax(big, dim=-1))
    assert not pick._tickets.any()
