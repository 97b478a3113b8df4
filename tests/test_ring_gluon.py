"""The Gluon port of the fused reduce-scatter GEMM (`overlap_runtime.ring_gluon`): which calls it takes (on any
machine), and on an sm_90 GPU the same checks as the Triton kernel's (`ring_cases.run_scatter`: out, the
staged partials and their counts; `late_flags`: partials and flags that arrive after the launch)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from compiled import run_compiled
from ring_cases import FP8, weight
from triton_interpreter import interpreted

from overlap_runtime import ring_gluon

ring_gemm = interpreted("overlap_runtime.ring_gemm")
gemm = ring_gemm.gemm
CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]


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


def test_the_dispatcher_takes_the_faster_kernel_on_every_case_timed_on_an_h100() -> None:
    """`ring_gemm.gluon_plan` against bench/results/gluon_ring_h100.json: every default reduce-scatter slot at BF16
    and FP8, both kernels timed beside the library.  Where the two are within `TIE` of each other either pick
    is right; a case without a Gluon time (its default segments were of unequal width) must now be cut evenly."""
    results = json.loads((REPO / "bench" / "results" / "gluon_ring_h100.json").read_text())
    sms, picks = results["environment"]["sm_count"], {}
    for row in results["timings"]:
        dtype = {"bf16": torch.bfloat16, "fp8": FP8}[row["dtype"]]
        plan = ring_gemm.gluon_plan(row["m"] // 2, row["n"], row["k"], chunks=2, dtype=dtype, gemm_sms=sms)
        case, vs = (row["shape"], row["slot"], row["dtype"]), row["vs_library"]
        picks[case] = "gluon" if plan is not None else "triton"
        if "gluon" not in vs:  # h8192 s4096 proj_fprop: Triton at BF16 (64 K steps), Gluon at FP8
            assert plan is None or ring_gluon.takes_plan(plan), case
        elif abs(vs["gluon"] / vs["triton"] - 1) > TIE:
            assert picks[case] == min(("gluon", "triton"), key=vs.__getitem__), (case, vs)
    assert len(picks) == 2 * 8 * 2  # dtypes x default shapes x (proj_fprop, fc2_fprop)
    assert sum(pick == "gluon" for pick in picks.values()) == 6 + 13, picks


TIE = 0.01
"""Two kernels' times within 1% of each other: the spread of one timed run, where either pick is right."""


_CUDA_CHECKS = """
from bench.gluon_ring_check import checks

rows = checks()  # each case's errors, printed as it goes
bad = [row for row in rows if not row["ok"]]
assert not bad, bad
# dtypes x shapes x every rank of 2 and of 4 chunks, dtypes x ranks as dispatched, two late and two one-late calls
assert len(rows) == 2 * 5 * (2 + 4) + 2 * 2 + 2 + 2, len(rows)
print(f"gluon scatter ok: {len(rows)} cases")
"""


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _sm90(), reason="needs a CUDA GPU of compute capability 9.0 (Hopper)")
def test_compiled_gluon_scatter_matches_the_triton_kernels_checks() -> None:
    """In a fresh process without TRITON_INTERPRET, `bench/gluon_ring_check.py`'s checks: BF16 and FP8, 2 and 4
    chunks, every rank, out, the staged partials and their counts as the Triton kernel's tests check them, then
    partials and flags that arrive after the launch."""
    run_compiled(_CUDA_CHECKS)
