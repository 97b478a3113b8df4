"""Benchmark the fused ring kernels (`overlap_runtime.ring_gemm`) on one GPU, with no communication.

Run from the repository root (the script puts the root on ``sys.path`` itself):

    python bench/ring_bench.py --out bench/results/ring_h200.json    # CUDA, about a minute on one H200
    python bench/ring_bench.py --dtype fp8 --out X.json              # FP8 operands (`gemm_bench` runs this too)
    python bench/ring_bench.py --dry-run [--out X.json]              # no CUDA: list the slots
    python bench/ring_bench.py --shapes h2048_s8192_b2 --out X.json  # your own model's slots

What it measures: for every slot of the shapes (``--shapes``, `bench.shapes`; TP=2) whose collective is
coupled to its GEMM (all-gather of a, reduce-scatter of out), rank 0's launch of the fused kernel with every
peer's chunk or partial already in place (flags preset, so no program ever waits), beside torch.mm (cuBLAS)
and `gemm.matmul` of the same whole GEMM [T, K] x [K, N], and the plain path that a fused config falls
back to where the kernel cannot win (`ring_gemm.fused_pays`): the library GEMM per chunk, for a reduce-scatter
then the received partials added by `flag_kernels.reduce_when_ready`.

    kernel / matmul   what the ring order, the flags and the staged partials cost inside the kernel
    fused / cuBLAS    what a fused config can reach at best, all communication hidden: the kernel's time, or
                      the plain path's where the dispatcher falls back to it
The overlap benchmark's fused-ring time minus this one is what the communication itself costs beside the
kernel (copy-engine traffic, the ranks' skew).  Timing as in `gemm_bench` (interleaved variants, each call
behind a GPU sleep, rotating inputs: `bench.timing`); every variant is checked against float32 cuBLAS (FP8:
``torch._scaled_mm`` is the cuBLAS variant, the reference the dequantized fp32 product).

Exit status: 0 all correct, 1 a variant failed or was wrong (the JSON is written either way), 2 usage.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.environment import environment  # noqa: E402
from bench.shapes import BenchShape  # noqa: E402
from bench.timing import (  # noqa: E402
    REL_ERR_LIMIT,
    Operands,
    Variant,
    check,
    l2_bytes,
    library,
    parse_args,
    scales,
    time_interleaved,
    write_json,
)
from overlap_runtime import flag_kernels, gemm, ring_gemm, ring_gluon  # noqa: E402
from overlap_runtime.shape import Collective, Slot, slot_gemm  # noqa: E402

DEFAULT_OUT = {
    "bf16": REPO / "bench" / "results" / "ring_h200.json",
    "fp8": REPO / "bench" / "results" / "ring_fp8_h200.json",
}
TP = 2
RANK = 0
EPOCH = 1


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RingCase:
    """One fused slot: the whole GEMM [m, k] x [k, n] and the collective that the kernel fuses."""

    shape: str
    slot: str
    m: int
    n: int
    k: int
    collective: str


def ring_cases(shapes: tuple[BenchShape, ...]) -> list[RingCase]:
    cases = []
    for shape in shapes:
        for slot in Slot:
            g = slot_gemm(shape.model(TP), slot)
            if g.coupled:
                cases.append(
                    RingCase(shape=shape.name, slot=slot.value, m=g.m, n=g.n, k=g.k, collective=g.collective.value)
                )
    return cases


def fused_variant(case: RingCase, device: torch.device, dtype: torch.dtype) -> tuple[Variant, dict[str, Any]]:
    """Rank 0's fused launch over ``dtype`` operands a [m, k] @ b [k, n] with every flag preset, and what it
    was planned with (a reduce-scatter's ``kernel``: "gluon" where `ring_gemm.scatter_matmul` runs `ring_gluon`).

    All-gather: the local shard is a's first chunk and the ring buffer is a itself (chunk 0 is never read
    from it).  Reduce-scatter: out's first chunk gets our partial plus the peer's, which is zero here.
    """
    rows = case.m // TP
    if case.collective == Collective.ALL_GATHER:
        ready = torch.full((TP,), EPOCH, dtype=torch.int32, device=device)
        gemm_sms = gemm.device_sm_count(device)
        config = ring_gemm.ring_config(rows, case.n, case.k, chunks=TP, dtype=dtype, gemm_sms=gemm_sms)

        def gather(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            return ring_gemm.gather_matmul(
                a[:rows], a, b, out, ready=ready, epoch=EPOCH, rank=RANK, config=config, **scales(a)
            )

        return gather, {"config": config.label()}
    plan = ring_gemm.scatter_plan(rows, case.n, case.k, chunks=TP, dtype=dtype, device=device, gemm_sms=None)
    gluon = ring_gluon.runs_on(device) and ring_gluon.takes_plan(plan)  # `ring_gemm.gluon_plan`'s plans
    planned = {"config": plan.config.label(), "segments": len(plan.segments), "kernel": "gluon" if gluon else "triton"}
    return scatter_variant(case, device, dtype, plan), planned


def scatter_variant(
    case: RingCase,
    device: torch.device,
    dtype: torch.dtype,
    plan: ring_gemm.ScatterPlan,
    scatter: Callable[..., None] = ring_gemm.scatter_matmul,
) -> Variant:
    """Rank 0's fused reduce-scatter of ``case`` on ``plan`` with every peer's flag up and its partial zero, run
    by ``scatter`` (`ring_gemm.scatter_matmul`, or a kernel that takes its call)."""
    rows = case.m // TP
    partial_dtype = gemm.out_dtype(dtype)
    parts = torch.empty((TP - 1, rows, case.n), dtype=partial_dtype, device=device)
    recv = torch.zeros((TP, rows, case.n), dtype=partial_dtype, device=device)
    counts = torch.zeros(((TP - 1) * len(plan.segments),), dtype=torch.int32, device=device)
    ready = torch.full((TP * ring_gemm.max_segments(rows),), EPOCH, dtype=torch.int32, device=device)

    def run(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        scatter(
            a, b, out[:rows], parts=parts, counts=counts, recv=recv, ready=ready, epoch=EPOCH, rank=RANK, plan=plan,
            **scales(a),
        )  # fmt: skip
        return out[:rows]

    return run


def plain_variant(case: RingCase, device: torch.device, dtype: torch.dtype) -> Variant:
    """Rank 0's plain ring with every peer's part in place: the library GEMM per chunk (`library`), and for a
    reduce-scatter the peer's partial (zero here) added to ours by `flag_kernels.reduce_when_ready`."""
    rows = case.m // TP
    if case.collective == Collective.ALL_GATHER:

        def gather(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            for c in range(TP):
                library(a[c * rows : (c + 1) * rows], b, out[c * rows : (c + 1) * rows])
            return out

        return gather
    partial_dtype = gemm.out_dtype(dtype)
    parts = torch.empty((TP, rows, case.n), dtype=partial_dtype, device=device)
    recv = torch.zeros((TP, rows, case.n), dtype=partial_dtype, device=device)
    ready = torch.full((TP,), EPOCH, dtype=torch.int32, device=device)

    def scatter(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for s in range(TP):  # the other owners' chunks first, ours (RANK's) last, as the plain ring runs them
            owner = (RANK + 1 + s) % TP
            library(a[owner * rows : (owner + 1) * rows], b, parts[s])
        flag_kernels.reduce_when_ready(out[:rows], parts[TP - 1], recv, ready, epoch=EPOCH, rank=RANK)
        return out[:rows]

    return scatter


def dispatched(case: RingCase, device: torch.device, dtype: torch.dtype) -> str:
    """What a fused config runs on ``case``: "kernel", or "plain" where `ring_gemm.fused_pays` says it loses."""
    if case.collective == Collective.REDUCE_SCATTER:
        return "kernel"
    rows, sms = case.m // TP, gemm.device_sm_count(device)
    pays = ring_gemm.fused_pays(rows, case.n, case.k, chunks=TP, dtype=dtype, gemm_sms=sms)
    return "kernel" if pays else "plain"


def variants(case: RingCase, device: torch.device, dtype: torch.dtype) -> tuple[dict[str, Variant], dict[str, Any]]:
    """cuBLAS (FP8: ``torch._scaled_mm``), `gemm.matmul`, the fused kernel and the plain ring on ``case``, and
    the plan (the kernel's tiles, what a fused config runs)."""
    kernel, planned = fused_variant(case, device, dtype)
    return {
        "cublas": library,
        "matmul": lambda a, b, out: gemm.matmul(a, b, out, **scales(a)),
        "kernel": kernel,
        "plain": plain_variant(case, device, dtype),
    }, planned | {"dispatched": dispatched(case, device, dtype)}


def measure(case: RingCase, *, dtype: torch.dtype, warmup: int, repeats: int, l2_bytes: int) -> dict[str, Any]:
    ops = Operands(case.m, case.n, case.k, l2_bytes, seed=0, dtype=dtype)
    fns, planned = variants(case, torch.device("cuda"), dtype)
    errors = {name: check(ops, fn) for name, fn in fns.items()}
    row: dict[str, Any] = dataclasses.asdict(case) | planned
    row["rel_err"] = {name: (e if math.isfinite(e) else None) for name, e in errors.items()}
    row["correct"] = all(e <= REL_ERR_LIMIT for e in errors.values())
    row["times"] = time_interleaved(ops, fns, warmup=warmup, repeats=repeats)
    ms = {name: t["ms"] for name, t in row["times"].items()}
    row["kernel_vs_matmul"] = ms["kernel"] / ms["matmul"]
    row["kernel_vs_cublas"] = ms["kernel"] / ms["cublas"]
    row["plain_vs_cublas"] = ms["plain"] / ms["cublas"]
    row["fused_vs_cublas"] = ms[row["dispatched"]] / ms["cublas"]
    del ops
    torch.cuda.empty_cache()
    return row


def run(cases: list[RingCase], *, dtype: torch.dtype, warmup: int, repeats: int) -> dict[str, Any]:
    """Every case measured and printed: {"rows": ..., "summary": ...} (medians of kernel / matmul, kernel /
    cuBLAS and, as dispatched, fused / cuBLAS with its worst case; the cases that computed wrong)."""
    l2 = l2_bytes()
    print(
        f"{'shape':20} {'slot':11} {'cuBLAS':>7} {'matmul':>7} {'kernel':>7} {'plain':>7} {'k/mm':>6} "
        f"{'k/cuBLAS':>8} {'p/cuBLAS':>8} {'fused':>6}  config"
    )
    rows = []
    for case in cases:
        row = measure(case, dtype=dtype, warmup=warmup, repeats=repeats, l2_bytes=l2)
        rows.append(row)
        ms = {name: t["ms"] for name, t in row["times"].items()}
        print(
            f"{case.shape:20} {case.slot:11} {ms['cublas']:7.4f} {ms['matmul']:7.4f} {ms['kernel']:7.4f} "
            f"{ms['plain']:7.4f} {row['kernel_vs_matmul']:6.3f} {row['kernel_vs_cublas']:8.3f} "
            f"{row['plain_vs_cublas']:8.3f} {row['dispatched']:>6}  {row['config']} {row.get('kernel', '')}"
            + ("" if row["correct"] else f"  WRONG {row['rel_err']}"),
            flush=True,
        )
    worst = max(rows, key=lambda r: r["fused_vs_cublas"])
    summary = {
        "kernel_vs_matmul_median": statistics.median(r["kernel_vs_matmul"] for r in rows),
        "kernel_vs_cublas_median": statistics.median(r["kernel_vs_cublas"] for r in rows),
        "fused_vs_cublas_median": statistics.median(r["fused_vs_cublas"] for r in rows),
        "fused_vs_cublas_max": worst["fused_vs_cublas"],
        "fused_worst_case": f"{worst['shape']}/{worst['slot']}",
        "plain_cases": [f"{r['shape']}/{r['slot']}" for r in rows if r["dispatched"] == "plain"],
        "wrong": [f"{r['shape']}/{r['slot']}" for r in rows if not r["correct"]],
    }
    print(summary)
    return {"rows": rows, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, doc=__doc__, default_out=DEFAULT_OUT, dry_run="list the fused slots", tp=TP)
    cases = ring_cases(args.shapes)
    payload: dict[str, Any] = {
        "environment": environment(),
        "method": {
            "dtype": args.dtype_name,
            "tp": TP,
            "rank": RANK,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "stat": "median (p20/p80 beside)",
            "rel_err_limit": REL_ERR_LIMIT,
        },
    }
    if args.dry_run:
        for c in cases:
            print(f"{c.shape:20} {c.slot:11} {c.collective:14} {c.m:>6} {c.n:>6} {c.k:>6}")
        if args.out is not None:
            write_json(args.out, payload | {"dry_run": True, "cases": [dataclasses.asdict(c) for c in cases]})
        return 0
    if not torch.cuda.is_available():
        print("error: cuda: a CUDA device is required (got none); use --dry-run", file=sys.stderr)
        return 2
    started = time.perf_counter()
    payload |= run(cases, dtype=args.dtype, warmup=args.warmup, repeats=args.repeats)
    payload["wall_s"] = time.perf_counter() - started
    write_json(args.out, payload)
    return 1 if payload["summary"]["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
