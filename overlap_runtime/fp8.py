"""FP8 data as the runtime handles it: E4M3 values with per-tensor dequantization scales (TE's ``scale_inv``).

A shape of dtype fp8 runs every GEMM on E4M3 operands (`gemm.FP8`) and writes bf16 (`gemm.FP8_OUT`), as TE's
delayed and current scaling do.  What moves at FP8 (docs/measurement.md, FP8):

- all-gathers move the FP8 operand itself, half the bytes of bf16 (TE forces an FP8 buffer for them);
- reduce-scatters move the bf16 partials, except a pipeline with ``fp8_buf``: each partial chunk is quantized
  with one scale every rank shares (TE's delayed scaling reduces the amax over the group), moved as FP8 and
  summed in fp32 by its owner (`methods.common.fp8_reduce_scatter`).

A transfer needs no float8 type: FP8 tensors travel as their bytes (`as_bytes`), on NCCL and on CPU.
"""

from __future__ import annotations

import torch

from overlap_runtime.gemm import FP8

E4M3_MAX = 448.0
"""The largest finite E4M3 value: quantization clamps to it (an unclamped cast may give NaN on the GPU)."""
Scales = tuple[torch.Tensor, torch.Tensor]
"""(scale_a, scale_b): one-element fp32 tensors, ``a_real = a_fp8 * scale_a``."""


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8


def quantize(t: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t / scale`` clamped to the E4M3 range, as E4M3 (into ``out`` when given)."""
    q = (t.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q if out is None else out.copy_(q)


def dequantized(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values that E4M3 ``t`` with dequantization ``scale`` stands for."""
    return t.float() * scale


def product(a: torch.Tensor, b: torch.Tensor, scales: Scales | None) -> torch.Tensor:
    """``a @ b`` in fp32: FP8 operands dequantized first (the CPU's FP8 GEMM, and the reference's)."""
    if scales is None:
        return a.float() @ b.float()
    return dequantized(a, scales[0]) @ dequantized(b, scales[1])


def host_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scales: Scales | None) -> None:
    """``out = a @ b`` on CPU: ``torch.mm`` for 16/32-bit operands; FP8 ones dequantized, then multiplied in
    fp32 and rounded once into ``out`` (bf16), which is what the GPU's FP8 GEMMs compute up to their
    accumulation order."""
    if scales is None:
        torch.mm(a, b, out=out)
    else:
        out.copy_(product(a, b, scales))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as uint8 (same memory) for a collective; any other tensor as it is."""
    return t.view(torch.uint8) if is_fp8(t) else t
