"""The overlap methods, as TE defines them (docs/te_rules.md, Methods), written once for both backends.

Shapes per rank (T tokens, P = tp, r = this rank, rows = T/P, chunk c = rows [c*rows, (c+1)*rows)):

- coupled all-gather (qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad):
  ``a`` = local shard [rows, K], ``b`` [K, n], ``out`` [T, n] = all_gather(a) @ b
- coupled reduce-scatter (proj_fprop, fc2_fprop, RS-dgrad):
  ``a`` [T, k], ``b`` [k, N], ``out`` [rows, N] = reduce_scatter(a @ b)[chunk r]
- bulk (qkv/fc1 dgrad and wgrad): ``out`` = a @ b beside an independent collective ``x`` -> ``y``
  (all-gather [rows, H] -> [T, H] or reduce-scatter [T, H] -> [rows, H]).

dtypes: ``a``, ``b`` and what is gathered are the shape's inputs (FP8 E4M3 at fp8, with ``Operands.scales``);
``out``, partials and what is reduce-scattered are the GEMM's output dtype (bf16 at fp8), except a pipeline
with ``fp8_buf``, whose partials travel as FP8 (`fp8_reduce_scatter`).

Every method leaves ``out`` (and ``y``) equal to the serial reference; `harness` checks it on every config.
Streams: see `device`.  GEMM chunks go to `Lanes`; the main stream orders transfers and joins the lanes.
Every wait and flag write of the copy-engine methods names its site, ``"<function>.<what>"`` (`races`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from overlap_runtime import ring_gemm
from overlap_runtime.config import Method, OverlapConfig, sm_driven_comm
from overlap_runtime.device import CommOptions, Device, Work
from overlap_runtime.fp8 import Scales, dequantized, quantize
from overlap_runtime.gemm import FP8
from overlap_runtime.knobs import DEFAULT_STREAMS
from overlap_runtime.shape import Collective, SlotGemm
from overlap_runtime.symmetric import ACK, READY, Counters, PeerBuffer

BULK_GATHERED = "bulk_gathered"
"""The peer buffer that a bulk all-gather's output ``y`` lives in (see `_bulk_gather_ce`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A config resolved against this device: the knobs the methods read, defaults filled in."""

    method: Method
    gemm_kind: str
    gemm_sms: int | None
    """SMs the overlapped GEMMs may use; None = all."""
    streams: int
    comm: CommOptions
    use_ce: bool
    fused: bool
    aggregate: bool
    num_splits: int
    first_gemm: bool
    fp8_buf: bool
    """pipeline at FP8: the partials are reduce-scattered through an FP8 buffer (`fp8_reduce_scatter`)."""
    comm_priority: int
    gemm_priority: int

    @classmethod
    def resolve(cls, config: OverlapConfig, dev: Device) -> Plan:
        sm_driven = sm_driven_comm(config)
        return cls(
            method=config.method,
            gemm_kind=config.gemm or "cublas",
            # TE's set_sm_margin keeps the comm's num_sm SMs off the GEMM: the GEMM gets the rest.
            gemm_sms=dev.sm_count - config.num_sm if config.set_sm_margin and config.num_sm else None,
            streams=config.num_max_streams or (DEFAULT_STREAMS if dev.is_cuda else 1),
            comm=CommOptions(
                num_sm=config.num_sm if sm_driven else None,
                cga_size=config.cga_size,
                high_priority=config.comm_priority is not None and config.comm_priority < 0,
            ),
            # On CPU the copy engine (emulated) runs only when asked for: use_ce unset is gloo's send/recv ring.
            use_ce=config.method != Method.NONE and not sm_driven and (dev.is_cuda or config.use_ce is True),
            fused=config.fused,
            aggregate=config.aggregate,
            num_splits=config.num_splits or 4,
            first_gemm=config.pipeline_rs_overlap_first_gemm,
            fp8_buf=config.fp8_buf,
            comm_priority=config.comm_priority or 0,
            gemm_priority=config.gemm_priority or 0,
        )


