"""The fused reduce-scatter GEMM (`ring_gemm.scatter_matmul`) as a Gluon ping-pong kernel for Hopper (issue 33).

Triton's scatter kernel adds each received partial after its tile's K loop, where nothing hides the read, and
Triton 3.6 cannot start a load into shared memory early and wait for it later.  Gluon can, on Hopper: a
ping-pong kernel that added a partial to half the tiles (`bench/gluon_probe.py`'s ``gluon_pp_s5_half_add``,
the epilogue of the reduce-scatter at tp = 2) took 1.169x (BF16) and 1.053x (FP8) of cuBLAS's time at
h2048 s8192 proj_fprop on an H100, where our Triton kernel took 1.278x and 1.413x (bench/results/README.md).

`ring_gemm.scatter_matmul` runs it where `supports` holds, on the plans `ring_gemm.gluon_plan` cuts where it
beats the Triton kernel (short K loops, and where the Triton kernel's own tiles leave a part-empty last round).
On one H100 (bench/results/gluon_ring_h100.json) it computed every staged partial, count and output of
tests/test_ring_gluon.py's checks right, partials and flags that arrive after the launch included, and took
1.06x-1.17x of the library's time on the reduce-scatters with short K where the Triton kernel took 1.15x-1.42x.

`scatter_matmul` runs the same call as `ring_gemm.scatter_matmul`, on the inputs it validated, with the same
result: the same tile order (all chunks' tiles in ring order, program pid taking tiles pid, pid + programs,
...; grouped by the plan's GROUP_M), the other owners' partials staged into ``parts`` segment by segment
(`ring_gemm.Segment`) and each tile counted with a release atomic, our own chunk last, each of its tiles
stored into ``out`` with the received partials added once their segment's flags arrived.

The schedule (one program per SM at most, 128x128 tiles, a ring of five (a, b) K steps in shared memory):

- the K loader warp issues every tile's TMA loads into the ring, in tile order, as far ahead as the ring
  has free stages; a's rows come from the chunk that the tile's owner keeps.
- two MMA warpgroups take every other tile and take turns at the K loop (`pingpong_mma`), so that each
  one's epilogue runs under the other's MMAs.  The epilogue, by tile kind:
  - another owner's tile (ring steps 0..P-2): in bf16 through the warpgroup's epilogue buffer into a
    coalesced layout, stored into its step's partial with pointer stores, then counted (`_stage`) at once,
    not one tile late as the Triton kernel counts: the release's wait for the stores falls in the epilogue,
    which runs under the other warpgroup's MMAs;
  - a tile of our own chunk (the last step): the received partials added to the fp32 accumulator in
    source order, as the Triton kernel adds them, and the tile stored into ``out`` by TMA (`_finish_own`).
- the partial loader warp walks this program's tiles of our own chunk: it waits for each segment's flags
  (acquire loads at system scope as `flag_kernels.wait_at_least`'s, one wait per segment and program, then
  a proxy fence, since what they publish is read by TMA) and loads each source's partial tile by TMA into
  the epilogue buffer of the warpgroup that takes the tile, as soon as that warpgroup has freed it.  So the
  partial's read runs under the tile's MMAs.

The flag waits and partial loads have a warp of their own, not the K loader's: a late flag would otherwise
hold up the K loads of our own tiles (the Triton kernel computes a tile before it waits for its flags, and
so does this one), and with more than two chunks the partials take turns in the one epilogue buffer (shared
memory holds no more: five stages and two epilogue buffers fill 224 of the 227 KiB), so the second source's
load waits until the warpgroup has added the first, after the tile's K loop, where a waiting K loader would
stall the other warpgroup.

Staged tiles are stored with pointer stores, not TMA: a count must release finished data, and Triton 3.6's
`tma.store_wait` is ``cp.async.bulk.wait_group.read``, which waits until the shared memory was read, not
until the global writes are done (triton-lang/triton#10415 changed it later), so a count released after it
would not release the tile.  Pointer stores are generic-proxy writes that a barrier and the release atomic
order, as `ring_gemm._release` does.

Supported (`supports`), else the caller runs the Triton kernel: CUDA tensors on an sm_90 GPU with Gluon and
Triton 3.6 (Gluon is experimental, and its API changes between releases); BF16 operands with a row-major b,
or FP8 E4M3 operands with b K-major (``w.t()`` of a row-major weight, the layout an FP8 wgmma reads from
shared memory), bf16 out; TMA-addressable a, b and out; whole tiles (rows and n multiples of 128, k of the
128-byte K step: 64 BF16 or 128 FP8 elements); segments all of one shape (the partials are then read and
written through a view of their segments stacked, `_segment_tile`); and a plan of 128x128 tiles without a
split tail.  The plan's tiles, because its segments and the counts that the copy engine waits for were cut
from them: a 128x128 fp32 accumulator fits a warpgroup (128 of its 232 registers), while 128x256 tiles would
need two warpgroups per tile, not ping-pong; BLOCK_K, the five stages and the warps are this kernel's own,
GROUP_M the plan's.  The split tail is not ported: its parts would meet through global scratch as in
`gemm.split_tail`.
"""

