"""Speculative-decoding tests run torch on one thread: their models are tiny (or the 135M default at batch 1), and
on a shared CPU a thread pool's hand-offs cost more than the work (10x on the tiny model)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
