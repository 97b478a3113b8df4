"""FP8 data as the runtime handles it (`overlap_runtime.fp8`): quantization, its bytes, the CPU's FP8 GEMM."""

from __future__ import annotations

import torch

from overlap_runtime.fp8 import E4M3_MAX, as_bytes, dequantized, host_mm, product, quantize
from overlap_runtime.gemm import FP8


def test_quantize_clamps_to_e4m3s_range_instead_of_overflowing() -> None:
    scale = torch.tensor([0.5])
    q = quantize(torch.tensor([1000.0, -1000.0, 1.3]), scale)
    assert q.dtype == FP8
    assert dequantized(q, scale).tolist() == [E4M3_MAX * 0.5, -E4M3_MAX * 0.5, 1.25]  # 2.6 -> 2.5: 3 mantissa bits


def test_fp8_tensors_travel_as_their_bytes_and_others_as_they_are() -> None:
    q = torch.randn(4, 8).to(FP8)
    wire = as_bytes(q)
    assert wire.dtype == torch.uint8 and wire.data_ptr() == q.data_ptr()
    assert torch.equal(wire.view(FP8).view(torch.uint8), q.view(torch.uint8))
    bf16 = torch.randn(4, 8, dtype=torch.bfloat16)
    assert as_bytes(bf16) is bf16


def test_the_cpus_fp8_gemm_is_the_dequantized_product_rounded_once_to_bf16() -> None:
    a, w = torch.randn(16, 32).to(FP8), torch.randn(24, 32).to(FP8)
    scales = (torch.tensor([0.37]), torch.tensor([1.9]))
    out = torch.empty(16, 24, dtype=torch.bfloat16)
    host_mm(a, w.t(), out, scales)
    exact = (a.double() * 0.37) @ (w.double().t() * 1.9)
    assert torch.equal(out, product(a, w.t(), scales).to(torch.bfloat16))
    assert float((out.double() - exact).norm() / exact.norm()) < 2**-8
