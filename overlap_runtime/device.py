"""Per-rank execution primitives that the overlap methods are written against.

The methods' runners (`methods/`) describe *what* runs where (which chunk GEMM, which transfer, which waits);
a `Device` supplies *how*, with the semantics of CUDA streams on both backends:

- `CudaDevice`: compute streams (the chunk GEMMs rotate over ``num_max_streams`` of them), one comm stream
  (copy-engine pushes, flag writes), NCCL collectives issued asynchronously (NCCL's own stream waits for the
  issuing stream; ``Work.wait()`` makes the *current* stream wait, never the host), events for cross-stream
  order, symmetric memory and stream memops for flags (`symmetric`).
- `emulation.HostDevice` (the CPU backend): the same, emulated: a thread per stream runs the work queued on
  it in order, symmetric memory lives in shared memory, and collectives move bytes through shared memory in issue
  order behind the issuing stream (see there).  So the copy-engine and fused protocols run, and race, on CPU too.

Stream legend: ``compute[i]`` GEMM chunk i % streams; ``comm`` copy-engine pushes and flag writes; NCCL's
internal stream for collectives and send/recv.

Every wait and flag write takes a ``site`` name: `races` says what it is for.  Work is queued with `launch`
(tensor work) or the flag primitives; nothing a method does touches memory from the host directly.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from overlap_runtime import flag_kernels, ring_gemm
from overlap_runtime import gemm as gemm_kernels
from overlap_runtime.fp8 import Scales, as_bytes
from overlap_runtime.races import Draws, FaultPlan, Jitter, Plant, SiteKind
from overlap_runtime.symmetric import stream_wait, stream_write

ALIGN_SLEEP_CYCLES = 4_000_000
"""One sleep kernel of `Device.align`: about 2 ms at H200 clocks (longer at lower clocks)."""
ALIGN_SLEEP_MS = 2.0
"""What one such sleep is taken to last when sleeps are counted (`align_sleeps`)."""
HOST_MARGIN = 1.5
"""`Device.align` sleeps this many times as long as the host is expected to take to queue the op."""
EPOCH_LIMIT = 1 << 30
"""Flags are int32 words compared with >=: epochs restart well before they could wrap (`PeerBuffer.next_epoch`)."""
MAX_ALIGN_SLEEPS = 50
"""100 ms: a host slower than that to queue one op is not queueing (a compile, a stall), and must not turn
every repeat into a long sleep."""


def align_sleeps(host_ms: float) -> int:
    """How many ALIGN_SLEEP_CYCLES sleeps cover ``host_ms`` of host work with a margin (1 to MAX_ALIGN_SLEEPS)."""
    return min(MAX_ALIGN_SLEEPS, max(1, math.ceil(HOST_MARGIN * host_ms / ALIGN_SLEEP_MS)))


PeerTensors = list[tuple[torch.Tensor, int]]
"""Tensors of a point-to-point exchange, each with the rank it goes to (sends) or comes from (receives)."""

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class CommOptions:
    """How SM-driven communication is shaped (NCCL communicator options); None = NCCL's defaults."""

    num_sm: int | None = None
    cga_size: int | None = None
    high_priority: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Kernels:
    """The kernels that wait for flags themselves (`flag_kernels`, `ring_gemm`), or the CPU's versions of
    them (`host_kernels`): the same arguments, the same waits."""

    gather_matmul: Callable[..., Any]
    scatter_matmul: Callable[..., Any]
    reduce_when_ready: Callable[..., Any]
    spin: Callable[..., Any]

    @classmethod
    def of(cls, ring: ModuleType, flags: ModuleType) -> Kernels:
        """The ring kernels of ``ring`` and the flag kernels of ``flags``."""
        return cls(
            gather_matmul=ring.gather_matmul,
            scatter_matmul=ring.scatter_matmul,
            reduce_when_ready=flags.reduce_when_ready,
            spin=flags.spin,
        )


class Work:
    """A pending transfer; ``wait()`` orders the current stream after it."""

    def __init__(self, waits: list[Callable[[], Any]]) -> None:
        self._waits = waits

    def wait(self) -> None:
        for w in self._waits:
            w()
        self._waits = []


