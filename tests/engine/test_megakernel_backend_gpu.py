"""The megakernel engine backend (Hopper GPU): prefill on the reference path, decode on the megakernel, both over
one bf16 paged cache; logits track the fp32 reference backend step by step (marker `gpu`)."""
import pytest
import torch

from mimw.models.reference import Segment
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the megakernel needs a Hopper (sm_90) GPU")
def test_megakernel_backend_decodes_like_the_reference():
    from mimw.engine.backends.megakernel import MegakernelBackend
    from mimw.engine.backends.reference import ReferenceBackend

    spec = get_preset("smollm2-135m").with_(num_layers=4)
    w = random_weights(spec, 3, dtype=torch.bfloat16, device="cuda")
    mk, ref = MegakernelBackend(w), ReferenceBackend(w.to(dtype=torch.float32))
    mk_cache, ref_cache = mk.make_cache(16, 8), ref.make_cache(16, 8)
    table = (5, 2, 7, 0, 1, 3)
    prompt = torch.randint(spec.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    a = mk.forward(prompt, [Segment(table, 0, 37)], mk_cache)
    b = ref.forward(prompt, [Segment(table, 0, 37)], ref_cache)
    agree = 0
    for i in range(20):
        tok = int(b[0].argmax())
        assert ((a - b).abs().max() / b.abs().max()).item() < 2e-2
        agree += int(a[0].argmax() == b[0].argmax())
        a = mk.forward(torch.tensor([tok]), [Segment(table, 37 + i, 1)], mk_cache)
        b = ref.forward(torch.tensor([tok]), [Segment(table, 37 + i, 1)], ref_cache)
    assert agree >= 19