# Gluon compiles these kernels from their Python AST: a list built with `*` does not compile, and an `if` on a
# constexpr is resolved at compile time where a conditional expression is not.
# ruff: noqa: RUF005, SIM108

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import triton

from overlap_runtime import gemm
from overlap_runtime.errors import InputError


def _uncompiled(fn: Callable[..., Any] | None = None, **_options: object) -> Any:
    """Stands in for Gluon's decorators where Gluon is missing: the kernels stay plain functions, which
    `supports` never lets run."""
    return fn if fn is not None else _uncompiled


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_ERROR: str | None = None
except ImportError as e:
    gluon = types.SimpleNamespace(jit=_uncompiled, constexpr_function=_uncompiled)
    GLUON_ERROR = f"{type(e).__name__}: {e}"

if TYPE_CHECKING:
    from overlap_runtime.ring_gemm import ScatterPlan

GLUON_TRITON = "3.6."
"""The Triton release whose Gluon these kernels are written in (`supports` requires it)."""

BLOCK_M = BLOCK_N = 128
"""The tile: what a plan must have been cut with (`supports`)."""
BLOCK_K_BYTES = 128
"""Bytes of each row per K step (64 BF16 or 128 FP8 elements), the 128-byte swizzle's width."""
STAGES = 5
"""K steps in the ring: five (160 KiB) and the two 32 KiB epilogue buffers fill shared memory.  On one H100 the
ping-pong probe with a partial added to every tile took 1.246x cuBLAS's time at 8192x2048x1024 with four stages,
1.217x with five (bench/results/gluon_probe_h100.json)."""
MMA_REGS = 232
"""Registers per thread of an MMA warpgroup (the accumulator takes 128); the loader warps get `LOADER_REGS`."""
LOADER_REGS = 40


@gluon.constexpr_function
def acc_layout(block_m, block_n, num_warps, in_dtype):
    """The wgmma accumulator's register layout: warpgroups stacked along M, one instruction as wide in N as
    the tile allows (at most 256) and reading 32 bytes of K per row of ``in_dtype`` operands."""
    warps = [4, num_warps // 4] if block_m < 64 * (num_warps // 4) else [num_warps, 1]
    n = min(256, block_n // warps[1])
    k = 256 // in_dtype.primitive_bitwidth
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, k])


