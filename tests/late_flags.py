"""Calls of our flag-waiting kernels (`flag_kernels`, `ring_gemm`) whose flags are raised only after the kernel
started: a "peer" writes the data and then its flag a while later, and the kernel must have waited for them.

What the kernel may read is NaN until the peer wrote it, so a kernel that did not wait gives NaN, provided
the peer writes later than the kernel would have read: after longer than the whole call takes when every flag
is already up (`calibrated`).  The peer is a thread in Triton's interpreter (CPU tensors, `ThreadPeer`) and a
second stream on a GPU (`StreamPeer`): shared by the interpreter tests and the compiled check
(`test_flag_kernels`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import ModuleType

import torch
from ring_cases import row_major


class AtOnce:
    """Writes before the kernel is launched: every flag is up when it starts."""

    def later(self, writes: Callable[[], None]) -> None:
        writes()

    def join(self) -> None:
        pass


class ThreadPeer:
    """Writes on another thread after ``delay_s``; ``written`` is when it had written everything."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.written = float("inf")
        self._thread: threading.Thread | None = None

    def later(self, writes: Callable[[], None]) -> None:
        def run() -> None:
            time.sleep(self.delay_s)
            writes()
            self.written = time.perf_counter()

        self._thread = threading.Thread(target=run)
        self._thread.start()

    def join(self) -> None:
        assert self._thread is not None
        self._thread.join()


class StreamPeer:
    """Writes on a second CUDA stream behind a sleep kernel of about ``delay_s`` (at 2 GHz)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._stream = torch.cuda.Stream()

    def later(self, writes: Callable[[], None]) -> None:
        self._stream.wait_stream(torch.cuda.current_stream())  # the buffers' initial values are in place
        with torch.cuda.stream(self._stream):
            torch.cuda._sleep(int(self.delay_s * 2e9))
            writes()

    def join(self) -> None:
        torch.cuda.synchronize()


Peer = AtOnce | ThreadPeer | StreamPeer


def calibrated(case: Callable[[Peer], object]) -> float:
    """A peer delay for ``case``: twice as long as the whole case takes with every flag already up, so that a
    kernel that did not wait would have read (and finished) before the peer wrote anything."""
    started = time.perf_counter()
    case(AtOnce())
    return 2 * (time.perf_counter() - started) + 0.05


def _rand(*shape: int, seed: int, device: str) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def spin_then_copy(flag_kernels: ModuleType, peer: Peer, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`spin` on a flag the peer raises after writing ``data``, then a copy of ``data`` behind it on the
    same stream: (the copy, data)."""
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    data = torch.full((256,), float("nan"), device=device)
    values = _rand(256, seed=1, device=device)
    peer.later(lambda: (data.copy_(values), flag.fill_(5)))
    flag_kernels.spin(flag, 5)
    seen = data.clone()
    peer.join()
    return seen, values


