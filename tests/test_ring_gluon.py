"""The Gluon port of the fused reduce-scatter GEMM (`overlap_runtime.ring_gluon`): which calls it takes (on any
machine), and on an sm_90 GPU the same checks as the Triton kernel's (`ring_cases.run_scatter`: out, the
staged partials and their counts; `late_flags`: partials and flags that arrive after the launch)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from compiled import run_compiled
from ring_cases import FP8, weight
from triton_interpreter import interpreted

from overlap_runtime import ring_gluon

ring_gemm = interpreted("overlap_runtime.ring_gemm")
gemm = ring_gemm.gemm
CPU = torch.device("cpu")


def _call(
    dtype: torch.dtype, *, rows: int = 256, n: int = 512, k: int = 256, chunks: int = 2, **plan: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    """(a, b, out, plan) of a `ring_gemm.scatter_matmul` call on CPU tensors, b laid out as the tests' GEMMs take
    it (`ring_cases.weight`), the plan on 128x128 tiles unless ``plan`` says otherwise."""
    a = torch.zeros(chunks * rows, k).to(dtype)
    b = weight(k, n, dtype=dtype, seed=0, device="cpu")
    out = torch.empty(rows, n, dtype=gemm.out_dtype(dtype))
    config = plan.pop("config", gemm.for_dtype(gemm.MEDIUM, dtype))
    return a, b, out, ring_gemm.scatter_plan(rows, n, k, chunks=chunks, dtype=dtype, device=CPU, gemm_sms=132,
                                             config=config, **plan)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_whole_128x128_tiles_in_even_segments_are_taken_wherever_they_are_and_run_on_hopper_only(
    dtype: torch.dtype,
) -> None:
    a, b, out, plan = _call(dtype, rows=2048, n=768, k=384, col_groups=3)  # 2 row groups x 3 column groups
    assert ring_gluon.handles(a, b, out, plan)
    assert not ring_gluon.supports(a, b, out, plan, True)  # CPU tensors: the Triton kernel (interpreter) runs them
    assert not ring_gluon.runs_on(CPU)


def test_the_plan_must_be_cut_from_128x128_tiles_without_a_split_tail_into_segments_of_one_shape() -> None:
    bf16 = torch.bfloat16
    medium = gemm.for_dtype(gemm.MEDIUM, bf16)
    refused = {
        "128x256 tiles": _call(bf16, config=gemm.LARGE),
        "64x128 tiles": _call(bf16, config=gemm.SMALL),
        "split tail": _call(bf16, config=dataclasses.replace(medium, split_tail=True)),
        "ragged row groups": _call(bf16, rows=2560),  # 20 tile rows: groups of 8, 8 and 4
        "ragged column groups": _call(bf16, n=640, col_groups=2),  # 5 tile columns: 3 + 2
    }
    for name, (a, b, out, plan) in refused.items():
        assert not ring_gluon.handles(a, b, out, plan), name
    a, b, out, plan = _call(bf16, config=dataclasses.replace(medium, group_m=4))  # GROUP_M is the plan's
    assert ring_gluon.handles(a, b, out, plan)


def test_operands_must_be_whole_tiles_of_bf16_or_k_major_fp8_with_tma_layouts() -> None:
    bf16 = torch.bfloat16
    a, b, out, plan = _call(bf16)
    cases = {
        "rows not whole tiles": _call(bf16, rows=192),
        "K not whole 64-deep steps": _call(bf16, k=96),
        "FP8 K not whole 128-deep steps": _call(FP8, k=192),
        "fp32 operands": (a.float(), b.float(), out.float(), plan),
        "BF16 b column-major": (a, b.t().contiguous().t(), out, plan),
        "FP8 b row-major": (a.to(FP8), b.to(FP8).contiguous(), out, plan),
        "a not row-major": (a.t().contiguous().t(), b, out, plan),
        "out rows not 16-byte aligned": (a, b, torch.empty(256, 516, dtype=bf16)[:, :512], plan),
    }
    assert ring_gluon.handles(a, b, out, plan)
    for name, (a_, b_, out_, plan_) in cases.items():
        assert not ring_gluon.handles(a_, b_, out_, plan_), name
    assert not ring_gluon.supports(a, b, out, plan, False)  # pointer loads asked for: the Triton kernel


_CUDA_SETUP = """
import dataclasses, sys, types
import torch
sys.path.insert(0, "tests")
from late_flags import StreamPeer, scatter_late, scatter_one_late
from ring_cases import FP8, REL_TOL, rel_err, run_scatter
from overlap_runtime import gemm, ring_gemm, ring_gluon

