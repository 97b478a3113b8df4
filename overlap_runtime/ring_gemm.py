"""Our persistent GEMM fused with a ring exchange: all tp chunks in ONE launch that moves chunks itself.

Splitting a GEMM into tp chunk launches costs each launch its last, partly idle wave (at h12288 s2048
qkv_fprop two M=1024 halves took 0.06 ms more than the whole: half the comm it was meant to hide).  One
persistent launch over every chunk's tiles has a single tail, and the chunk order lives in its tile order:

- `gather_matmul` (all-gather slots): ``out = all_gather(a) @ b``.  The tiles of the local shard come
  first, then each peer's chunk in ring order; a program's first tile of a peer chunk spins until that
  chunk's ready flag reaches the call's epoch (the copy engine pushed it and wrote the flag, see
  `symmetric`), then reads it.  The local shard is read in place, never copied into the gathered buffer.
- `scatter_matmul` (reduce-scatter slots): ``out = reduce_scatter(a @ b)``, our chunk.  The tiles of every
  other owner's chunk come first, stored into a local staging buffer and counted per segment (a block of
  tiles that the tile order finishes together, `Segment`; a release atomic, one tile late so that the stores
  have landed); the copy engine, stalled on
  each segment's count by a stream wait, pushes the segment into the owner's receive slot and raises the
  owner's flag for it.  Our own chunk comes last and its epilogue adds the partials received, each
  segment once its flags arrived: no separate reduction kernel, and the partials travel segment by
  segment while the GEMM computes.  (Storing partials straight into the
  owner's memory from the epilogue was tried first: the NVLink stores and the release fence behind them
  held each program up, 0.161 ms against 0.131 ms for cuBLAS chunks at h4096 proj_fprop on 2 x H200.)

On Hopper, `scatter_matmul` runs the Gluon port of its kernel (`ring_gluon`) where `gluon_plan` says it wins: it
reads the received partials under the MMAs, where the Triton kernel's epilogue waits for them.

Both kernels split their part-empty last round along K like `gemm.matmul` (`gemm.split_tail`) when the
tile config asks for it: those tiles are the last chunk's, the one that arrives (gather) or that we keep
(scatter) last, so the split shortens the part of the launch that no communication hides.

Layouts (row-major, per rank; P = tp, R = rows per chunk = T / P):
    gather:  a [R, K] local shard, ring [P*R, K] (chunk c = rows c*R.., written by peer c), b [K, N],
             out [P*R, N]
    scatter: a [P*R, K] (chunk c = the rows owner c keeps), b [K, N], out [R, N],
             parts [P-1, R, N] (staging, step s = owner rank+1+s), recv [P, R, N] (slot s = rank s's partial);
             each partial segment by segment, not row-major (`Segment.offset`)

Flags are int32 words of `symmetric.PeerBuffer` that only grow: the kernels wait for ``ready[src] >=
epoch`` (per segment for the scatter); the caller's copy-engine pushes wait until the owner acknowledged
the previous call, so a slot is never overwritten while its owner still reads it.

A flag that never comes spins forever: the group's watchdog kills such a call (`group`).  On CPU tensors
with ``TRITON_INTERPRET=1`` both kernels run in Triton's interpreter, with the peers' side prepared by
the caller (the tests do this).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from overlap_runtime import gemm, ring_gluon
from overlap_runtime.errors import InputError
from overlap_runtime.flag_kernels import wait_at_least

EVERY_CALL = ("epoch",)
"""Kernel arguments that change on every call: Triton must not specialize on them (it would compile new
variants when the epoch reaches 1 or a multiple of 16: seconds of compiling in the middle of a measurement,
which a fresh H200 host spent inside the timed repeats of h8192 s8192 qkv_fprop)."""


@triton.jit
def _ring_tile(tile, grid, GROUP_M: tl.constexpr):
    """(step, pid_m, pid_n) of ``tile``, numbered over all chunks in ring order: its ring step and its
    position in that step's chunk (``grid`` = a chunk's rows, columns of tiles)."""
    chunk_tiles = grid[0] * grid[1]
    pid_m, pid_n = gemm.tile_position(tile % chunk_tiles, grid, GROUP_M)
    return tile // chunk_tiles, pid_m, pid_n


@triton.jit
def _chunk_rows(t, chunk, row, R, stride_m, TMA: tl.constexpr):
    """(base, row) that address row ``row`` of chunk ``chunk`` (chunks of R rows) of ``t``: a descriptor
    indexes the whole tensor (chunk rows are whole tiles, the host checks), a pointer moves to the chunk."""
    if TMA:
        return t, chunk * R + row
    else:
        return t + chunk * R * stride_m, row


@triton.jit(do_not_specialize=EVERY_CALL)
def _gather_matmul_kernel(
    a,
    ring,
    b,
    c,
    scales,
    ready_ptr,
    scratch,
    dims,
    stride_a,
    stride_b,
    stride_c,
    rank,
    epoch,
    tail,
    C: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    pid, grid, whole_tiles, steps = gemm.tile_grid(dims, tail, C, CHUNKS)
    chunk_tiles = grid[0] * grid[1]
    # A loop per chunk, each flattened like `gemm.matmul`'s (the next tile's loads start under this tile's
    # last MMAs), with the chunk's flag awaited before it: one loop over every chunk cannot be flattened, since
    # its first loads of a new chunk would start ahead of the wait.  The loops share their shared memory (213 KB
    # at FP8 128x256x128, as one).  One H200, FP8, flags preset (`bench/ring_bench.py`, 2026-12-02): h4096 s4096
    # qkv_fprop from 1.047x to 1.021x of torch._scaled_mm's time, h5120 s2048 fc1_fprop from 1.174x to 1.123x.
    _gathered_rounds(a, b, c, scales, 0, rank, 0, whole_tiles, pid, steps, grid, dims, stride_a, stride_b, stride_c, C)
    for step in range(1, CHUNKS):
        src = (rank + CHUNKS - step) % CHUNKS
        lo = step * chunk_tiles
        if _first_tile(pid, lo, C.GEMM_SMS) < tl.minimum(lo + chunk_tiles, whole_tiles):  # a tile of this chunk
            wait_at_least(ready_ptr + src, epoch)
        _gathered_rounds(
            ring, b, c, scales, src, src, lo, whole_tiles, pid, steps, grid, dims, stride_a, stride_b, stride_c, C
        )
    # the last chunk's part-empty last round, cut along K as `gemm.split_tail` does; a compile-time
    # `if` of its own, so that kernels without a split tail do not even compile it
    if C.SPLIT_TAIL:  # noqa: SIM102
        if pid < tail[0] * tail[1]:
            t, ks = gemm.tail_part(pid, tail, dims[2], C.BLOCK_K)
            tile = whole_tiles + t
            arrived = _last_step(pid, whole_tiles, chunk_tiles, C.GEMM_SMS)
            acc, src, off = _gathered_tile(
                a, ring, b, scales, ready_ptr, tile, ks, arrived, grid, dims, stride_a, stride_b, rank, epoch, C, CHUNKS
            )
            last, total = gemm.add_parts(scratch, tail, acc, pid, t, C)
            if last:
                _store_gathered(c, total, src, off, dims, stride_c, C)


@triton.jit
def _first_tile(pid, lo, GEMM_SMS: tl.constexpr):
    """Program ``pid``'s first tile at or after tile ``lo`` of the persistent loop (tiles pid, pid + GEMM_SMS, ...)."""
    return pid + (tl.maximum(lo - pid, 0) + GEMM_SMS - 1) // GEMM_SMS * GEMM_SMS


