"""Probe: can a Gluon kernel hide the fused reduce-scatter's read of the received partial (issue 33)?

Our Triton scatter kernel adds the received partial after each tile's K loop, and that read is exposed: on
one H100 a plain kernel took 57.6 us unflattened and 69.3 us with a TMA read of a bf16 [M, N] partial after
the K loop (8192x2048x1024 BF16, cuBLAS 52.9 us; bench/results/README.md).  Triton cannot start a load into
shared memory early and wait for it later; Gluon can.  This probe times, on one GPU, beside cuBLAS and our
`gemm.matmul`, persistent Hopper GEMMs written in Gluon, each with and without (``_add``) a bf16 partial tile
that it loads by TMA while the tile's MMAs run and adds before the store:

    gluon              one partition: TMA loads through a 3-stage ring, async wgmma, the next loads issued
                       under the current MMAs; the partial lands in the epilogue's buffer halfway through
                       the K loop (after the last tile's store left it)
    gluon_ws           warp-specialized: a loader warp keeps the ring full, two MMA warpgroups (128x256
                       tiles) run the wgmma and the epilogue; the partial as above
    gluon_ws_128       the same on 128x128 tiles and one MMA warpgroup, five stages
    gluon_ws_128_s4    four stages, and ``_add2``: the partial loaded at the tile's start into a ring of two
                       buffers of its own, so neither side ever waits for the other to free it
    gluon_pp           ping-pong, as cuBLAS's and CUTLASS's Hopper kernels schedule: 128x128 tiles, a loader
                       warp and two MMA warpgroups that take turns at the K loop over one ring (4 stages;
                       ``_s3``/``_s5``: 3 or 5), so each warpgroup's epilogue (the partial loaded into its own
                       epilogue buffer during its K loop, added, the tile stored) runs under the other's MMAs;
                       ``_half``: the partial added to the first half of the rows only, as the fused
                       reduce-scatter at tp = 2 adds received partials to its own chunk's tiles alone

and the library's own answer to the same question: ``cublas_addmm`` (BF16: cuBLAS with the partial as its C,
beta = 1) and ``cublas_then_add`` (FP8: cuBLASLt's FP8 GEMM takes no [M, N] addend, so a second kernel adds).

    python bench/gluon_probe.py [--dtype fp8] [--variants NAME,...] [--out X.json]

FP8 (E4M3 operands, bf16 out, scaled as `bench.timing.FP8_SCALES`) runs cuBLAS, ours and the ping-pong kernels:
the older variants read b N-major, which an FP8 wgmma does not take.
"""

# Gluon compiles these kernels from their Python AST: a list built with `*` does not compile, and an `if` on a
# constexpr is resolved at compile time, so it stays apart from the runtime test nested in it.
# ruff: noqa: RUF005, SIM102

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from bench.environment import environment  # noqa: E402
from bench.timing import (  # noqa: E402
    FP8_SCALES,
    Operands,
    l2_bytes,
    library,
    reference,
    rel_err,
    scales,
    time_interleaved,
)
from overlap_runtime import gemm  # noqa: E402
from overlap_runtime.ring_gluon import (  # noqa: E402
    acc_layout,
    fill_stage,
    gemm_descriptors,
    load_tile,
    pingpong_mma,
    pingpong_ring,
    ring_mma,
    scaled,
    schedule,
    tile_coords,
    tile_descriptor,
)

SHAPES = (
    (8192, 2048, 1024),
    (8192, 2560, 1280),
    (2048, 5120, 2560),
    (4096, 4096, 2048),
    (2048, 2560, 5120),
    (4096, 8192, 4096),
    (8192, 8192, 8192),
)
"""(m, n, k): h2048 s8192 proj_fprop (both chunks), h2560 s8192 and h5120 s2048 proj_fprop (the fused ring's
worst cases after it), h4096 s4096 proj_fprop, our worst plain layer shape, h8192 s4096 proj_fprop, a large
square."""


