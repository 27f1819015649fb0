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
    (dict(max_tokens=0), "max_tokens"),
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