@dataclass(kw_only=True)
class Operands:
    """Inputs, outputs and scratch of one slot on one rank (see the module legend)."""

    gemm: SlotGemm
    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None
    scales: Scales | None = None
    """FP8 ``a`` and ``b``'s dequantization scales (`fp8`), the same for every input set; None otherwise."""
    partial_scale: torch.Tensor | None = None
    """FP8: the scale an FP8 reduce-scatter buffer quantizes partials with, the same on every rank (TE's
    delayed scaling: known before the GEMM, from the amax reduced over the group)."""
    scratch: dict[tuple[str, tuple[int, ...]], Any] = field(default_factory=dict)
    turn: int = 0
    """Calls that took an input set so far (`harness`): the next call takes set ``turn % sets``."""
    keep_gathered: bool = False
    """A coupled all-gather leaves the whole gathered input in `gathered` after the call, whatever its method
    (a layer's weight gradient reads it); the copy-engine rings then copy it out of their peer buffer before
    telling the peers that they may push again."""

    @property
    def rows(self) -> int:
        return self.gemm.tokens // self.gemm.tp

    def chunk(self, c: int, size: int = 1) -> slice:
        return slice(c * self.rows, (c + size) * self.rows)

    def gathered(self) -> torch.Tensor:
        """The all-gathered input [tokens, k] of an all-gather slot: scratch that the collective fills."""
        return self.buffer("gathered", (self.gemm.tokens, self.gemm.k), self.a.dtype)

    def partials(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Scratch in the GEMM's output dtype: partial products and what they are reduced into."""
        return self.buffer(name, shape, self.out.dtype)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Scratch kept across calls; methods that share a name with another shape get their own."""
        key = (name, shape)
        if key not in self.scratch:
            self.scratch[key] = torch.empty(shape, dtype=dtype, device=self.a.device)
        return self.scratch[key]

    def peer_buffer(
        self, dev: Device, name: str, shape: tuple[int, ...], dtype: torch.dtype, *, lanes: int = 1
    ) -> PeerBuffer:
        key = (name, shape)
        if key not in self.scratch:
            self.scratch[key] = PeerBuffer(dev, shape, dtype, lanes=lanes)
        return self.scratch[key]

    def counters(self, dev: Device, name: str, n: int) -> Counters:
        key = (name, (n,))
        if key not in self.scratch:
            self.scratch[key] = Counters(dev, n)
        self.scratch[key].begin()
        return self.scratch[key]

    def outputs(self) -> list[torch.Tensor]:
        return [t for t in (self.out, self.y) if t is not None]

    def poison(self, dev: Device) -> None:
        """On the current stream: NaN into the outputs and every buffer a transfer or a chunk writes (scratch,
        staging, this rank's side of every peer buffer: the peers' receive buffers once every rank did it), so
        that a read of anything this call did not write shows."""
        written = [*self.outputs(), *(t for t in self.scratch.values() if isinstance(t, torch.Tensor))]
        written += [t.local for t in self.scratch.values() if isinstance(t, PeerBuffer)]
        for t in written:
            dev.fill(t, math.nan)


class Lanes:
    """Rotates chunk GEMMs over ``n`` compute streams so one chunk's tail wave overlaps the next chunk.

    A lane starts after everything already queued on the main stream; `join` orders main after all lanes.
    """

    def __init__(self, dev: Device, n: int, priority: int) -> None:
        self.dev = dev
        self.streams = [dev.stream("gemm", i, priority) for i in range(n)] if dev.is_cuda and n > 1 else []
        self.used: set[int] = set()

    @contextlib.contextmanager
    def lane(self, i: int) -> Iterator[None]:
        if not self.streams:
            yield
            return
        k = i % len(self.streams)
        start = self.dev.mark()
        with self.dev.on(self.streams[k]):
            self.dev.wait(start)
            yield
        self.used.add(k)

    def join(self) -> None:
        for k in sorted(self.used):
            with self.dev.on(self.streams[k]):
                mark = self.dev.mark()
            self.dev.wait(mark)
        self.used.clear()


def run(dev: Device, ops: Operands, plan: Plan) -> None:
    """Run ``plan.method`` once: ``ops.out`` (and ``ops.y``) hold the result on the current stream's timeline."""
    g = ops.gemm
    if plan.method == Method.NONE:
        serial(dev, ops)
    elif plan.method == Method.BULK:
        _bulk(dev, ops, plan)
    elif plan.method == Method.PIPELINE:
        _pipeline_rs(dev, ops, plan)
    elif plan.fused and g.collective == Collective.REDUCE_SCATTER:
        _fused_ring_rs(dev, ops, plan)
    elif plan.fused and _fused_pays(dev, ops, plan):
        _fused_ring_ag(dev, ops, plan)
    elif plan.fused:  # our GEMM would lose to the library here: the copy-engine ring with cuBLAS chunks
        _ring_ag_ce(dev, ops, dataclasses.replace(plan, fused=False, gemm_kind="cublas"))
    elif g.collective == Collective.ALL_GATHER:
        (_ring_ag_ce if plan.use_ce else _ring_ag)(dev, ops, plan)
    else:
        (_ring_rs_ce if plan.use_ce else _ring_rs)(dev, ops, plan)


def serial(dev: Device, ops: Operands, *, fp8_buf: bool = False) -> None:
    """No overlap: the collective and the library GEMM back to back (the reference and the `none` method).

    ``fp8_buf``: the reduce-scatter goes through an FP8 buffer, quantized as a pipeline with ``fp8_buf``
    quantizes (the reference of such a config: the same quantization, so only the order of the sums differs)."""
    g = ops.gemm
    if not g.coupled:
        _independent_collective(dev, ops, CommOptions()).wait()
        dev.library_gemm(ops.a, ops.b, ops.out, ops.scales)
    elif g.collective == Collective.ALL_GATHER:
        gathered = ops.gathered()
        dev.all_gather(gathered, ops.a).wait()
        dev.library_gemm(gathered, ops.b, ops.out, ops.scales)
    else:
        partial = ops.partials("partial", (g.tokens, g.n))
        dev.library_gemm(ops.a, ops.b, partial, ops.scales)
        if fp8_buf:
            fp8_reduce_scatter(dev, ops, ops.out, partial, "serial", CommOptions()).wait()
        else:
            dev.reduce_scatter(ops.out, partial).wait()


def fp8_reduce_scatter(
    dev: Device, ops: Operands, out: torch.Tensor, full: torch.Tensor, name: str, options: CommOptions
) -> Work:
    """``out = reduce_scatter(full)`` through an FP8 buffer (TE's pipeline with ``fp8_buf``): on the current
    stream ``full`` [T, n] is quantized with `Operands.partial_scale`; each owner's rows travel to it as FP8
    (half the bytes of bf16) and `Work.wait` queues, on the waiting stream, the owner's fp32 sum of what it
    received, dequantized, into ``out`` [T/P, n].  ``name`` keeps the scratch of concurrent calls apart."""
    p, r = dev.tp, dev.rank
    scale = ops.partial_scale
    assert scale is not None, "an FP8 buffer needs FP8 operands (check_config)"
    sent = ops.buffer(f"{name}_fp8_sent", tuple(full.shape), FP8)
    received = ops.buffer(f"{name}_fp8_received", (p, *out.shape), FP8)
    dev.launch(lambda: quantize(full, scale, out=sent))
    dev.copy(received[r], sent[ops.chunk(r)])
    peers = [(r + d) % p for d in range(1, p)]
    work = dev.exchange(
        [(sent[ops.chunk(peer)], peer) for peer in peers], [(received[peer], peer) for peer in peers], options
    )

    def reduce() -> None:
        out.copy_(dequantized(received, scale).sum(dim=0))

    return Work([work.wait, lambda: dev.launch(reduce)])


def gemm_only(dev: Device, ops: Operands) -> None:
    """The full GEMM alone, all SMs, library GEMM: what `gemm_ms` times."""
    g = ops.gemm
    if g.coupled and g.collective == Collective.ALL_GATHER:
        dev.library_gemm(ops.gathered(), ops.b, ops.out, ops.scales)
    elif g.coupled:
        dev.library_gemm(ops.a, ops.b, ops.partials("partial", (g.tokens, g.n)), ops.scales)
    else:
        dev.library_gemm(ops.a, ops.b, ops.out, ops.scales)


def comm_only(dev: Device, ops: Operands) -> None:
    """The collective alone (NCCL / gloo): what `comm_ms` times."""
    g = ops.gemm
    if not g.coupled:
        _independent_collective(dev, ops, CommOptions()).wait()
    elif g.collective == Collective.ALL_GATHER:
        dev.all_gather(ops.gathered(), ops.a).wait()
    else:
        dev.reduce_scatter(ops.out, ops.partials("partial", (g.tokens, g.n))).wait()


def _independent_collective(dev: Device, ops: Operands, options: CommOptions) -> Any:
    assert ops.x is not None and ops.y is not None
    if ops.gemm.collective == Collective.ALL_GATHER:
        return dev.all_gather(ops.y, ops.x, options)
    return dev.reduce_scatter(ops.y, ops.x, options)


def _gemm(dev: Device, plan: Plan, ops: Operands) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    return lambda a, b, out: dev.gemm(a, b, out, gemm_sms=plan.gemm_sms, kind=plan.gemm_kind, scales=ops.scales)


def _bulk(dev: Device, ops: Operands, plan: Plan) -> None:
    """TE bulk: the independent collective on NCCL's stream (num_sm CTAs) beside one full GEMM; with the
    copy engine, the transfers run on our comm stream instead and take no SM but the final reduction's."""
    if not plan.use_ce:
        work = _independent_collective(dev, ops, plan.comm)
        _gemm(dev, plan, ops)(ops.a, ops.b, ops.out)
        work.wait()
        return
    comm = dev.stream("comm", 0, plan.comm_priority)
    ready = dev.mark()
    with dev.on(comm):
        dev.wait(ready, site="bulk.inputs")
        (_bulk_gather_ce if ops.gemm.collective == Collective.ALL_GATHER else _bulk_scatter_ce)(dev, ops)
    _gemm(dev, plan, ops)(ops.a, ops.b, ops.out)
    _join_stream(dev, comm, site="bulk.join")


def _bulk_gather_ce(dev: Device, ops: Operands) -> None:
    """On the current (comm) stream: push our shard ``x`` straight into every peer's ``y`` (peer-mapped,
    `BULK_GATHERED`), copy it into our own, and wait for theirs.

    ``y`` is also written outside this protocol (a reference all-gather, the numerical check's poison), so
    a peer may push only once we say so: each rank first raises ACK at the call's epoch ("clear to send",
    after everything before the op), and a sender waits for it, not for the end of the previous call.
    """
    assert ops.x is not None and ops.y is not None
    p, r = dev.tp, dev.rank
    buf = ops.peer_buffer(dev, BULK_GATHERED, tuple(ops.y.shape), ops.y.dtype)
    assert buf.local.data_ptr() == ops.y.data_ptr(), "y must live in the bulk peer buffer (make_operands)"
    e = buf.next_epoch()
    for src in _senders(dev):
        buf.signal(src, ACK, e, site="bulk_gather.clear")
    for d in range(1, p):
        peer = (r + d) % p
        buf.wait(peer, ACK, e, site="bulk_gather.cleared")
        buf.push(peer, buf.peers[peer][ops.chunk(r)], ops.x, e, site="bulk_gather.ready")
    dev.copy(buf.local[ops.chunk(r)], ops.x)
    for src in _senders(dev):
        buf.wait(src, READY, e, site="bulk_gather.arrived")


def _bulk_scatter_ce(dev: Device, ops: Operands) -> None:
    """On the current (comm) stream: push each owner's rows of ``x`` into its receive slot, then add what
    arrived for our rows (the only SM work of a copy-engine reduce-scatter)."""
    assert ops.x is not None and ops.y is not None
    p, r = dev.tp, dev.rank
    box = ops.peer_buffer(dev, "bulk_received", (p, ops.rows, ops.gemm.hidden), ops.x.dtype)
    e = box.next_epoch()
    for d in range(1, p):
        owner = (r + d) % p
        box.wait(owner, ACK, e - 1, site="bulk_scatter.acked")
        box.push(owner, box.peers[owner][r], ops.x[ops.chunk(owner)], e, site="bulk_scatter.ready")
    dev.reduce_when_ready(ops.y, ops.x[ops.chunk(r)], box.local, box.flags[:p], epoch=e, site="bulk_scatter.arrived")
    for src in _senders(dev):
        box.signal(src, ACK, e, site="bulk_scatter.ack")


def _ring_ag(dev: Device, ops: Operands, plan: Plan) -> None:
    """Ring all-gather with send/recv: GEMM the chunk in hand while the next one arrives from the left.

    Transfers are issued from the comm stream, so forwarding a chunk waits for its arrival, never for a GEMM.
    With ``aggregate`` the partner ranks (r, r^1) first swap chunks, then pairs travel two ranks per step.
    """
    p, r = dev.tp, dev.rank
    gemm = _gemm(dev, plan, ops)
    gathered = ops.gathered()
    dev.copy(gathered[ops.chunk(r)], ops.a)
    comm = dev.stream("comm", 0, plan.comm_priority)
    lanes = Lanes(dev, plan.streams, plan.gemm_priority)
    start = dev.mark()
    with dev.on(comm):
        dev.wait(start)
        if plan.aggregate:
            partner = r ^ 1
            dev.exchange(
                [(gathered[ops.chunk(r)], partner)], [(gathered[ops.chunk(partner)], partner)], plan.comm
            ).wait()
    size = hop = 2 if plan.aggregate else 1
    steps = p // size

    def held(s: int) -> int:
        """First chunk in hand at step s (a pair of chunks when aggregating)."""
        return (r // size * size - size * s) % p

    for s in range(steps):
        with dev.on(comm):
            have = dev.mark()
            work = None
            if s + 1 < steps:
                work = dev.exchange(
                    [(gathered[ops.chunk(held(s), size)], (r + hop) % p)],
                    [(gathered[ops.chunk(held(s + 1), size)], (r - hop) % p)],
                    plan.comm,
                )
        with lanes.lane(s):
            dev.wait(have)
            rows = ops.chunk(held(s), size)
            gemm(gathered[rows], ops.b, ops.out[rows])
        if work is not None:
            with dev.on(comm):
                work.wait()
    lanes.join()
    _join_stream(dev, comm)


def _ring_rs(dev: Device, ops: Operands, plan: Plan) -> None:
    """Ring reduce-scatter with send/recv: GEMM each owner's chunk (others first, own last), send the partial
    to its owner as soon as it is done, and reduce what arrived at the end."""
    g, p, r = ops.gemm, dev.tp, dev.rank
    gemm = _gemm(dev, plan, ops)
    parts = ops.partials("parts", (p, ops.rows, g.n))
    received = ops.partials("received", (max(p - 1, 1), ops.rows, g.n))
    lanes = Lanes(dev, plan.streams, plan.gemm_priority)
    works = []
    for s in range(p):
        owner = (r + s + 1) % p
        with lanes.lane(s):
            gemm(ops.a[ops.chunk(owner)], ops.b, parts[s])
            if owner != r:  # issued from the lane, so the send waits for this chunk's GEMM only
                works.append(dev.exchange([(parts[s], owner)], [(received[s], (r - s - 1) % p)], plan.comm))
    lanes.join()
    for work in works:
        work.wait()
    dev.launch(lambda: _reduce(ops.out, parts[p - 1], list(received[: p - 1])))


def _reduce(out: torch.Tensor, own: torch.Tensor, received: list[torch.Tensor]) -> None:
    """out = own + every partial received for our chunk."""
    if len(received) == 1:
        torch.add(own, received[0], out=out)
    else:
        torch.sum(torch.stack([own, *received]), dim=0, out=out)


def _pipeline_rs(dev: Device, ops: Operands, plan: Plan) -> None:
    """TE pipeline: ``num_splits`` chunks along the output features; the RS of chunk j runs (NCCL, num_sm
    CTAs) while chunk j+1 computes.  With ``first_gemm`` the GEMM of chunk j+1 is issued before RS j.
    Each RS is issued from its chunk's lane, so it waits for that chunk's GEMM and nothing else."""
    g, k = ops.gemm, plan.num_splits
    width = g.n // k
    gemm = _gemm(dev, plan, ops)
    parts = ops.partials("parts", (k, g.tokens, width))
    scattered = ops.partials("scattered", (k, ops.rows, width)) if k > 1 else ops.out.unsqueeze(0)
    lanes = Lanes(dev, plan.streams, plan.gemm_priority)
    works: list[Any] = []

    def scatter(j: int) -> None:
        with lanes.lane(j):
            if plan.fp8_buf:
                works.append(fp8_reduce_scatter(dev, ops, scattered[j], parts[j], f"pipeline{j}", plan.comm))
            else:
                works.append(dev.reduce_scatter(scattered[j], parts[j], plan.comm))

    for j in range(k):
        with lanes.lane(j):
            gemm(ops.a, ops.b[:, j * width : (j + 1) * width], parts[j])
        if not plan.first_gemm:
            scatter(j)
        elif j > 0:
            scatter(j - 1)
    if plan.first_gemm:
        scatter(k - 1)
    lanes.join()
    for j, work in enumerate(works):
        work.wait()
        if k > 1:
            dev.copy(ops.out[:, j * width : (j + 1) * width], scattered[j])


def _push_shard(dev: Device, ops: Operands, plan: Plan) -> tuple[PeerBuffer, int, Any]:
    """On the comm stream: push the local shard straight into every peer's gather buffer (nearest consumer
    first) and raise its ready flag there.  Returns the buffer, the call's epoch and the comm stream."""
    g, p, r = ops.gemm, dev.tp, dev.rank
    buf = ops.peer_buffer(dev, "gathered_peer", (g.tokens, g.k), ops.a.dtype)
    e = buf.next_epoch()
    comm = dev.stream("comm", 0, plan.comm_priority)
    ready = dev.mark()
    with dev.on(comm):
        dev.wait(ready, site="push_shard.inputs")
        for d in range(1, p):
            peer = (r + d) % p
            # the peer finished reading what we pushed last call
            buf.wait(peer, ACK, e - 1, site="push_shard.acked")
            buf.push(peer, buf.peers[peer][ops.chunk(r)], ops.a, e, site="push_shard.ready")
    return buf, e, comm


def _senders(dev: Device) -> list[int]:
    """The peers that push to this rank, nearest first."""
    return [(dev.rank - s) % dev.tp for s in range(1, dev.tp)]


def _finish(dev: Device, comm: Any, buf: PeerBuffer, e: int) -> None:
    """End a copy-engine op: the main stream joins ``comm`` (our pushes have landed), then ``comm`` tells every
    peer, once the main stream has read what it pushed at epoch ``e``, that it may push again.

    The acknowledgement is queued on ``comm`` after the join, so the op's time does not include it: memops
    behind the last kernel of the main stream ended that stream 4-5 µs later on 2 x H200 (h5120 s2048
    proj_dgrad, proj_fprop and fc2_fprop, 2026-11-30).  Nothing waits for it but the peer's next push."""
    _join_stream(dev, comm, site="finish.join")
    read = dev.mark()
    with dev.on(comm):
        dev.wait(read, site="finish.read")
        for src in _senders(dev):
            buf.signal(src, ACK, e, site="finish.ack")


def _fused_pays(dev: Device, ops: Operands, plan: Plan) -> bool:
    """`ring_gemm.fused_pays` on CUDA; the emulated GPU always runs the fused kernel (nothing to win there)."""
    if not dev.is_cuda:
        return True
    g = ops.gemm
    gemm_sms = plan.gemm_sms or dev.sm_count
    return ring_gemm.fused_pays(ops.rows, g.n, g.k, chunks=dev.tp, dtype=ops.a.dtype, gemm_sms=gemm_sms)


def _fused_ring_ag(dev: Device, ops: Operands, plan: Plan) -> None:
    """Copy-engine all-gather into one launch of our GEMM that starts on the local shard and reads each
    peer's chunk once its ready flag arrives (`ring_gemm.gather_matmul`)."""
    buf, e, comm = _push_shard(dev, ops, plan)
    dev.gather_gemm(
        ops.a, buf, ops.b, ops.out, epoch=e, gemm_sms=plan.gemm_sms, site="fused_ag.arrived", scales=ops.scales
    )
    _keep_gathered(dev, ops, buf)
    _finish(dev, comm, buf, e)


def _keep_gathered(dev: Device, ops: Operands, buf: PeerBuffer) -> None:
    """On the main stream, after the GEMMs that waited for every chunk: the gathered input into `gathered`
    when the caller keeps it (`Operands.keep_gathered`); the peers' chunks are still ours until `_finish`."""
    if ops.keep_gathered:
        gathered = ops.gathered()
        dev.copy(gathered, buf.local)
        dev.copy(gathered[ops.chunk(dev.rank)], ops.a)


def _fused_ring_rs(dev: Device, ops: Operands, plan: Plan) -> None:
    """One launch of our GEMM over every chunk, the other owners' first (`ring_gemm.scatter_matmul`); the
    copy engine pushes each of their segments to its owner as soon as the kernel has counted it done."""
    g, p, r = ops.gemm, dev.tp, dev.rank
    tiling = ring_gemm.scatter_plan(
        ops.rows, g.n, g.k, chunks=p, dtype=ops.a.dtype, device=ops.a.device, gemm_sms=plan.gemm_sms
    )
    lanes = ring_gemm.max_segments(ops.rows)
    box = ops.peer_buffer(dev, "scattered_peer", (p, ops.rows, g.n), ops.out.dtype, lanes=lanes)
    parts = ops.partials("scatter_parts", (p - 1, ops.rows, g.n))
    counts = ops.counters(dev, "scatter_counts", (p - 1) * lanes)
    e = box.next_epoch()
    # The kernel is queued before the pushes that wait for it: should the comm stream share a hardware queue
    # with this one (more streams than CUDA_DEVICE_MAX_CONNECTIONS), the kernel is then ahead of them.
    dev.scatter_gemm(ops.a, ops.b, ops.out, parts=parts, counts=counts, box=box, epoch=e, plan=tiling,
                     site="fused_rs.arrived", scales=ops.scales)  # fmt: skip
    comm = dev.stream("comm", 0, plan.comm_priority)
    # No wait for the main stream: the pushes read only what the counts release, into slots that the owners'
    # acknowledgements release, and the main stream writes `parts` again only after joining them (`_finish`).
    with dev.on(comm):
        for s in range(p - 1):
            owner = (r + 1 + s) % p
            box.wait(owner, ACK, e - 1, site="fused_rs.acked")
            for j, seg in enumerate(tiling.segments):
                counts.wait(s * len(tiling.segments) + j, seg.tiles, site="fused_rs.counted")
                span = slice(seg.offset, seg.offset + seg.numel)  # contiguous in both (`ring_gemm.Segment`)
                box.push(owner, box.peers[owner][r].view(-1)[span], parts[s].view(-1)[span], e, lane=j,
                         site="fused_rs.ready")  # fmt: skip
    _finish(dev, comm, box, e)


def _ring_ag_ce(dev: Device, ops: Operands, plan: Plan) -> None:
    """Copy-engine all-gather: push the local shard straight into every peer's buffer, GEMM the local chunk
    meanwhile, then each peer's chunk as its ready flag arrives."""
    p, r = dev.tp, dev.rank
    gemm = _gemm(dev, plan, ops)
    buf, e, comm = _push_shard(dev, ops, plan)
    lanes = Lanes(dev, plan.streams, plan.gemm_priority)
    with lanes.lane(0):
        gemm(ops.a, ops.b, ops.out[ops.chunk(r)])
    for s in range(1, p):
        src = (r - s) % p
        with lanes.lane(s):
            buf.spin(src, READY, e, site="ring_ag_ce.arrived")
            gemm(buf.local[ops.chunk(src)], ops.b, ops.out[ops.chunk(src)])
    lanes.join()
    _keep_gathered(dev, ops, buf)
    _finish(dev, comm, buf, e)


def _ring_rs_ce(dev: Device, ops: Operands, plan: Plan) -> None:
    """Copy-engine reduce-scatter: GEMM each owner's chunk (others first), push the partial into the owner's
    receive slot as soon as it is done, GEMM our own chunk meanwhile, then add each partial as it arrives."""
    g, p, r = ops.gemm, dev.tp, dev.rank
    gemm = _gemm(dev, plan, ops)
    parts = ops.partials("parts", (p, ops.rows, g.n))
    box = ops.peer_buffer(dev, "received_peer", (p, ops.rows, g.n), ops.out.dtype)
    e = box.next_epoch()
    comm = dev.stream("comm", 0, plan.comm_priority)
    lanes = Lanes(dev, plan.streams, plan.gemm_priority)
    for s in range(p):
        owner = (r + s + 1) % p
        with lanes.lane(s):
            gemm(ops.a[ops.chunk(owner)], ops.b, parts[s])
            done = dev.mark()
        if owner != r:
            with dev.on(comm):
                dev.wait(done, site="ring_rs_ce.computed")
                box.wait(owner, ACK, e - 1, site="ring_rs_ce.acked")
                box.push(owner, box.peers[owner][r], parts[s], e, site="ring_rs_ce.ready")
    lanes.join()
    dev.reduce_when_ready(ops.out, parts[p - 1], box.local, box.flags[:p], epoch=e, site="ring_rs_ce.arrived")
    _finish(dev, comm, box, e)


def _join_stream(dev: Device, stream: Any, *, site: str | None = None) -> None:
    """Order the main stream after ``stream``: the op ends when its own pushes have landed too."""
    with dev.on(stream):
        done = dev.mark()
    dev.wait(done, site=site)