@gluon.jit
def _issue_load(load, total, a_desc, b_desc, c_desc, bars, a_bufs, b_bufs, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """TMA loads of this program's ``load``-th (a, b) K step, counted over all its tiles, into stage
    ``load % STAGES`` (predicated off past the last)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    num_pid_m, num_pid_n, k_tiles, start, step, _ = schedule(a_desc, c_desc, 1)
    valid = load < total
    t = load // k_tiles
    kk = load - t * k_tiles
    pid_m, pid_n = tile_coords(start + t * step, num_pid_m, num_pid_n, GROUP_M)
    s = load % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=valid)
    tma.async_copy_global_to_shared(a_desc, [pid_m * BLOCK_M, kk * BLOCK_K], bar, a_bufs.index(s), pred=valid)
    tma.async_copy_global_to_shared(b_desc, [kk * BLOCK_K, pid_n * BLOCK_N], bar, b_bufs.index(s), pred=valid)


@gluon.jit
def _probe_kernel(
    a_desc,
    b_desc,
    c_desc,
    p_desc,
    ADD: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    acc_l: gl.constexpr = acc_layout(BLOCK_M, BLOCK_N, num_warps, a_desc.dtype)
    num_pid_m, num_pid_n, k_tiles, start, step, my_tiles = schedule(a_desc, c_desc, 1)
    total = my_tiles * k_tiles

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    # one buffer for the tile's partial (loaded by TMA) and its result (stored by TMA): both do not fit
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.init(p_bar, count=1)
    for i in gl.static_range(STAGES - 1):
        _issue_load(i, total, a_desc, b_desc, c_desc, bars, a_bufs, b_bufs, STAGES, GROUP_M)

    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_l)
    load = 0
    for t in range(my_tiles):
        pid_m, pid_n = tile_coords(start + t * step, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kk in range(k_tiles):
            s = load % STAGES
            mbarrier.wait(bars.index(s), (load // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, use_acc=kk > 0, is_async=True)
            # one wgmma in flight: the one before it is done, so its stage takes the next load
            acc, _, _ = warpgroup_mma_wait(1, deps=(acc, a_bufs.index(s), b_bufs.index(s)))
            _issue_load(load + STAGES - 1, total, a_desc, b_desc, c_desc, bars, a_bufs, b_bufs, STAGES, GROUP_M)
            if ADD:
                if kk == k_tiles // 2:
                    # the last tile's store must have left the buffer the partial lands in
                    tma.store_wait(pendings=0)
                    mbarrier.expect(p_bar, p_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(p_desc, [off_m, off_n], p_bar, c_smem)
            load += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        if ADD:
            mbarrier.wait(p_bar, t & 1)
            part = c_smem.load(acc_l)
            out = (acc + part.to(gl.float32)).to(dtype)
        else:
            tma.store_wait(pendings=0)
            out = acc.to(dtype)
        c_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_loader(
    a_desc,
    b_desc,
    p_desc,
    a_bufs,
    b_bufs,
    p_bufs,
    empty,
    ready,
    p_empty,
    p_ready,
    ADD: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    P_BUFS: gl.constexpr,
):
    """The loader warp: every tile's (a, b) K steps into the ring, ahead of the MMAs by as many stages as are
    free, and with ADD the tile's partial: into the epilogue's buffer halfway through the tile once the MMA
    warps have stored the last tile from it (P_BUFS 0), or at the tile's start into a ring of P_BUFS buffers
    of its own."""
    BLOCK_M: gl.constexpr = p_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = p_desc.block_type.shape[1]
    num_pid_m, num_pid_n, k_tiles, start, step, my_tiles = schedule(a_desc, p_desc, 1)
    load = 0
    for t in range(my_tiles):
        pid_m, pid_n = tile_coords(start + t * step, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kk in range(k_tiles):
            fill_stage(load, kk, off_m, off_n, a_desc, b_desc, a_bufs, b_bufs, empty, ready, STAGES, False)
            if ADD:
                if P_BUFS == 0:
                    if kk == k_tiles // 2:
                        # after this step's load, so the MMA warps can reach the step where they free c_smem
                        load_tile(p_desc, off_m, off_n, p_bufs.index(0), p_empty.index(0), p_ready.index(0), t & 1)
                elif kk == 0:
                    # the buffer's last partial (P_BUFS tiles ago) was read long before: no wait in practice
                    pb = t % P_BUFS
                    phase = ((t // P_BUFS) & 1) ^ 1
                    load_tile(p_desc, off_m, off_n, p_bufs.index(pb), p_empty.index(pb), p_ready.index(pb), phase)
            load += 1


@gluon.jit
def _ws_mma(
    a_desc,
    b_desc,
    c_desc,
    a_bufs,
    b_bufs,
    c_smem,
    p_bufs,
    empty,
    ready,
    p_empty,
    p_ready,
    ADD: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    P_BUFS: gl.constexpr,
):
    """The MMA warps (the default partition): async wgmma over the ring, freeing each stage once the MMA after
    it was issued, then the epilogue (with ADD, the partial the loader put in ``p_bufs`` added first)."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    dtype: gl.constexpr = c_desc.dtype
    acc_l: gl.constexpr = acc_layout(BLOCK_M, BLOCK_N, gl.num_warps(), a_desc.dtype)
    num_pid_m, num_pid_n, k_tiles, start, step, my_tiles = schedule(a_desc, c_desc, 1)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_l)
    load = 0
    for t in range(my_tiles):
        pid_m, pid_n = tile_coords(start + t * step, num_pid_m, num_pid_n, GROUP_M)
        for kk in range(k_tiles):
            acc = ring_mma(acc, a_bufs, b_bufs, ready, empty, load, kk, STAGES, False)
            if ADD and P_BUFS == 0:
                if kk == k_tiles // 2:
                    tma.store_wait(pendings=0)
                    mbarrier.arrive(p_empty.index(0))
            load += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((load + STAGES - 1) % STAGES))
        if ADD:
            pb = t % gl.maximum(P_BUFS, 1)
            mbarrier.wait(p_ready.index(pb), (t // gl.maximum(P_BUFS, 1)) & 1)
            part = p_bufs.index(pb).load(acc_l)
            if P_BUFS > 0:
                mbarrier.arrive(p_empty.index(pb))
            out = (acc + part.to(gl.float32)).to(dtype)
        else:
            out = acc.to(dtype)
        if not (ADD and P_BUFS == 0):
            tma.store_wait(pendings=0)
        c_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_kernel(
    a_desc,
    b_desc,
    c_desc,
    p_desc,
    ADD: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    P_BUFS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = a_desc.dtype
    PB: gl.constexpr = max(P_BUFS, 1)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    if P_BUFS == 0:  # the partial lands in the epilogue's buffer
        p_bufs = c_smem._reinterpret(dtype, [1] + c_desc.block_type.shape, c_desc.layout)
    else:
        p_bufs = gl.allocate_shared_memory(dtype, [P_BUFS] + c_desc.block_type.shape, c_desc.layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [PB, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [PB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(PB):
        mbarrier.init(p_empty.index(i), count=1)
        mbarrier.init(p_ready.index(i), count=1)
    gl.warp_specialize(
        [
            (
                _ws_mma,
                (
                    a_desc,
                    b_desc,
                    c_desc,
                    a_bufs,
                    b_bufs,
                    c_smem,
                    p_bufs,
                    empty,
                    ready,
                    p_empty,
                    p_ready,
                    ADD,
                    STAGES,
                    GROUP_M,
                    P_BUFS,
                ),
            ),
            (
                _ws_loader,
                (
                    a_desc,
                    b_desc,
                    p_desc,
                    a_bufs,
                    b_bufs,
                    p_bufs,
                    empty,
                    ready,
                    p_empty,
                    p_ready,
                    ADD,
                    STAGES,
                    GROUP_M,
                    P_BUFS,
                ),
            ),
        ],
        [1],
        [LOADER_REGS],
    )


@gluon.jit
def _pp_loader(
    a_desc,
    b_desc,
    p_desc,
    ring,
    epilogue,
    own_rows,
    ADD: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    B_KMAJOR: gl.constexpr,
):
    """Ping-pong's loader warp: every tile's (a, b) K steps into the one ring, in tile order, and with ADD the
    partial of each tile in the first ``own_rows`` rows into its consumer's epilogue buffer once that consumer
    has stored its last tile from it.  ``p_desc`` has the output's shape and tiles (the output's own descriptor
    without ADD)."""
    a_bufs, b_bufs, empty, ready = ring
    c_bufs, p_empty, p_ready = epilogue
    BLOCK_M: gl.constexpr = p_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = p_desc.block_type.shape[1]
    num_pid_m, num_pid_n, k_tiles, start, step, my_tiles = schedule(a_desc, p_desc, 1)
    load = 0
    for t in range(my_tiles):
        pid_m, pid_n = tile_coords(start + t * step, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kk in range(k_tiles):
            fill_stage(load, kk, off_m, off_n, a_desc, b_desc, a_bufs, b_bufs, empty, ready, STAGES, B_KMAJOR)
            if ADD:
                if kk == 0:
                    # the consumer frees its buffer at every tile's start, its own or not, so the parity counts
                    # all of its tiles
                    if off_m < own_rows:
                        me = t % 2
                        phase = ((t // 2) & 1) ^ 1
                        load_tile(p_desc, off_m, off_n, c_bufs.index(me), p_empty.index(me), p_ready.index(me), phase)
            load += 1


@gluon.jit
def _pp_consumer(
    a_desc,
    b_desc,
    c_desc,
    ring,
    epilogue,
    turn,
    scale,
    own_rows,
    ME: gl.constexpr,
    ADD: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    B_KMAJOR: gl.constexpr,
    SCALED: gl.constexpr,
):
    """One of ping-pong's two MMA warpgroups: every other tile of the program (``ME``: the first or the second),
    so its epilogue (the partial added, the tile stored) runs under the other warpgroup's MMAs, which take turns
    at the K loop (`pingpong_mma`)."""
    c_bufs, p_empty, p_ready = epilogue
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    dtype: gl.constexpr = c_desc.dtype
    acc_l: gl.constexpr = acc_layout(BLOCK_M, BLOCK_N, 4, a_desc.dtype)
    num_pid_m, num_pid_n, k_tiles, start, step, my_tiles = schedule(a_desc, c_desc, 1)
    c_smem = c_bufs.index(ME)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_l)
    added = 0  # partials this warpgroup has taken: the parity of its buffer's ready barrier
    for t in range(ME, my_tiles, 2):
        pid_m, pid_n = tile_coords(start + t * step, num_pid_m, num_pid_n, GROUP_M)
        own = pid_m * BLOCK_M < own_rows
        # the partial lands in the buffer this warpgroup's last tile was stored from: that store must have left
        # it, a wait that falls while the other warpgroup has its turn at the K loop
        tma.store_wait(pendings=0)
        if ADD:
            mbarrier.arrive(p_empty.index(ME), pred=t >= 2)
        acc = pingpong_mma(acc, ring, turn, t, k_tiles, ME, STAGES, B_KMAJOR)
        if ADD:
            if own:
                mbarrier.wait(p_ready.index(ME), added & 1)
                added += 1
        # one expression, the scale applied inside it: a scaled copy of the loop-carried accumulator spills, as
        # does a branch on `own` with a result of each side; a tile not its own reads the buffer and drops it
        if ADD == 1:
            part = gl.where(own, c_smem.load(acc_l).to(gl.float32), 0.0)
            out = scaled(acc, scale, SCALED, part).to(dtype)
        else:
            out = scaled(acc, scale, SCALED).to(dtype)
        c_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _pp_kernel(
    a_desc,
    b_desc,
    c_desc,
    p_desc,
    scale,
    own_rows,
    ADD: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    B_KMAJOR: gl.constexpr,
    SCALED: gl.constexpr,
    MMA_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    ring, epilogue, turn = pingpong_ring(a_desc, b_desc, c_desc, STAGES)
    gl.warp_specialize(
        [
            (
                _pp_consumer,
                (
                    a_desc,
                    b_desc,
                    c_desc,
                    ring,
                    epilogue,
                    turn,
                    scale,
                    own_rows,
                    0,
                    ADD,
                    STAGES,
                    GROUP_M,
                    B_KMAJOR,
                    SCALED,
                ),
            ),
            (
                _pp_consumer,
                (
                    a_desc,
                    b_desc,
                    c_desc,
                    ring,
                    epilogue,
                    turn,
                    scale,
                    own_rows,
                    1,
                    ADD,
                    STAGES,
                    GROUP_M,
                    B_KMAJOR,
                    SCALED,
                ),
            ),
            (_pp_loader, (a_desc, b_desc, p_desc, ring, epilogue, own_rows, ADD, STAGES, GROUP_M, B_KMAJOR)),
        ],
        [4, 1],
        [MMA_REGS, LOADER_REGS],
    )


def _launch_args(a, b, out, partial, block):
    """The TMA descriptors of a, b, out and the partial (out's own without one) for ``block`` = (bm, bn, bk)
    tiles, and the persistent grid: one program per SM, at most one per tile.  An FP8 b comes as
    `bench.timing.Operands` makes it, a [K, N] view of a row-major [N, K], and is read K-major."""
    bm, bn, _ = block
    a_desc, b_desc, c_desc = gemm_descriptors(a, b, out, block)
    p_desc = tile_descriptor(partial, bm, bn) if partial is not None else c_desc
    tiles = triton.cdiv(out.shape[0], bm) * triton.cdiv(out.shape[1], bn)
    return (a_desc, b_desc, c_desc, p_desc), (min(gemm.device_sm_count(a.device), tiles),)


def pingpong_matmul(
    a, b, out, partial=None, *, added=True, own_rows=None, stages=4, group_m=8, mma_regs=232, loader_regs=40
):
    """``out = a @ b (+ partial)`` on 128x128 tiles, two MMA warpgroups taking turns (`_pp_kernel`).  FP8
    operands are scaled by `FP8_SCALES`.  ``added=False`` loads the partial as for the add but leaves it out:
    what its traffic alone costs.  ``own_rows``: only the tiles of the first so many rows take the partial, as
    the fused reduce-scatter adds received partials to its own chunk's tiles only (default: every row)."""
    fp8 = a.dtype == gemm.FP8
    descriptors, grid = _launch_args(a, b, out, partial, (128, 128, 128 if fp8 else 64))
    scale = FP8_SCALES[0] * FP8_SCALES[1] if fp8 else 1.0
    mode = 0 if partial is None else 1 if added else 2
    rows = out.shape[0] if own_rows is None else own_rows
    _pp_kernel[grid](*descriptors, scale, rows, mode, stages, group_m, fp8, fp8, mma_regs, loader_regs, num_warps=4)
    return out


def gluon_matmul(a, b, out, partial=None, *, ws=False, block=(128, 256, 64), stages=3, group_m=8, warps=8, p_bufs=0):
    descriptors, grid = _launch_args(a, b, out, partial, block)
    if ws:
        _ws_kernel[grid](*descriptors, partial is not None, stages, group_m, p_bufs, 40, num_warps=warps)
    else:
        _probe_kernel[grid](*descriptors, partial is not None, stages, group_m, num_warps=warps)
    return out


M128 = {"block": (128, 128, 64), "stages": 5, "warps": 4}
"""128x128 tiles on one warpgroup."""


def _variants(fp8: bool, part) -> dict:
    """The probe's variants for BF16 or FP8 operands; ``part(o)`` is the partial of the set whose output is o."""
    pingpong = {
        "gluon_pp": lambda a, b, o: pingpong_matmul(a, b, o),
        "gluon_pp_add": lambda a, b, o: pingpong_matmul(a, b, o, part(o)),
        "gluon_pp_s3_add": lambda a, b, o: pingpong_matmul(a, b, o, part(o), stages=3),
        "gluon_pp_s5_add": lambda a, b, o: pingpong_matmul(a, b, o, part(o), stages=5),
        "gluon_pp_s5": lambda a, b, o: pingpong_matmul(a, b, o, stages=5),
        "gluon_pp_s5_loaded": lambda a, b, o: pingpong_matmul(a, b, o, part(o), added=False, stages=5),
        # the fused reduce-scatter's epilogue at tp = 2: the received partial added to one chunk's tiles only
        "gluon_pp_s5_half_add": lambda a, b, o: pingpong_matmul(a, b, o, part(o), own_rows=o.shape[0] // 2, stages=5),
    }
    if fp8:
        return {
            "cublas": lambda a, b, o: library(a, b, o),
            "ours": lambda a, b, o: gemm.matmul(a, b, o, **scales(a)),
            # cuBLASLt's FP8 GEMM takes no [M, N] addend: the add is a second kernel
            "cublas_then_add": lambda a, b, o: library(a, b, o).add_(part(o)),
            **pingpong,
        }
    return {
        "cublas": lambda a, b, o: torch.mm(a, b, out=o),
        "ours": lambda a, b, o: gemm.matmul(a, b, o),
        "gluon": lambda a, b, o: gluon_matmul(a, b, o),
        "gluon_add": lambda a, b, o: gluon_matmul(a, b, o, part(o)),
        "gluon_ws": lambda a, b, o: gluon_matmul(a, b, o, ws=True),
        "gluon_ws_add": lambda a, b, o: gluon_matmul(a, b, o, part(o), ws=True),
        "gluon_ws_128": lambda a, b, o: gluon_matmul(a, b, o, ws=True, **M128),
        "gluon_ws_128_add": lambda a, b, o: gluon_matmul(a, b, o, part(o), ws=True, **M128),
        # four stages leave room for two partial buffers of their own (224 KiB of shared memory in all)
        "gluon_ws_128_s4": lambda a, b, o: gluon_matmul(a, b, o, ws=True, **(M128 | {"stages": 4})),
        "gluon_ws_128_add2": lambda a, b, o: gluon_matmul(
            a, b, o, part(o), ws=True, p_bufs=2, **(M128 | {"stages": 4})
        ),
        # cuBLAS with the partial as its C (beta = 1): the library's own fused add
        "cublas_addmm": lambda a, b, o: torch.addmm(part(o), a, b, out=o),
        **pingpong,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--variants", help="comma-separated names to time (default: all); cublas always runs")
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="operands (fp8: E4M3, bf16 out)")
    args = parser.parse_args()
    fp8 = args.dtype == "fp8"
    rows = []
    for m, n, k in SHAPES:
        ops = Operands(m, n, k, l2_bytes(), seed=0, dtype=gemm.FP8 if fp8 else torch.bfloat16)
        # one partial per operand set, rotating with them: a partial read from L2 would flatter the adds
        partials = {id(o): torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _, _, o in ops.sets}
        variants = _variants(fp8, lambda o, partials=partials: partials[id(o)])
        if args.variants:
            keep = {"cublas", *args.variants.split(",")}
            variants = {name: fn for name, fn in variants.items() if name in keep}
        a, b, o = ops.sets[0]
        ref = reference(a, b)
        errs = {}
        for name, fn in list(variants.items()):
            o.fill_(float("nan"))
            try:
                fn(a, b, o)
            except Exception as e:  # a variant that does not compile or launch here is reported, not timed
                print(f"{m}x{n}x{k} {name}: {type(e).__name__}: {str(e).strip()[-1500:]}", flush=True)
                del variants[name]
                continue
            want = ref + partials[id(o)].float() if "_add" in name else ref  # _add, _add2, addmm, then_add
            if "_half" in name:
                want[m // 2 :] = ref[m // 2 :]
            errs[name] = rel_err(o, want)
        times = time_interleaved(ops, variants, warmup=10, repeats=args.repeats)
        base = times["cublas"]["ms"]
        row = {"m": m, "n": n, "k": k, "rel_err": errs, "times": times}
        row["vs_cublas"] = {name: t["ms"] / base for name, t in times.items()}
        rows.append(row)
        print(
            f"{m}x{n}x{k}: "
            + "  ".join(f"{name} {t['ms'] * 1e3:7.1f} us ({row['vs_cublas'][name]:.3f}x)" for name, t in times.items())
            + "  errs "
            + " ".join(f"{name} {e:.1e}" for name, e in errs.items()),
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps({"env": environment(), "rows": rows}, indent=1, default=str) + "\n")
    bad = [r for r in rows if max(r["rel_err"].values()) > 1e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