class Device(abc.ABC):
    """Streams, events, GEMMs, flags and collectives of one rank (see the module docstring)."""

    is_cuda: bool
    kernels: Kernels
    jitter: Jitter
    """The check's random delays on this backend (`races.Jitter`)."""

    def __init__(self, *, rank: int, tp: int, device: torch.device, group: Any = None) -> None:
        self.rank = rank
        self.tp = tp
        self.device = device
        self.pg = dist.group.WORLD if group is None else group
        """The TP group every collective, rendezvous and barrier of this device runs on; ``rank`` and ``tp`` are
        this rank's place in it and its size (a user's group under torchrun, or WORLD in our own `TPGroup`)."""
        self.sm_count = 0
        self._groups: dict[CommOptions, Any] = {CommOptions(): self.pg}
        self.epoch_limit = EPOCH_LIMIT
        """Flag epochs and counter totals restart from 0 before they pass this (`symmetric`)."""
        self.faults = FaultPlan()
        self.sites: dict[str, SiteKind] = {}
        """Every wait and flag-write site issued so far (what a test can plant, `races`)."""
        self._draws: Draws | None = None
        self._slow: str | None = None

    # -- streams and ordering -------------------------------------------------------------------
    @abc.abstractmethod
    def stream(self, name: str, index: int = 0, priority: int = 0) -> Any:
        """The stream ``(name, index, priority)``, created on first use."""

    @abc.abstractmethod
    def on(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` the current stream inside the block."""

    @abc.abstractmethod
    def mark(self) -> Any:
        """An event on the current stream, for another stream to wait on."""

    def wait(self, mark: Any, *, site: str | None = None) -> None:
        """Order the current stream after ``mark``."""
        if not self._skips(site):
            self._wait_event(mark)

    @abc.abstractmethod
    def _wait_event(self, mark: Any) -> None: ...

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until every stream has run what was queued on it."""

    @abc.abstractmethod
    def launch(self, work: Callable[[], Any]) -> None:
        """Run ``work`` (tensor work) on the current stream: CUDA queues its kernels as it runs; the CPU runs it
        on the stream's thread, in order."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``dst[...] = src`` on the current stream (into a peer's buffer: the copy engine, no SM)."""
        self.launch(lambda: dst.copy_(src, non_blocking=True))
        return dst

    def fill(self, t: torch.Tensor, value: float) -> None:
        self.launch(lambda: t.fill_(value))

    # -- compute --------------------------------------------------------------------------------
    # ``scales`` (scale_a, scale_b): FP8 operands' per-tensor dequantization scales (`fp8`); None otherwise.
    @abc.abstractmethod
    def gemm(
        self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, gemm_sms: int | None, kind: str,
        scales: Scales | None = None,
    ) -> None:  # fmt: skip
        """``out = a @ b`` with the GEMM ``kind`` held to ``gemm_sms`` SMs (None: all)."""

    @abc.abstractmethod
    def library_gemm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scales: Scales | None = None) -> None:
        """The best library GEMM at full SMs: the `gemm_ms` reference (FP8: ``torch._scaled_mm``)."""

    def gather_gemm(
        self, a: torch.Tensor, ring: Any, b: torch.Tensor, out: torch.Tensor, *, epoch: int, gemm_sms: int | None,
        site: str, scales: Scales | None = None,
    ) -> None:  # fmt: skip
        """``out = all_gather(a) @ b`` in one launch of our GEMM, each peer chunk read from ``ring`` (a
        `symmetric.PeerBuffer`) once its ready flag reaches ``epoch`` (`ring_gemm.gather_matmul`)."""
        epoch = self._awaited(site, epoch)
        kwargs = dict(ready=ring.flags[: self.tp], epoch=epoch, rank=self.rank, gemm_sms=gemm_sms, **self._paced())
        kwargs |= _scale_kwargs(scales)
        self.launch(lambda: self.kernels.gather_matmul(a, ring.local, b, out, **kwargs))

    def scatter_gemm(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        *,
        parts: torch.Tensor,
        counts: Any,
        box: Any,
        epoch: int,
        plan: ring_gemm.ScatterPlan,
        site: str,
        scales: Scales | None = None,
    ) -> None:
        """``out = reduce_scatter(a @ b)`` (our chunk) in one launch of our GEMM that stages the other owners'
        partials in ``parts`` (counted per segment in ``counts``, a `symmetric.Counters`) and adds what arrived
        in ``box`` (a `symmetric.PeerBuffer`; `ring_gemm.scatter_matmul`); the copy engine's pushes are the
        caller's."""
        epoch = self._awaited(site, epoch)
        words = counts.words[: (self.tp - 1) * len(plan.segments)]
        ready = box.flags[: self.tp * box.lanes]
        kwargs = dict(parts=parts, counts=words, recv=box.local, ready=ready, epoch=epoch, rank=self.rank, plan=plan)
        kwargs |= self._paced() | _scale_kwargs(scales)
        self.launch(lambda: self.kernels.scatter_matmul(a, b, out, **kwargs))

    def reduce_when_ready(
        self, out: torch.Tensor, own: torch.Tensor, received: torch.Tensor, ready: torch.Tensor, *, epoch: int,
        site: str,
    ) -> None:  # fmt: skip
        """``out = own + sum(received[s])`` over every other rank s, each slot read once ``ready[s]`` reaches
        ``epoch`` (`flag_kernels.reduce_when_ready`)."""
        kwargs = dict(epoch=self._awaited(site, epoch), rank=self.rank, **self._paced())
        self.launch(lambda: self.kernels.reduce_when_ready(out, own, received, ready, **kwargs))

    # -- symmetric memory and flags ---------------------------------------------------------------
    @abc.abstractmethod
    def symmetric(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A buffer that every rank of the group allocates at once (collective): (this rank's, every rank's as
        this rank addresses it)."""

    def write_flag(self, words: torch.Tensor, index: int, value: int, *, site: str) -> None:
        """On the current stream: ``words[index] = value`` (int32, any rank's flags) once prior work is done
        and visible."""
        self._write_flag(words, index, value, early=self._early(site))

    @abc.abstractmethod
    def _write_flag(self, words: torch.Tensor, index: int, value: int, *, early: bool) -> None:
        """``early``: issued out of stream order, ahead of the work queued before it (a planted fault)."""

    def wait_flag(self, words: torch.Tensor, index: int, value: int, *, site: str) -> None:
        """Stall the current stream until this rank's int32 ``words[index]`` is at least ``value`` (no SM: for a
        stream whose next op is a copy)."""
        value = self._awaited(site, value)
        if value > 0:
            self._wait_flag(words, index, value)

    @abc.abstractmethod
    def _wait_flag(self, words: torch.Tensor, index: int, value: int) -> None: ...

    def spin_flag(self, words: torch.Tensor, index: int, value: int, *, site: str) -> None:
        """`wait_flag` with a one-program kernel on the current stream: for a stream whose next op is a kernel."""
        value = self._awaited(site, value)
        if value > 0:
            kwargs = self._paced()
            self.launch(lambda: self.kernels.spin(words[index : index + 1], value, **kwargs))

    def barrier(self) -> None:
        """Every rank of the group reached this point (host side)."""
        dist.barrier(group=self.pg)

    # -- communication --------------------------------------------------------------------------
    def group(self, options: CommOptions) -> Any:
        """A communicator shaped by ``options`` (created once, collectively, in the same order on all ranks)."""
        if options not in self._groups:
            # Only the group's ranks take part: the other ranks of a DP x TP job never call this.
            self._groups[options] = dist.new_group(
                dist.get_process_group_ranks(self.pg),
                pg_options=self._pg_options(options),
                use_local_synchronization=True,
            )
        return self._groups[options]

    def release_groups(self) -> None:
        """Drop this device's references to its process groups, so that ``destroy_process_group`` frees them
        while the interpreter is whole (`tp_linear.TPContext.release_all`)."""
        self._groups.clear()
        self.pg = None

    def _pg_options(self, options: CommOptions) -> Any:
        return None

    # Each runs on the communicator ``options`` in stream order, and returns a `Work` that orders a stream after it.
    @abc.abstractmethod
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, options: CommOptions = CommOptions()) -> Work:
        """``out`` = every rank's ``shard``, in rank order along dim 0."""

    @abc.abstractmethod
    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, options: CommOptions = CommOptions()) -> Work:
        """``out`` = the sum over ranks of their ``full``'s chunk of this rank (dim 0)."""

    @abc.abstractmethod
    def exchange(self, sends: PeerTensors, recvs: PeerTensors, options: CommOptions = CommOptions()) -> Work:
        """Point-to-point sends and receives issued together; the sends to a peer match its receives from this
        rank in order and size."""

    @abc.abstractmethod
    def align(self, host_ms: float = 0.0) -> None:
        """Start all ranks together (see `CudaDevice.align`)."""

    # -- races: random delays and planted faults (`races`) -----------------------------------------
    @contextlib.contextmanager
    def jittered(self, seed: int) -> Iterator[None]:
        """Queue work behind random delays (`jitter`, seeded by ``seed`` and the rank) inside the block."""
        self._draws = self.jitter.draws(seed * 1_000_003 + self.rank)
        try:
            yield
        finally:
            self._draws = None

    @contextlib.contextmanager
    def slowed(self, stream: str | None) -> Iterator[None]:
        """Inside `jittered`: delay everything queued on the stream named ``stream`` ("main", or a name given to
        `stream`) by ``jitter.slow_s`` inside the block."""
        self._slow = stream
        try:
            yield
        finally:
            self._slow = None

    def _paced(self) -> dict[str, Any]:
        """Extra arguments of the flag-waiting kernels: the pauses between their steps and how long a wait may
        last (`host_kernels`)."""
        return {}

    def _delay_s(self, stream: str) -> float:
        """The delay to queue before the next op of the stream named ``stream`` (0 outside `jittered`)."""
        if self._draws is None:
            return 0.0
        return (self.jitter.slow_s if stream == self._slow else 0.0) + self._draws.next_s()

    @contextlib.contextmanager
    def planted(self, faults: FaultPlan) -> Iterator[None]:
        """Issue the waits and flags that ``faults`` names wrongly inside the block (tests only)."""
        self.faults = faults
        try:
            yield
        finally:
            self.faults = FaultPlan()

    def _skips(self, site: str | None) -> bool:
        """Whether the event wait at ``site`` is left out (recording the site)."""
        if site is None:
            return False
        self.sites[site] = SiteKind.WAIT
        return self.faults.plants(site, Plant.SKIP)

    def _awaited(self, site: str, epoch: int) -> int:
        """The value a flag wait at ``site`` waits for (recording the site): 0 (any flag is there) when the
        wait is left out, one less when it is planted short."""
        self.sites[site] = SiteKind.FLAG
        if self.faults.plants(site, Plant.SKIP):
            return 0
        return max(epoch - 1, 0) if self.faults.plants(site, Plant.SHORT) else epoch

    def _early(self, site: str) -> bool:
        self.sites[site] = SiteKind.SIGNAL
        return self.faults.plants(site, Plant.EARLY)

    def read_late(self, site: str) -> bool:
        """Whether the read at ``site``, which must end before the release that lets the peers write what it
        reads, is planted after that release instead (recording the site)."""
        self.sites[site] = SiteKind.READ
        return self.faults.plants(site, Plant.LATE)


class CudaDevice(Device):
    """The primitives on one GPU (see the module docstring)."""

    is_cuda = True
    kernels = Kernels.of(ring_gemm, flag_kernels)
    jitter = Jitter(chance=0.3, max_s=50e-6, slow_s=500e-6)
    """Random sleep kernels of up to 50 µs (a small chunk GEMM or push), and 0.5 ms before every op of a
    slowed stream: longer than most chunk GEMMs of the shapes the tests check."""
    SLEEP_CYCLES_PER_S = ALIGN_SLEEP_CYCLES / (ALIGN_SLEEP_MS * 1e-3)

    def __init__(self, *, rank: int, tp: int, device: torch.device, group: Any = None) -> None:
        super().__init__(rank=rank, tp=tp, device=device, group=group)
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        self._streams: dict[tuple[str, int, int], Any] = {}
        self._names: dict[int, str] = {}

    def stream(self, name: str, index: int = 0, priority: int = 0) -> Any:
        key = (name, index, priority)
        if key not in self._streams:
            self._streams[key] = stream = torch.cuda.Stream(device=self.device, priority=priority)
            self._names[stream.cuda_stream] = name
        return self._streams[key]

    def _current_name(self) -> str:
        """The current stream's name: "main", or the name it was created with."""
        return self._names.get(torch.cuda.current_stream(self.device).cuda_stream, "main")

    def on(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(stream)

    def mark(self) -> Any:
        event = torch.cuda.Event()
        event.record()
        return event

    def _wait_event(self, mark: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(mark)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def launch(self, work: Callable[[], Any]) -> None:
        if self._draws is not None:  # only the numerical check pays for looking up the stream
            delay = self._delay_s(self._current_name())
            if delay:
                torch.cuda._sleep(int(delay * self.SLEEP_CYCLES_PER_S))
        work()

    def gemm(
        self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, gemm_sms: int | None, kind: str,
        scales: Scales | None = None,
    ) -> None:  # fmt: skip
        matmul = gemm_kernels.matmul if kind == "triton" else gemm_kernels.cublas_matmul
        kwargs = _scale_kwargs(scales)
        self.launch(lambda: matmul(a, b, out, gemm_sms=gemm_sms, **kwargs))

    def library_gemm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scales: Scales | None = None) -> None:
        if scales is None:
            self.launch(lambda: torch.mm(a, b, out=out))
        else:
            self.launch(lambda: gemm_kernels.cublas_matmul(a, b, out, **_scale_kwargs(scales)))

    def symmetric(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        local = symm_mem.empty(*shape, dtype=dtype, device=self.device)
        handle = symm_mem.rendezvous(local, self.pg.group_name)
        return local, [handle.get_buffer(p, shape, dtype) for p in range(self.tp)]

    def _write_flag(self, words: torch.Tensor, index: int, value: int, *, early: bool) -> None:
        address = words.data_ptr() + 4 * index
        if early:  # a stream of its own that waits for nothing: the write lands about at once
            with torch.cuda.stream(self.stream("early")):
                stream_write(address, value)
        else:
            self.launch(lambda: stream_write(address, value))

    def _wait_flag(self, words: torch.Tensor, index: int, value: int) -> None:
        self.launch(lambda: stream_wait(words.data_ptr() + 4 * index, value))

    def _pg_options(self, options: CommOptions) -> Any:
        pg_options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=options.high_priority)
        if options.num_sm is not None:
            pg_options.config.min_ctas = options.num_sm
            pg_options.config.max_ctas = options.num_sm
        if options.cga_size is not None:
            pg_options.config.cga_cluster_size = options.cga_size
        return pg_options

    # FP8 tensors travel as their bytes (`fp8.as_bytes`): a transfer needs no float8 type.
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, options: CommOptions = CommOptions()) -> Work:
        out, shard = as_bytes(out), as_bytes(shard)
        return self._collective(options, lambda group: [_all_gather(out, shard, group=group, async_op=True)])

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, options: CommOptions = CommOptions()) -> Work:
        return self._collective(options, lambda group: [_reduce_scatter(out, full, group=group, async_op=True)])

    def exchange(self, sends: PeerTensors, recvs: PeerTensors, options: CommOptions = CommOptions()) -> Work:
        def issue(group: Any) -> list[Any]:  # NCCL's send/recv kernels
            ops = [dist.P2POp(dist.isend, as_bytes(t), group=group, group_peer=peer) for t, peer in sends]
            ops += [dist.P2POp(dist.irecv, as_bytes(t), group=group, group_peer=peer) for t, peer in recvs]
            return dist.batch_isend_irecv(ops) if ops else []

        return self._collective(options, issue)

    def _collective(self, options: CommOptions, issue: Callable[[Any], list[Any]]) -> Work:
        """Issue ``issue(group)``'s async torch.distributed calls on the current stream (NCCL orders them)."""
        return Work([w.wait for w in issue(self.group(options))])

    def align(self, host_ms: float = 0.0) -> None:
        """Start all ranks together: a host barrier, then a device-side all-reduce behind a sleep of at least
        ~2 ms that outlasts ``host_ms``, this rank's time to queue the op that follows (the all-reduce waits
        for every rank's sleep, so the longest one counts).

        The sleep lets the host queue the whole op before the GPU reaches it, so the timed region measures
        the GPU's work, not Python's launch latency (in training the host runs ahead of the GPU too).  An op
        that takes longer to queue than the sleep runs its chunks as the host reaches them, and each collective
        waits for the slower rank's host: on 2 x H200, h5120 s2048 proj_fprop under pipeline with 8 splits
        took 1.6-3.5 ms of Python per call and was timed at 1.30-1.65 ms behind a fixed 2 ms sleep, against
        0.28 ms with a sleep that outlasts the host."""
        self.synchronize()
        self.barrier()
        for _ in range(align_sleeps(host_ms)):
            torch.cuda._sleep(ALIGN_SLEEP_CYCLES)
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.pg)


def _scale_kwargs(scales: Scales | None) -> dict[str, torch.Tensor]:
    """The ``scale_a``, ``scale_b`` keyword arguments of our kernels (none for 16/32-bit operands)."""
    return {} if scales is None else {"scale_a": scales[0], "scale_b": scales[1]}


class Timer:
    """Elapsed milliseconds of the region between ``start()`` and ``stop()`` on the current stream."""

    def __init__(self, device: Device) -> None:
        self._device = device
        self._cuda = device.is_cuda
        if self._cuda:
            self._start, self._stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self._cuda:
            self._start.record()
        else:
            self._start = self._device.mark()

    def stop(self) -> None:
        if self._cuda:
            self._stop.record()
        else:
            self._stop = self._device.mark()

    def ms(self) -> float:
        """Read after the device is synchronized."""
        if self._cuda:
            return self._start.elapsed_time(self._stop)
        return (self._stop.time - self._start.time) * 1e3
