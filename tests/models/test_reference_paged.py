"""ReferenceDecoder over several paged segments in one step."""


def test_last_only_returns_each_segments_last_row():
    import torch

    from mimw.kv.pages import KVLayout, PagedKVCache
    from mimw.models.reference import ReferenceDecoder, Segment
    from mimw.models.spec import get_preset
    from mimw.models.weights import random_weights

    spec = get_preset("tiny-qwen3")
    dec = ReferenceDecoder(random_weights(spec, 4))
    segs = [Segment((0, 1), 0, 5), Segment((2,), 0, 1), Segment((3, 4), 0, 17)]
    toks = torch.randint(spec.vocab_size, (23,), generator=torch.Generator().manual_seed(0))
    full = dec.forward(toks, segs, PagedKVCache(KVLayout.for_spec(spec, 16, 5, torch.float32)))
    last = dec.forward(toks, segs, PagedKVCache(KVLayout.for_spec(spec, 16, 5, torch.float32)), last_only=True)
    assert last.shape == (3, spec.vocab_size)
    assert torch.allclose(last, full[[4, 5, 22]], rtol=1e-5, atol=1e-5)



def test_num_logits_returns_each_segments_last_rows():
    import torch

    from mimw.kv.pages import KVLayout, PagedKVCache
    from mimw.models.reference import ReferenceDecoder, Segment
    from mimw.models.spec import get_preset
    from mimw.models.weights import random_weights

    spec = get_preset("tiny-qwen3")
    dec = ReferenceDecoder(random_weights(spec, 4))
    segs = [Segment((0, 1), 0, 5, num_logits=3), Segment((2,), 0, 1), Segment((3, 4), 0, 17, num_logits=17)]
    toks = torch.randint(spec.vocab_size, (23,), generator=torch.Generator().manual_seed(1))
    full = dec.forward(toks, segs, PagedKVCache(KVLayout.for_spec(spec, 16, 5, torch.float32)))
    rows = dec.forward(toks, segs, PagedKVCache(KVLayout.for_spec(spec, 16, 5, torch.float32)), last_only=True)
    assert rows.shape == (21, spec.vocab_size)
    assert torch.allclose(rows, full[[2, 3, 4, 5] + list(range(6, 23))], rtol=1e-5, atol=1e-5)


def test_num_logits_out_of_range_is_refused():
    import pytest

    from mimw.models.reference import Segment

    with pytest.raises(ValueError, match="num_logits"):
        Segment((0,), 0, 2, num_logits=3)
    with pytest.raises(ValueError, match="num_logits"):
        Segment((0,), 0, 2, num_logits=0)
