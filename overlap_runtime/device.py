"""Per-rank execution primitives that the overlap methods are written against.

The methods in `methods.py` describe *what* runs where (which chunk GEMM, which transfer, which waits);
this module supplies *how* on each backend:

- CUDA: compute streams (the chunk GEMMs rotate over ``num_max_streams`` of them), one comm stream (copy
  engine pushes, signals), NCCL collectives issued asynchronously (NCCL's own stream waits for the issuing
  stream; ``Work.wait()`` makes the *current* stream wait, never the host), events for cross-stream order.
- CPU: one host thread runs the matmuls while gloo's background threads move data (``async_op=True``),
  so communication really overlaps; streams and events collapse to program order.

Stream legend (CUDA): ``compute[i]`` GEMM chunk i % streams; ``comm`` copy-engine pushes and flag writes;
NCCL's internal stream for collectives and send/recv.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from overlap_runtime import gemm as gemm_kernels
from overlap_runtime import ring_gemm
from overlap_runtime.symmetric import Counters, PeerBuffer

ALIGN_SLEEP_CYCLES = 4_000_000
"""One sleep kernel of `Device.align`: about 2 ms at H200 clocks (longer at lower clocks)."""
ALIGN_SLEEP_MS = 2.0
"""What one such sleep is taken to last when sleeps are counted (`align_sleeps`)."""
HOST_MARGIN = 1.5
"""`Device.align` sleeps this many times as long as the host is expected to take to queue the op."""
MAX_ALIGN_SLEEPS = 50
"""100 ms: a host slower than that to queue one op is not queueing (a compile, a stall), and must not turn
every repeat into a long sleep."""


def align_sleeps(host_ms: float) -> int:
    """How many ALIGN_SLEEP_CYCLES sleeps cover ``host_ms`` of host work with a margin (1 to MAX_ALIGN_SLEEPS)."""
    return min(MAX_ALIGN_SLEEPS, max(1, math.ceil(HOST_MARGIN * host_ms / ALIGN_SLEEP_MS)))


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class CommOptions:
    """How SM-driven communication is shaped (NCCL communicator options); None = NCCL's defaults."""

    num_sm: int | None = None
    cga_size: int | None = None
    high_priority: bool = False