def scatter_plan(rows, n, k, *, dtype, config=None, **kwargs):
    # 128x128 tiles where the caller picks none: the tiles the Gluon kernel takes
    config = config or gemm.for_dtype(gemm.MEDIUM, dtype)
    return ring_gemm.scatter_plan(rows, n, k, dtype=dtype, config=config, **kwargs)

def scatter_matmul(a, b, out, *, plan, tma=True, scale_a=None, scale_b=None, **exchange):
    assert ring_gluon.supports(a, b, out, plan, tma), plan
    ring_gluon.scatter_matmul(a, b, out, plan=plan, scales=gemm.check_scales(a, scale_a, scale_b), **exchange)

# what the shared helpers take for `ring_gemm`: its plan and its call, run by the Gluon kernel
gluon = types.SimpleNamespace(scatter_plan=scatter_plan, scatter_matmul=scatter_matmul)
"""
_CUDA_CHECKS = """
# (rows, n, k, gemm_sms, col_groups, group_m): h2048 s8192 proj_fprop's chunks; a few programs that each take
# staged and own tiles; 2 row groups x 3 column groups; fewer tile rows than a row group; GROUP_M 4
shapes = lambda chunks: [
    (8192 // chunks, 2048, 1024, None, None, 8),
    (256, 256, 128, 3, None, 8),
    (2048, 768, 384, None, 3, 8),
    (384, 512, 256, 7, 2, 8),
    (1024, 512, 256, 5, 2, 4),
]
passed = 0
for dtype in (torch.bfloat16, FP8):
    for chunks in (2, 4):
        for rows, n, k, gemm_sms, col_groups, group_m in shapes(chunks):
            config = dataclasses.replace(gemm.for_dtype(gemm.MEDIUM, dtype), group_m=group_m)
            for rank in range(chunks):
                case = (str(dtype), chunks, rank, (rows, n, k), gemm_sms, col_groups, group_m)
                out, ref = run_scatter(gluon, chunks, rank, (rows, n, k), dtype, tma=True, config=config,
                                       gemm_sms=gemm_sms, device="cuda", col_groups=col_groups)
                err = rel_err(out, ref)
                assert out.dtype == torch.bfloat16 and err <= REL_TOL[dtype], (case, err)
                passed += 1
assert passed == 2 * 5 * (2 + 4), passed  # dtypes x shapes x every rank of 2 and of 4 chunks
print(f"gluon scatter ok: {passed} cases")

torch.cuda.set_stream(torch.cuda.Stream())  # not the legacy default stream, which waits for every other one
# partials and flags written by a second stream behind a 0.2 s sleep, segment by segment, while the kernel spins
for chunks, rank in ((2, 0), (4, 1)):
    out, want = scatter_late(gluon, StreamPeer(0.2), "cuda", chunks=chunks, rank=rank, shape=(256, 512, 256),
                             config=None, gemm_sms=4, col_groups=2)
    assert rel_err(out, want) <= 1e-2, ("late", chunks, rank)
# one rank behind the others, the last call's partials and flags still there: waited for; one epoch short, the
# kernel takes the late rank's last partial
for short in (False, True):
    err = rel_err(*scatter_one_late(gluon, StreamPeer(0.2), "cuda", chunks=4, rank=3, late=0, shape=(256, 512, 256),
                                    gemm_sms=4, col_groups=2, short=short))
    assert (err > 1e-2) if short else (err <= 1e-2), (short, err)
print("gluon late flags ok")
"""


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _sm90(), reason="needs a CUDA GPU of compute capability 9.0 (Hopper)")
def test_compiled_gluon_scatter_matches_the_triton_kernels_checks() -> None:
    """In a fresh process without TRITON_INTERPRET, BF16 and FP8, 2 and 4 chunks, every rank: out, the staged
    partials and their counts as the Triton kernel's tests check them, then partials and flags that arrive after
    the launch."""
    run_compiled(_CUDA_SETUP + _CUDA_CHECKS)
