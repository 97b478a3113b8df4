"""A persistent Triton GEMM whose SM count is an argument, and cuBLAS held to an SM count beside it.

Shape legend (row-major, as everywhere in `overlap_runtime`):
    a   [M, K]   left operand (tokens x in-features)
    b   [K, N]   right operand (in-features x out-features, i.e. a weight already transposed)
    out [M, N]   ``out[m, n] = sum_k a[m, k] * b[k, n]``, accumulated in fp32, stored in ``a.dtype``
                 (FP8 E4M3 operands: times ``scale_a * scale_b``, stored in bf16; see `matmul`)
Any of the three may be a strided view: a transpose (``w.t()``), a row slice, or a column slice of a
bigger buffer (``buf[:, 128:256]``, the chunk of a userbuffers communicator).  Strides go to the kernel
as they are; nothing is copied.  ``out`` is written in place when given and must not overlap ``a`` or
``b`` (not checked: overlapping views give undefined results).

The SM contract.  `matmul` launches ``min(gemm_sms, tiles)`` programs and each one loops over the
output tiles ``pid, pid + gemm_sms, ...`` (grouped, ``group_m`` rows of tiles at a time, for L2 reuse).
So ``gemm_sms`` is a *hard bound*: at most ``gemm_sms`` programs exist, so the GEMM never occupies more than
``gemm_sms`` SMs (the block scheduler puts them on idle SMs first; a 128x256 program with 8 warps and
~200 KB of shared memory fills an SM), and the others stay free for communication kernels.  `cublas_matmul` can only *ask* cuBLAS for fewer SMs: it sets PyTorch's SM
carve-out on the cuBLASLt path (the only path that reads it: docs/measurement.md, Holding a GEMM to
fewer SMs), a target that
cuBLASLt's heuristic may turn into a different kernel but that is no guarantee of the SMs it uses.

Tiles move by TMA (tensor descriptors built on the host) whenever every operand has unit stride in its
last dim and 16-byte aligned rows, the layouts the runtime uses; other views take pointer loads with masks.
With TMA the persistent loop is flattened (the next tile's loads start under this tile's last MMAs).

Measured on one H200 (132 SMs, torch 2.11, Triton 3.6, `bench/gemm_bench.py`, 2026-11-30): 128x256x64
tiles, 8 warps, 3 stages ran 8192^3 bf16 at 1.01x cuBLAS; at the median of the 41 TP=2 layer GEMMs of the
anchor shapes 0.99x cuBLAS (pointer loads had reached 0.973x), 0.82-0.96x on the M=2048 h5120 s2048 ones,
where a part-empty last round of tiles costs most (`split_tail` took them from 0.77-0.95x).  Held to 124 /
116 / 100 / 66 SMs it took 1.05 / 1.09 / 1.18 / 1.77x its full-chip time (cuBLASLt with the carve-out:
1.02 / 1.04 / 1.21 / 1.81x).

The last round.  ``tiles % gemm_sms`` tiles are left for the last round, which leaves the other SMs idle.
With ``split_tail`` (`choose_config` sets it where its cost model says it pays) each of those tiles is cut
along K over the idle programs and the parts are added by whichever part finishes last (`split_tail`).
An even stream-K spread of every K step over all programs was tried first and ran 1.7x slower per K step:
programs at unrelated K offsets of unrelated tiles share nothing in L2.

FP8 (`FP8` operands, per-tensor scales as TE's delayed and current scaling produce them): the same kernels,
SM bound and TMA loads, K steps of 128 (`for_dtype`), the scales applied to the fp32 accumulator before the
store; ``cublas_matmul``'s FP8 path is ``torch._scaled_mm``.  Compiled for sm_90 with Triton 3.6 the FP8
kernels issue ``wgmma ... e4m3.e4m3`` MMAs with the shared memory of bf16's (213 KB at 128x256); their
speed against ``torch._scaled_mm`` is `bench/gemm_bench.py --dtype fp8`'s to measure.

The kernel is launched on the current CUDA stream of ``a``'s device.  With ``TRITON_INTERPRET=1`` set
before this module is imported, it runs in Triton's interpreter on CPU tensors (the tests do this).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from overlap_runtime.errors import ConfigError, InputError

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Dtypes of `matmul` whose output is in the inputs' dtype; the accumulator is always fp32."""

FP8 = torch.float8_e4m3fn
"""FP8 operands (E4M3, as TE's delayed and current scaling quantize inputs and weights), with per-tensor
dequantization scales and a `FP8_OUT` output."""

FP8_OUT = torch.bfloat16
"""What a GEMM of FP8 operands writes."""

CPU_DEFAULT_GEMM_SMS = 4
"""Programs launched on CPU tensors (Triton's interpreter) when ``gemm_sms`` is None."""

SMEM_SLACK = 1024
"""Shared memory Triton adds to a TMA kernel's tiles (barriers; 32 bytes measured at 128x256x64)."""

MAX_INT32_OFFSET = 2**31 - 1
"""The kernel computes element offsets in int32: larger views are rejected, not silently wrapped."""

MAX_TAIL_SPLITS = 6
"""Most K parts `split_tail` cuts a tile into: each part costs a pipeline fill and an fp32 partial.  One H200
(2026-12-03), 3456x2560x8192 (6 tiles in the last round): 4 / 6 / 8 parts ran at 0.925 / 0.942 / 0.944 of
the library's speed at BF16, 0.861 / 0.863 / 0.853 at FP8."""

MIN_PART_STEPS = 8
"""Fewest K steps of one part of a `split_tail` tile: a shorter part is mostly its pipeline's fill."""

