"""Peer-mapped buffers and stream-ordered flags for copy-engine communication (CUDA only).

Every rank allocates the same buffer with PyTorch symmetric memory (CUDA IPC, no multicast), so each rank
can ``copy_`` straight into a peer's buffer: a ``cudaMemcpyAsync`` that the copy engine runs without any SM.
Readiness travels as 32-bit epoch flags written with ``cuStreamWriteValue32`` (after a system fence, no SM)
and awaited with ``cuStreamWaitValue32`` (the stream stalls, no kernel spins).  Epochs only grow, so flags
never need a reset.  Flag layout per rank: ``flags[READY, src]`` = last epoch whose data ``src`` pushed here;
``flags[ACK, src]`` = last epoch in which ``src`` finished reading what this rank pushed to it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

READY, ACK = 0, 1


def _driver():  # imported lazily: cuda-bindings exists only on GPU hosts
    from cuda.bindings import driver

    return driver


def _check(result: tuple) -> None:
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")


class PeerBuffer:
    """A [*shape] buffer on every rank of the group, addressable from every peer, with epoch flags."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        group = dist.group.WORLD
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local = symm_mem.empty(*shape, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(self.local, group)
        self.peers = [handle.get_buffer(p, shape, dtype) for p in range(self.world)]
        self._flags = symm_mem.empty(2 * self.world, dtype=torch.int32, device=device)
        self._flags.zero_()
        flag_handle = symm_mem.rendezvous(self._flags, group)
        self._flag_ptrs = list(flag_handle.buffer_ptrs)
        self.epoch = 0
        torch.cuda.synchronize(device)
        dist.barrier()

    def next_epoch(self) -> int:
        """The flag value of the call starting now.  Counted per buffer, not per call of the op: a flag
        awaited at epoch e-1 must have been written at e-1, whatever other methods ran in between."""
        self.epoch += 1
        return self.epoch

    def _addr(self, owner: int, kind: int, src: int) -> int:
        return self._flag_ptrs[owner] + 4 * (kind * self.world + src)

    def signal(self, peer: int, kind: int, epoch: int) -> None:
        """On the current stream: set ``peer``'s flag ``(kind, self.rank)`` to ``epoch`` once prior work is done."""
        driver = _driver()
        stream = torch.cuda.current_stream().cuda_stream
        _check(
            driver.cuStreamWriteValue32(
                driver.CUstream(stream),
                driver.CUdeviceptr(self._addr(peer, kind, self.rank)),
                epoch,
                driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT,
            )
        )

    def wait(self, src: int, kind: int, epoch: int) -> None:
        """Stall the current stream until this rank's flag ``(kind, src)`` reaches ``epoch``."""
        if epoch <= 0:
            return
        driver = _driver()
        stream = torch.cuda.current_stream().cuda_stream
        _check(
            driver.cuStreamWaitValue32(
                driver.CUstream(stream),
                driver.CUdeviceptr(self._addr(self.rank, kind, src)),
                epoch,
                driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
            )
        )
