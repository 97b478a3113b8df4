"""PyTorch's fused async-TP ops, the comparator our methods must beat (CUDA only).

``torch.ops.symm_mem.fused_all_gather_matmul`` (all-gather slots) and ``fused_matmul_reduce_scatter``
(reduce-scatter slots) decompose the collective into copy-engine transfers over symmetric memory beside
chunked cuBLAS GEMMs.  They exist only for coupled collectives: bulk slots have no fused op.
"""

from __future__ import annotations

import statistics

import torch

from overlap_runtime.config import Method, problem
from overlap_runtime.group import RankContext
from overlap_runtime.harness import device_of, make_operands, time_region
from overlap_runtime.methods import serial
from overlap_runtime.shape import Collective, ModelShape, Slot
from overlap_runtime.uncertainty import spread


def has_fused_op(shape: ModelShape, slot: Slot) -> bool:
    """Whether the slot's collective feeds or drains its GEMM (under a ring exchange), as the fused ops need."""
    return problem(shape, slot, Method.RING_EXCHANGE).coupled


def fused_task(ctx: RankContext, shape: ModelShape, slot: Slot, *, repeats: int = 20, warmup: int = 5) -> dict:
    """Time the fused op for ``slot`` and check it against the serial reference: {"ms", "cv", "rel_err"}."""
    dev = device_of(ctx)
    gemm = problem(shape, slot, Method.RING_EXCHANGE)
    ops, sets = make_operands(dev, gemm, seed=0)
    name = dev.pg.group_name

    def fused() -> torch.Tensor:
        if gemm.collective == Collective.ALL_GATHER:
            return torch.ops.symm_mem.fused_all_gather_matmul(ops.a, [ops.b], 0, name, return_A=False)[1][0]
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(ops.a, ops.b, "sum", 0, name)

    serial(dev, ops)
    want = ops.out.double()
    got = fused().double()
    rel_err = float((got - want).norm() / want.norm())
    samples = time_region(dev, ops, sets, fused, repeats=repeats, warmup=warmup)
    return {"ms": statistics.median(samples), "cv": spread(samples), "rel_err": rel_err}