# Relative speed of one program per tile shape (tile flops per unit time, 128x256 = 1), used by
# `choose_config` to trade tile efficiency against idle SMs in the last wave.  From `bench/gemm_bench.py`
# on one H200 (2026-11-30): 128x128 (4 warps) ran at 0.92-0.97 of 128x256's rate on 8192^3 (0.97 with TMA)
# and beat it on 2048x2560x5120 (0.096 vs 0.113 ms with TMA); 64x128 ran at 0.59 (measured before the
# mask-free EVEN_* paths existed).  Re-check with the benchmark's sweep when the kernel changes.
_TILE_EFFICIENCY = {(128, 256): 1.0, (128, 128): 0.92, (64, 128): 0.59}

MAX_EARLY_WAITERS = 1 / 8
"""Share of a ring kernel's programs that `choose_config` lets start on a chunk still in flight."""

TAIL_FIXUP_STEPS = 22
"""What `split_tail`'s fix-up (storing and re-reading fp32 parts) adds, in K steps of the config's own tile: it
moves fp32 copies of the tile, so it grows with the tile's area.  15-20 us for 128x256 tiles on one H200, the
time of 22 of their K steps (`bench/gemm_bench.py` sweep on the h5120 s2048 shapes, 2026-11-30).  Charged at
128x256's size to 128x128 tiles too, it kept their split tails out where they win: on 2048x2560x5120 (one
H100, 2026-12-06) 4 parts of 128x256 took 12.8 us to fix up and 2 parts of 128x128 5.0 us, and the whole
GEMM took 91.6 us against 85.3 (cuBLAS 72.3)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True, slots=True)
class GemmTileConfig:
    """Tile shape and launch parameters of the persistent kernel (all Triton compile-time constants)."""

    block_m: int = 128
    """Rows of ``out`` per tile (power of two, >= 16)."""
    block_n: int = 256
    """Columns of ``out`` per tile (power of two, >= 16)."""
    block_k: int = 64
    """Depth of one step of the K loop (power of two, >= 16)."""
    num_warps: int = 8
    """Warps per program (1, 2, 4, 8 or 16)."""
    num_stages: int = 4
    """Software-pipelining depth of the K loop (>= 1); each stage holds one a- and one b-block in SMEM."""
    group_m: int = 8
    """Rows of tiles visited together by the grouped tile order (>= 1): the L2 reuse knob."""
    split_tail: bool = False
    """Cut the tiles of a part-empty last wave along K over the idle programs (`split_tail`)."""

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not _is_int(value) or value < 16 or value & (value - 1):
                raise ConfigError(name, "must be a power of two >= 16", value)
        if not _is_int(self.num_warps) or self.num_warps not in (1, 2, 4, 8, 16):
            raise ConfigError("num_warps", "must be one of 1, 2, 4, 8, 16", self.num_warps)
        for name in ("num_stages", "group_m"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(name, "must be an integer >= 1", value)
        if not isinstance(self.split_tail, bool):
            raise ConfigError("split_tail", "must be a bool", self.split_tail)

    def label(self) -> str:
        """Short name: ``128x256x64_w8_s4_g8`` (``_st`` appended with `split_tail`)."""
        st = "_st" if self.split_tail else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k}_w{self.num_warps}_s{self.num_stages}_g{self.group_m}{st}"


LARGE = GemmTileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4)
"""Large problems: cuBLAS parity at 8192^3 bf16 on H200 (bench/results/gemm_h200.json).  Four stages (192 KB)
fit beside the epilogue's [128, 128] staging half-tile in the 227 KB of shared memory (`store_tile`)."""
MEDIUM = GemmTileConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6)
"""When 128x256 tiles would leave many SMs idle in the last wave.  Six stages (192 KB) fit beside the staging
half-tile as LARGE's four do; on one H200 (2026-12-04, `bench/gemm_bench.py`'s worst layer shapes) they took
128x128 tiles from 0.917-0.955 to 0.956-0.984 of cuBLAS's speed at BF16 (2048x5120x2560, 8192x1280x2560,
3072x2048x8192) and from 0.893-0.971 to 0.935-0.997 of ``torch._scaled_mm`` at FP8."""
SMALL = GemmTileConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
"""Few tiles (small M or N)."""


def choose_config(m: int, n: int, k: int, dtype: torch.dtype, gemm_sms: int, *, chunks: int = 1) -> GemmTileConfig:
    """The tile config `matmul` and the ring kernels (`ring_gemm`, ``chunks`` = tp) use when the caller gives
    none.

    The heuristic: a persistent kernel finishes when its busiest program does, after ``ceil(tiles /
    gemm_sms)`` tiles of ``steps = ceil(k / block_k)`` K steps each, so a config costs ``rounds * steps *
    tile_area / efficiency`` (`_TILE_EFFICIENCY`).  With `split_tail` the last, part-empty round costs
    ``steps / splits`` plus the fix-up (`TAIL_FIXUP_STEPS`).  The cheapest of LARGE, MEDIUM and SMALL, each
    with and without a split tail, wins; ties go to the larger tile without split.  So big problems take
    128x256x64, and a split tail or 128x128 / 64x128 tiles take over when 128x256 tiles would leave most
    SMs idle in the last round.

    FP8 K steps are 128 deep (`_for_dtype`): a stage holds the same 128 bytes of each row as bf16's 64, so
    the same shared memory, and twice the MMA work per step.

    A ring kernel's tiles past its first chunk (m / ``chunks`` rows) wait for communication, so a config
    whose first chunk leaves more than `MAX_EARLY_WAITERS` of the programs waiting from the start is
    passed over when another one keeps them busy (at h5120 s2048 proj_dgrad on 2 x H200, 128x256 tiles
    with a split tail started 52 of 132 programs on the peer's chunk: 0.130 ms against 0.108 with 128x128).
    """
    return min(_costed_configs(m, n, k, dtype, gemm_sms, chunks=chunks), key=lambda choice: choice[:2])[2]


