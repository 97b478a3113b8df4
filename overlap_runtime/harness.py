"""Timing and numerical checks inside each rank (the measurement contract: docs/measurement.md).

Every timed region starts with the ranks aligned (`Device.align`), is timed with CUDA events (CPU:
perf_counter) after warm-up, and is repeated; the slowest rank's time of each repeat counts and the
median of those is reported, with the spread as ``cv``.  Inputs are random (never zeros), different on
every rank, and rotate over at least two sets (on CUDA enough to exceed the L2 cache), so that no call sees
the inputs of the call before it.  Every config's output is compared with the serial reference computed from
the same inputs (`_check_numerics`).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from overlap_runtime.config import DeviceLimits, OverlapConfig, check_config, problem
from overlap_runtime.device import CudaDevice, Device, Timer
from overlap_runtime.emulation import HostDevice
from overlap_runtime.fp8 import E4M3_MAX
from overlap_runtime.gemm import FP8
from overlap_runtime.group import RankContext
from overlap_runtime.measurement import REL_ERR_LIMIT, Baselines, BaselineSource, Measurement
from overlap_runtime.methods.common import BULK_GATHERED, Operands, Plan, comm_only, gemm_only, run, serial
from overlap_runtime.races import slowed_streams
from overlap_runtime.shape import Collective, ModelShape, Slot, SlotGemm
from overlap_runtime.uncertainty import Series

ROTATE_BYTES = 128 << 20
"""Inputs rotate over enough sets to cover this many bytes: over twice an H200's 50 MB L2."""
MAX_SETS = 8
MIN_SETS = 2
"""Even where one set would cover the rotation's bytes: consecutive calls always see different inputs, so a
call that reads a buffer before its data arrived reads the last call's data, and the check sees it."""
OPERAND_CACHE = 2


def device_of(ctx: RankContext) -> Device:
    if "device" not in ctx.state:
        if ctx.backend == "cuda":
            # Work on our own stream, never the legacy default stream, whose implicit synchronization with
            # other streams would serialize the overlap (and can deadlock with stream-ordered flag waits).
            torch.cuda.set_stream(torch.cuda.Stream(device=ctx.device))
        kind = CudaDevice if ctx.backend == "cuda" else HostDevice
        ctx.state["device"] = kind(rank=ctx.rank, tp=ctx.tp, device=ctx.device)
    return ctx.state["device"]


def limits_task(ctx: RankContext) -> DeviceLimits | None:
    """The GPU's limits that configs are validated against (None on CPU)."""
    if ctx.backend != "cuda":
        return None
    return DeviceLimits(
        sm_count=torch.cuda.get_device_properties(ctx.device).multi_processor_count,
        priority_range=tuple(reversed(torch.cuda.Stream.priority_range())),
    )


FP8_SCALE_A = 0.75
FP8_SCALE_B = 0.5
"""FP8 inputs are E4M3 values of unit spread with dequantization scales ``FP8_SCALE_A * k**-0.25`` (one for
the whole gathered input, as TE's amax reduction over the group gives every shard one scale) and
``FP8_SCALE_B * (1 + rank / 4) * k**-0.25`` (each rank's own weight scale): products stay O(1) whatever K
is, and no scale is a power of two, so one dropped or applied twice shows in the numerical check."""
PARTIAL_SIGMAS = 8.0
"""An FP8 reduce-scatter buffer's scale maps this many standard deviations of a partial to E4M3's largest
value: no partial of these inputs comes near it (more than 8 sigma: about 1e-15 per element), and values
down to 2^-9 of it keep E4M3's full 3-bit mantissa."""


