"""pipeline's runner (`overlap_runtime.methods.pipeline`): output-feature chunks, each reduce-scattered while
the next computes."""

from __future__ import annotations

from typing import Any

from overlap_runtime.device import Device
from overlap_runtime.methods.common import (
    Lanes,
    Operands,
    Plan,
    chunk_gemm,
    fp8_reduce_scatter,
)


def run(dev: Device, ops: Operands, plan: Plan) -> None:
    """TE pipeline: ``num_splits`` chunks along the output features; the RS of chunk j runs (NCCL, num_sm
    CTAs) while chunk j+1 computes.  With ``first_gemm`` the GEMM of chunk j+1 is issued before RS j.
    Each RS is issued from its chunk's lane, so it waits for that chunk's GEMM and nothing else."""
    g, k = ops.gemm, plan.num_splits
    width = g.n // k
    gemm = chunk_gemm(dev, plan, ops)
    parts = ops.partials("parts", (k, g.tokens, width))
    scattered = ops.partials("scattered", (k, ops.rows, width)) if k > 1 else ops.out.unsqueeze(0)
    lanes = Lanes(dev, plan.streams, plan.gemm_priority)
    works: list[Any] = []

    def scatter(j: int) -> None:
        with lanes.lane(j):
            if plan.fp8_buf:
                works.append(fp8_reduce_scatter(dev, ops, scattered[j], parts[j], f"pipeline{j}", plan.comm))
            else:
                works.append(dev.reduce_scatter(scattered[j], parts[j], plan.comm))

    for j in range(k):
        with lanes.lane(j):
            gemm(ops.a, ops.b[:, j * width : (j + 1) * width], parts[j])
        if not plan.first_gemm:
            scatter(j)
        elif j > 0:
            scatter(j - 1)
    if plan.first_gemm:
        scatter(k - 1)
    lanes.join()
    for j, work in enumerate(works):
        work.wait()
        if k > 1:
            dev.copy(ops.out[:, j * width : (j + 1) * width], scattered[j])
