"""The peer inboxes of a tensor-parallel step: where every rank's partials land, and their readiness.

Rank r of N (docs/megakernel.md, "Tensor parallelism") holds three inboxes, fp32, in memory every rank can store
into (symmetric memory on the GPU; shared tensors in the VM), one after the other in one buffer (``inbox_views``,
the layout the GPU kernel addresses: device/peer.py):

    inbox[O_SUM]      [N, M, D]     each rank's O_PROJ partial attn_r . W_o[:, cols_r]^T, in slot [src]
    inbox[DOWN_SUM]   [N, M, D]     each rank's DOWN_PROJ partial act_r . W_down[:, cols_r]^T
    inbox[LM_GATHER]  [N, M, V/N]   each rank's logits of its vocabulary rows
A rank's PEER-flagged instruction (isa.PEER) stores its rows into slot [its rank] of every rank's inbox (its own
included) and signals each rank's peer counter of those rows; that rank's REDUCE reads every slot of its own inbox.

Why three inboxes and not one: a rank may run ahead of a peer by up to one reduction. Rank A's DOWN_PROJ of layer l
needs A's reduced x, hence every rank's O_PROJ partial of layer l, but not that rank B has read them yet; were
DOWN_PROJ's partials stored in the same inbox, A could overwrite B's unread O_PROJ partials. With one inbox per
kind, A's next store into B's O_SUM inbox (layer l + 1, or the next step's layer 0) comes after A received B's
DOWN_PROJ partials of layer l, which B sends only after its MLP_IN, i.e. after every REDUCE of B's O_SUM inbox
(and likewise for DOWN_SUM, whose next writer needs B's LM_HEAD or next O_PROJ partials). LM_GATHER is rewritten
only in the next step, after B's step started, hence after B's gather of this one. ``InboxVersions`` checks this
in the VM (readiness.InboxVersions): a store into a region whose last contents were not read yet raises
``DependencyError``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

O_SUM, DOWN_SUM, LM_GATHER = 0, 1, 2
INBOX_NAMES = ("o", "down", "lm")


def inbox_elements(size: int, num_tokens: int, hidden: int, vocab_shard: int) -> int:
    """fp32 elements of one rank's inbox buffer."""
    return size * num_tokens * (2 * hidden + vocab_shard)


def inbox_views(buffer: torch.Tensor, size: int, num_tokens: int, hidden: int,
                vocab_shard: int) -> list[torch.Tensor]:
    """A rank's three inboxes [size, num_tokens, width] (O_SUM, DOWN_SUM, LM_GATHER) as views of its flat buffer, in
    that order, each right after the one before."""
    out, at = [], 0
    for width in (hidden, hidden, vocab_shard):
        n = size * num_tokens * width
        out.append(buffer[at: at + n].view(size, num_tokens, width))
        at += n
    return out


@dataclass
class PeerMemory:
    """The inboxes of every rank: ``inbox[rank][kind]`` [N, M, width] fp32, views of ``buffers[rank]`` (the VM's
    stand-in for peer memory; on one GPU, the memory the ranks' kernels store into: launch/tp.py)."""

    buffers: list[torch.Tensor]
    inbox: list[list[torch.Tensor]]

    @property
    def size(self) -> int:
        return len(self.inbox)

    def view(self, rank: int) -> "PeerView":
        return PeerView(self, rank)

    def poison(self) -> None:
        for b in self.buffers:
            b.fill_(float("nan"))


def alloc_peer_memory(size: int, num_tokens: int, hidden: int, vocab_shard: int,
                      device: torch.device | str = "cpu") -> PeerMemory:
    """Inboxes for ``size`` ranks (NaN: nothing reads a slot before a peer stored it)."""
    shape = (size, num_tokens, hidden, vocab_shard)
    buffers = [torch.full((inbox_elements(*shape),), float("nan"), dtype=torch.float32, device=device)
               for _ in range(size)]
    return PeerMemory(buffers, [inbox_views(b, *shape) for b in buffers])


@dataclass(frozen=True)
class PeerView:
    """What one rank's instructions see of peer memory: stores into every rank's inbox, reads of its own."""

    memory: PeerMemory
    rank: int

    def send(self, kind: int, rows: slice, value: torch.Tensor) -> None:
        """Store ``value`` [M, n] as this rank's partial of ``rows`` into inbox ``kind`` of every rank."""
        for boxes in self.memory.inbox:
            boxes[kind][self.rank, :, rows] = value

    def inbox(self, kind: int) -> torch.Tensor:
        """This rank's inbox ``kind``: [N, M, width], slot [src] holding rank src's partial."""
        return self.memory.inbox[self.rank][kind]