@triton.jit
def _last_step(pid, whole_tiles, chunk_tiles, GEMM_SMS: tl.constexpr):
    """The ring step of program ``pid``'s last whole tile (0 when it has none): the last chunk it waited for."""
    last = pid + (whole_tiles - 1 - pid) // GEMM_SMS * GEMM_SMS
    return tl.where(pid < whole_tiles, last // chunk_tiles, 0)


@triton.jit
def _gathered_rounds(
    rows,
    b,
    c,
    scales,
    chunk,
    src,
    lo,
    whole_tiles,
    pid,
    steps,
    grid,
    dims,
    stride_a,
    stride_b,
    stride_c,
    C: tl.constexpr,
):
    """This program's whole tiles of the chunk whose tiles start at ``lo`` (numbered over all chunks): chunk
    ``chunk`` of ``rows`` (a's only one, or the ring's chunk src) times b, into out's chunk ``src``."""
    hi = tl.minimum(lo + grid[0] * grid[1], whole_tiles)
    for tile in tl.range(_first_tile(pid, lo, C.GEMM_SMS), hi, C.GEMM_SMS, flatten=C.TMA):
        pid_m, pid_n = gemm.tile_position(tile - lo, grid, C.GROUP_M)
        base, row0 = _chunk_rows(rows, chunk, pid_m * C.BLOCK_M, dims[0], stride_a[0], C.TMA)
        acc = gemm.partial_product(base, b, (row0, pid_n * C.BLOCK_N), (0, steps), dims, stride_a, stride_b, scales, C)
        _store_gathered(c, acc, src, (pid_m * C.BLOCK_M, pid_n * C.BLOCK_N), dims, stride_c, C)


@triton.jit
def _gathered_tile(
    a,
    ring,
    b,
    scales,
    ready_ptr,
    tile,
    ks,
    arrived,
    grid,
    dims,
    stride_a,
    stride_b,
    rank,
    epoch,
    C: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """K steps ``ks`` = [k_lo, k_hi) of ``tile`` (numbered over all chunks in ring order: the local shard's tiles
    first, read from ``a``, then chunk src = rank - step's, read from ``ring`` once it arrived; ``arrived`` =
    the last ring step this program has waited for).  Returns (acc, src, off): ``off`` = the tile's (row,
    column) offsets in its chunk."""
    step, pid_m, pid_n = _ring_tile(tile, grid, C.GROUP_M)
    src = (rank + CHUNKS - step) % CHUNKS
    if step > arrived:
        wait_at_least(ready_ptr + src, epoch)
    rows = a
    row0 = pid_m * C.BLOCK_M
    if step > 0:
        rows, row0 = _chunk_rows(ring, src, row0, dims[0], stride_a[0], C.TMA)
    acc = gemm.partial_product(rows, b, (row0, pid_n * C.BLOCK_N), ks, dims, stride_a, stride_b, scales, C)
    return acc, src, (pid_m * C.BLOCK_M, pid_n * C.BLOCK_N)


@triton.jit
def _store_gathered(c, acc, src, off, dims, stride_c, C: tl.constexpr):
    """Store a tile of chunk ``src`` (``off`` = its offsets in the chunk) into its rows of ``out``."""
    R, N, _ = dims
    rows, row0 = _chunk_rows(c, src, off[0], R, stride_c[0], C.TMA)
    gemm.store_tile(rows, (row0, off[1]), (R, N), stride_c, acc, C, C.TMA)


@triton.jit(do_not_specialize=EVERY_CALL)
def _scatter_matmul_kernel(
    a,
    b,
    c,
    scales,
    exchange,
    recv_tiles,
    scratch,
    dims,
    stride_a,
    stride_b,
    stride_c,
    rank,
    epoch,
    segments,
    tail,
    C: tl.constexpr,
    CHUNKS: tl.constexpr,
    RECV_TMA: tl.constexpr,
):
    pid, grid, whole_tiles, steps = gemm.tile_grid(dims, tail, C, CHUNKS)
    arrived = -1  # the last segment of our chunk whose received partials this program saw arrive
    # Not flattened like `gemm.matmul`'s loop, though its loads read only our own inputs: Triton 3.6 cannot
    # flatten a loop whose body branches at run time, and a branch-free version (a loop per epilogue, the
    # wait in PTX) compiled but ran 2.7-4.5x slower on an H200 (`bench/ring_bench.py`, 2026-11-30).  Nor do
    # flattened loops of the other owners' tiles alone pay (2026-12-02): the barrier between a staged tile's
    # stores and its count took them to 1.9-3.2x torch._scaled_mm's time at FP8, and without it the count
    # would not release what all threads stored.
    # A staged tile's count is released at the end of this program's next tile (`_finish_scattered`): its
    # stores then had a whole K loop to land, so the release no longer waits for them.  One H200, flags preset
    # (2026-12-03): proj_fprop 1.264x -> 1.234x cuBLAS's time at h2048 s8192 BF16, 1.356x -> 1.325x at FP8.
    # Asking L2 for the received partials before a tile's K loop (prefetch.global.L2) made them 0.5-1% slower.
    pending = -1  # the count of this program's staged tile not yet released (-1: none)
    for tile in tl.range(pid, whole_tiles, C.GEMM_SMS):
        step, pid_m, pid_n = _ring_tile(tile, grid, C.GROUP_M)
        acc = _owner_tile(a, b, scales, step, pid_m, pid_n, (0, steps), dims, stride_a, stride_b, rank, C, CHUNKS)
        arrived, pending = _finish_scattered(
            c, exchange, recv_tiles, acc, step, pid_m, pid_n, arrived, pending, dims, stride_c, rank, epoch, segments,
            C, CHUNKS, RECV_TMA,
        )  # fmt: skip
    if pending >= 0:
        _release(exchange[1], pending)
        pending = -1
    # our own chunk's part-empty last round, cut along K as `gemm.split_tail` does; a compile-time
    # `if` of its own, so that kernels without a split tail do not even compile it
    if C.SPLIT_TAIL:  # noqa: SIM102
        if pid < tail[0] * tail[1]:
            t, ks = gemm.tail_part(pid, tail, dims[2], C.BLOCK_K)
            step, pid_m, pid_n = _ring_tile(whole_tiles + t, grid, C.GROUP_M)
            acc = _owner_tile(a, b, scales, step, pid_m, pid_n, ks, dims, stride_a, stride_b, rank, C, CHUNKS)
            last, total = gemm.add_parts(scratch, tail, acc, pid, t, C)
            if last:
                arrived, pending = _finish_scattered(
                    c, exchange, recv_tiles, total, step, pid_m, pid_n, arrived, pending, dims, stride_c, rank, epoch,
                    segments, C, CHUNKS, RECV_TMA,
                )  # fmt: skip
                if pending >= 0:  # a tile of another owner's chunk (the tail can reach into it)
                    _release(exchange[1], pending)


@triton.jit
def _owner_tile(
    a, b, scales, step, pid_m, pid_n, ks, dims, stride_a, stride_b, rank, C: tl.constexpr, CHUNKS: tl.constexpr
):
    """K steps ``ks`` = [k_lo, k_hi) of tile (pid_m, pid_n) of ring step ``step`` (the other owners' chunks first, ours
    last), read from the rows of ``a`` its owner keeps."""
    rows, row0 = _chunk_rows(a, (rank + 1 + step) % CHUNKS, pid_m * C.BLOCK_M, dims[0], stride_a[0], C.TMA)
    return gemm.partial_product(rows, b, (row0, pid_n * C.BLOCK_N), ks, dims, stride_a, stride_b, scales, C)


@triton.jit
def _segment_tile(pid_m, pid_n, dims, segments, C: tl.constexpr):
    """Where tile (pid_m, pid_n) of a chunk lies in its segment: (seg, seg_count, seg_base, (seg_rows,
    seg_cols), off) = the segment's number, the chunk's segments, its first element in a partial, its shape
    and the tile's (row, column) offsets in it (see `_finish_scattered`)."""
    col_tiles = segments[1]
    R, N, _ = dims
    num_pid_m = (R + C.BLOCK_M - 1) // C.BLOCK_M
    num_pid_n = (N + C.BLOCK_N - 1) // C.BLOCK_N
    col_groups = (num_pid_n + col_tiles - 1) // col_tiles
    seg_count = (num_pid_m + C.GROUP_M - 1) // C.GROUP_M * col_groups
    seg = pid_m // C.GROUP_M * col_groups + pid_n // col_tiles
    row0 = pid_m // C.GROUP_M * (C.GROUP_M * C.BLOCK_M)
    col0 = pid_n // col_tiles * (col_tiles * C.BLOCK_N)
    seg_rows = tl.minimum(C.GROUP_M * C.BLOCK_M, R - row0)
    seg_cols = tl.minimum(col_tiles * C.BLOCK_N, N - col0)
    off = (pid_m * C.BLOCK_M - row0, pid_n * C.BLOCK_N - col0)
    return seg, seg_count, row0 * N + seg_rows * col0, (seg_rows, seg_cols), off


@triton.jit
def _release(counts_ptr, index):
    """Count one more finished tile at ``counts[index]``, releasing what every thread stored before."""
    tl.debug_barrier()  # the whole tile is stored before the count releases it to the copy engine
    tl.atomic_add(counts_ptr + index, 1, sem="release", scope="gpu")


@triton.jit
def _finish_scattered(
    c,
    exchange,
    recv_tiles,
    acc,
    step,
    pid_m,
    pid_n,
    arrived,
    pending,
    dims,
    stride_c,
    rank,
    epoch,
    segments,
    C: tl.constexpr,
    CHUNKS: tl.constexpr,
    RECV_TMA: tl.constexpr,
):
    """Hand a finished tile ``acc`` of ring step ``step`` on: another owner's partial is staged and counted
    for the copy engine; a tile of our own chunk gets the partials received for its segment added and is
    stored.  Returns (arrived, pending): the last segment whose flags this program has seen, and the count
    of a staged tile not yet released (-1: none).

    ``exchange`` = (parts, counts, recv, ready) as `scatter_matmul` takes them, ``segments`` = (lanes,
    col_tiles).  Segments (`Segment`) are GROUP_M tile rows by ``col_tiles`` tile columns, numbered in the
    grouped tile order (row group by row group, columns left to right within one), so a program meets them
    in rising order; partials keep each one contiguous, row-major at its own width (whole tiles: EVEN_*
    still hold).  With ``RECV_TMA`` every segment has the same shape and ``recv_tiles`` is a descriptor of
    the received partials as [sources * segments, rows, columns] (`_segment_tiles`), else the pointer
    ``recv``.
    """
    parts_ptr, counts_ptr, recv_ptr, ready_ptr = exchange
    lanes = segments[0]
    R, N, _ = dims
    seg, seg_count, seg_base, seg_shape, off = _segment_tile(pid_m, pid_n, dims, segments, C)
    if pending >= 0:  # before any wait below: a peer's wait may be for this very count
        _release(counts_ptr, pending)
        pending = -1
    if step < CHUNKS - 1:
        # A pointer store, not TMA's asynchronous one: the count must release finished data.
        staged = parts_ptr + step * R * N + seg_base
        gemm.store_tile(staged, off, seg_shape, (seg_shape[1], 1), acc, C, False)
        pending = step * seg_count + seg
    else:
        if seg > arrived:  # tiles only move forward, so one wait per segment and program
            for d in tl.static_range(1, CHUNKS):
                wait_at_least(ready_ptr + ((rank + CHUNKS - d) % CHUNKS) * lanes + seg, epoch)
            arrived = seg
        offs_m = off[0] + tl.arange(0, C.BLOCK_M)
        offs_n = off[1] + tl.arange(0, C.BLOCK_N)
        for d in tl.static_range(1, CHUNKS):
            src = (rank + CHUNKS - d) % CHUNKS
            if RECV_TMA:
                part = recv_tiles.load([src * seg_count + seg, off[0], off[1]]).reshape(C.BLOCK_M, C.BLOCK_N)
            else:
                part_ptrs = recv_ptr + src * R * N + seg_base + offs_m[:, None] * seg_shape[1] + offs_n[None, :]
                part = gemm.load_block(part_ptrs, offs_m < seg_shape[0], offs_n < seg_shape[1], C.EVEN_M, C.EVEN_N)
            acc += part.to(tl.float32)
        gemm.store_tile(c, (pid_m * C.BLOCK_M, pid_n * C.BLOCK_N), (R, N), stride_c, acc, C, C.TMA)
    return arrived, pending


def gather_matmul(
    a: torch.Tensor,
    ring: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    *,
    ready: torch.Tensor,
    epoch: int,
    rank: int,
    gemm_sms: int | None = None,
    config: gemm.GemmTileConfig | None = None,
    tma: bool = True,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = all_gather(a) @ b`` in one launch: chunk ``rank`` from ``a``, chunk c from ``ring`` once
    ``ready[c] >= epoch`` (see the module docstring for layouts; ``config``, ``tma`` and FP8 operands with
    ``scale_a`` (every chunk's) and ``scale_b`` as in `gemm.matmul`: the ring then moves FP8 rows)."""
    rows = a.shape[0]
    chunks = _chunks(ring, rows, "ring")
    gemm.check_operands(a, b, None)
    gemm.check_operands(ring, b, out)
    scales = gemm.check_scales(a, scale_a, scale_b)
    if ring.stride() != a.stride():
        raise InputError("ring", f"strides must equal a's {a.stride()}", ring.stride())
    _expect_flags("ready", ready, chunks)
    tiled = {"a": (a, "a"), "ring": (ring, "a"), "b": (b, "b"), "c": (out, "c")}
    _launch(
        _gather_matmul_kernel,
        tiled,
        a=a,
        b=b,
        out=out,
        chunks=chunks,
        gemm_sms=gemm_sms,
        config=config,
        tma=tma,
        scales=scales,
        ready_ptr=ready,
        rank=rank,
        epoch=epoch,
    )
    return out


SEGMENT_BYTES = 2 << 20
"""Size `scatter_plan` aims at per segment: a copy-engine push per ~2 MiB starts the reduce-scatter after the
first round of tiles, not after the whole chunk (one row group per chunk made it about as slow as serial at
h5120 s2048 proj_fprop on 2 x H200), while each push's fixed cost stays small beside its transfer."""

MAX_SEGMENTS = 16
"""At most this many segments per chunk unless the row groups alone are more."""

PUSH_FLOPS = 20e9
"""GEMM work (whole launch) per segment at least: ~25 us at the ~750 TFLOP/s of an H200 in bf16, several times a
push's fixed cost.  Pushes queue on one stream, and each costs ~5 us beyond its bytes: 8 segments instead of
2 took h4096 s4096 proj_fprop (0.1 ms of GEMM) from 0.115 to 0.148 ms on 2 x H200, while 12 segments took
h12288 s2048 proj_fprop (0.39 ms) from 0.429 to 0.422 and fc2_fprop from 76% to 83% hidden."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """Rows [row_start, row_stop) x columns [col_start, col_stop) of a chunk, whose ``tiles`` tiles
    `scatter_matmul` finishes together.  A partial holds it contiguously, row-major at its own width, from
    element ``offset``: one copy-engine push moves it."""

    row_start: int
    row_stop: int
    col_start: int
    col_stop: int
    tiles: int
    offset: int

    @property
    def numel(self) -> int:
        return (self.row_stop - self.row_start) * (self.col_stop - self.col_start)


@dataclass(frozen=True, kw_only=True, slots=True)
class ScatterPlan:
    """How one `scatter_matmul` call tiles a chunk: what the copy engine's waits need before the launch."""

    config: gemm.GemmTileConfig
    gemm_sms: int
    col_tiles: int
    """Tile columns per segment (the last one may have fewer)."""
    segments: tuple[Segment, ...]


def ring_config(rows: int, n: int, k: int, *, chunks: int, dtype: torch.dtype, gemm_sms: int) -> gemm.GemmTileConfig:
    """The tile config of a ring kernel over ``chunks`` chunks of ``rows`` x ``n`` (depth ``k``) on ``gemm_sms``
    programs when the caller gives none: `gemm.choose_config` of the whole problem, told its chunks."""
    return gemm.choose_config(chunks * rows, n, k, dtype, gemm_sms, chunks=chunks)


PLAIN_BELOW = 0.87
"""`gemm.balance` under which a fused all-gather falls back to the plain ring (`fused_pays`)."""


def fused_pays(rows: int, n: int, k: int, *, chunks: int, dtype: torch.dtype, gemm_sms: int) -> bool:
    """Whether a fused all-gather over ``chunks`` chunks of ``rows`` x ``n`` (depth ``k``) on ``gemm_sms`` SMs
    should run `gather_matmul`, rather than the plain ring: the library GEMM per chunk as each one arrives.

    The kernel costs our GEMM's time plus 1-3%, so it loses where our GEMM loses to the library: where its tiles
    leave many SMs idle (`gemm.balance` below `PLAIN_BELOW`).  One H200, flags preset (`bench/ring_bench.py`,
    2026-12-03): at FP8 the plain ring took 1.01x cuBLAS's time where the kernel took 1.12x on h5120 s2048
    fc1_fprop and fc2_dgrad (balance 0.86), 1.13x against 1.17x on proj_dgrad (0.74); at balance 0.89-0.91
    the two were within 2-5% either way (BF16 h5120 fc1_fprop: plain 1.14x, kernel 1.06x), so they stay fused.
    A problem of less than one round of tiles stays fused too (tests, latency-bound sizes).

    A reduce-scatter always stays fused: its plain ring adds a pass over the partials, and measured 1.00-1.55x
    cuBLAS's time where the kernel took 1.00-1.39x (faster only on two h5120 s2048 cases, by 4-6%)."""
    m = chunks * rows
    large = gemm.for_dtype(gemm.LARGE, dtype)
    if triton.cdiv(m, large.block_m) * triton.cdiv(n, large.block_n) < gemm_sms:
        return True
    return gemm.balance(m, n, k, dtype, gemm_sms) >= PLAIN_BELOW


def max_segments(rows: int) -> int:
    """An upper bound of `scatter_plan`'s default segments for any tile config (flag lanes are sized by it)."""
    smallest = min(cfg.block_m * cfg.group_m for cfg in (gemm.LARGE, gemm.MEDIUM, gemm.SMALL))
    return max(MAX_SEGMENTS, triton.cdiv(rows, smallest))


def scatter_plan(
    rows: int,
    n: int,
    k: int,
    *,
    chunks: int,
    dtype: torch.dtype,
    device: torch.device,
    gemm_sms: int | None,
    config: gemm.GemmTileConfig | None = None,
    col_groups: int | None = None,
) -> ScatterPlan:
    """The tile config and segments of `scatter_matmul` for chunks of ``rows`` x ``n`` (depth ``k``, ``dtype``
    operands, partials in its `gemm.out_dtype`): each row group of the tile order (``group_m`` tile rows) is
    cut into ``col_groups`` column groups (None: segments of about `SEGMENT_BYTES`, at most `MAX_SEGMENTS`, and
    at least `PUSH_FLOPS` of the launch's work each).

    The config is ``config`` when given.  Else, where `ring_gluon` runs on ``device``, takes this problem and
    beats the Triton kernel on it (`gluon_plan`), its 128x128 plan.  Else `ring_config`'s pick for the Triton
    kernel."""
    gemm_sms = gemm.resolve_gemm_sms(device, gemm_sms)
    if config is None:
        if ring_gluon.runs_on(device):
            plan = gluon_plan(rows, n, k, chunks=chunks, dtype=dtype, gemm_sms=gemm_sms, col_groups=col_groups)
            if plan is not None:
                return plan
        config = ring_config(rows, n, k, chunks=chunks, dtype=dtype, gemm_sms=gemm_sms)
    return _cut(rows, n, k, chunks=chunks, dtype=dtype, cfg=config, gemm_sms=gemm_sms, col_groups=col_groups)


GLUON_MAX_K_STEPS = {torch.bfloat16: 48, gemm.FP8: 64}
"""K steps of `ring_gluon` (``ring_gluon.block_k``) up to which `gluon_plan` takes its kernel over the Triton
kernel on 128x256 tiles.  The Gluon kernel reads the received partial under the tile's MMAs, where the Triton
kernel's read follows the K loop, exposed: a cost per tile that short K loops cannot amortize.  Its 128x128
ping-pong main loop, though, runs slower than Triton's 128x256 tiles at long K.  On one H100, flags preset, every
reduce-scatter slot of the eight default shapes (`bench/gluon_ring_check.py`, bench/results/gluon_ring_h100.json):
BF16 Gluon won at 16-40 steps (h2048 s8192 proj_fprop 1.173x the library's time against 1.260x) and lost at
54 and more (h2560 fc2_fprop, 54 steps: 1.109x against 1.067x; h8192 s8192 proj_fprop, 64: 1.121x against
1.041x); FP8 won up to 56 steps (h4096 fc2_fprop 1.054x against 1.067x) and lost at 112 and more (1.093x-1.134x
against 1.018x-1.037x), with one near tie at 32 (h2048 s8192 fc2_fprop, 1.130x against 1.122x).  Measured on an
H100, not an H200: the same SMs, with less memory bandwidth for the partials."""


def gluon_plan(
    rows: int,
    n: int,
    k: int,
    *,
    chunks: int,
    dtype: torch.dtype,
    gemm_sms: int,
    col_groups: int | None = None,
) -> ScatterPlan | None:
    """`gluon_tiling`'s plan where `ring_gluon`'s kernel takes the problem (`ring_gluon.takes_problem`) and
    beats the Triton kernel (`gluon_pays`), else None; `scatter_plan` asks only on a device it runs on
    (`ring_gluon.runs_on`)."""
    if not ring_gluon.takes_problem(rows, n, k, chunks=chunks, dtype=dtype):
        return None
    if not gluon_pays(rows, n, k, chunks=chunks, dtype=dtype, gemm_sms=gemm_sms):
        return None
    plan = gluon_tiling(rows, n, k, chunks=chunks, dtype=dtype, gemm_sms=gemm_sms, col_groups=col_groups)
    return plan if ring_gluon.takes_plan(plan) else None


def gluon_pays(rows: int, n: int, k: int, *, chunks: int, dtype: torch.dtype, gemm_sms: int) -> bool:
    """Whether `ring_gluon`'s kernel beats the Triton kernel on this problem: where its K loop is short
    (`GLUON_MAX_K_STEPS`), or where `ring_config`'s own pick is not 128x256 tiles in whole rounds (128x128 tiles,
    or a split tail: h5120 s2048 proj_fprop and fc2_fprop, 1.06x-1.12x the library's time against 1.13x-1.42x at
    either dtype on one H100)."""
    triton_pick = ring_config(rows, n, k, chunks=chunks, dtype=dtype, gemm_sms=gemm_sms)
    whole_large = triton_pick.block_n == gemm.LARGE.block_n and not triton_pick.split_tail
    return not whole_large or triton.cdiv(k, ring_gluon.block_k(dtype)) <= GLUON_MAX_K_STEPS[dtype]


def gluon_tiling(
    rows: int,
    n: int,
    k: int,
    *,
    chunks: int,
    dtype: torch.dtype,
    gemm_sms: int,
    col_groups: int | None = None,
) -> ScatterPlan:
    """The plan on `ring_gluon`'s 128x128 tiles: ``col_groups`` column groups per row group, else as many as
    `scatter_plan` would cut, down to a divisor of the tile columns (the kernel needs segments of one shape)."""
    cfg = gemm.for_dtype(gemm.MEDIUM, dtype)
    if col_groups is None:
        tiles_n = triton.cdiv(n, cfg.block_n)
        most = _col_groups(rows, n, k, chunks=chunks, dtype=dtype, cfg=cfg)
        col_groups = max(g for g in range(1, most + 1) if tiles_n % g == 0)
    return _cut(rows, n, k, chunks=chunks, dtype=dtype, cfg=cfg, gemm_sms=gemm_sms, col_groups=col_groups)


def _col_groups(rows: int, n: int, k: int, *, chunks: int, dtype: torch.dtype, cfg: gemm.GemmTileConfig) -> int:
    """`scatter_plan`'s default column groups per row group on ``cfg``'s tiles: segments of about
    `SEGMENT_BYTES`, at most `MAX_SEGMENTS`, and at least `PUSH_FLOPS` of the launch's work each."""
    tiles_n = triton.cdiv(n, cfg.block_n)
    row_groups = triton.cdiv(rows, cfg.block_m * cfg.group_m)
    by_bytes = rows * n * gemm.out_dtype(dtype).itemsize // row_groups // SEGMENT_BYTES
    by_work = int(2 * chunks * rows * n * k / PUSH_FLOPS) // row_groups
    return max(1, min(tiles_n, by_bytes, by_work, MAX_SEGMENTS // row_groups))


def _cut(
    rows: int,
    n: int,
    k: int,
    *,
    chunks: int,
    dtype: torch.dtype,
    cfg: gemm.GemmTileConfig,
    gemm_sms: int,
    col_groups: int | None,
) -> ScatterPlan:
    """`scatter_plan` on the tile config ``cfg``."""
    tiles_n = triton.cdiv(n, cfg.block_n)
    span = cfg.block_m * cfg.group_m
    if col_groups is None:
        col_groups = _col_groups(rows, n, k, chunks=chunks, dtype=dtype, cfg=cfg)
    elif not (isinstance(col_groups, int) and 1 <= col_groups <= tiles_n):
        raise InputError("col_groups", f"must be between 1 and the {tiles_n} tile columns", col_groups)
    col_tiles = triton.cdiv(tiles_n, col_groups)
    segments = []
    for row_start in range(0, rows, span):
        row_stop = min(row_start + span, rows)
        for col_start in range(0, n, col_tiles * cfg.block_n):
            col_stop = min(col_start + col_tiles * cfg.block_n, n)
            tiles = triton.cdiv(row_stop - row_start, cfg.block_m) * triton.cdiv(col_stop - col_start, cfg.block_n)
            offset = row_start * n + (row_stop - row_start) * col_start
            segments.append(Segment(row_start=row_start, row_stop=row_stop, col_start=col_start, col_stop=col_stop,
                                    tiles=tiles, offset=offset))  # fmt: skip
    return ScatterPlan(config=cfg, gemm_sms=gemm_sms, col_tiles=col_tiles, segments=tuple(segments))


def scatter_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    *,
    parts: torch.Tensor,
    counts: torch.Tensor,
    recv: torch.Tensor,
    ready: torch.Tensor,
    epoch: int,
    rank: int,
    plan: ScatterPlan,
    tma: bool = True,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    gluon: bool = True,
) -> None:
    """``out = reduce_scatter(a @ b)[rank]`` in one launch (see the module docstring; ``tma`` and FP8
    operands with ``scale_a`` and ``scale_b`` as in `gemm.matmul`).  `ring_gluon`'s kernel runs the call where
    it takes it (`ring_gluon.supports`: a Hopper GPU, ``plan`` from `gluon_plan`, ...), unless ``gluon`` is
    False (the benchmarks compare the two); else the Triton kernel.

    The partials are in out's dtype (bf16 for FP8 operands, already scaled).  ``parts`` [P-1, R, N]: our partials for the other owners, in step order (owner rank+1+s), each laid out
    segment by segment (`Segment.offset`); each stored tile bumps ``counts[s * S + j]`` of its segment j
    (S segments; release, so the copy engine that waits for a segment's count reads finished data).
    ``recv`` [P, R, N]: slot src = the partial that src sent us, in the same layout, segment j in once
    ``ready[src * lanes + j] >= epoch`` (lanes = ``ready.numel() // P``).
    """
    rows, n = out.shape
    chunks = _chunks(a, rows, "a")
    gemm.check_operands(a[:rows], b, out)
    scales = gemm.check_scales(a, scale_a, scale_b)
    segments = len(plan.segments)
    for name, t, shape in (("parts", parts, (chunks - 1, rows, n)), ("recv", recv, (chunks, rows, n))):
        if tuple(t.shape) != shape or t.dtype != out.dtype or not t.is_contiguous():
            raise InputError(name, f"must be a contiguous {out.dtype} tensor of shape {shape}", tuple(t.shape))
    _expect_flags("counts", counts, (chunks - 1) * segments)
    if ready.dtype != torch.int32 or not ready.is_contiguous() or ready.numel() < chunks * segments:
        raise InputError("ready", f"must hold at least {chunks * segments} contiguous int32 flags", tuple(ready.shape))
    if gluon and ring_gluon.supports(a, b, out, plan, tma):
        ring_gluon.scatter_matmul(a, b, out, parts=parts, counts=counts, recv=recv, ready=ready, epoch=epoch,
                                  rank=rank, plan=plan, scales=scales)  # fmt: skip
        return
    recv_tiles = _segment_tiles(recv, plan) if tma else recv
    _launch(
        _scatter_matmul_kernel,
        {"a": (a, "a"), "b": (b, "b"), "c": (out, "c")},
        a=a[:rows],
        b=b,
        out=out,
        chunks=chunks,
        gemm_sms=plan.gemm_sms,
        config=plan.config,
        tma=tma,
        scales=scales,
        exchange=(parts, counts, recv, ready),
        recv_tiles=recv_tiles,
        RECV_TMA=recv_tiles is not recv,
        rank=rank,
        epoch=epoch,
        segments=(ready.numel() // chunks, plan.col_tiles),
    )


def _segment_tiles(recv: torch.Tensor, plan: ScatterPlan) -> torch.Tensor | TensorDescriptor:
    """What the kernel reads ``recv`` [P, R, N] through: when every segment of ``plan`` has the same shape
    (whole row groups, equal column groups), a descriptor of its [BLOCK_M, BLOCK_N] tiles in recv viewed as
    [P * segments, rows, columns], else ``recv`` itself (pointer loads).  The copy engine then fetches a
    tile into shared memory in one transfer, where pointer loads went through registers and a shared-memory
    layout change: on one H200 at FP8 (`bench/ring_bench.py`'s cases, 2026-12-02) h4096 s4096 proj_fprop took
    1.231x torch._scaled_mm's time instead of 1.249x, h8192 s8192 proj_fprop 1.105x instead of 1.120x, h5120
    s2048 proj_fprop 1.310x instead of 1.335x (h8192 s4096 proj_fprop, 6-tile column groups of 32 tiles,
    keeps pointers)."""
    cfg, first = plan.config, plan.segments[0]
    shape = (first.row_stop - first.row_start, first.col_stop - first.col_start)
    uniform = all((s.row_stop - s.row_start, s.col_stop - s.col_start) == shape for s in plan.segments)
    if not uniform or shape[0] % cfg.block_m or shape[1] % cfg.block_n:
        return recv
    view = recv.view(-1, *shape)
    if not gemm.tma_layout(view):
        return recv
    return TensorDescriptor.from_tensor(view, [1, cfg.block_m, cfg.block_n])


def _launch(
    kernel: triton.JITFunction,
    tiled: dict[str, tuple[torch.Tensor, str]],
    *,
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    chunks: int,
    gemm_sms: int | None,
    config: gemm.GemmTileConfig | None,
    tma: bool,
    rank: int,
    **args: object,
) -> None:
    """Launch a ring kernel over ``chunks`` chunks of the problem ``a [R, K] @ b [K, N]`` (`gemm.launch`:
    ``tiled`` are the operands whose tiles it moves, ``rank`` and ``args`` its own arguments by name).  The
    tiles move by TMA when ``tma``, `gemm.tma_fits` allows and a chunk is whole tiles (a tile must not reach
    into the next chunk).
    """
    (rows, k), n = a.shape, b.shape[1]
    if not 0 <= rank < chunks:
        raise InputError("rank", f"must be between 0 and {chunks - 1}", rank)
    gemm.check_launchable(a)
    gemm_sms = gemm.resolve_gemm_sms(a.device, gemm_sms)
    cfg = config or ring_config(rows, n, k, chunks=chunks, dtype=a.dtype, gemm_sms=gemm_sms)
    gemm.launch(
        kernel,
        tiled,
        a=a,
        b=b,
        out=out,
        cfg=cfg,
        gemm_sms=gemm_sms,
        tma=tma and rows % cfg.block_m == 0,
        chunks=chunks,
        rank=rank,
        **args,
    )


def _chunks(t: torch.Tensor, rows: int, name: str) -> int:
    """How many chunks of ``rows`` rows ``t`` holds (at least 2: a ring needs a peer)."""
    if t.dim() != 2 or rows < 1 or t.shape[0] % rows or t.shape[0] // rows < 2:
        raise InputError(name, f"must be 2-D with rows a multiple (>= 2) of the chunk's {rows}", tuple(t.shape))
    return t.shape[0] // rows


def _expect_flags(name: str, flags: torch.Tensor, count: int) -> None:
    if flags.dtype != torch.int32 or flags.numel() != count or not flags.is_contiguous():
        raise InputError(name, f"must be {count} contiguous int32 flags", tuple(flags.shape))