def reduce_late(flag_kernels: ModuleType, peer: Peer, device: str, *, sources: int, rank: int,
                rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`reduce_when_ready` with every source's partial and flag written by the peer, one source after the
    other: (out, float64 reference)."""
    own = _rand(rows, n, seed=2, device=device)
    partials = _rand(sources, rows, n, seed=3, device=device)
    received = torch.full_like(partials, float("nan"))
    ready = torch.zeros(sources, dtype=torch.int32, device=device)
    epoch = 4

    def writes() -> None:
        for src in range(sources):
            if src != rank:
                received[src].copy_(partials[src])
                ready[src : src + 1].fill_(epoch)

    peer.later(writes)
    out = torch.full_like(own, float("nan"))
    flag_kernels.reduce_when_ready(out, own, received, ready, epoch=epoch, rank=rank)
    peer.join()
    want = own.double() + sum(partials[s].double() for s in range(sources) if s != rank)
    return out, want


def gather_late(ring_gemm: ModuleType, peer: Peer, device: str, *, chunks: int, rank: int,
                shape: tuple[int, int, int], config: object, gemm_sms: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`gather_matmul` with every peer chunk and its ready flag written by the peer after the launch: (out,
    float64 reference)."""
    rows, n, k = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    full = _rand(chunks * rows, k, seed=4, device=device).to(dtype)
    b = _rand(k, n, seed=5, device=device).to(dtype)
    ring = torch.full_like(full, float("nan"))
    ready = torch.zeros(chunks, dtype=torch.int32, device=device)
    epoch = 3

    def writes() -> None:
        for step in range(1, chunks):  # in the order the kernel reads them
            src = (rank - step) % chunks
            ring[src * rows : (src + 1) * rows].copy_(full[src * rows : (src + 1) * rows])
            ready[src : src + 1].fill_(epoch)

    peer.later(writes)
    out = torch.full((chunks * rows, n), float("nan"), dtype=dtype, device=device)
    local = full[rank * rows : (rank + 1) * rows].clone()
    ring_gemm.gather_matmul(local, ring, b, out, ready=ready, epoch=epoch, rank=rank, gemm_sms=gemm_sms, config=config)
    peer.join()
    return out, full.double() @ b.double()


def scatter_late(ring_gemm: ModuleType, peer: Peer, device: str, *, chunks: int, rank: int,
                 shape: tuple[int, int, int], config: object, gemm_sms: int,
                 col_groups: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`scatter_matmul` with every other rank's partial written by the peer segment by segment, each
    segment's flag after it: (out, float64 reference)."""
    rows, n, k = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = _rand(chunks * rows, k, seed=6, device=device).to(dtype)
    b = _rand(k, n, seed=7, device=device).to(dtype)
    plan = ring_gemm.scatter_plan(rows, n, k, chunks=chunks, dtype=dtype, device=a.device, gemm_sms=gemm_sms,
                                  config=config, col_groups=col_groups)  # fmt: skip
    lanes = len(plan.segments)
    sent = _rand(chunks, rows, n, seed=8, device=device).to(dtype)  # each source's partial, segment layout
    recv = torch.full_like(sent, float("nan"))
    ready = torch.zeros(chunks * lanes, dtype=torch.int32, device=device)
    epoch = 2

    def writes() -> None:
        for j, seg in enumerate(plan.segments):
            for src in range(chunks):
                if src != rank:
                    span = slice(seg.offset, seg.offset + seg.numel)
                    recv[src].view(-1)[span].copy_(sent[src].view(-1)[span])
                    ready[src * lanes + j : src * lanes + j + 1].fill_(epoch)

    peer.later(writes)
    parts = torch.empty(chunks - 1, rows, n, dtype=dtype, device=device)
    counts = torch.zeros((chunks - 1) * lanes, dtype=torch.int32, device=device)
    out = torch.full((rows, n), float("nan"), dtype=dtype, device=device)
    ring_gemm.scatter_matmul(a, b, out, parts=parts, counts=counts, recv=recv, ready=ready, epoch=epoch, rank=rank,
                             plan=plan)  # fmt: skip
    peer.join()
    own = (a.double() @ b.double())[rank * rows : (rank + 1) * rows]
    return out, own + sum(row_major(plan, sent[s]).double() for s in range(chunks) if s != rank)


def gather_one_late(ring_gemm: ModuleType, peer: Peer, device: str, *, chunks: int, rank: int, late: int,
                    shape: tuple[int, int, int], gemm_sms: int, short: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`gather_matmul` at ``epoch`` where the last call's chunks (other values) and flags (``epoch - 1``) are
    still in the ring: every source but ``late`` has written this call's chunk and flag before the launch,
    ``late`` writes its own through the peer (a rank behind the others).  ``short`` plants the narrowest race
    there is: the kernel waits for ``epoch - 1``, so it reads ``late``'s chunk of the last call.  (out, float64
    reference of this call)."""
    rows, n, k = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    full = _rand(chunks * rows, k, seed=4, device=device).to(dtype)
    b = _rand(k, n, seed=5, device=device).to(dtype)
    ring = _rand(chunks * rows, k, seed=9, device=device).to(dtype)  # the last call's chunks
    epoch = 3
    ready = torch.full((chunks,), epoch - 1, dtype=torch.int32, device=device)

    def write(src: int) -> None:
        ring[src * rows : (src + 1) * rows].copy_(full[src * rows : (src + 1) * rows])
        ready[src : src + 1].fill_(epoch)

    for src in range(chunks):
        if src not in (rank, late):
            write(src)
    peer.later(lambda: write(late))
    out = torch.full((chunks * rows, n), float("nan"), dtype=dtype, device=device)
    local = full[rank * rows : (rank + 1) * rows].clone()
    waited = epoch - 1 if short else epoch
    ring_gemm.gather_matmul(local, ring, b, out, ready=ready, epoch=waited, rank=rank, gemm_sms=gemm_sms)
    peer.join()
    return out, full.double() @ b.double()


def scatter_one_late(ring_gemm: ModuleType, peer: Peer, device: str, *, chunks: int, rank: int, late: int,
                     shape: tuple[int, int, int], gemm_sms: int, col_groups: int,
                     short: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`scatter_matmul` at ``epoch`` where the last call's partials and flags (``epoch - 1``) are still in
    ``recv``: every source but ``late`` has sent this call's before the launch, ``late`` sends its own through
    the peer, segment by segment.  ``short``: the kernel waits for ``epoch - 1`` (`gather_one_late`)."""
    rows, n, k = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = _rand(chunks * rows, k, seed=6, device=device).to(dtype)
    b = _rand(k, n, seed=7, device=device).to(dtype)
    plan = ring_gemm.scatter_plan(rows, n, k, chunks=chunks, dtype=dtype, device=a.device, gemm_sms=gemm_sms,
                                  col_groups=col_groups)  # fmt: skip
    lanes = len(plan.segments)
    sent = _rand(chunks, rows, n, seed=8, device=device).to(dtype)
    recv = _rand(chunks, rows, n, seed=10, device=device).to(dtype)  # the last call's partials
    epoch = 2
    ready = torch.full((chunks * lanes,), epoch - 1, dtype=torch.int32, device=device)

    def write(src: int) -> None:
        for j, seg in enumerate(plan.segments):
            span = slice(seg.offset, seg.offset + seg.numel)
            recv[src].view(-1)[span].copy_(sent[src].view(-1)[span])
            ready[src * lanes + j : src * lanes + j + 1].fill_(epoch)

    for src in range(chunks):
        if src not in (rank, late):
            write(src)
    peer.later(lambda: write(late))
    parts = torch.empty(chunks - 1, rows, n, dtype=dtype, device=device)
    counts = torch.zeros((chunks - 1) * lanes, dtype=torch.int32, device=device)
    out = torch.full((rows, n), float("nan"), dtype=dtype, device=device)
    waited = epoch - 1 if short else epoch
    ring_gemm.scatter_matmul(a, b, out, parts=parts, counts=counts, recv=recv, ready=ready, epoch=waited, rank=rank,
                             plan=plan)  # fmt: skip
    peer.join()
    own = (a.double() @ b.double())[rank * rows : (rank + 1) * rows]
    return out, own + sum(row_major(plan, sent[s]).double() for s in range(chunks) if s != rank)