def fp8_scales(dev: Device, gemm: SlotGemm) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(scale_a, scale_b) of this rank's FP8 inputs and the partials' scale every rank shares (`FP8_SCALE_A`)."""
    k_term = gemm.k**-0.25
    scale_a = FP8_SCALE_A * k_term
    scale_b = [FP8_SCALE_B * (1 + r / 4) * k_term for r in range(dev.tp)]
    # A partial sums k products of unit-spread values: its spread is sqrt(k) * scale_a * scale_b.
    sigma = math.sqrt(gemm.k) * scale_a * max(scale_b)

    def one(value: float) -> torch.Tensor:
        return torch.tensor([value], dtype=torch.float32, device=dev.device)

    return (one(scale_a), one(scale_b[dev.rank])), one(PARTIAL_SIGMAS * sigma / E4M3_MAX)


def make_operands(dev: Device, gemm: SlotGemm, seed: int) -> tuple[Operands, list[tuple[torch.Tensor, ...]]]:
    """Output buffers and a list of rotating random input sets (a, b[, x]).

    fp8 shapes: a, b and a gathered x are E4M3 (`fp8_scales`), b column-major (``w.t()`` of a row-major
    weight, as TE holds it and ``torch._scaled_mm`` needs it); out and a reduce-scattered x are bf16 (on CPU
    too, so the emulated collectives move the dtypes the GPU's do)."""
    rows = gemm.tokens // gemm.tp
    gen = torch.Generator(device=dev.device).manual_seed(seed * 1000 + dev.rank)
    fp8 = gemm.dtype == "fp8"
    # bf16 shapes run fp32 on CPU: the reference and the methods then agree to rounding of fp32 sums.
    dtype = torch.bfloat16 if dev.is_cuda or fp8 else torch.float32
    scales, partial_scale = fp8_scales(dev, gemm) if fp8 else (None, None)

    def rand(*shape: int, quantized: bool = False) -> torch.Tensor:
        if quantized:  # unit spread, well inside E4M3's range; the scales size the products
            return torch.randn(shape, generator=gen, device=dev.device).to(FP8)
        # Scaled so the products stay O(1) whatever K is.
        return torch.randn(shape, generator=gen, device=dev.device, dtype=dtype) / math.sqrt(shape[-1])

    def weight() -> torch.Tensor:
        return rand(gemm.n, gemm.k, quantized=True).t() if fp8 else rand(gemm.k, gemm.n)

    if gemm.coupled and gemm.collective == Collective.ALL_GATHER:
        a_shape, out_shape = (rows, gemm.k), (gemm.tokens, gemm.n)
    elif gemm.coupled:
        a_shape, out_shape = (gemm.tokens, gemm.k), (rows, gemm.n)
    else:
        a_shape, out_shape = (gemm.m, gemm.k), (gemm.m, gemm.n)
    x_shape = y_shape = None
    if not gemm.coupled:
        full, shard = (gemm.tokens, gemm.hidden), (rows, gemm.hidden)
        x_shape, y_shape = (shard, full) if gemm.collective == Collective.ALL_GATHER else (full, shard)
    # At FP8 an all-gather moves the FP8 input (TE forces an FP8 buffer there), a reduce-scatter bf16.
    x_fp8 = fp8 and gemm.collective == Collective.ALL_GATHER
    in_bytes = FP8.itemsize if fp8 else 2
    x_bytes = math.prod(x_shape) * (in_bytes if x_fp8 else 2) if x_shape else 0
    set_bytes = (math.prod(a_shape) + gemm.k * gemm.n) * in_bytes + x_bytes
    n_sets = max(MIN_SETS, min(MAX_SETS, math.ceil(ROTATE_BYTES / set_bytes)) if dev.is_cuda else MIN_SETS)
    sets = [
        (rand(*a_shape, quantized=fp8), weight(), *([rand(*x_shape, quantized=x_fp8)] if x_shape else []))
        for _ in range(n_sets)
    ]
    out = torch.empty(out_shape, device=dev.device, dtype=dtype)
    ops = Operands(
        gemm=gemm,
        a=sets[0][0],
        b=sets[0][1],
        out=out,
        x=sets[0][2] if x_shape else None,
        scales=scales,
        partial_scale=partial_scale,
    )
    if y_shape and gemm.collective == Collective.ALL_GATHER:
        # Peer-mapped, as TE's userbuffer is: a copy-engine bulk all-gather pushes straight into it.
        ops.y = ops.peer_buffer(dev, BULK_GATHERED, y_shape, sets[0][2].dtype).local
    elif y_shape:
        ops.y = torch.empty(y_shape, device=dev.device, dtype=dtype)
    if gemm.coupled and gemm.collective == Collective.ALL_GATHER:
        # `gemm_only` reads the gathered input, which only a collective fills: random until then, never the
        # allocator's zeros (an H200 runs a GEMM of zeros 12-15% faster: its power draw depends on the data).
        ops.gathered().copy_(rand(gemm.tokens, gemm.k, quantized=fp8))
    return ops, sets


def cached_operands(
    ctx: RankContext, dev: Device, gemm: SlotGemm, seed: int
) -> tuple[Operands, list[tuple[torch.Tensor, ...]]]:
    """Operands reused by every config of one problem: inputs are generated once and the peer buffers
    (symmetric memory, rendezvous is collective and slow) are mapped once.  The latest two problems are kept (a dgrad slot has two: bulk and RS-dgrad)."""
    key = (gemm, seed)
    cache = ctx.state.setdefault("operands", {})
    if key not in cache:
        if len(cache) >= OPERAND_CACHE:
            del cache[next(iter(cache))]
        cache[key] = make_operands(dev, gemm, seed)
    return cache[key]


def _use(ops: Operands, inputs: tuple[torch.Tensor, ...]) -> None:
    ops.a, ops.b = inputs[0], inputs[1]
    if len(inputs) > 2:
        ops.x = inputs[2]


def _use_next(ops: Operands, sets: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Hand ``ops`` the input set after the one its last call took (`Operands.turn`, kept across regions and
    configs); returns it."""
    inputs = sets[ops.turn % len(sets)]
    ops.turn += 1
    _use(ops, inputs)
    return inputs


def time_region(
    dev: Device, ops: Operands, sets: list, fn: Callable[[], None], *, repeats: int, warmup: int
) -> list[float]:
    """`time_calls` of ``fn``, each call on the next of ``sets`` (`Operands.turn`)."""
    return time_calls(dev, lambda: _use_next(ops, sets), fn, repeats=repeats, warmup=warmup)


def time_calls(
    dev: Device, before: Callable[[], object], fn: Callable[[], None], *, repeats: int, warmup: int
) -> list[float]:
    """Per-repeat times of ``fn`` in ms, each the slowest rank's, ranks aligned before every repeat;
    ``before()`` runs ahead of each call, untimed (it hands the call its next inputs).

    The warm-up calls also time the host: each repeat's alignment sleeps long enough for this rank to queue
    all of ``fn`` (`Device.align`; its closing all-reduce holds every rank until the longest sleep is over),
    so on CUDA only the GPU's work is timed."""
    host_ms = []
    for _ in range(warmup):
        before()
        t0 = time.perf_counter()
        fn()
        host_ms.append((time.perf_counter() - t0) * 1e3)
    # The first call may compile kernels or create communicators: it says nothing about the next ones, and
    # the median ignores a later one that did.
    queue_ms = statistics.median(host_ms[1:] or host_ms) if host_ms else 0.0
    timers = [Timer(dev) for _ in range(repeats)]
    for timer in timers:
        before()
        dev.align(queue_ms)
        timer.start()
        fn()
        timer.stop()
    dev.synchronize()
    mine = torch.tensor([t.ms() for t in timers], dtype=torch.float64, device=dev.device)
    every = [torch.empty_like(mine) for _ in range(dev.tp)]
    dist.all_gather(every, mine, group=dev.pg)
    return torch.stack(every).max(dim=0).values.tolist()


def relative_error(dev: Device, got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """``‖got − want‖ / ‖want‖`` over all the tensors together, the worst rank's (inf when not finite)."""
    num = sum(float((g.double() - w.double()).norm() ** 2) for g, w in zip(got, want, strict=True))
    den = sum(float(w.double().norm() ** 2) for w in want)
    err = math.sqrt(num / den) if den > 0 else math.sqrt(num)
    worst = torch.tensor([err if math.isfinite(err) else math.inf], dtype=torch.float64, device=dev.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=dev.pg)
    return float(worst.item())


@dataclass(kw_only=True)
class Timed:
    """One timed thing's repeats as they accumulate, round after round, and where each round ran."""

    samples: list[float] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    def time(self, ctx: RankContext, dev: Device, ops: Operands, sets: list, fn: Callable[[], None], **timing) -> None:
        """One round: ``fn`` timed by `time_region`, at the group's next position."""
        self.time_calls(ctx, dev, lambda: _use_next(ops, sets), fn, **timing)

    def time_calls(
        self, ctx: RankContext, dev: Device, before: Callable[[], object], fn: Callable[[], None], **timing
    ) -> None:
        """One round: ``fn`` timed by `time_calls` (``before`` ahead of each call), at the group's next position."""
        position = ctx.state.get("timed_regions", 0)
        ctx.state["timed_regions"] = position + 1
        self.samples += time_calls(dev, before, fn, **timing)
        self.positions.append(position)

    def series(self) -> Series:
        return Series(samples=tuple(self.samples), positions=tuple(self.positions))


_BASELINES: tuple[tuple[str, Callable[[Device, Operands], None]], ...] = (
    ("gemm", gemm_only),
    ("gemm_ours", functools.partial(gemm_only, kind="triton")),
    ("comm", comm_only),
    ("serial", serial),
)
"""What a config is scored against, timed in this order: the library GEMM and ours (`Measurement.gemm_ms` is
the faster), ``comm_ms``, ``serial_ms``."""


@dataclass(kw_only=True)
class _Problem:
    """One problem's baselines as they are timed: on the operands of the first config that runs it."""

    ops: Operands
    sets: list
    timed: dict[str, Timed] = field(default_factory=lambda: {name: Timed() for name, _ in _BASELINES})

    def time(self, ctx: RankContext, dev: Device, **timing) -> None:
        for name, fn in _BASELINES:
            self.timed[name].time(ctx, dev, self.ops, self.sets, lambda fn=fn: fn(dev, self.ops), **timing)

    def baselines(self, source: BaselineSource) -> Baselines:
        return Baselines(
            source=source,
            collective=self.ops.gemm.collective,
            **{name: timed.series() for name, timed in self.timed.items()},
        )


@dataclass(kw_only=True)
class _Candidate:
    """One config being measured: its operands, plan, numerical error and timing samples."""

    config: OverlapConfig
    ops: Operands
    sets: list
    plan: Plan
    rel_err: float = math.nan
    timed: Timed = field(default_factory=Timed)

    def call(self, dev: Device) -> None:
        run(dev, self.ops, self.plan)


def measure_task(
    ctx: RankContext,
    shape: ModelShape,
    slot: Slot,
    configs: list[OverlapConfig],
    *,
    repeats: int = 20,
    warmup: int = 5,
    rounds: int = 1,
    seed: int = 0,
    baselines: BaselineSource = BaselineSource.SAME_ROUNDS,
) -> list[Measurement]:
    """Measure ``configs`` for ``slot`` of ``shape`` on this TP group; rank 0 returns the list, which is what
    the caller reads (`Runtime.measure_many`), and the other ranks an empty one: scoring the same samples
    again would cost each rank the bootstrap of every config's hidden interval.

    The configs are timed interleaved over ``rounds`` (A B C A B C ...), ``repeats`` per round, so slow drift
    of the machine (clocks, neighbours) hits every config alike.  Each config is scored against its own
    problem's GEMM, collective and serial run (a reduce-scatter dgrad against its reduce-scatter):
    `BaselineSource.SAME_ROUNDS` times them in every round after the configs (A B C gemm comm serial A B C
    gemm comm serial ...), `BaselineSource.CACHED` once per process and problem, after the first batch.
    """
    dev = device_of(ctx)
    limits = limits_task(ctx)
    candidates = []
    for config in configs:
        gemm = problem(shape, slot, config.method)
        check_config(config, gemm, backend=ctx.backend, limits=limits)
        ops, sets = cached_operands(ctx, dev, gemm, seed)
        candidates.append(_Candidate(config=config, ops=ops, sets=sets, plan=Plan.resolve(config, dev)))
    for c in candidates:
        c.rel_err = _check_numerics(dev, c)
    problems: dict[SlotGemm, _Problem] = {}
    for c in candidates:
        problems.setdefault(c.ops.gemm, _Problem(ops=c.ops, sets=c.sets))
    timing = {"repeats": repeats, "warmup": warmup}
    same_rounds = baselines == BaselineSource.SAME_ROUNDS
    for _ in range(rounds):
        for c in candidates:
            c.timed.time(ctx, dev, c.ops, c.sets, lambda c=c: c.call(dev), **timing)
        for p in problems.values() if same_rounds else ():
            p.time(ctx, dev, **timing)
    scored = {
        gemm: p.baselines(baselines) if same_rounds else _cached(ctx, dev, p, seed, timing)
        for gemm, p in problems.items()
    }
    if ctx.rank != 0:
        return []
    limit = REL_ERR_LIMIT[shape.dtype]
    return [
        Measurement.measured(
            overlap=c.timed.series(),
            baselines=scored[c.ops.gemm],
            rel_err=c.rel_err,
            valid=math.isfinite(c.rel_err) and c.rel_err <= limit,
        )
        for c in candidates
    ]


def _check_numerics(dev: Device, c: _Candidate, *, seed: int = 0) -> float:
    """Worst-rank relative error of back-to-back calls against the serial reference on the same inputs, under
    random delays (`Device.jittered`), one call per stream that `races.slowed_streams` slows in turn.

    Made to fail on a race, not only on wrong arithmetic: every buffer that a transfer or a chunk writes is
    poisoned first (`Operands.poison`, on every rank), so a read of anything this check's calls did not
    write shows as NaN; each call takes the input set after the last one's, so a read ahead of its data reads
    the last call's numbers; each call's inputs are written on the stream just before it, as the kernel that
    produced them would, so a transfer that does not wait for them moves the last call's; each call's
    outputs are copied out on the stream right after it, as the next kernel would read them, so a transfer
    that lands late, or a peer that overwrites a buffer still being read, shows in the copy."""
    ops = c.ops
    schedule = slowed_streams(dev.tp)
    turns = [_use_next(ops, c.sets) for _ in schedule]
    references: dict[int, list[torch.Tensor]] = {}
    for inputs in turns:
        if id(inputs) not in references:
            _use(ops, inputs)
            serial(dev, ops, fp8_buf=c.plan.fp8_buf)
            dev.synchronize()
            references[id(inputs)] = [t.clone() for t in ops.outputs()]
    dev.barrier()  # every rank's reference is done before any rank's poison: no transfer is in flight
    ops.poison(dev)
    dev.synchronize()
    dev.barrier()
    got, want = [], []
    with dev.jittered(seed):
        for inputs, slow in zip(turns, schedule, strict=True):
            with dev.slowed(slow[1] if slow and slow[0] == dev.rank else None):
                _stage(dev, ops, inputs)
                c.call(dev)
                got += [dev.copy(torch.empty_like(t), t) for t in ops.outputs()]
            want += references[id(inputs)]
        dev.synchronize()
    return relative_error(dev, got, want)


def _stage(dev: Device, ops: Operands, inputs: tuple[torch.Tensor, ...]) -> None:
    """Copy ``inputs`` into buffers of their own on the current stream and hand those to ``ops``."""
    staged = [_staged(dev, ops, i, t) for i, t in enumerate(inputs)]
    _use(ops, tuple(staged))


def _staged(dev: Device, ops: Operands, i: int, t: torch.Tensor) -> torch.Tensor:
    """A copy of input ``t`` in a buffer of its own, with ``t``'s strides (a column-major FP8 weight stays one)."""
    if _column_major(t):
        return dev.copy(ops.buffer(f"staged_{i}", tuple(t.t().shape), t.dtype).t(), t)
    return dev.copy(ops.buffer(f"staged_{i}", tuple(t.shape), t.dtype), t)


def _column_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(0) == 1 and t.stride(1) != 1


def _cached(ctx: RankContext, dev: Device, p: _Problem, seed: int, timing: dict) -> Baselines:
    """``p``'s baselines timed once per process and problem (one round), then reused: search trials' cheap
    reference, which says so (`BaselineSource.CACHED`)."""
    cache = ctx.state.setdefault("baselines", {})
    key = (p.ops.gemm, seed)
    if key not in cache:
        p.time(ctx, dev, **timing)
        cache[key] = p.baselines(BaselineSource.CACHED)
    return cache[key]
