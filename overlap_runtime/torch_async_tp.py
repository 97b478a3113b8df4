"""PyTorch's fused async-TP ops, the comparator our methods must beat (CUDA only).

``torch.ops.symm_mem.fused_all_gather_matmul`` (all-gather slots) and ``fused_matmul_reduce_scatter``
(reduce-scatter slots) decompose the collective into copy-engine transfers over symmetric memory beside
chunked cuBLAS GEMMs.  They exist only for coupled collectives: bulk slots have no fused op.

`AsyncTPColumnParallelLinear` and `AsyncTPRowParallelLinear` are the library layers with these ops in place of
ours, forward and backward, where torchtitan's async TP (inductor's micro-pipeline TP over symmetric memory)
puts them: the column layer's all-gather + fprop GEMM and its dgrad GEMM + reduce-scatter, the row layer's
fprop GEMM + reduce-scatter and its all-gather + dgrad GEMM; weight gradients read the gathered operand.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from overlap_runtime.group import RankContext
from overlap_runtime.harness import device_of, make_operands, time_region
from overlap_runtime.methods.common import serial
from overlap_runtime.shape import RS_DGRAD_SLOTS, Collective, ModelShape, Slot, SlotGemm, slot_gemm
from overlap_runtime.tp_linear import ColumnParallelLinear, RowParallelLinear
from overlap_runtime.uncertainty import spread


def has_fused_op(shape: ModelShape, slot: Slot) -> bool:
    """Whether the slot's collective feeds or drains its GEMM (RS-dgrad for a dgrad slot), as the fused ops need."""
    return _coupled(shape, slot).coupled


def _coupled(shape: ModelShape, slot: Slot) -> SlotGemm:
    """The slot's GEMM with the collective coupled to it where TE can couple one (RS-dgrad)."""
    return slot_gemm(shape, slot, rs_dgrad=Slot(slot) in RS_DGRAD_SLOTS)


def fused_task(ctx: RankContext, shape: ModelShape, slot: Slot, *, repeats: int = 20, warmup: int = 5) -> dict:
    """Time the fused op for ``slot`` and check it against the serial reference: {"ms", "cv", "rel_err"}."""
    dev = device_of(ctx)
    gemm = _coupled(shape, slot)
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


def _group_name(layer: Any) -> str:
    """The layer's group, with symmetric memory enabled on it as torchtitan does (a no-op where PyTorch always
    has it)."""
    import torch.distributed._symmetric_memory as symm_mem

    name = layer.context.group.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        enable(name)
    return name


class _FusedColumnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Any) -> torch.Tensor:
        name = _group_name(layer)
        gathered, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(x.contiguous(), [weight.t()], 0, name,
                                                                       return_A=True)  # fmt: skip
        ctx.save_for_backward(gathered, weight)
        ctx.name, ctx.has_bias = name, bias is not None
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gathered, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.ops.symm_mem.fused_matmul_reduce_scatter(dy, weight, "sum", 0, ctx.name)
        return dx, dy.t() @ gathered, dy.sum(0) if ctx.has_bias else None, None


class _FusedRowFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Any) -> torch.Tensor:
        name = _group_name(layer)
        x = x.contiguous()
        out = torch.ops.symm_mem.fused_matmul_reduce_scatter(x, weight.t(), "sum", 0, name)
        ctx.save_for_backward(x, weight)
        ctx.name, ctx.has_bias = name, bias is not None
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        gathered, (dx,) = torch.ops.symm_mem.fused_all_gather_matmul(dy.contiguous(), [weight], 0, ctx.name,
                                                                      return_A=True)  # fmt: skip
        return dx, gathered.t() @ x, gathered.sum(0) if ctx.has_bias else None, None


class AsyncTPColumnParallelLinear(ColumnParallelLinear):
    """`ColumnParallelLinear` on PyTorch's fused ops (module docstring); CUDA only, its overlap configs unused."""

    function = _FusedColumnFn


class AsyncTPRowParallelLinear(RowParallelLinear):
    """`RowParallelLinear` on PyTorch's fused ops (module docstring); CUDA only, its overlap configs unused."""

    function = _FusedRowFn