class Work:
    """A pending transfer; ``wait()`` orders the current stream (CUDA) or the host (CPU) after it."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []


class Device:
    """Streams, events, GEMMs and collectives of one rank."""

    def __init__(self, *, rank: int, tp: int, device: torch.device) -> None:
        self.rank = rank
        self.tp = tp
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count if self.is_cuda else 0
        self._groups: dict[CommOptions, Any] = {CommOptions(): dist.group.WORLD}
        self._streams: dict[tuple[str, int, int], Any] = {}

    # -- streams and ordering -------------------------------------------------------------------
    def stream(self, name: str, index: int = 0, priority: int = 0) -> Any:
        if not self.is_cuda:
            return None
        key = (name, index, priority)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=self.device, priority=priority)
        return self._streams[key]

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        """Make ``stream`` current (CUDA); program order on CPU."""
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield

    def mark(self) -> Any:
        """An event on the current stream, for another stream to wait on."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, mark: Any) -> None:
        """Order the current stream after ``mark``."""
        if mark is not None:
            torch.cuda.current_stream(self.device).wait_event(mark)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    # -- compute --------------------------------------------------------------------------------
    def gemm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, num_sms: int | None, kind: str) -> None:
        """``out = a @ b`` with the GEMM ``kind`` held to ``num_sms`` SMs (None: all)."""
        if not self.is_cuda:
            torch.mm(a, b, out=out)
        elif kind == "triton":
            gemm_kernels.matmul(a, b, out, num_sms=num_sms)
        else:
            gemm_kernels.cublas_matmul(a, b, out, num_sms=num_sms)

    def gather_gemm(
        self, a: torch.Tensor, ring: PeerBuffer, b: torch.Tensor, out: torch.Tensor, *, epoch: int, num_sms: int | None
    ) -> None:
        """``out = all_gather(a) @ b`` in one launch of our GEMM, each peer chunk read from ``ring`` once its
        ready flag reaches ``epoch`` (`ring_gemm.gather_matmul`)."""
        ready = ring.flags[: self.tp]
        ring_gemm.gather_matmul(a, ring.local, b, out, ready=ready, epoch=epoch, rank=self.rank, num_sms=num_sms)

    def scatter_gemm(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        *,
        parts: torch.Tensor,
        counts: Counters,
        box: PeerBuffer,
        epoch: int,
        plan: ring_gemm.ScatterPlan,
    ) -> None:
        """``out = reduce_scatter(a @ b)`` (our chunk) in one launch of our GEMM that stages the other owners'
        partials in ``parts`` (counted per segment in ``counts``) and adds what arrived in ``box``
        (`ring_gemm.scatter_matmul`); the copy engine's pushes are the caller's."""
        ring_gemm.scatter_matmul(
            a,
            b,
            out,
            parts=parts,
            counts=counts.words[: (self.tp - 1) * len(plan.segments)],
            recv=box.local,
            ready=box.flags[: self.tp * box.lanes],
            epoch=epoch,
            rank=self.rank,
            plan=plan,
        )

    def library_gemm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """The best library GEMM at full SMs: the `gemm_ms` reference."""
        torch.mm(a, b, out=out)

    # -- communication --------------------------------------------------------------------------
    def group(self, options: CommOptions) -> Any:
        """A communicator shaped by ``options`` (created once, collectively, in the same order on all ranks)."""
        if options not in self._groups:
            pg_options = None
            if self.is_cuda:
                pg_options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=options.high_priority)
                if options.num_sm is not None:
                    pg_options.config.min_ctas = options.num_sm
                    pg_options.config.max_ctas = options.num_sm
                if options.cga_size is not None:
                    pg_options.config.cga_cluster_size = options.cga_size
            self._groups[options] = dist.new_group(list(range(self.tp)), pg_options=pg_options)
        return self._groups[options]

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, options: CommOptions = CommOptions()) -> Work:
        return Work([_all_gather(out, shard, group=self.group(options), async_op=True)])

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, options: CommOptions = CommOptions()) -> Work:
        return Work([_reduce_scatter(out, full, group=self.group(options), async_op=True)])

    def exchange(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        options: CommOptions = CommOptions(),
    ) -> Work:
        """Point-to-point sends and receives issued together (NCCL send/recv kernels, or gloo threads)."""
        group = self.group(options)
        ops = [dist.P2POp(dist.isend, t, peer, group=group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group=group) for t, peer in recvs]
        return Work(dist.batch_isend_irecv(ops) if ops else [])

    def align(self, host_ms: float = 0.0) -> None:
        """Start all ranks together: a host barrier, then (CUDA) a device-side all-reduce behind a sleep of
        at least ~2 ms that outlasts ``host_ms``, this rank's time to queue the op that follows (the all-reduce
        waits for every rank's sleep, so the longest one counts).

        The sleep lets the host queue the whole op before the GPU reaches it, so the timed region measures
        the GPU's work, not Python's launch latency (in training the host runs ahead of the GPU too).  An op
        that takes longer to queue than the sleep runs its chunks as the host reaches them, and each collective
        waits for the slower rank's host: on 2 x H200, h5120 s2048 proj_fprop under pipeline with 8 splits
        took 1.6-3.5 ms of Python per call and was timed at 1.30-1.65 ms behind a fixed 2 ms sleep, against
        0.28 ms with a sleep that outlasts the host."""
        if self.is_cuda:
            self.synchronize()
            dist.barrier()
            for _ in range(align_sleeps(host_ms)):
                torch.cuda._sleep(ALIGN_SLEEP_CYCLES)
            dist.all_reduce(torch.zeros(1, device=self.device))
        else:
            dist.barrier()


class Timer:
    """Elapsed milliseconds of the region between ``start()`` and ``stop()`` on the current stream."""

    def __init__(self, device: Device) -> None:
        self._cuda = device.is_cuda
        if self._cuda:
            self._start, self._stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self._cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._cuda:
            self._stop.record()
        else:
            self._t1 = time.perf_counter()

    def ms(self) -> float:
        """Read after the device is synchronized."""
        if self._cuda:
            return self._start.elapsed_time(self._stop)
        return (self._t1 - self._t0) * 1e3