def balance(m: int, n: int, k: int, dtype: torch.dtype, gemm_sms: int) -> float:
    """How well `choose_config`'s pick keeps ``gemm_sms`` SMs busy on ``m x n x k``, by its own cost model: the
    work spread evenly at LARGE's rate over its cost (1: no idle SM in any round; h5120 s2048 proj_dgrad at
    TP=2, 160 tiles of 128x256 on 132 SMs: 0.80).  Where it is low, cuBLAS's finer tilings win: at BF16 on
    one H200, 0.89-0.91 went with our GEMM at 1.05-1.09x cuBLAS's time, 0.80 with 1.24x, and 0.97 with
    0.99-1.02x (`bench/gemm_bench.py` layer shapes, 2026-12-03)."""
    even = m * n * triton.cdiv(k, for_dtype(LARGE, dtype).block_k) / gemm_sms
    return even / min(cost for _, cost, _ in _costed_configs(m, n, k, dtype, gemm_sms))


def _costed_configs(
    m: int, n: int, k: int, dtype: torch.dtype, gemm_sms: int, *, chunks: int = 1
) -> list[tuple[bool, float, GemmTileConfig]]:
    """`choose_config`'s candidates: (starts programs on a chunk in flight, cost, config)."""
    choices = []
    for base in (LARGE, MEDIUM, SMALL):
        cfg = for_dtype(base, dtype)
        steps = max(1, triton.cdiv(k, cfg.block_k))
        area = cfg.block_m * cfg.block_n / _TILE_EFFICIENCY[(cfg.block_m, cfg.block_n)]
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        full, tail = divmod(tiles, gemm_sms)
        waiters = gemm_sms - triton.cdiv(m // chunks, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        early = chunks > 1 and waiters > gemm_sms * MAX_EARLY_WAITERS
        choices.append((early, (full + (tail > 0)) * steps * area, cfg))
        splits = tail_splits(tiles, gemm_sms, steps)
        if splits:
            cost = (full * steps + steps / splits) * area + TAIL_FIXUP_STEPS * cfg.block_m * cfg.block_n
            choices.append((early, cost, dataclasses.replace(cfg, split_tail=True)))
    # min() keeps the first of equal keys: ties go to the larger tile, then to no split
    return choices


class KernelConstants(NamedTuple):
    """The compile-time constants of one launch that our kernels and their helpers share, passed as one
    constexpr ``C`` (`launch` fills it).  A NamedTuple because Triton takes tuples, not dataclasses, as
    kernel arguments; a ring kernel's ``CHUNKS`` stays a constexpr of its own, since Triton 3.6 gives fields
    of a constexpr tuple to ``tl.static_range`` as plain ints, which it refuses."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    GEMM_SMS: int
    """Programs of a full round: the stride of the persistent tile loop."""
    FP32_IEEE: bool
    """fp32 operands: full fp32 products, not TF32 (the tests compare against float64)."""
    UPCAST: bool
    """Interpreter only: bf16 operands go to fp32 before `tl.dot` (it multiplies bf16 bit patterns, triton#11584)."""
    EVEN_M: bool
    """M is a multiple of BLOCK_M: no row masks (EVEN_N, EVEN_K likewise)."""
    EVEN_N: bool
    EVEN_K: bool
    TMA: bool
    """The tiled operands are tensor descriptors, else pointers with strides."""
    B_KMAJOR: bool
    """With TMA, b is column-major and its descriptor is b.T's ([BLOCK_N, BLOCK_K] tiles, transposed as loaded):
    the layout that the FP8 MMA reads from shared memory as it is (`_b_kmajor`)."""
    SPLIT_TAIL: bool
    """The last round is cut along K (`split_tail`)."""


def for_dtype(cfg: GemmTileConfig, dtype: torch.dtype) -> GemmTileConfig:
    """A bf16 tile config adapted to ``dtype`` operands: K steps of the same 128 bytes (64 bf16, 128 FP8 or
    32 fp32 elements), and for fp32 (tests) 3 stages, which then fit in shared memory."""
    if dtype == FP8:
        return dataclasses.replace(cfg, block_k=cfg.block_k * 2)
    if dtype == torch.float32:
        return dataclasses.replace(cfg, block_k=cfg.block_k // 2, num_stages=3)
    return cfg


@triton.jit
def tile_grid(dims, tail, C: tl.constexpr, CHUNKS: tl.constexpr):
    """The opening of every persistent kernel of ours, over ``CHUNKS`` chunks of ``dims`` = (M, N, K):
    (pid, grid, whole_tiles, steps) = this program, one chunk's grid of tiles (rows, columns), the tiles that
    the persistent loop walks (all chunks' but the ``tail[0]`` of a split tail) and a whole tile's K steps."""
    M, N, K = dims
    pid = tl.program_id(axis=0)
    num_pid_m = (M + C.BLOCK_M - 1) // C.BLOCK_M
    num_pid_n = (N + C.BLOCK_N - 1) // C.BLOCK_N
    whole_tiles = CHUNKS * (num_pid_m * num_pid_n) - tail[0]
    steps = (K + C.BLOCK_K - 1) // C.BLOCK_K
    return pid, (num_pid_m, num_pid_n), whole_tiles, steps


@triton.jit
def load_block(ptrs, rows_ok, cols_ok, EVEN_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr):
    """Load a 2-D block, masking (with zeros) only the dimensions that can be ragged."""
    if EVEN_ROWS and EVEN_COLS:
        block = tl.load(ptrs)
    elif EVEN_ROWS:
        block = tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    elif EVEN_COLS:
        block = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    else:
        block = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    return block


@triton.jit
def tile_position(tile, grid, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of ``tile`` in grouped order on ``grid`` (rows, columns of tiles): GROUP_M rows of tiles
    are walked column by column, so the b-blocks they share stay in L2."""
    num_pid_m, num_pid_n = grid
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile % num_pid_in_group) % group_size_m
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def partial_product(a, b, off, ks, dims, stride_a, stride_b, scales, C: tl.constexpr):
    """The fp32 tile ``a[off_m:off_m+BLOCK_M, k] @ b[k, off_n:off_n+BLOCK_N]`` (``off`` = (off_m, off_n))
    over the K steps ``ks`` = (k_lo, k_hi), ``k_lo <= ki < k_hi`` of BLOCK_K each: all of them for a whole
    tile, a range for one part of a `split_tail` tile, times ``scale_a * scale_b`` when ``scales`` =
    (scale_a, scale_b) is not None (FP8: the parts of a split tile are scaled before they are added).  With
    TMA, ``a`` and ``b`` are tensor descriptors (the copy hardware zero-fills past the edges); else pointers
    with strides (row, column) and masks."""
    off_m, off_n = off
    k_lo, k_hi = ks
    M, N, K = dims
    acc = tl.full((C.BLOCK_M, C.BLOCK_N), 0.0, dtype=tl.float32)  # = tl.zeros, a builtin
    if C.TMA:
        for ki in range(k_lo, k_hi):
            a_block = a.load([off_m, ki * C.BLOCK_K])
            if C.B_KMAJOR:  # noqa: SIM108 (a compile-time choice of load, one per variant)
                b_block = b.load([off_n, ki * C.BLOCK_K]).T
            else:
                b_block = b.load([ki * C.BLOCK_K, off_n])
            acc = _dot(a_block, b_block, acc, C)
    else:
        offs_m = off_m + tl.arange(0, C.BLOCK_M)
        offs_n = off_n + tl.arange(0, C.BLOCK_N)
        offs_k0 = tl.arange(0, C.BLOCK_K)
        mask_m = offs_m < M  # masks are applied only where EVEN_* says a dimension can be ragged
        mask_n = offs_n < N
        a_ptrs = a + offs_m[:, None] * stride_a[0] + (k_lo * C.BLOCK_K + offs_k0)[None, :] * stride_a[1]
        b_ptrs = b + (k_lo * C.BLOCK_K + offs_k0)[:, None] * stride_b[0] + offs_n[None, :] * stride_b[1]
        for ki in range(k_lo, k_hi):
            mask_k = offs_k0 < K - ki * C.BLOCK_K
            a_block = load_block(a_ptrs, mask_m, mask_k, C.EVEN_M, C.EVEN_K)
            b_block = load_block(b_ptrs, mask_k, mask_n, C.EVEN_K, C.EVEN_N)
            acc = _dot(a_block, b_block, acc, C)
            a_ptrs += C.BLOCK_K * stride_a[1]
            b_ptrs += C.BLOCK_K * stride_b[0]
    if scales is not None:
        acc = acc * (tl.load(scales[0]) * tl.load(scales[1]))
    return acc


@triton.jit
def _dot(a, b, acc, C: tl.constexpr):
    if C.UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if C.FP32_IEEE:  # noqa: SIM108 (keeps the bf16 path literally `tl.dot(a, b, acc)`)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def store_tile(c, off, bounds, strides, acc, C: tl.constexpr, TMA: tl.constexpr):
    """``c[off_m:, off_n:] = acc`` in c's dtype (``off`` = (off_m, off_n)): a descriptor store (clipped at the
    edges by the hardware) with TMA, else a pointer store with ``strides`` (row, column), masked at ``bounds``
    (rows, columns) where C's EVEN_M / EVEN_N say a dimension can be ragged."""
    off_m, off_n = off
    if TMA:
        # Two [BLOCK_M, BLOCK_N / 2] halves: half the staging tile, which makes room for a fourth stage of
        # LARGE's 128x256 tiles (`tma_fits`).  One H200, `bench/gemm_bench.py` shapes (2026-12-03): the median
        # of 36 layer GEMMs went from 1.018x to 1.013x cuBLAS's time at BF16 and from 1.005x to 0.999x at FP8
        # with 4 stages; halves alone, at 3 stages, took 0.2-0.5% off.
        left, right = acc.reshape(C.BLOCK_M, 2, C.BLOCK_N // 2).permute(0, 2, 1).split()
        c.store([off_m, off_n], left.to(c.dtype))
        c.store([off_m, off_n + C.BLOCK_N // 2], right.to(c.dtype))
    else:
        rows, cols = bounds
        offs_m = off_m + tl.arange(0, C.BLOCK_M)
        offs_n = off_n + tl.arange(0, C.BLOCK_N)
        c_ptrs = c + offs_m[:, None] * strides[0] + offs_n[None, :] * strides[1]
        if C.EVEN_M and C.EVEN_N:
            tl.store(c_ptrs, acc.to(c.dtype.element_ty))
        else:
            tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=(offs_m < rows)[:, None] & (offs_n < cols)[None, :])


@triton.jit
def _persistent_matmul_kernel(
    a, b, c, scales, scratch, dims, stride_a, stride_b, stride_c, tail, C: tl.constexpr, CHUNKS: tl.constexpr
):
    # Only tl builtins and our own @jit helpers here (no tl.cdiv, tl.zeros & co., @jit functions of
    # triton.language): then the interpreter runs this kernel even when triton was imported before
    # TRITON_INTERPRET=1 was set.
    pid, grid, whole_tiles, steps = tile_grid(dims, tail, C, CHUNKS)
    M, N, _ = dims
    # flatten: the K loops of consecutive tiles form one software pipeline (loads of the next tile start
    # under the last MMAs of this one); measured with TMA only.
    for tile in tl.range(pid, whole_tiles, C.GEMM_SMS, flatten=C.TMA):
        pid_m, pid_n = tile_position(tile, grid, C.GROUP_M)
        off = (pid_m * C.BLOCK_M, pid_n * C.BLOCK_N)
        acc = partial_product(a, b, off, (0, steps), dims, stride_a, stride_b, scales, C)
        store_tile(c, off, (M, N), stride_c, acc, C, C.TMA)
    if C.SPLIT_TAIL:
        split_tail(a, b, c, scales, scratch, whole_tiles, tail, grid, dims, stride_a, stride_b, stride_c, C)


@triton.jit
def split_tail(a, b, c, scales, scratch, first_tile, tail, grid, dims, stride_a, stride_b, stride_c, C: tl.constexpr):
    """The last ``tail`` = (tail_tiles, splits) tiles (from ``first_tile``), each cut along K into ``splits``
    equal parts: program ``t + s * tail_tiles`` computes part s of tail tile t (`tail_part`), so the part-empty
    last wave becomes ``splits`` times shorter, and whichever part arrives last stores the tile (`add_parts`).
    Programs with the same s read the same K range of neighbouring tiles at the same time (L2 reuse, which
    an even stream-K spread of K steps loses: measured 1.7x slower per step)."""
    M, N, K = dims
    pid = tl.program_id(axis=0)
    if pid < tail[0] * tail[1]:
        t, ks = tail_part(pid, tail, K, C.BLOCK_K)
        pid_m, pid_n = tile_position(first_tile + t, grid, C.GROUP_M)
        off = (pid_m * C.BLOCK_M, pid_n * C.BLOCK_N)
        acc = partial_product(a, b, off, ks, dims, stride_a, stride_b, scales, C)
        last, total = add_parts(scratch, tail, acc, pid, t, C)
        if last:
            store_tile(c, off, (M, N), stride_c, total, C, C.TMA)


@triton.jit
def tail_part(pid, tail, K, BLOCK_K: tl.constexpr):
    """(t, (k_lo, k_hi)) of program ``pid`` in a split tail of ``tail`` = (tail_tiles, splits): its tail tile
    t and the K steps of its part."""
    tail_tiles, splits = tail
    part = pid // tail_tiles
    steps = (K + BLOCK_K - 1) // BLOCK_K
    return pid % tail_tiles, (part * steps // splits, (part + 1) * steps // splits)


@triton.jit
def add_parts(scratch, tail, acc, pid, t, C: tl.constexpr):
    """Hand in program ``pid``'s part ``acc`` of tail tile t; returns (last, total): whether this part arrived
    last and, if so, the sum of all parts (else ``acc``), which the caller then stores.

    ``scratch`` = (partials, locks), ``tail`` = (tail_tiles, splits).  Each part goes to ``partials`` (fp32
    [tail_tiles * splits, BLOCK_M * BLOCK_N], row = program) and bumps the tile's counter in ``locks``
    (acq_rel: the stores before it are visible to whoever reads the count after it).  The last one adds all
    parts in split order (the sum does not depend on who arrived last) and resets the counter to 0 for the
    next launch.  Nobody waits.  Of two parts, the last adds the other's to its own in registers: fp32
    addition commutes, so the sum is the same whichever arrived last, and it reads one tile, not two.

    One H200 (`bench/gemm_bench.py`'s worst layer shapes, 2026-12-03): reading one tile instead of two took
    two-part split tails 1-3% faster at BF16 and FP8 (2048x2560x5120 FP8 0.695 -> 0.714 of the library's
    speed, 8192x1280x2560 FP8 0.754 -> 0.786).  Two ways to read fewer tiles with more parts were slower:
    pairs of pairs (a tree that adds siblings as they meet: ceil(log2(splits)) stores, counts and reads in
    a row, 1-3% slower at 3 and 4 parts) and the last part taking its own from registers while adding the
    others in split order (its part and the sum both held in registers: split tails at 4 parts no faster
    than none at all, 2048x2560x5120 BF16 0.64 of the library's speed against 0.80).
    """
    partials, locks = scratch
    tail_tiles, splits = tail
    local = tl.arange(0, C.BLOCK_M)[:, None] * C.BLOCK_N + tl.arange(0, C.BLOCK_N)[None, :]
    tl.store(partials + pid * (C.BLOCK_M * C.BLOCK_N) + local, acc)
    tl.debug_barrier()  # the whole part is stored before the count publishes it
    last = tl.atomic_add(locks + t, 1, sem="acq_rel", scope="gpu") == splits - 1
    total = acc
    if last:
        tl.debug_barrier()  # every thread reads after the acquire
        if splits == 2:
            other = t + (1 - pid // tail_tiles) * tail_tiles
            total = acc + tl.load(partials + other * (C.BLOCK_M * C.BLOCK_N) + local, cache_modifier=".cg")
        else:
            total = tl.full((C.BLOCK_M, C.BLOCK_N), 0.0, dtype=tl.float32)
            for q in range(0, splits):
                total += tl.load(
                    partials + (t + q * tail_tiles) * (C.BLOCK_M * C.BLOCK_N) + local, cache_modifier=".cg"
                )
        tl.store(locks + t, 0)
    return last, total


def tail_splits(tiles: int, gemm_sms: int, steps: int) -> int:
    """How many K parts `split_tail` cuts each tile of the last, part-empty wave into (0: no split): as many
    as idle programs allow, at most `MAX_TAIL_SPLITS` and never below `MIN_PART_STEPS` K steps a part."""
    tail = tiles % gemm_sms
    splits = min(gemm_sms // tail, MAX_TAIL_SPLITS, steps // MIN_PART_STEPS) if tail else 0
    return splits if splits >= 2 else 0


@dataclass(frozen=True, kw_only=True, slots=True)
class TailSplit:
    """How one launch splits its last round (`split_tail`): ``tiles`` tail tiles, ``splits`` K parts each
    (0: no split), and the scratch the parts meet in."""

    tiles: int
    splits: int
    partials: torch.Tensor
    locks: torch.Tensor

    @classmethod
    def plan(cls, cfg: GemmTileConfig, *, tiles: int, gemm_sms: int, k: int, device: torch.device) -> TailSplit:
        """The split of ``tiles`` tiles of depth ``k`` on ``gemm_sms`` programs (none unless ``cfg.split_tail``)."""
        splits = tail_splits(tiles, gemm_sms, triton.cdiv(k, cfg.block_k)) if cfg.split_tail else 0
        tail = tiles % gemm_sms if splits else 0
        # Scratch from PyTorch's caching allocator, per call: launches on concurrent streams never share it.
        partials = torch.empty((tail * splits, cfg.block_m * cfg.block_n), dtype=torch.float32, device=device)
        return cls(
            tiles=tail, splits=splits, partials=partials, locks=torch.zeros(tail, dtype=torch.int32, device=device)
        )

    def grid(self, tiles: int, gemm_sms: int) -> tuple[int]:
        """One program per SM, or per tile or tail part when there are fewer."""
        return (min(gemm_sms, max(tiles, self.tiles * self.splits)),)

    def scratch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' argument ``scratch`` = (partials, locks)."""
        return self.partials, self.locks

    def sizes(self) -> tuple[int, int]:
        """The kernels' argument ``tail`` = (tail_tiles, splits)."""
        return self.tiles, self.splits


INTERPRETED = isinstance(_persistent_matmul_kernel, InterpretedFunction)
"""True when TRITON_INTERPRET=1 was set before this module was imported: the kernel runs in Triton's
interpreter (CPU tensors allowed), and bf16 operands are upcast to fp32 before `tl.dot` there."""


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    gemm_sms: int | None = None,
    config: GemmTileConfig | None = None,
    tma: bool = True,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = a @ b`` on at most ``gemm_sms`` SMs (None: all of the device's; 4 on CPU).

    FP8 (`FP8` a and b): ``out = (a * scale_a) @ (b * scale_b)`` in `FP8_OUT`, with ``scale_a`` and
    ``scale_b`` one-element fp32 tensors on a's device (per-tensor dequantization scales, TE's scale_inv),
    applied to the fp32 accumulator before the store.  b column-major (``w.t()`` of a row-major [N, K]
    weight, the layout ``torch._scaled_mm`` requires) is the one the FP8 MMA reads straight from TMA; a
    row-major b works too, transposed on chip.  Other dtypes take no scales.

    ``config`` None picks tiles with `choose_config`.  The tiles move by TMA (tensor descriptors) when
    ``tma`` and `tma_fits` allows it, else by pointer loads.  Raises `InputError` (a ValueError) naming the
    argument for bad tensors, scales or ``gemm_sms``, `ConfigError` for a bad ``config``.
    """
    m, n, k = check_operands(a, b, out)
    scales = check_scales(a, scale_a, scale_b)
    check_launchable(a)
    gemm_sms = resolve_gemm_sms(a.device, gemm_sms)
    if config is not None and not isinstance(config, GemmTileConfig):
        raise ConfigError("config", "must be a GemmTileConfig or None", type(config).__name__)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype(a.dtype), device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config if config is not None else choose_config(m, n, k, a.dtype, gemm_sms)
    tiled = {"a": (a, "a"), "b": (b, "b"), "c": (out, "c")}
    launch(_persistent_matmul_kernel, tiled, a=a, b=b, out=out, cfg=cfg, gemm_sms=gemm_sms, tma=tma, scales=scales)
    return out


def check_launchable(a: torch.Tensor) -> None:
    """Our kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter."""
    if a.device.type != "cuda" and not INTERPRETED:
        raise InputError(
            "a", "must be a CUDA tensor (CPU tensors need TRITON_INTERPRET=1 before this import)", str(a.device)
        )


def launch(
    kernel: triton.JITFunction,
    tiled: dict[str, tuple[torch.Tensor, str]],
    *,
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    cfg: GemmTileConfig,
    gemm_sms: int,
    tma: bool,
    chunks: int = 1,
    **args: object,
) -> None:
    """Launch one of our persistent GEMM kernels on ``chunks`` chunks of the problem ``a [M, K] @ b [K, N] ->
    out`` (a ring kernel's chunk is M rows; `matmul` has one), on at most ``gemm_sms`` programs.

    Every such kernel takes, by name: its operands whose tiles it moves, ``tiled`` (each with its role "a",
    "b" or "c": TMA descriptors of its tiles (`tma_views`) when ``tma`` and `tma_fits` allow, else the
    tensors), its own ``args`` (``scales`` among them: `check_scales`), ``dims`` = (M, N, K), the (row,
    column) strides ``stride_a``, ``stride_b`` and ``stride_c`` of a, b and out, the split tail's ``scratch``
    and ``tail`` (`TailSplit`), and the compile-time constants ``C`` (`KernelConstants`) and ``CHUNKS``.
    """
    m, k = a.shape
    n = b.shape[1]
    for name, t in (("a", a), ("b", b), ("out", out)):
        check_int32_offsets(name, t, cfg)
    tiles = chunks * triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = TailSplit.plan(cfg, tiles=tiles, gemm_sms=gemm_sms, k=k, device=a.device)
    b_kmajor = _b_kmajor(b)
    views = tma_views(cfg, tiled, b_kmajor=b_kmajor)
    tma = tma and tma_fits(cfg, *(view for view, _ in views.values()))
    operands = {name: TensorDescriptor.from_tensor(*views[name]) if tma else t for name, (t, _) in tiled.items()}
    constants = KernelConstants(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        GEMM_SMS=gemm_sms,
        FP32_IEEE=a.dtype == torch.float32,
        UPCAST=INTERPRETED and a.dtype == torch.bfloat16,
        EVEN_M=m % cfg.block_m == 0,
        EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % cfg.block_k == 0,
        TMA=tma,
        B_KMAJOR=tma and b_kmajor,
        SPLIT_TAIL=split.splits > 0,
    )
    with torch.cuda.device(a.device) if a.device.type == "cuda" else contextlib.nullcontext():
        kernel[split.grid(tiles, gemm_sms)](
            **operands,
            **args,
            scratch=split.scratch(),
            dims=(m, n, k),
            stride_a=a.stride(),
            stride_b=b.stride(),
            stride_c=out.stride(),
            tail=split.sizes(),
            C=constants,
            CHUNKS=chunks,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )


def _b_kmajor(b: torch.Tensor) -> bool:
    """Whether TMA reads ``b`` through b.T's descriptor: FP8 with K contiguous.  FP8 MMAs read only K-major
    tiles from shared memory, so a row-major FP8 b is transposed on chip; 16-bit MMAs read either layout, and
    their column-major b keeps the pointer loads it was measured with."""
    return b.dtype == FP8 and b.stride(0) == 1 and b.stride(1) != 1


def tma_views(
    cfg: GemmTileConfig, tiled: dict[str, tuple[torch.Tensor, str]], *, b_kmajor: bool
) -> dict[str, tuple[torch.Tensor, list[int]]]:
    """Per tiled operand, the view a tensor descriptor addresses and its tile: [block_m, block_k] of a,
    [block_k, block_n] of b (b.T's [block_n, block_k] when ``b_kmajor``), [block_m, block_n / 2] of out ("c":
    the epilogue stores each tile as two halves, `store_tile`)."""
    blocks = {"a": [cfg.block_m, cfg.block_k], "b": [cfg.block_k, cfg.block_n], "c": [cfg.block_m, cfg.block_n // 2]}
    views = {}
    for name, (t, role) in tiled.items():
        kmajor = role == "b" and b_kmajor
        views[name] = (t.t(), blocks[role][::-1]) if kmajor else (t, blocks[role])
    return views


def tma_fits(cfg: GemmTileConfig, *tensors: torch.Tensor) -> bool:
    """Whether ``cfg`` can move the tiles of ``tensors`` (the operands, out last) by TMA: every layout allows
    it (`tma_layout`) and the stages plus the epilogue's staging half-tile, which TMA adds, fit in the device's
    shared memory (a config that fills it with stages, like 256x128x64 with 4, runs with pointer loads
    instead)."""
    if not all(tma_layout(t) for t in tensors):
        return False
    device = tensors[0].device
    if device.type != "cuda":
        return True
    stages = cfg.num_stages * (cfg.block_m * cfg.block_k + cfg.block_k * cfg.block_n) * tensors[0].element_size()
    staging = cfg.block_m * cfg.block_n // 2 * tensors[-1].element_size()
    return stages + staging + SMEM_SLACK <= max_shared_mem(device.index)


@functools.cache
def max_shared_mem(device_index: int) -> int:
    """Shared memory one program may opt into on a CUDA device.  Cached: Triton's driver query behind it
    reads every device attribute, and `launch` needs it on every call."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def tma_layout(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor can address ``t``: unit last stride, 16-byte aligned base and strides."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride()[:-1])


def cublas_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    gemm_sms: int | None = None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = a @ b`` through ``torch.mm`` (cuBLAS on CUDA), asking cuBLAS for ``gemm_sms`` SMs.

    FP8 operands (scales as in `matmul`) go to ``torch._scaled_mm`` (cuBLASLt) with fast accumulation, which
    is what our kernel's FP8 MMAs do on Hopper (Triton's default there) and TE's forward GEMMs ask for.  Its
    layout rules hold: a row-major, b column-major, K and N multiples of 16 (`check_scaled_mm_layout`).

    With ``gemm_sms`` set (CUDA only), the call runs on the cuBLASLt backend with PyTorch's SM carve-out
    set to ``sm_count - gemm_sms``; both are process-global and read at launch, so they are set right
    before the call and restored (previous carve-out, previous backend) right after it, also on error.
    Not thread-safe against other threads launching cuBLAS meanwhile.  A strided ``out`` is written in
    place (``torch.mm``'s ``out=`` takes any strides; ``torch._scaled_mm``'s is given a contiguous one).
    """
    m, n, _ = check_operands(a, b, out)
    scales = check_scales(a, scale_a, scale_b)
    if scales is not None:
        check_scaled_mm_layout(a, b)
    if gemm_sms is not None and a.device.type != "cuda":
        raise InputError("gemm_sms", "can only be set for CUDA tensors (cuBLAS SM carve-out)", gemm_sms)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype(a.dtype), device=a.device)
    with _cublas_sm_bound(a.device, gemm_sms):
        if scales is None:
            torch.mm(a, b, out=out)
        else:
            # torch._scaled_mm writes out as if it were contiguous (torch 2.13 on CPU filled a [64, 48] column
            # slice of a [64, 200] buffer row after row): a strided out gets the product through a contiguous one.
            target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
            torch._scaled_mm(a, b, *scales, out_dtype=out.dtype, use_fast_accum=True, out=target)
            if target is not out:
                out.copy_(target)
    return out


@contextlib.contextmanager
def _cublas_sm_bound(device: torch.device, gemm_sms: int | None) -> Iterator[None]:
    """cuBLASLt with PyTorch's SM carve-out for ``gemm_sms`` SMs inside (nothing for None), restored after."""
    if gemm_sms is None:
        yield
        return
    sm_count = resolve_gemm_sms(device, gemm_sms)
    total = torch.cuda.get_device_properties(device).multi_processor_count
    prev_backend = torch.backends.cuda.preferred_blas_library()
    prev_carveout = torch._C._get_sm_carveout_experimental()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(total - sm_count)
        yield
    finally:
        torch._C._set_sm_carveout_experimental(prev_carveout)
        torch.backends.cuda.preferred_blas_library(prev_backend)


def check_scaled_mm_layout(a: torch.Tensor, b: torch.Tensor) -> None:
    """``torch._scaled_mm``'s layout rules, refused as bad input instead of its runtime error."""
    if a.stride(1) != 1 or a.shape[1] % 16:
        raise InputError(
            "a", "must be row-major with K a multiple of 16 (torch._scaled_mm)", (tuple(a.shape), a.stride())
        )
    if b.stride(0) != 1 or b.shape[1] % 16:
        rule = "must be column-major (w.t() of a row-major weight) with N a multiple of 16 (torch._scaled_mm)"
        raise InputError("b", rule, (tuple(b.shape), b.stride()))


def device_sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; `CPU_DEFAULT_GEMM_SMS` for CPU tensors (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_DEFAULT_GEMM_SMS


def resolve_gemm_sms(device: torch.device, gemm_sms: int | None) -> int:
    if gemm_sms is None:
        return device_sm_count(device)
    if not _is_int(gemm_sms) or gemm_sms < 1:
        raise InputError("gemm_sms", "must be an integer >= 1 or None", gemm_sms)
    if device.type == "cuda" and gemm_sms > device_sm_count(device):
        raise InputError("gemm_sms", f"must be at most the device's {device_sm_count(device)} SMs", gemm_sms)
    return int(gemm_sms)


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a GEMM of ``dtype`` operands writes: `FP8_OUT` for `FP8`, else ``dtype`` itself."""
    return FP8_OUT if dtype == FP8 else dtype


def check_operands(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> tuple[int, int, int]:
    """Validate ``a [M, K] @ b [K, N] -> out [M, N]`` (a and b of one dtype, out of its `out_dtype`); returns
    (M, N, K)."""
    named = [("a", a), ("b", b)] + ([("out", out)] if out is not None else [])
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise InputError(name, "must be a torch.Tensor", type(t).__name__)
        if t.dim() != 2:
            raise InputError(name, "must be 2-D", tuple(t.shape))
        if t.dtype not in (*SUPPORTED_DTYPES, FP8) or (name == "out" and t.dtype == FP8):
            raise InputError(name, "dtype must be bfloat16, float16, float32 or (a, b) float8_e4m3fn", str(t.dtype))
    if a.shape[1] != b.shape[0]:
        raise InputError("b", f"rows must equal a's columns K={a.shape[1]}", tuple(b.shape))
    for name, t in named[1:]:
        want = a.dtype if name == "b" else out_dtype(a.dtype)
        if t.dtype != want:
            raise InputError(name, f"dtype must be {want} for {a.dtype} operands", str(t.dtype))
        if t.device != a.device:
            raise InputError(name, f"must be on a's device {a.device}", str(t.device))
    m, k = a.shape
    n = b.shape[1]
    if out is not None:
        if tuple(out.shape) != (m, n):
            raise InputError("out", f"shape must be (M, N) = {(m, n)}", tuple(out.shape))
        if out.numel() > 1 and any(s == 0 and d > 1 for s, d in zip(out.stride(), out.shape, strict=True)):
            raise InputError("out", "must not have zero strides (expanded views alias their elements)", out.stride())
    return m, n, k


def check_scales(
    a: torch.Tensor, scale_a: torch.Tensor | None, scale_b: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernels' ``scales`` argument: (scale_a, scale_b) for `FP8` operands, each a one-element fp32
    tensor on a's device (read on the device, so a scale that TE updates in place needs no host sync and no
    recompile); None for other dtypes, which take no scales."""
    named = (("scale_a", scale_a), ("scale_b", scale_b))
    if a.dtype != FP8:
        for name, scale in named:
            if scale is not None:
                raise InputError(name, "is only for float8_e4m3fn operands", str(a.dtype))
        return None
    for name, scale in named:
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
            got = f"{scale.dtype} x {scale.numel()}" if isinstance(scale, torch.Tensor) else type(scale).__name__
            raise InputError(name, "must be a one-element float32 tensor for float8_e4m3fn operands", got)
        if scale.device != a.device:
            raise InputError(name, f"must be on a's device {a.device}", str(scale.device))
    return scale_a, scale_b


def check_int32_offsets(name: str, t: torch.Tensor, cfg: GemmTileConfig) -> None:
    # Offsets of every element of a tile are computed (masked ones too), up to one block past the edge.
    pad = max(cfg.block_m, cfg.block_n, cfg.block_k)
    reach = sum((size + pad) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    if reach > MAX_INT32_OFFSET:
        raise InputError(name, "element offsets must fit in int32 (view too large for this kernel)", tuple(t.shape))
