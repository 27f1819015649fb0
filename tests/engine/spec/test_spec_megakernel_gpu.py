"""Verify blocks on the megakernel backend (Hopper GPU): a block's rows match the reference, and decoding on after a
block whose drafts were rejected reads none of their K/V (marker `gpu`)."""
import pytest
import torch

from mimw.models.reference import Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
def test_rejected_block_then_megakernel_decode_matches_the_reference():
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.engine.backends.reference import ReferenceBackend

    spec = get_preset("smollm2-135m").with_(num_layers=4)
    w = random_weights(spec, 3, dtype=torch.bfloat16, device="cuda")
    mk, ref = MegakernelBackend(w), ReferenceBackend(w.to(dtype=torch.float32))
    mk_cache, ref_cache = mk.make_cache(16, 8), ref.make_cache(16, 8)
    table = (5, 2, 7, 0, 1, 3)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(spec.vocab_size, (37,), generator=g)
    mk.forward(prompt, [Segment(table, 0, 37)], mk_cache)
    b = ref.forward(prompt, [Segment(table, 0, 37)], ref_cache)
    tok = int(b[0].argmax())
    garbage = torch.randint(spec.vocab_size, (4,), generator=g)
    block = torch.cat([torch.tensor([tok]), garbage])
    a = mk.forward(block, [Segment(table, 37, 5, 5)], mk_cache)  # [5, V]: the pending token + 4 drafts
    b = ref.forward(torch.tensor([tok]), [Segment(table, 37, 1)], ref_cache)
    assert a.shape[0] == 5 and ((a[0] - b[0]).abs().max() / b.abs().max()).item() < 2e-2
    for i in range(6):  # all drafts rejected: decode on from position 38, over the garbage's stale K/V
        tok = int(b[0].argmax())
        a = mk.forward(torch.tensor([tok]), [Segment(table, 38 + i, 1)], mk_cache)
        b = ref.forward(torch.tensor([tok]), [Segment(table, 38 + i, 1)], ref_cache)
        assert ((a - b).abs().max() / b.abs().max()).item() < 2e-2
