"""The CPU backend: a `device.Device` that emulates a GPU's streams, events, symmetric memory and flag memops,
so that the copy-engine and fused methods run their ordering logic (flags, epochs, acknowledgements,
staging) on CPU, and a missing wait or an early flag gives wrong numbers there as it would on the GPU.

- Streams (`HostStream`): a thread each, running the work queued on it in order; the host only queues, as
  with CUDA.  Events (`HostEvent`) are recorded and awaited in stream order, and carry the time they were
  recorded (`device.Timer`).  The rank's main stream is one of them.  `HostDevice.synchronize` skips idle
  streams, and outside `Device.jittered` (where every op keeps its random delay) an event recorded on an
  idle stream is recorded at once by the host and a wait for an event already recorded is not queued: the
  same order with fewer thread hand-offs, which are much of what a timed repeat costs on CPU.
- Symmetric memory: every rank maps every rank's buffer, a file in shared memory created once per buffer and
  unlinked once all ranks mapped it (`HostDevice.symmetric`).  A copy into a peer's buffer is a memcpy into
  its mapping; the "copy engine" is the comm stream's thread.
- Flags are int32 words of such buffers: a write is queued in stream order, a wait (stream memop or spinning
  kernel alike) blocks its stream until the word reaches the value, polling it, for at most ``wait_limit_s``
  (`WAIT_LIMIT_S` unless told; a flag that never comes, a peer that died, fails the call instead of hanging it).  Stores and loads of x86 are not
  reordered against each other (TSO), so data written before a flag is visible to the reader that saw it.
- Collectives run on one "NCCL" stream per communicator in the order the host issued them, each once the
  issuing stream reached it, as NCCL's own stream does; ``Work.wait`` makes the current stream wait.  They
  move their bytes through shared memory on that stream's thread (`host_collectives.Mailbox`), not through
  gloo's sockets and threads.
- The alignment before every timed repeat (`HostDevice.align`) waits for the peers in shared memory
  (`Arrivals`), not in a gloo barrier.
- Kernels that wait for flags themselves run as host code with the same waits and counts (`host_kernels`).
- Under `Device.jittered` every queued op may first sleep a random while (`races.Jitter`), so streams and
  ranks overtake each other in ever different orders.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from overlap_runtime import host_kernels
from overlap_runtime.device import CommOptions, Device, Kernels, PeerTensors, Work
from overlap_runtime.fp8 import Scales, host_mm
from overlap_runtime.host_collectives import Mailbox
from overlap_runtime.host_kernels import WAIT_LIMIT_S, StreamError, wait_until
from overlap_runtime.races import Jitter

SHARED_DIRS = (Path("/dev/shm"), Path(tempfile.gettempdir()))
"""Where the files of `HostDevice.symmetric` live (briefly: they are unlinked once mapped): shared memory
where it has room for every rank's file twice over (containers often get 64 MB of it), else a file whose
pages the ranks share through the page cache."""


def _shared_dir(nbytes: int) -> Path:
    for path in SHARED_DIRS:
        if path.is_dir():
            stat = os.statvfs(path)
            if stat.f_bavail * stat.f_frsize >= 2 * nbytes:
                return path
    return SHARED_DIRS[-1]


def _after(delay_s: float, work: Callable[[], Any]) -> Callable[[], None]:
    def delayed() -> None:
        time.sleep(delay_s)
        work()

    return delayed


class HostEvent:
    """A point in a stream's order: set when the stream has run everything queued before it."""

    def __init__(self, limit_s: float = WAIT_LIMIT_S) -> None:
        # Held until recorded: a lock hands one waiter over in one futex call each way, where an Event's
        # condition variable takes several (the emulation waits on thousands of events per measurement).
        self._pending = threading.Lock()
        self._pending.acquire()
        self.limit_s = limit_s
        self.time = math.nan
        """`time.perf_counter` when recorded."""

    def record(self) -> None:
        self.time = time.perf_counter()
        self._pending.release()

    def recorded(self) -> bool:
        return not self._pending.locked()

    def wait(self) -> None:
        if not self._pending.acquire(timeout=self.limit_s):
            raise StreamError(f"an event was not recorded within {self.limit_s:g} s")
        self._pending.release()  # the next waiter of the same event passes too


