"""Shared pytest set-up: `gpu` tests skip with a clear reason when no CUDA device is present."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (Hopper sm_90a for the megakernel); none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
