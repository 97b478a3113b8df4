"""The kernels that wait for flags themselves (`flag_kernels`, `ring_gemm`), as host code for the CPU
backend (`emulation`): the same arguments, the same waits in the same order, and the same counts after the
same stores, so the protocols around them race on CPU as they would on the GPU.

What the GPU kernels spread over programs runs here one chunk (gather) or one segment (scatter) at a time, in
the order a program meets them: the waits are per chunk and per segment in both.  The scatter stores and
counts a segment tile by tile, as its programs do, so a wait that goes ahead one tile short sees a segment
with a tile missing.  A wait polls the flag word,
which another rank's emulated copy engine writes (`wait_until`); it gives up after ``limit_s`` (the device's
``wait_limit_s``, `WAIT_LIMIT_S` unless told).  ``pause``
runs before every step (the emulation's random delays, `races.Draws.pauses`): GPU programs do not keep pace
with each other either, so a step may read long after the one before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from overlap_runtime.errors import AutotuneError
from overlap_runtime.fp8 import Scales, host_mm, product
from overlap_runtime.ring_gemm import ScatterPlan, Segment

WAIT_LIMIT_S = 30.0
"""The longest any emulated wait blocks before it fails the call."""
POLL_S = (20e-6, 1e-3)
"""Pause between two reads of a flag word that a wait polls: the first, doubling up to the last (a wait
that lasts costs the cores little; the ranks share them)."""


def _no_pause() -> None:
    pass


class StreamError(AutotuneError, RuntimeError):
    """Work on an emulated stream failed: a wait outlasted `WAIT_LIMIT_S` (its flag or event never came), or
    the work raised (`emulation.HostDevice.synchronize` says which stream)."""


def wait_until(words: torch.Tensor, index: int, value: int, *, limit_s: float = WAIT_LIMIT_S) -> None:
    """Block until the int32 ``words[index]`` (memory that another thread or rank writes) is at least ``value``;
    `StreamError` after ``limit_s`` (a peer that died never raises its flag)."""
    word = words.numpy()[index : index + 1]  # a view: every read goes to memory
    deadline = time.monotonic() + limit_s
    pause, longest = POLL_S
    while word[0] < value:
        if time.monotonic() > deadline:
            raise StreamError(f"flag word {index} stayed at {int(word[0])} < {value} for {limit_s:g} s")
        time.sleep(pause)
        pause = min(2 * pause, longest)


def spin(flag: torch.Tensor, target: int, *, pause: Callable[[], None] = _no_pause,
         limit_s: float = WAIT_LIMIT_S) -> None:  # fmt: skip
    """`flag_kernels.spin`: return once ``flag[0]`` reaches ``target``."""
    wait_until(flag, 0, target, limit_s=limit_s)
    pause()


def reduce_when_ready(out: torch.Tensor, own: torch.Tensor, received: torch.Tensor, ready: torch.Tensor,
                      *, epoch: int, rank: int, pause: Callable[[], None] = _no_pause,
                      limit_s: float = WAIT_LIMIT_S) -> None:  # fmt: skip
    """`flag_kernels.reduce_when_ready`: ``out = own + sum(received[s])``, each source's slot read once its flag
    reached ``epoch``; sums in fp32, in source order."""
    acc = own.to(torch.float32, copy=True)
    for src in range(received.shape[0]):
        if src != rank:
            wait_until(ready, src, epoch, limit_s=limit_s)
            pause()
            acc += received[src]
    out.copy_(acc)


def gather_matmul(a: torch.Tensor, ring: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, ready: torch.Tensor,
                  epoch: int, rank: int, gemm_sms: int | None, pause: Callable[[], None] = _no_pause,
                  limit_s: float = WAIT_LIMIT_S, scale_a: torch.Tensor | None = None,
                  scale_b: torch.Tensor | None = None) -> None:  # fmt: skip
    """`ring_gemm.gather_matmul`: the local shard first (read in place), then each peer's chunk in ring order
    once its ready flag reached ``epoch``."""
    rows = a.shape[0]
    chunks = ring.shape[0] // rows
    scales = _scales(scale_a, scale_b)
    host_mm(a, b, out[rank * rows : (rank + 1) * rows], scales)
    for step in range(1, chunks):
        src = (rank - step) % chunks
        wait_until(ready, src, epoch, limit_s=limit_s)
        pause()
        host_mm(ring[src * rows : (src + 1) * rows], b, out[src * rows : (src + 1) * rows], scales)


def scatter_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, parts: torch.Tensor,
                   counts: torch.Tensor, recv: torch.Tensor, ready: torch.Tensor, epoch: int, rank: int,
                   plan: ScatterPlan, pause: Callable[[], None] = _no_pause, limit_s: float = WAIT_LIMIT_S,
                   scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None) -> None:  # fmt: skip
    """`ring_gemm.scatter_matmul`: each other owner's chunk first (owner rank+1+s at step s), segment by segment
    stored into ``parts[s]`` in the segment layout and counted (its tiles) once stored; then our own chunk,
    each segment once every source's flag for it reached ``epoch``, plus what they sent."""
    rows = out.shape[0]
    chunks = a.shape[0] // rows
    lanes = ready.numel() // chunks
    count = counts.numpy()
    scales = _scales(scale_a, scale_b)
    for step in range(chunks - 1):
        owner = (rank + 1 + step) % chunks
        for j, seg in enumerate(plan.segments):
            pause()
            block = _segment_product(a, b, owner * rows, seg, scales)
            stored = parts[step].view(-1)[seg.offset : seg.offset + seg.numel].view(block.shape)
            for i, tile in enumerate(_tiles(seg, plan)):
                if i:
                    pause()
                stored[tile] = block[tile]
                count[step * len(plan.segments) + j] += 1
    for j, seg in enumerate(plan.segments):
        pause()
        acc = _segment_product(a, b, rank * rows, seg, scales)
        sources = [(rank - d) % chunks for d in range(1, chunks)]
        for src in sources:
            wait_until(ready, src * lanes + j, epoch, limit_s=limit_s)
        pause()
        for src in sources:
            acc += recv[src].view(-1)[seg.offset : seg.offset + seg.numel].view(acc.shape)
        out[seg.row_start : seg.row_stop, seg.col_start : seg.col_stop] = acc


def _tiles(seg: Segment, plan: ScatterPlan) -> list[tuple[slice, slice]]:
    """The ``seg.tiles`` tiles of ``seg``, as slices of its [rows, cols] block, row by row."""
    m, n = plan.config.block_m, plan.config.block_n
    rows, cols = seg.row_stop - seg.row_start, seg.col_stop - seg.col_start
    tiles = [(slice(r, r + m), slice(c, c + n)) for r in range(0, rows, m) for c in range(0, cols, n)]
    assert len(tiles) == seg.tiles, (len(tiles), seg.tiles)
    return tiles


def _segment_product(a: torch.Tensor, b: torch.Tensor, row0: int, seg: Segment, scales: Scales | None) -> torch.Tensor:
    """Segment ``seg`` of the chunk of ``a`` that starts at row ``row0``, times ``b``: [seg rows, seg cols], fp32."""
    return product(a[row0 + seg.row_start : row0 + seg.row_stop], b[:, seg.col_start : seg.col_stop], scales)


def _scales(scale_a: torch.Tensor | None, scale_b: torch.Tensor | None) -> Scales | None:
    return None if scale_a is None or scale_b is None else (scale_a, scale_b)
