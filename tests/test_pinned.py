"""Host-to-device copies through pinned memory (mimw.pinned) on the CPU: values and views as ``copy_`` and ``to``
give them (the GPU's non-blocking path: the prefill, step-graph and sampling GPU tests)."""
import torch

from mimw.pinned import copy_in, to_device


def test_copy_in_writes_the_source_into_a_destination_view():
    dst = torch.full((3, 5), -1, dtype=torch.int32)
    src = torch.arange(6, dtype=torch.int32).view(3, 2)
    copy_in(dst[:, :2], src)
    assert torch.equal(dst[:, :2], src) and bool((dst[:, 2:] == -1).all())
    tokens = torch.empty(4, dtype=torch.long)
    copy_in(tokens, torch.tensor([7, 8, 9, 10], dtype=torch.int32))  # converts the dtype as copy_ does
    assert tokens.tolist() == [7, 8, 9, 10]


def test_to_device_gives_the_values_on_the_device():
    t = torch.arange(5, dtype=torch.int32)
    out = to_device(t, "cpu")
    assert out.device.type == "cpu" and out.dtype == torch.int32 and out.tolist() == [0, 1, 2, 3, 4]
