"""Peer-mapped buffers and stream-ordered flags for copy-engine communication (CUDA only).

Every rank allocates the same buffer with PyTorch symmetric memory (CUDA IPC, no multicast), so each rank
can ``copy_`` straight into a peer's buffer: a ``cudaMemcpyAsync`` that the copy engine runs without any SM.
Readiness travels as 32-bit epoch flags written with ``cuStreamWriteValue32`` (after a system fence, no SM).
A comm stream awaits them with ``cuStreamWaitValue32`` (`PeerBuffer.wait`: the stream stalls, no SM); a
compute stream with a kernel that spins (`PeerBuffer.spin`, `flag_kernels`), because the kernel behind a
memop wait starts microseconds late.  Epochs only grow, so flags never need a reset.  Flag layout per rank:
``flags[READY, src]`` = last epoch whose data ``src`` pushed here; ``flags[ACK, src]`` = last epoch in which
``src`` finished reading what this rank pushed to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from overlap_runtime import flag_kernels

READY, ACK = 0, 1


def _driver():  # imported lazily: cuda-bindings exists only on GPU hosts
    from cuda.bindings import driver

    return driver


def _check(result: tuple) -> None:
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")


def stream_write(address: int, value: int) -> None:
    """On the current stream: write the int32 ``value`` at ``address`` (any rank's mapped memory) once prior
    work is done and visible (the default flags fence first)."""
    driver = _driver()
    _on_current_stream(
        driver.cuStreamWriteValue32, address, value, driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    )


def stream_wait(address: int, value: int) -> None:
    """Stall the current stream until the int32 at ``address`` is at least ``value`` (no kernel spins)."""
    driver = _driver()
    _on_current_stream(
        driver.cuStreamWaitValue32, address, value, driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    )


def _on_current_stream(op: Callable[..., tuple], address: int, value: int, flags: Any) -> None:
    """Queue the stream memory operation ``op`` (cuStreamWriteValue32 / cuStreamWaitValue32) on the current
    stream."""
    driver = _driver()
    stream = torch.cuda.current_stream().cuda_stream
    _check(op(driver.CUstream(stream), driver.CUdeviceptr(address), value, flags))


class Counters:
    """Local int32 words that a kernel bumps and a stream waits on (`stream_wait`).  They only grow, so the
    host keeps each one's total at the end of the current call; a call adds what its kernel will add."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.words = torch.zeros(n, dtype=torch.int32, device=device)
        self.totals = [0] * n

    def wait(self, i: int, added: int) -> None:
        """Stall the current stream until word ``i`` has grown by ``added`` in this call."""
        self.totals[i] += added
        stream_wait(self.words.data_ptr() + 4 * i, self.totals[i])


class PeerBuffer:
    """A [*shape] buffer on every rank of the group, addressable from every peer, with epoch flags.

    ``lanes`` > 1 gives each (kind, source) pair that many flags, for data that arrives in parts (flag
    ``(kind, src, lane)`` is word ``(kind * world + src) * lanes + lane``).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, lanes: int = 1) -> None:
        group = dist.group.WORLD
        self.rank, self.world, self.lanes = dist.get_rank(), dist.get_world_size(), lanes
        self.local = symm_mem.empty(*shape, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(self.local, group)
        self.peers = [handle.get_buffer(p, shape, dtype) for p in range(self.world)]
        self.flags = symm_mem.empty(2 * self.world * lanes, dtype=torch.int32, device=device)
        """This rank's flag words, [READY per source and lane, ACK per source and lane]."""
        self.flags.zero_()
        flag_handle = symm_mem.rendezvous(self.flags, group)
        self._flag_ptrs = list(flag_handle.buffer_ptrs)
        self.epoch = 0
        torch.cuda.synchronize(device)
        dist.barrier()

    def next_epoch(self) -> int:
        """The flag value of the call starting now.  Counted per buffer, not per call of the op: a flag
        awaited at epoch e-1 must have been written at e-1, whatever other methods ran in between."""
        self.epoch += 1
        return self.epoch

    def _word(self, kind: int, src: int, lane: int) -> int:
        """The index of flag ``(kind, src, lane)`` in every rank's flag words."""
        return (kind * self.world + src) * self.lanes + lane

    def _addr(self, owner: int, kind: int, src: int, lane: int) -> int:
        return self._flag_ptrs[owner] + 4 * self._word(kind, src, lane)

    def signal(self, peer: int, kind: int, epoch: int, lane: int = 0) -> None:
        """On the current stream: set ``peer``'s flag ``(kind, self.rank, lane)`` to ``epoch`` once prior work
        is done."""
        stream_write(self._addr(peer, kind, self.rank, lane), epoch)

    def wait(self, src: int, kind: int, epoch: int, lane: int = 0) -> None:
        """Stall the current stream until this rank's flag ``(kind, src, lane)`` reaches ``epoch``."""
        if epoch > 0:
            stream_wait(self._addr(self.rank, kind, src, lane), epoch)

    def spin(self, src: int, kind: int, epoch: int, lane: int = 0) -> None:
        """`wait` with a one-program kernel on the current stream: for a stream whose next op is a kernel."""
        if epoch > 0:
            word = self._word(kind, src, lane)
            flag_kernels.spin(self.flags[word : word + 1], epoch)
