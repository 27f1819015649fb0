"""The standalone warp-specialized GEMV (built from the orchestration module) against torch, on a Hopper GPU."""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("n,k", [(4096, 2048), (2048, 8192), (1024, 576)])
def test_gemv_matches_torch(n, k):
    from mimw.megakernel.gpu.gemv import gemv, reference

    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16) * k ** -0.5
    x = torch.randn(k, device="cuda", generator=g).to(torch.bfloat16)
    y = gemv(w, x)
    ref = reference(w, x).float()
    assert torch.isfinite(y).all()
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
