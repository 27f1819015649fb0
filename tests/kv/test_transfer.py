"""Page copies between a device-layout pool [L, P, ...] and a host-layout pool [P, L, ...]."""
import pytest
import torch

from mimw.kv.pages import KVLayout, PagedKVCache
from mimw.kv.transfer import CudaCopier, DeferredCopier, SyncCopier


def pools(device="cpu", pin=False, pages=6, host_pages=4):
    cache = PagedKVCache(KVLayout(2, 2, 8, 4, pages, torch.float32), device)
    for t in cache.page_tensors():
        t.copy_(torch.randn(t.shape))
    host = tuple(torch.zeros((host_pages, t.shape[0], *t.shape[2:]), pin_memory=pin) for t in cache.page_tensors())
    return cache, host


def test_sync_round_trip_is_bit_exact():
    cache, host = pools()
    before = [t.clone() for t in cache.page_tensors()]
    c = SyncCopier()
    t = c.offload(cache.page_tensors(), [4, 1], host, [0, 3])
    assert t.done() and t.nbytes == 2 * 2 * (2 * 2 * 4 * 8 * 4)
    assert torch.equal(host[0][3], before[0][:, 1]) and torch.equal(host[1][0], before[1][:, 4])
    t = c.restore(host, [3, 0], cache.page_tensors(), [2, 5])
    assert t.done()
    for b, now in zip(before, cache.page_tensors()):
        assert torch.equal(now[:, 2], b[:, 1]) and torch.equal(now[:, 5], b[:, 4])
        assert torch.equal(now[:, [0, 1, 3, 4]], b[:, [0, 1, 3, 4]])  # nothing else written


def test_deferred_copies_run_in_issue_order_and_read_their_source_when_they_run():
    cache, host = pools()
    c = DeferredCopier()
    t1 = c.offload(cache.page_tensors(), [0], host, [0])
    t2 = c.restore(host, [0], cache.page_tensors(), [1])
    assert not t1.done() and not t2.done() and c.num_pending == 2
    cache.k[:, 0] = 7.0  # written before the offload ran: the offload sees it
    c.run(1)
    assert t1.done() and not t2.done() and bool((host[0][0] == 7.0).all())
    c.fence([t2])
    assert t2.done() and c.num_pending == 0 and bool((cache.k[:, 1] == 7.0).all())


@pytest.mark.gpu
def test_cuda_copier_round_trip_is_bit_exact_and_ordered_after_compute():
    cache, host = pools("cuda", pin=True, pages=64, host_pages=64)
    before = [t.clone() for t in cache.page_tensors()]
    c = CudaCopier(cache.device)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        big = big @ big.T / 4096  # queue compute ahead of the copy on the compute stream
    cache.k[:, 5] = 3.0  # issued after that compute: the offload must still see it
    t = c.offload(cache.page_tensors(), list(range(64)), host, list(range(63, -1, -1)))
    torch.cuda.synchronize()
    assert t.done()
    assert bool((host[0][63 - 5] == 3.0).all())
    assert torch.equal(host[1][0].cuda(), before[1][:, 63])
    t = c.restore(host, list(range(64)), cache.page_tensors(), list(range(64)))
    c.fence([t])
    back = [x.clone() for x in cache.page_tensors()]  # runs on the compute stream after the fence
    torch.cuda.synchronize()
    assert t.done()
    assert torch.equal(back[1][:, 0], before[1][:, 63]) and bool((back[0][:, 63 - 5] == 3.0).all())
