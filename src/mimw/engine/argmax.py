"""Greedy picks on the device in one kernel launch: ``DeviceArgmax(x)`` is ``torch.argmax(x, dim=-1)`` of logits
[B, V] (the lowest index on ties; a NaN counts as the maximum, so the first NaN wins; a row of -inf gives 0).

torch's reduction runs one thread block a row (26 us for the 1B's 128,256 fp32 logits on an H100, 3% of its batch-1
step); two reductions over chunks take ~10 us in four launches, each a gap in the stream between two decode steps
(bench/NOTES.md, "Overlap scheduler"). Here every (chunk, row) is a program: it reduces its chunk to the maximum,
that maximum's first index and the first NaN's index, stores them, and draws the row's ticket; the program that
draws the last ticket reduces the row's chunks and writes the pick, then resets the ticket, so the next launch
finds it at 0 with no clearing op between. The tickets live in the object, one per row: it is the caller's
workspace (an engine keeps one), and launches of one object are in stream order.

``argmax_torch`` is the PyTorch reference (torch.argmax); on a device that is not CUDA ``DeviceArgmax`` runs it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["DeviceArgmax", "argmax_torch"]

BLOCK = 1024  # entries a program: 126 programs a row of the 1B's 128,256 logits, 48 of SmolLM2's 49,152


@triton.jit
def _argmax_kernel(X, stride, V, PV, PI, PN, TICKET, OUT, NCH, BLOCK: tl.constexpr, NP2: tl.constexpr):
    c = tl.program_id(0)
    row = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row.to(tl.int64) * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    nan = x != x
    first_nan = tl.min(tl.where(nan, offs, V), axis=0)
    x = tl.where(nan, float("-inf"), x)
    mx = tl.max(x, axis=0)
    at = tl.min(tl.where(x == mx, offs, V), axis=0)  # a chunk holds a real entry: at < V
    part = row * NCH + c
    tl.store(PV + part, mx)
    tl.store(PI + part, at)
    tl.store(PN + part, first_nan)
    # acq_rel at GPU scope: this program's stores are visible before its ticket, and the last drawer's loads after
    if tl.atomic_add(TICKET + row, 1) == NCH - 1:
        k = tl.arange(0, NP2)
        ok = k < NCH
        pv = tl.load(PV + row * NCH + k, mask=ok, other=float("-inf"), volatile=True)
        pi = tl.load(PI + row * NCH + k, mask=ok, other=V, volatile=True)
        pn = tl.load(PN + row * NCH + k, mask=ok, other=V, volatile=True)
        gn = tl.min(pn, axis=0)
        gi = tl.min(tl.where(pv == tl.max(pv, axis=0), pi, V), axis=0)
        tl.store(OUT + row, tl.where(gn < V, gn, gi).to(tl.int64))
        tl.store(TICKET + row, 0)


def argmax_torch(x: torch.Tensor) -> torch.Tensor:
    """The reference: ``torch.argmax(x, dim=-1)``, int64 ids [B]."""
    return torch.argmax(x, dim=-1)


class DeviceArgmax:
    """Greedy picks of logits rows (module doc); one object per stream of launches, its tickets reused."""

    def __init__(self) -> None:
        self._tickets: torch.Tensor | None = None

    def warm(self, vocab: int, device: torch.device) -> None:
        """Compile the kernel for rows of ``vocab`` logits (any batch: rows are the grid's) before serving."""
        self(torch.zeros(1, vocab, device=device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, V] (last dim contiguous) -> int64 ids [B] on x's device, nothing read back to the host."""
        if x.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(x.shape)}")
        b, v = x.shape
        if (x.device.type != "cuda" and not triton.knobs.runtime.interpret) or b == 0 or v == 0:
            return argmax_torch(x)
        if x.stride(1) != 1:
            x = x.contiguous()
        t = self._tickets
        if t is None or t.device != x.device or t.numel() < b:
            # zeroed once here (the launches leave them at 0); grown to a whole 64 rows
            t = self._tickets = torch.zeros(-(-b // 64) * 64, dtype=torch.int32, device=x.device)
        nch = triton.cdiv(v, BLOCK)
        parts = torch.empty(3, b * nch, dtype=torch.int32, device=x.device)  # one allocation: maxima, indices, NaNs
        pv, pi, pn = parts[0].view(torch.float32), parts[1], parts[2]
        out = torch.empty(b, dtype=torch.int64, device=x.device)
        _argmax_kernel[(nch, b)](x, x.stride(0), v, pv, pi, pn, t, out, nch, BLOCK=BLOCK,
                                 NP2=triton.next_power_of_2(nch), num_warps=4)
        return out
