"""Peer-mapped buffers and stream-ordered flags for copy-engine communication.

Every rank allocates the same buffer (`Device.symmetric`: PyTorch symmetric memory on CUDA, CUDA IPC without
multicast; shared memory on CPU, `emulation`), so each rank can copy straight into a peer's buffer: on CUDA a
``cudaMemcpyAsync`` that the copy engine runs without any SM.  Readiness travels as 32-bit epoch flags written
in stream order (`Device.write_flag`; CUDA: ``cuStreamWriteValue32`` after a system fence, no SM).  A comm
stream awaits them with a stream wait (`PeerBuffer.wait`; CUDA: ``cuStreamWaitValue32``, the stream stalls,
no SM); a compute stream with a kernel that spins (`PeerBuffer.spin`, `flag_kernels`), because the kernel
behind a memop wait starts microseconds late.  Epochs only grow, so flags never need a reset.  Flag layout per rank:
``flags[READY, src]`` = last epoch whose data ``src`` pushed here; ``flags[ACK, src]`` = last epoch in which
``src`` finished reading what this rank pushed to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from overlap_runtime.device import Device

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
    """Local int32 words that a kernel bumps and a stream waits on (`Device.wait_flag`).  They only grow, so
    the host keeps each one's total at the end of the current call; a call adds what its kernel will add."""

    def __init__(self, dev: Device, n: int) -> None:
        self.dev = dev
        self.words = torch.zeros(n, dtype=torch.int32, device=dev.device)
        self.totals = [0] * n

    def begin(self) -> None:
        """Before a call's kernel: restart the words from 0 once a total nears ``dev.epoch_limit`` (local
        words: waiting for this rank's streams to finish is enough)."""
        if max(self.totals) >= self.dev.epoch_limit:
            self.dev.synchronize()
            self.words.zero_()
            self.totals = [0] * len(self.totals)

    def wait(self, i: int, added: int, *, site: str) -> None:
        """Stall the current stream until word ``i`` has grown by ``added`` in this call."""
        self.totals[i] += added
        self.dev.wait_flag(self.words, i, self.totals[i], site=site)


class PeerBuffer:
    """A [*shape] buffer on every rank of the group, addressable from every peer, with epoch flags.

    ``lanes`` > 1 gives each (kind, source) pair that many flags, for data that arrives in parts (flag
    ``(kind, src, lane)`` is word ``(kind * world + src) * lanes + lane``).
    """

    def __init__(self, dev: Device, shape: tuple[int, ...], dtype: torch.dtype, *, lanes: int = 1) -> None:
        self.dev = dev
        self.rank, self.world, self.lanes = dev.rank, dev.tp, lanes
        self.local, self.peers = dev.symmetric(shape, dtype)
        self.flags, self._peer_flags = dev.symmetric((2 * self.world * lanes,), torch.int32)
        """This rank's flag words, [READY per source and lane, ACK per source and lane], and every rank's."""
        self._restart()

    def _restart(self) -> None:
        """Every rank's flags at 0, epoch 0 (collective: every rank of the group calls it together)."""
        self.dev.synchronize()
        self.dev.barrier()  # no rank still reads or writes the flags of the previous epochs
        self.flags.zero_()
        self.epoch = 0
        self.dev.synchronize()
        self.dev.barrier()

    def next_epoch(self) -> int:
        """The flag value of the call starting now.  Counted per buffer, not per call of the op: a flag
        awaited at epoch e-1 must have been written at e-1, whatever other methods ran in between.

        Before the int32 flags could wrap (``dev.epoch_limit``), every rank restarts them from 0: ranks call
        the same ops in the same order, so they all reach the limit in the same call, and after a device
        synchronize and a barrier no flag of an earlier epoch is still awaited anywhere."""
        if self.epoch >= self.dev.epoch_limit:
            self._restart()
        self.epoch += 1
        return self.epoch

    def _word(self, kind: int, src: int, lane: int) -> int:
        """The index of flag ``(kind, src, lane)`` in every rank's flag words."""
        return (kind * self.world + src) * self.lanes + lane

    def signal(self, peer: int, kind: int, epoch: int, *, lane: int = 0, site: str) -> None:
        """On the current stream: set ``peer``'s flag ``(kind, self.rank, lane)`` to ``epoch`` once prior work
        is done."""
        self.dev.write_flag(self._peer_flags[peer], self._word(kind, self.rank, lane), epoch, site=site)

    def push(self, peer: int, dst: torch.Tensor, src: torch.Tensor, epoch: int, *, lane: int = 0, site: str) -> None:
        """On the current stream: copy ``src`` into ``dst`` (a view of ``peers[peer]``), then raise ``peer``'s
        READY flag ``(self.rank, lane)`` to ``epoch``: the data is there before the flag says so."""
        self.dev.copy(dst, src)
        self.signal(peer, READY, epoch, lane=lane, site=site)

    def wait(self, src: int, kind: int, epoch: int, *, lane: int = 0, site: str) -> None:
        """Stall the current stream until this rank's flag ``(kind, src, lane)`` reaches ``epoch``."""
        self.dev.wait_flag(self.flags, self._word(kind, src, lane), epoch, site=site)

    def spin(self, src: int, kind: int, epoch: int, *, lane: int = 0, site: str) -> None:
        """`wait` with a one-program kernel on the current stream: for a stream whose next op is a kernel."""
        self.dev.spin_flag(self.flags, self._word(kind, src, lane), epoch, site=site)