@gluon.constexpr_function
def _store_layout(block_m, block_n, num_warps):
    """A register layout of 16 contiguous bytes of bf16 per thread, rows whole per warp: coalesced stores."""
    lanes_n = min(32, block_n // 8)
    return gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[32 // lanes_n, lanes_n], warps_per_cta=[num_warps, 1], order=[1, 0]
    )


@gluon.jit
def schedule(a_desc, out_desc, CHUNKS: gl.constexpr):
    """This program's share of the persistent grid over CHUNKS chunks of the output's tiles: (tile rows and
    tile columns of a chunk, K steps, first tile, stride, its tiles).  Counted on the output's tiles
    (``out_desc``: one chunk's output or partial), so that b may be K-major."""
    num_pid_m = gl.cdiv(out_desc.shape[0], out_desc.block_type.shape[0])
    num_pid_n = gl.cdiv(out_desc.shape[1], out_desc.block_type.shape[1])
    k_tiles = gl.cdiv(a_desc.shape[1], a_desc.block_type.shape[1])
    start = gl.program_id(0)
    step = gl.num_programs(0)
    return num_pid_m, num_pid_n, k_tiles, start, step, gl.cdiv(CHUNKS * num_pid_m * num_pid_n - start, step)


@gluon.jit
def tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(pid_m, pid_n) of ``tile`` in `gemm.tile_position`'s grouped order: GROUP_M rows of tiles walked
    column by column."""
    group = GROUP_M * num_pid_n
    first_m = (tile // group) * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % group) % size_m, (tile % group) // size_m


@gluon.jit
def fill_stage(
    load, kk, off_m, off_n, a_desc, b_desc, a_bufs, b_bufs, empty, ready, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr
):
    """A loader's ``load``-th TMA load into the ring (K step ``kk`` of the tile at a's row ``off_m`` and b's
    column ``off_n``), once the MMAs freed its stage; b is [K, N], or [N, K] with ``B_KMAJOR``."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    s = load % STAGES
    # a fresh barrier counts as freed once: the first pass over the ring does not wait
    mbarrier.wait(empty.index(s), ((load // STAGES) & 1) ^ 1)
    bar = ready.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K], bar, a_bufs.index(s))
    if B_KMAJOR:
        tma.async_copy_global_to_shared(b_desc, [off_n, kk * BLOCK_K], bar, b_bufs.index(s))
    else:
        tma.async_copy_global_to_shared(b_desc, [kk * BLOCK_K, off_n], bar, b_bufs.index(s))


@gluon.jit
def load_tile(desc, row, col, buf, free, full, phase):
    """TMA-load the tile of ``desc`` at (``row``, ``col``) into ``buf`` once barrier ``free`` completed its
    phase of parity ``phase``; barrier ``full`` completes when the tile has landed."""
    mbarrier.wait(free, phase)
    mbarrier.expect(full, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], full, buf)


