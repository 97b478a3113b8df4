"""What every method's runner shares: its plan, its operands, its compute lanes, the serial
reference and the steps several methods take (docs/te_rules.md, Methods).  Each method runs in its own
module (``<method>_run``), written once for both backends.

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
Every wait and flag write of the copy-engine methods names its site, ``"<function>.<what>"`` (`races`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from overlap_runtime.config import Method, OverlapConfig, sm_driven_comm
from overlap_runtime.device import CommOptions, Device, Work
from overlap_runtime.fp8 import Scales, dequantized, quantize
from overlap_runtime.gemm import FP8
from overlap_runtime.knobs import DEFAULT_STREAMS
from overlap_runtime.methods import method_spec
from overlap_runtime.shape import Collective, SlotGemm
from overlap_runtime.symmetric import Counters, PeerBuffer

BULK_GATHERED = "bulk_gathered"
"""The peer buffer that a bulk all-gather's output ``y`` lives in (`bulk_run`)."""


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
            # On CPU the copy engine (emulated) runs only when asked for: use_ce unset is the send/recv ring.
            use_ce=config.overlaps and not sm_driven and (dev.is_cuda or config.use_ce is True),
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
        """What a call leaves for its caller: the output, the independent collective's, and the gathered input
        when the caller keeps it (`keep_gathered`)."""
        kept = [self.gathered()] if self.keep_gathered else []
        return [t for t in (self.out, self.y) if t is not None] + kept

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
    method_spec(plan.method).load_runner()(dev, ops, plan)


def serial(dev: Device, ops: Operands, *, fp8_buf: bool = False) -> None:
    """No overlap: the collective and the library GEMM back to back (the reference and the `none` method).

    ``fp8_buf``: the reduce-scatter goes through an FP8 buffer, quantized as a pipeline with ``fp8_buf``
    quantizes (the reference of such a config: the same quantization, so only the order of the sums differs)."""
    g = ops.gemm
    if not g.coupled:
        independent_collective(dev, ops, CommOptions()).wait()
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


def gemm_only(dev: Device, ops: Operands, *, kind: str = "cublas") -> None:
    """The full GEMM alone, all SMs: the library GEMM (``kind`` cublas) or ours (triton); `gemm_ms` is the
    faster of the two."""
    g = ops.gemm
    if g.coupled and g.collective == Collective.ALL_GATHER:
        a, out = ops.gathered(), ops.out
    elif g.coupled:
        a, out = ops.a, ops.partials("partial", (g.tokens, g.n))
    else:
        a, out = ops.a, ops.out
    if kind == "cublas":
        dev.library_gemm(a, ops.b, out, ops.scales)
    else:
        dev.gemm(a, ops.b, out, gemm_sms=None, kind=kind, scales=ops.scales)


def comm_only(dev: Device, ops: Operands) -> None:
    """The collective alone (NCCL, or shared memory on CPU): what `comm_ms` times."""
    g = ops.gemm
    if not g.coupled:
        independent_collective(dev, ops, CommOptions()).wait()
    elif g.collective == Collective.ALL_GATHER:
        dev.all_gather(ops.gathered(), ops.a).wait()
    else:
        dev.reduce_scatter(ops.out, ops.partials("partial", (g.tokens, g.n))).wait()


def independent_collective(dev: Device, ops: Operands, options: CommOptions) -> Any:
    assert ops.x is not None and ops.y is not None
    if ops.gemm.collective == Collective.ALL_GATHER:
        return dev.all_gather(ops.y, ops.x, options)
    return dev.reduce_scatter(ops.y, ops.x, options)


def chunk_gemm(dev: Device, plan: Plan, ops: Operands) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    return lambda a, b, out: dev.gemm(a, b, out, gemm_sms=plan.gemm_sms, kind=plan.gemm_kind, scales=ops.scales)


def senders(dev: Device) -> list[int]:
    """The peers that push to this rank, nearest first."""
    return [(dev.rank - s) % dev.tp for s in range(1, dev.tp)]


def join_stream(dev: Device, stream: Any, *, site: str | None = None) -> None:
    """Order the main stream after ``stream``: the op ends when its own pushes have landed too."""
    with dev.on(stream):
        done = dev.mark()
    dev.wait(done, site=site)
