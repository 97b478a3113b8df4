"""One rank's call of a ring kernel (`overlap_runtime.ring_gemm`) with the peers' side of the exchange
already done (their pushes, flags and counts prepared here), and its float64 reference.

Shared by the interpreter tests (CPU tensors, the module from `triton_interpreter.interpreted`) and the
compiled check on a GPU (CUDA tensors, the module imported plainly in a fresh process).
"""

from __future__ import annotations

from types import ModuleType

import torch

FP8 = torch.float8_e4m3fn
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, FP8: 1e-2}
"""Relative Frobenius error against a float64 reference of the same operand values (FP8: dequantized).  bf16
outputs (bf16 and FP8 operands) are off by their rounding: at most 2^-8 relative per element on the GPU
(round to nearest), 2^-7 in Triton's interpreter (it truncates); 1e-2 leaves room for the fp32 sums, and on
Hopper for the FP8 MMA's fast accumulation.  fp32 outputs: the sums' order only."""

FP8_SCALES = (0.37, 1.9)
"""Per-tensor dequantization scales of FP8 a and b: neither is a power of two, so a scale that is dropped or
applied twice shows."""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.to(out.device)).norm() / ref.norm().clamp_min(1e-30))


def _rand(*shape: int, dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def weight(k: int, n: int, *, dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    """b [k, n]: FP8 column-major (``w.t()`` of a row-major [n, k] weight, as TE and ``torch._scaled_mm`` hold
    it), other dtypes row-major."""
    if dtype == FP8:
        return _rand(n, k, dtype=dtype, seed=seed, device=device).t()
    return _rand(k, n, dtype=dtype, seed=seed, device=device)


def scales(dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """The ``scale_a``, ``scale_b`` keyword arguments that ``dtype`` operands take (FP8 only)."""
    if dtype != FP8:
        return {}
    return {name: torch.tensor([v], device=device) for name, v in zip(("scale_a", "scale_b"), FP8_SCALES, strict=True)}


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The float64 reference of ``a @ b``, FP8 operands dequantized with `FP8_SCALES`."""
    sa, sb = FP8_SCALES if a.dtype == FP8 else (1.0, 1.0)
    return (a.double() * sa) @ (b.double() * sb)


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == FP8 else dtype


def run_gather(
    ring_gemm: ModuleType,
    chunks: int,
    rank: int,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    *,
    tma: bool,
    config: object,
    gemm_sms: int | None,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_matmul` of chunks of ``shape`` = (rows, n, k) with every peer chunk arrived: (out, reference)."""
    rows, n, k = shape
    full = _rand(chunks * rows, k, dtype=dtype, seed=chunks + rank, device=device)
    # Seeds of a and b never coincide: the same seed makes a's rows b's columns (FP8 b is made transposed), so
    # the product's diagonal becomes sums of squares, the worst case for Hopper's FP8 fast accumulation.
    b = weight(k, n, dtype=dtype, seed=0, device=device)
    local = full[rank * rows : (rank + 1) * rows].clone()
    ring = full.clone()
    ring[rank * rows : (rank + 1) * rows] = float("nan")  # our own chunk must come from `local`
    epoch = 5
    ready = torch.full((chunks,), epoch, dtype=torch.int32, device=device)
    ready[rank] = 0  # never awaited: the local shard needs no flag
    out = torch.full((chunks * rows, n), float("nan"), dtype=out_dtype(dtype), device=device)
    ring_gemm.gather_matmul(
        local,
        ring,
        b,
        out,
        ready=ready,
        epoch=epoch,
        rank=rank,
        gemm_sms=gemm_sms,
        config=config,
        tma=tma,
        **scales(dtype, device),
    )
    assert ready.tolist() == [0 if c == rank else epoch for c in range(chunks)]  # flags are only read
    return out, product(full, b)


def run_scatter(
    ring_gemm: ModuleType,
    chunks: int,
    rank: int,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    *,
    tma: bool,
    config: object,
    gemm_sms: int | None,
    device: str = "cpu",
    col_groups: int | None = None,
    gluon: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scatter_matmul` of chunks of ``shape`` = (rows, n, k) with every peer's partial received: (out,
    reference); ``col_groups`` as in `scatter_plan`, ``gluon`` as in `ring_gemm.scatter_matmul` (None: not
    passed).  Asserts what it staged and counted for the other owners on the way."""
    rows, n, k = shape
    a = _rand(chunks * rows, k, dtype=dtype, seed=10 + rank, device=device)
    b = weight(k, n, dtype=dtype, seed=9, device=device)  # below a's seeds (see run_gather)
    partial_dtype = out_dtype(dtype)
    epoch = 3
    plan = ring_gemm.scatter_plan(rows, n, k, chunks=chunks, dtype=dtype, device=a.device, gemm_sms=gemm_sms,
                                  config=config, col_groups=col_groups)  # fmt: skip
    segments = len(plan.segments)
    lanes = segments + 1
    recv = torch.full((chunks, rows, n), float("nan"), dtype=partial_dtype, device=device)
    for src in range(chunks):
        if src != rank:  # what the peers' copy engines pushed to us this call
            recv[src] = _rand(rows, n, dtype=partial_dtype, seed=20 + src, device=device)
    ready = torch.full((chunks * lanes,), epoch, dtype=torch.int32, device=device)  # every segment is in
    parts = torch.full((chunks - 1, rows, n), float("nan"), dtype=partial_dtype, device=device)
    counts = torch.full(((chunks - 1) * segments,), 5, dtype=torch.int32, device=device)  # totals of earlier calls
    out = torch.full((rows, n), float("nan"), dtype=partial_dtype, device=device)
    ring_gemm.scatter_matmul(
        a,
        b,
        out,
        parts=parts,
        counts=counts,
        recv=recv,
        ready=ready,
        epoch=epoch,
        rank=rank,
        plan=plan,
        tma=tma,
        **scales(dtype, device),
        **({} if gluon is None else {"gluon": gluon}),
    )
    partial = product(a, b).view(chunks, rows, n)
    for step in range(chunks - 1):
        staged = row_major(plan, parts[step])
        assert rel_err(staged, partial[(rank + 1 + step) % chunks]) <= REL_TOL[dtype], step
    assert counts.tolist() == [5 + seg.tiles for _ in range(chunks - 1) for seg in plan.segments]
    assert ready.tolist() == [epoch] * (chunks * lanes)  # flags are only read
    received = sum(row_major(plan, recv[s]).double() for s in range(chunks) if s != rank)
    return out, partial[rank] + received


def row_major(plan: object, partial: torch.Tensor) -> torch.Tensor:
    """A [rows, n] partial laid out segment by segment (`ring_gemm.Segment`) in row-major order."""
    flat, out = partial.reshape(-1), torch.empty_like(partial)
    for seg in plan.segments:
        block = flat[seg.offset : seg.offset + seg.numel].view(seg.row_stop - seg.row_start, -1)
        out[seg.row_start : seg.row_stop, seg.col_start : seg.col_stop] = block
    return out