class HostStream:
    """A queue of work that one thread runs in order.  An op that raises does not stop the stream (later
    work runs as if it had returned); the error is kept for the host's next `HostDevice.synchronize`."""

    def __init__(self, name: str, *, rank: int) -> None:
        self.name = name
        """"main", "nccl", or the name `HostDevice.stream` was given."""
        self._queue: queue.SimpleQueue[Callable[[], Any]] = queue.SimpleQueue()
        # `idle` compares the two counts: the submitted one must never lag the queue, whichever thread queues.
        self._submitting = threading.Lock()
        self._submitted = 0
        self._finished = 0
        self.error: BaseException | None = None
        threading.Thread(
            target=self._run, args=(torch.get_num_threads(),), name=f"rank{rank}-{name}", daemon=True
        ).start()

    def submit(self, work: Callable[[], Any]) -> None:
        with self._submitting:
            self._submitted += 1
            self._queue.put(work)

    def idle(self) -> bool:
        """Everything queued so far has run (only this stream's thread counts work finished)."""
        return self._finished == self._submitted

    def _run(self, threads: int) -> None:
        # OpenMP's thread count is per thread: without this a stream's matmuls would use every core, and
        # oversubscribed cores made a tiny GEMM take 40-70 ms.
        torch.set_num_threads(threads)
        # Device work never records autograd: the layers queue it from autograd functions, where grad mode is off
        # on the caller's thread only (it is per thread).
        torch.set_grad_enabled(False)
        while True:
            work = self._queue.get()
            try:
                work()
            except BaseException as e:
                if self.error is None:
                    self.error = e
            self._finished += 1


class Arrivals:
    """A barrier in shared memory, for the alignment before every timed repeat: gloo's barrier (a worker thread
    and a TCP round trip per call) cost about 1 ms of CPU a repeat, as much as a small repeat itself.  Each rank
    counts its arrivals in its own int32 word of a `HostDevice.symmetric` buffer and waits until every peer's
    count reached its own; counts only grow, so one word per rank serves every call."""

    def __init__(self, mine: torch.Tensor, peers: list[torch.Tensor], *, limit_s: float) -> None:
        self._mine = mine.numpy()
        self._peers = peers
        self._count = 0
        self.limit_s = limit_s

    def wait(self) -> None:
        self._count += 1
        self._mine[0] = self._count
        for peer in self._peers:
            wait_until(peer, 0, self._count, limit_s=self.limit_s)


