"""Host-to-GPU copies that never wait for the GPU: the host values go through pinned memory by non-blocking copies,
queued in stream order. A copy from pageable memory first waits for every kernel queued before it, so the host could
not prepare the next step while this one runs. The caching host allocator reuses a pinned block only once the copies
that read it have completed, so the host source may be a temporary."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``: through pinned memory, not waiting, where a host tensor goes to a CUDA device."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``: through pinned memory, not waiting, where a host source goes to a CUDA destination."""
    if dst.device.type == "cuda" and src.device.type == "cpu":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
