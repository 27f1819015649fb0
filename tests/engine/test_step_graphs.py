"""StepGraphs' host side on the CPU (the graphs themselves: test_step_graphs_gpu.py)."""
import torch

from mimw.engine.backends.step_graphs import copy_in


def test_copy_in_writes_the_source_into_a_destination_view():
    dst = torch.full((3, 5), -1, dtype=torch.int32)
    src = torch.arange(6, dtype=torch.int32).view(3, 2)
    copy_in(dst[:, :2], src)
    assert torch.equal(dst[:, :2], src) and bool((dst[:, 2:] == -1).all())
    tokens = torch.empty(4, dtype=torch.long)
    copy_in(tokens, torch.tensor([7, 8, 9, 10], dtype=torch.int32))  # converts the dtype as copy_ does
    assert tokens.tolist() == [7, 8, 9, 10]