class HostDevice(Device):
    """The primitives of one rank on CPU, emulated (see the module docstring)."""

    is_cuda = False
    kernels = Kernels.of(host_kernels, host_kernels)
    jitter = Jitter(chance=0.3, max_s=0.5e-3, slow_s=6e-3)
    """Random delays of up to 0.5 ms, 6 ms before every op of a slowed stream: many times a small op's own run
    time on CPU, and more than a loaded 2-core machine delays a thread by itself (at 2 ms, with two busy
    processes beside four test processes, 4 of 26 race-plant tests let a wait left out pass now and then)."""

    def __init__(
        self, *, rank: int, tp: int, device: torch.device, group: Any = None, wait_limit_s: float = WAIT_LIMIT_S
    ) -> None:
        super().__init__(rank=rank, tp=tp, device=device, group=group)
        self.wait_limit_s = wait_limit_s
        """The longest any wait of this device blocks its stream (a flag, an event, a peer's collective)."""
        self._main = HostStream("main", rank=rank)
        self._current = self._main
        self._streams: dict[tuple[str, int, int], HostStream] = {}
        self._comm_streams: dict[CommOptions, HostStream] = {}
        self._mailboxes: dict[CommOptions, Mailbox] = {}
        self._arrivals: Arrivals | None = None

    def _all_streams(self) -> list[HostStream]:
        return [self._main, *self._streams.values(), *self._comm_streams.values()]

    def stream(self, name: str, index: int = 0, priority: int = 0) -> HostStream:
        key = (name, index, priority)  # a priority means nothing to a thread, but names a stream of its own
        if key not in self._streams:
            self._streams[key] = HostStream(name, rank=self.rank)
        return self._streams[key]

    @contextlib.contextmanager
    def on(self, stream: HostStream) -> Iterator[None]:
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    def _submit(self, work: Callable[[], Any], stream: HostStream | None = None) -> None:
        stream = stream or self._current
        delay = self._delay_s(stream.name)
        stream.submit(_after(delay, work) if delay else work)

    def launch(self, work: Callable[[], Any]) -> None:
        self._submit(work)

    def _paced(self) -> dict[str, Any]:
        if self._draws is None:
            return {"limit_s": self.wait_limit_s}
        pause = self._draws.pauses(self.jitter.slow_s if self._current.name == self._slow else 0.0)
        return {"pause": pause, "limit_s": self.wait_limit_s}

    def mark(self) -> HostEvent:
        event = HostEvent(self.wait_limit_s)
        if self._draws is None and self._current.idle():
            event.record()  # the stream would run it at once: the same time, without waking its thread
        else:
            self._submit(event.record)
        return event

    def _wait_event(self, mark: HostEvent) -> None:
        if self._draws is None and mark.recorded():
            return  # a wait that would pass at once
        self._submit(mark.wait)

    def synchronize(self) -> None:
        for stream in self._all_streams():
            if stream.idle():
                continue
            done = HostEvent(self.wait_limit_s)
            stream.submit(done.record)
            done.wait()
        for stream in self._all_streams():
            if stream.error is not None:
                error, stream.error = stream.error, None
                raise StreamError(f"{type(error).__name__} on stream {stream.name}: {error}") from error

    def gemm(
        self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, gemm_sms: int | None, kind: str,
        scales: Scales | None = None,
    ) -> None:  # fmt: skip
        self.library_gemm(a, b, out, scales)  # any GEMM kind: only the order of the work matters here

    def library_gemm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scales: Scales | None = None) -> None:
        """``torch.mm``; FP8 operands dequantized, then multiplied in fp32 (`fp8.host_mm`: the CPU's stand-in for
        ``torch._scaled_mm``)."""
        self.launch(lambda: host_mm(a, b, out, scales))

    def symmetric(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Files in shared memory, one per rank, that every rank maps (all ranks call this together)."""
        self.synchronize()  # what is in flight may use the group that the collectives below use
        numel = math.prod(shape)
        # rank 0 names the files (one per rank) and picks where they go, for every rank alike
        where = [_shared_dir(self.tp * numel * dtype.itemsize) / f"overlap-{os.getpid()}-{secrets.token_hex(4)}"]
        dist.broadcast_object_list(where, group=self.pg, group_src=0)

        def mapped(rank: int) -> torch.Tensor:
            path = f"{where[0]}-{rank}"
            return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)

        local = mapped(self.rank)  # creates the file, zeroed
        self.barrier()
        peers = [local if p == self.rank else mapped(p) for p in range(self.tp)]
        self.barrier()
        Path(f"{where[0]}-{self.rank}").unlink()
        return local, peers

    def _write_flag(self, words: torch.Tensor, index: int, value: int, *, early: bool) -> None:
        word = words.numpy()

        def write() -> None:
            word[index] = value

        if early:
            write()
        else:
            self._submit(write)

    def _wait_flag(self, words: torch.Tensor, index: int, value: int) -> None:
        self._submit(lambda: wait_until(words, index, value, limit_s=self.wait_limit_s))

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, options: CommOptions = CommOptions()) -> Work:
        return self._collective(options, lambda box: box.all_gather(out, shard))

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, options: CommOptions = CommOptions()) -> Work:
        return self._collective(options, lambda box: box.reduce_scatter(out, full))

    def exchange(self, sends: PeerTensors, recvs: PeerTensors, options: CommOptions = CommOptions()) -> Work:
        return self._collective(options, lambda box: box.transfer(sends, recvs))

    def _collective(self, options: CommOptions, issue: Callable[[Mailbox], Any]) -> Work:
        if options not in self._comm_streams:
            # Made collectively: every rank issues its first collective of a communicator at the same point.
            self._mailboxes[options] = Mailbox(self.symmetric, rank=self.rank, tp=self.tp, limit_s=self.wait_limit_s)
            self._comm_streams[options] = HostStream("nccl", rank=self.rank)
        box = self._mailboxes[options]
        issued, done = self.mark(), HostEvent(self.wait_limit_s)

        def run() -> None:
            try:
                issued.wait()
                issue(box)
            finally:  # the streams that wait for it go on: the next synchronize reports this stream's error
                done.record()

        self._submit(run, self._comm_streams[options])
        return Work([lambda: self._wait_event(done)])

    def align(self, host_ms: float = 0.0) -> None:
        """Start all ranks together: every stream idle, then every rank arrived (`Arrivals`, made by the first
        call, which every rank makes at the same point: alignment is collective)."""
        self.synchronize()
        if self.tp == 1:
            return
        if self._arrivals is None:
            mine, peers = self.symmetric((1,), torch.int32)
            self._arrivals = Arrivals(mine, peers, limit_s=self.wait_limit_s)
        self._arrivals.wait()
