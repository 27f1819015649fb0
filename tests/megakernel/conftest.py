import pytest
import torch


@pytest.fixture
def one_thread():
    """The VM and the solvers run thousands of tiny ops: intra-op threads only add contention on a 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