@gluon.jit
def ring_mma(acc, a_bufs, b_bufs, ready, empty, load, kk, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr):
    """One K step of an MMA partition fed by a loader: wait for ring stage ``load``, issue its async wgmma (b
    read K-major where ``B_KMAJOR``), keep one in flight, and free the stage of the wgmma before it (which is
    done) for the loader.  ``kk``: the step's index in its tile (the first frees nothing)."""
    s = load % STAGES
    mbarrier.wait(ready.index(s), (load // STAGES) & 1)
    if B_KMAJOR:
        b_op = b_bufs.index(s).permute((1, 0))
    else:
        b_op = b_bufs.index(s)
    acc = warpgroup_mma(a_bufs.index(s), b_op, acc, use_acc=kk > 0, is_async=True)
    acc, _, _ = warpgroup_mma_wait(1, deps=(acc, a_bufs.index(s), b_bufs.index(s)))
    mbarrier.arrive(empty.index((load + STAGES - 1) % STAGES), pred=kk > 0)
    return acc


@gluon.jit
def pingpong_ring(a_desc, b_desc, c_desc, STAGES: gl.constexpr):
    """Ping-pong's shared memory: (ring, epilogue, turn) = the ring of STAGES (a, b) K steps and its barriers,
    (a_bufs, b_bufs, empty, ready) (``ready``: a stage loaded, ``empty``: freed by the MMAs); each MMA
    warpgroup's epilogue buffer and the barriers for what a loader puts in it, (c_bufs, p_empty, p_ready)
    (``p_ready``: landed, ``p_empty``: free again); and the warpgroups' turns at the K loop."""
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(p_empty.index(i), count=1)
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    return (a_bufs, b_bufs, empty, ready), (c_bufs, p_empty, p_ready), turn


@gluon.jit
def pingpong_mma(acc, ring, turn, t, k_tiles, ME: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr):
    """The K loop of this program's tile ``t`` on MMA warpgroup ME (every other tile: ``t % 2 == ME``), over
    ring stages t * k_tiles on: the finished accumulator.

    The two warpgroups take turns (``turn``: each arrives at the other's barrier once it has waited for its
    tile's last load).  Besides ordering the MMAs, the turn keeps the shared ring's parity waits sound: a
    warpgroup could otherwise reach a stage two loads ahead of the other's and pass on the older phase."""
    a_bufs, b_bufs, empty, ready = ring
    # a fresh barrier counts as passed once, so the first tile's wait passes
    mbarrier.wait(turn.index(ME), ((t // 2) & 1) ^ ME ^ 1)
    load = t * k_tiles
    for kk in range(k_tiles):
        acc = ring_mma(acc, a_bufs, b_bufs, ready, empty, load, kk, STAGES, B_KMAJOR)
        load += 1
    mbarrier.arrive(turn.index(1 - ME))
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((load + STAGES - 1) % STAGES))
    return acc


@gluon.jit
def scaled(acc, scale, SCALED: gl.constexpr, part=None):
    """The epilogue's value: ``acc`` (times ``scale`` for FP8 operands), plus ``part`` where given."""
    if SCALED:
        acc = acc * scale
    if part is not None:
        acc = acc + part
    return acc


def gemm_descriptors(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, block: tuple[int, int, int]
) -> tuple[Any, Any, Any]:
    """TMA descriptors of ``a [M, K] @ b [K, N] -> out`` (bf16) for ``block`` = (BLOCK_M, BLOCK_N, BLOCK_K) tiles:
    a's and out's row-major, b's as it is, or for FP8 b.T's (b K-major, which is what an FP8 wgmma reads)."""
    block_m, block_n, block_k = block
    layout = gl.NVMMASharedLayout.get_default_for
    fp8 = a.dtype == gemm.FP8
    in_dtype = gl.float8e4nv if fp8 else gl.bfloat16
    a_desc = TensorDescriptor.from_tensor(a, [block_m, block_k], layout([block_m, block_k], in_dtype))
    if fp8:
        b_desc = TensorDescriptor.from_tensor(b.t(), [block_n, block_k], layout([block_n, block_k], in_dtype))
    else:
        b_desc = TensorDescriptor.from_tensor(b, [block_k, block_n], layout([block_k, block_n], in_dtype))
    return a_desc, b_desc, tile_descriptor(out, block_m, block_n)


def tile_descriptor(t: torch.Tensor, block_m: int, block_n: int) -> Any:
    """A TMA descriptor of ``t``'s [block_m, block_n] bf16 tiles, in the layout of the epilogue buffers."""
    layout = gl.NVMMASharedLayout.get_default_for([block_m, block_n], gl.bfloat16)
    return TensorDescriptor.from_tensor(t, [block_m, block_n], layout)


@gluon.jit
def _ring_tile(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(step, pid_m, pid_n) of ``tile``, numbered over all chunks in ring order (`ring_gemm._ring_tile`)."""
    chunk_tiles = num_pid_m * num_pid_n
    pid_m, pid_n = tile_coords(tile % chunk_tiles, num_pid_m, num_pid_n, GROUP_M)
    return tile // chunk_tiles, pid_m, pid_n


@gluon.jit
def _first_own(start, step, num_pid_m, num_pid_n, CHUNKS: gl.constexpr):
    """The index among this program's tiles of its first tile of our own chunk, the last ring step (its
    number of tiles where it has none): the tiles before it are staged, those from it on are ours."""
    lo = (CHUNKS - 1) * num_pid_m * num_pid_n
    return (gl.maximum(lo - start, 0) + step - 1) // step


@gluon.jit
def _segment(pid_m, pid_n, num_pid_n, col_tiles, GROUP_M: gl.constexpr):
    """The segment of tile (pid_m, pid_n) of a chunk: GROUP_M tile rows by ``col_tiles`` tile columns, numbered
    row group by row group (`ring_gemm._segment_tile`)."""
    return pid_m // GROUP_M * (num_pid_n // col_tiles) + pid_n // col_tiles


@gluon.jit
def _segments(num_pid_m, num_pid_n, col_tiles, GROUP_M: gl.constexpr):
    """A chunk's segments."""
    return gl.cdiv(num_pid_m, GROUP_M) * (num_pid_n // col_tiles)


@gluon.jit
def _segment_tile(
    part,
    pid_m,
    pid_n,
    num_pid_m,
    num_pid_n,
    col_tiles,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    """(row, col) of tile (pid_m, pid_n) of partial ``part`` in the partials viewed as their segments stacked,
    [partials * segments * seg_rows, seg_cols]: every segment has one shape here, seg_rows = GROUP_M tile
    rows (the whole chunk's, where it has fewer) by seg_cols = ``col_tiles`` tile columns (`segment_shape`)."""
    seg_rows = gl.minimum(GROUP_M, num_pid_m) * BLOCK_M
    block = part * _segments(num_pid_m, num_pid_n, col_tiles, GROUP_M) + _segment(
        pid_m, pid_n, num_pid_n, col_tiles, GROUP_M
    )
    return block * seg_rows + pid_m % GROUP_M * BLOCK_M, pid_n % col_tiles * BLOCK_N


@gluon.jit
def _wait_at_least(flag_ptr, target):
    """`flag_kernels.wait_at_least` in Gluon: spin until the int32 at ``flag_ptr`` reaches ``target`` (acquire,
    system scope: what the flag publishes, written by a peer's copy engine, is visible after it)."""
    while gl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys") < target:
        pass


@gluon.jit
def _fence_proxy_async_global():
    """Order this thread's generic-proxy accesses of global memory before its later async-proxy (TMA) ones:
    the acquire of a flag before the TMA loads of what it published (PTX: accesses of one location through
    two proxies need a proxy fence; Gluon 3.6's `fence_async_shared` covers shared memory only)."""
    gl.inline_asm_elementwise(
        "fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _k_loader(
    a_desc,
    b_desc,
    c_desc,
    ring,
    rank,
    CHUNKS: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    B_KMAJOR: gl.constexpr,
):
    """The K loader warp: every tile's K steps into the ring, in tile order, from the rows of a that the
    tile's owner (rank + 1 + step) keeps."""
    a_bufs, b_bufs, empty, ready = ring
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    num_pid_m, num_pid_n, k_tiles, start, step, my_tiles = schedule(a_desc, c_desc, CHUNKS)
    load = 0
    for t in range(my_tiles):
        ring_step, pid_m, pid_n = _ring_tile(start + t * step, num_pid_m, num_pid_n, GROUP_M)
        off_m = ((rank + 1 + ring_step) % CHUNKS * num_pid_m + pid_m) * BLOCK_M
        for kk in range(k_tiles):
            fill_stage(load, kk, off_m, pid_n * BLOCK_N, a_desc, b_desc, a_bufs, b_bufs, empty, ready, STAGES, B_KMAJOR)
            load += 1


@gluon.jit
def _partial_loader(
    a_desc,
    c_desc,
    recv_desc,
    epilogue,
    ready_ptr,
    rank,
    epoch,
    lanes,
    col_tiles,
    CHUNKS: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    """The partial loader warp: for each of this program's tiles of our own chunk, once its segment's flags
    ``ready[src * lanes + seg] >= epoch`` arrived from every other source, the received partial tiles of the
    sources in order d = 1..CHUNKS-1 (src = rank - d) into the epilogue buffer of the warpgroup that takes
    the tile, each once the warpgroup freed it.

    A warpgroup frees its buffer at the start of each of its own tiles (its last tile's store has left it)
    and after adding each partial but the tile's last, so the j-th partial it gets waits for the j-th
    freeing: parity j & 1 of ``p_empty``, as its j-th ``p_ready``."""
    c_bufs, p_empty, p_ready = epilogue
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    num_pid_m, num_pid_n, _, start, step, my_tiles = schedule(a_desc, c_desc, CHUNKS)
    first_own = _first_own(start, step, num_pid_m, num_pid_n, CHUNKS)
    arrived = -1  # the last segment whose flags this program saw arrive: tiles only move forward
    for t in range(first_own, my_tiles):
        pid_m, pid_n = tile_coords((start + t * step) % (num_pid_m * num_pid_n), num_pid_m, num_pid_n, GROUP_M)
        seg = _segment(pid_m, pid_n, num_pid_n, col_tiles, GROUP_M)
        if seg > arrived:
            for d in gl.static_range(1, CHUNKS):
                _wait_at_least(ready_ptr + ((rank + CHUNKS - d) % CHUNKS) * lanes + seg, epoch)
            _fence_proxy_async_global()
            arrived = seg
        me = t % 2
        for d in gl.static_range(1, CHUNKS):
            src = (rank + CHUNKS - d) % CHUNKS
            row, col = _segment_tile(src, pid_m, pid_n, num_pid_m, num_pid_n, col_tiles, BLOCK_M, BLOCK_N, GROUP_M)
            got = (t - first_own) // 2 * (CHUNKS - 1) + d - 1
            load_tile(recv_desc, row, col, c_bufs.index(me), p_empty.index(me), p_ready.index(me), got & 1)


@gluon.jit
def _scatter_consumer(
    a_desc,
    c_desc,
    ring,
    epilogue,
    turn,
    staged,
    scales,
    col_tiles,
    ME: gl.constexpr,
    CHUNKS: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    B_KMAJOR: gl.constexpr,
):
    """MMA warpgroup ME: this program's tiles t with t % 2 == ME, the other owners' (staged) first, then ours.
    ``staged`` = (parts, counts), ``scales`` = (scale_a, scale_b) pointers for FP8 operands, else (None, None)."""
    c_bufs, p_empty, p_ready = epilogue
    parts_ptr, counts_ptr = staged
    scale_a, scale_b = scales
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    acc_l: gl.constexpr = acc_layout(BLOCK_M, BLOCK_N, 4, a_desc.dtype)
    SCALED: gl.constexpr = scale_a is not None
    num_pid_m, num_pid_n, k_tiles, start, step, my_tiles = schedule(a_desc, c_desc, CHUNKS)
    first_own = _first_own(start, step, num_pid_m, num_pid_n, CHUNKS)
    c_smem = c_bufs.index(ME)
    scale = 1.0
    if SCALED:
        scale = gl.load(scale_a) * gl.load(scale_b)
    # A fresh accumulator per tile, not a loop-carried one: a loop-carried accumulator stays live beside the
    # epilogue's scaled copy, and the two do not fit in registers.
    for t in range(ME, first_own, 2):
        ring_step, pid_m, pid_n = _ring_tile(start + t * step, num_pid_m, num_pid_n, GROUP_M)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_l)
        acc = pingpong_mma(acc, ring, turn, t, k_tiles, ME, STAGES, B_KMAJOR)
        row, col = _segment_tile(ring_step, pid_m, pid_n, num_pid_m, num_pid_n, col_tiles, BLOCK_M, BLOCK_N, GROUP_M)
        count = ring_step * _segments(num_pid_m, num_pid_n, col_tiles, GROUP_M) + _segment(
            pid_m, pid_n, num_pid_n, col_tiles, GROUP_M
        )
        _stage(scaled(acc, scale, SCALED), c_smem, parts_ptr, counts_ptr + count, row, col, col_tiles * BLOCK_N)
    for t in range(first_own + (first_own + ME) % 2, my_tiles, 2):
        pid_m, pid_n = tile_coords((start + t * step) % (num_pid_m * num_pid_n), num_pid_m, num_pid_n, GROUP_M)
        # the partial loader may fill the buffer once this warpgroup's last tile was stored from it
        tma.store_wait(pendings=0)
        mbarrier.arrive(p_empty.index(ME))
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_l)
        acc = pingpong_mma(acc, ring, turn, t, k_tiles, ME, STAGES, B_KMAJOR)
        got = (t - first_own) // 2 * (CHUNKS - 1)
        _finish_own(
            scaled(acc, scale, SCALED),
            c_smem,
            c_desc,
            p_empty.index(ME),
            p_ready.index(ME),
            got,
            pid_m * BLOCK_M,
            pid_n * BLOCK_N,
            CHUNKS,
        )
    tma.store_wait(pendings=0)


@gluon.jit
def _stage(acc, c_smem, parts_ptr, count_ptr, row, col, seg_cols):
    """Store a finished tile of another owner's chunk into the partials ``parts_ptr`` (segments stacked, rows
    of ``seg_cols``; the tile at (``row``, ``col``)), then count it at ``count_ptr`` for the copy engine.

    Through the epilogue buffer into rows of 16-byte vectors, stored with pointers; a barrier, then the release
    atomic (gpu scope, as `ring_gemm._release`): every thread's stores are done before the count publishes them.
    The proxy fence before the barrier orders this warpgroup's reads of the buffer before the partial loader's
    TMA writes into it."""
    BLOCK_M: gl.constexpr = c_smem.type.shape[0]
    BLOCK_N: gl.constexpr = c_smem.type.shape[1]
    layout: gl.constexpr = _store_layout(BLOCK_M, BLOCK_N, 4)
    c_smem.store(acc.to(c_smem.dtype))
    tile = c_smem.load(layout)
    rows = row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = col + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    gl.store(parts_ptr + rows[:, None] * seg_cols + cols[None, :], tile)
    fence_async_shared()
    gl.thread_barrier()
    gl.atomic_add(count_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def _finish_own(acc, c_smem, c_desc, p_empty, p_ready, got, off_m, off_n, CHUNKS: gl.constexpr):
    """Add the received partials to a finished tile of our own chunk, in source order, and store it into out
    at (``off_m``, ``off_n``) by TMA.  The partial loader puts them one by one into the epilogue buffer
    ``c_smem``: the first is the ``got``-th this warpgroup takes (`_partial_loader`), and the buffer is freed
    after each but the last, whose place the result takes."""
    for d in gl.static_range(1, CHUNKS):
        mbarrier.wait(p_ready, (got + d - 1) & 1)
        acc = acc + c_smem.load(acc.type.layout).to(gl.float32)
        if d < CHUNKS - 1:
            acc = _settled(acc)
            # the loader's TMA write of the next partial comes after every warp has read this one
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(p_empty)
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)


@gluon.jit
def _settled(x):
    """``x`` through a volatile identity, so that it is computed here: the compiler otherwise sinks each
    partial's adds below the next partial's barrier wait and load, and holds the partials in registers all at
    once (with four chunks the epilogue then spilled 728 bytes a thread)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit(do_not_specialize=["epoch"])  # as `ring_gemm.EVERY_CALL`
def _scatter_kernel(
    a_desc,
    b_desc,
    c_desc,
    recv_desc,
    parts_ptr,
    counts_ptr,
    ready_ptr,
    scale_a,
    scale_b,
    rank,
    epoch,
    lanes,
    col_tiles,
    CHUNKS: gl.constexpr,
    GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    B_KMAJOR: gl.constexpr,
    MMA_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    ring, epilogue, turn = pingpong_ring(a_desc, b_desc, c_desc, STAGES)
    staged = (parts_ptr, counts_ptr)
    scales = (scale_a, scale_b)
    # every partition's arguments spelled out: constexprs concatenated into a tuple reach it as run-time values
    gl.warp_specialize(
        [
            (
                _scatter_consumer,
                (a_desc, c_desc, ring, epilogue, turn, staged, scales, col_tiles, 0, CHUNKS, GROUP_M, STAGES, B_KMAJOR),
            ),
            (
                _scatter_consumer,
                (a_desc, c_desc, ring, epilogue, turn, staged, scales, col_tiles, 1, CHUNKS, GROUP_M, STAGES, B_KMAJOR),
            ),
            (_k_loader, (a_desc, b_desc, c_desc, ring, rank, CHUNKS, GROUP_M, STAGES, B_KMAJOR)),
            (
                _partial_loader,
                (a_desc, c_desc, recv_desc, epilogue, ready_ptr, rank, epoch, lanes, col_tiles, CHUNKS, GROUP_M),
            ),
        ],
        [4, 1, 1],
        [MMA_REGS, LOADER_REGS, LOADER_REGS],
    )


def block_k(dtype: torch.dtype) -> int:
    """The kernel's K step for ``dtype`` operands (`BLOCK_K_BYTES` of each row)."""
    return BLOCK_K_BYTES // dtype.itemsize


def segment_shape(plan: ScatterPlan) -> tuple[int, int] | None:
    """(rows, columns) of every segment of ``plan`` when they are all of one shape and whole 128x128 tiles, else
    None (`ring_gemm._segment_tiles` reads such partials through a descriptor too)."""
    first = plan.segments[0]
    shape = (first.row_stop - first.row_start, first.col_stop - first.col_start)
    if any((s.row_stop - s.row_start, s.col_stop - s.col_start) != shape for s in plan.segments):
        return None
    return shape if shape[0] % BLOCK_M == 0 and shape[1] % BLOCK_N == 0 else None


def supports(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, plan: ScatterPlan, tma: bool) -> bool:
    """Whether `scatter_matmul` can run this `ring_gemm.scatter_matmul` call (validated arguments: a [P*R, K],
    b [K, N], out [R, N]; ``tma`` False asks for pointer loads): `handles` its operands and plan, on a device
    that runs the kernel (`runs_on`).  See the module docstring for what and why."""
    return tma and handles(a, b, out, plan) and runs_on(a.device)


def handles(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, plan: ScatterPlan) -> bool:
    """Whether the kernel takes these operands (dtypes, layouts, whole tiles) and ``plan`` (`takes_plan`),
    wherever they are."""
    (rows, n), k = out.shape, a.shape[1]
    if out.dtype != torch.bfloat16 or b.dtype != a.dtype or a.shape[0] % rows:
        return False
    if not takes_problem(rows, n, k, chunks=a.shape[0] // rows, dtype=a.dtype) or not takes_plan(plan):
        return False
    b_tiles = b.t() if a.dtype == gemm.FP8 else b
    return all(gemm.tma_layout(t) for t in (a, b_tiles, out))


def takes_problem(rows: int, n: int, k: int, *, chunks: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes ``chunks`` chunks of ``rows`` x ``n`` (depth ``k``) of ``dtype`` operands: BF16 or
    FP8, whole 128x128 tiles and whole K steps (`block_k`)."""
    if dtype not in (torch.bfloat16, gemm.FP8):
        return False
    if rows % BLOCK_M or n % BLOCK_N or k % block_k(dtype):
        return False
    return chunks * rows * n <= gemm.MAX_INT32_OFFSET  # the staged tiles' offsets in the partials are int32


def takes_plan(plan: ScatterPlan) -> bool:
    """Whether ``plan`` is cut as the kernel needs: 128x128 tiles, no split tail, segments of one shape."""
    cfg = plan.config
    return (cfg.block_m, cfg.block_n) == (BLOCK_M, BLOCK_N) and not cfg.split_tail and segment_shape(plan) is not None


def runs_on(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``: Gluon of `GLUON_TRITON` imported, and a CUDA device of compute
    capability 9.0 (Hopper)."""
    if GLUON_ERROR is not None or not triton.__version__.startswith(GLUON_TRITON):
        return False
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _hopper(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


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
    scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """`ring_gemm.scatter_matmul`'s call (``scales`` as `gemm.check_scales` returns them) where `supports` says
    this kernel runs it: the same layouts, counts and flags, on the current stream of a's device."""
    rows, n = out.shape
    chunks = a.shape[0] // rows
    shape = segment_shape(plan)
    if shape is None:
        raise InputError("plan", "must cut the chunk into segments of one shape, whole 128x128 tiles", plan.config)
    seg_cols = shape[1]
    a_desc, b_desc, c_desc = gemm_descriptors(a, b, out, (BLOCK_M, BLOCK_N, block_k(a.dtype)))
    scale_a, scale_b = scales if scales is not None else (None, None)
    tiles = chunks * (rows // BLOCK_M) * (n // BLOCK_N)
    # on a CUDA device, or compiled for one without launching (bench/sm90_compile.py)
    with torch.cuda.device(a.device) if a.device.type == "cuda" else contextlib.nullcontext():
        _scatter_kernel[(min(plan.gemm_sms, tiles),)](
            a_desc,
            b_desc,
            c_desc,
            tile_descriptor(recv.view(-1, seg_cols), BLOCK_M, BLOCK_N),
            parts,
            counts,
            ready,
            scale_a,
            scale_b,
            rank,
            epoch,
            ready.numel() // chunks,
            plan.col_tiles,
            CHUNKS=chunks,
            GROUP_M=plan.config.group_m,
            STAGES=STAGES,
            B_KMAJOR=a.dtype == gemm.FP8,
            MMA_REGS=MMA_REGS,
            LOADER_REGS=LOADER_REGS,
            num_warps=4,
        )
