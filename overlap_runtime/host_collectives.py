"""The CPU backend's collectives: the ranks' comm streams move bytes through shared memory, as NCCL does
between the GPUs of one node, not through gloo.

Gloo sends every message over a TCP connection, through its own event-loop and worker threads: for the
small messages of CPU tuning that was about a quarter of a rank's CPU (the loop thread alone used more than
the rank's GEMMs), and the threads woke each other for every message.  Here a collective runs on the thread
of the comm stream that issued it, start to end: it copies what it sends into the sender's mailbox and what
it receives out of the peer's.

A `Mailbox` belongs to one communicator (one `CommOptions`, one comm stream per rank, so one thread per rank
uses it, in the order the host issued its collectives, the same order on every rank).  It holds one channel
for every ordered pair of ranks: ``SLOTS`` slots of ``SLOT_BYTES`` in the sender's `HostDevice.symmetric`
buffer, and two int32 counts, the pieces the sender has written (in the sender's flag words) and the pieces
the receiver has taken (in the receiver's).  A message is cut into pieces of at most a slot; the sender waits
for a free slot, the receiver for a written one.  Stores are not reordered on x86 (the emulation's flags rely
on the same), so a piece is whole before its count says so.  Every send and receive of one call makes
progress together, so two ranks that send each other more than a channel holds do not deadlock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from overlap_runtime.device import PeerTensors
from overlap_runtime.fp8 import as_bytes
from overlap_runtime.host_kernels import POLL_S, StreamError

SLOTS = 4
"""Pieces in flight per ordered pair of ranks."""
SLOT_BYTES = 256 * 1024
"""The largest piece: a CPU tuning message (hidden 256 to 1024) takes one to a few."""

Symmetric = Callable[[tuple[int, ...], torch.dtype], tuple[torch.Tensor, list[torch.Tensor]]]
"""`HostDevice.symmetric`: this rank's buffer and every rank's mapping of theirs (all ranks call it)."""


def _pieces(tensors: list[torch.Tensor]) -> deque[torch.Tensor]:
    """The tensors' bytes, in order, cut into pieces of at most a slot (never across two tensors: a receiver
    cuts its buffers alike)."""
    pieces: deque[torch.Tensor] = deque()
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"a collective moves contiguous tensors only, got strides {t.stride()}")
        flat = as_bytes(t).reshape(-1).view(torch.uint8)
        pieces.extend(flat.split(SLOT_BYTES))
    return pieces


class Mailbox:
    """The channels of one communicator between ``tp`` ranks (see the module docstring)."""

    def __init__(self, symmetric: Symmetric, *, rank: int, tp: int, limit_s: float) -> None:
        self.rank, self.tp, self.limit_s = rank, tp, limit_s
        self._slots, peer_slots = symmetric((tp, SLOTS, SLOT_BYTES), torch.uint8)
        words, peer_words = symmetric((2, tp), torch.int32)
        self._peer_slots = peer_slots
        # Row 0: pieces written towards each rank; row 1: pieces taken from each rank.
        self._written, self._taken = words.numpy()[0], words.numpy()[1]
        self._peer_written = [w.numpy()[0] for w in peer_words]
        self._peer_taken = [w.numpy()[1] for w in peer_words]

    def transfer(self, sends: PeerTensors, recvs: PeerTensors) -> None:
        """Send and receive together; the sends to a peer match its receives from this rank in order and size."""
        outgoing = self._by_peer(sends)
        incoming = self._by_peer(recvs)
        deadline = time.monotonic() + self.limit_s
        pause, longest = POLL_S
        while outgoing or incoming:
            moved = self._send(outgoing) + self._receive(incoming)
            if moved:
                pause = POLL_S[0]
                continue
            if time.monotonic() > deadline:
                waiting = sorted({*outgoing, *incoming})
                raise StreamError(f"a collective waited for ranks {waiting} for {self.limit_s:g} s")
            time.sleep(pause)
            pause = min(2 * pause, longest)

    def _by_peer(self, pairs: PeerTensors) -> dict[int, deque[torch.Tensor]]:
        by_peer: dict[int, list[torch.Tensor]] = {}
        for tensor, peer in pairs:
            if not 0 <= peer < self.tp or peer == self.rank:
                raise ValueError(f"peer must be another rank of the {self.tp}, got {peer} on rank {self.rank}")
            by_peer.setdefault(peer, []).append(tensor)
        return {peer: pieces for peer, tensors in by_peer.items() if (pieces := _pieces(tensors))}

    def _send(self, outgoing: dict[int, deque[torch.Tensor]]) -> int:
        moved = 0
        for peer, pieces in list(outgoing.items()):
            taken = self._peer_taken[peer]
            while pieces and self._written[peer] - taken[self.rank] < SLOTS:
                piece = pieces.popleft()
                self._slots[peer, self._written[peer] % SLOTS, : piece.numel()].copy_(piece)
                self._written[peer] += 1
                moved += 1
            if not pieces:
                del outgoing[peer]
        return moved

    def _receive(self, incoming: dict[int, deque[torch.Tensor]]) -> int:
        moved = 0
        for peer, pieces in list(incoming.items()):
            written, slots = self._peer_written[peer], self._peer_slots[peer]
            while pieces and written[self.rank] > self._taken[peer]:
                piece = pieces.popleft()
                piece.copy_(slots[self.rank, self._taken[peer] % SLOTS, : piece.numel()])
                self._taken[peer] += 1
                moved += 1
            if not pieces:
                del incoming[peer]
        return moved

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """``out`` = every rank's ``shard``, in rank order along dim 0."""
        chunks = out.view(self.tp, *shard.shape)
        peers = [p for p in range(self.tp) if p != self.rank]
        self.transfer([(shard, p) for p in peers], [(chunks[p], p) for p in peers])
        chunks[self.rank].copy_(shard)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """``out`` = the sum over ranks of their ``full``'s chunk of this rank (dim 0), summed in fp32 in rank
        order."""
        chunks = full.view(self.tp, *out.shape)
        peers = [p for p in range(self.tp) if p != self.rank]
        received = {p: torch.empty_like(out) for p in peers}
        self.transfer([(chunks[p], p) for p in peers], [(received[p], p) for p in peers])
        total = torch.zeros(out.shape, dtype=torch.float32)
        for p in range(self.tp):
            total += chunks[p] if p == self.rank else received[p]
        out.copy_(total)
