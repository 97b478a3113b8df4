"""A tensor-parallel transformer layer built from the library layers, and its step timing (`autotune validate`).

Layer (sequence parallel, [s, b, h] per rank, s = seq / tp): LayerNorm -> qkv (column) -> causal attention on
this rank's heads (``torch.nn.functional.scaled_dot_product_attention``, GQA where the shape has groups) ->
proj (row) -> residual -> LayerNorm -> fc1 (column) -> GELU, or SwiGLU for a gated shape -> fc2 (row) ->
residual.  The LayerNorms' weights are replicated and their gradients stay per rank (a trainer all-reduces
them over the TP group; the timing does not need it).

`step_task` times one forward and backward of that layer per variant, variants interleaved round by round, and
returns every step's time, the slowest rank's.  The variant ``torch_async_tp`` swaps the four linears for
PyTorch's fused async-TP ops (`torch_async_tp`), CUDA only.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from overlap_runtime.errors import ShapeError
from overlap_runtime.group import RankContext
from overlap_runtime.layers import TransformerOverlap
from overlap_runtime.shape import ModelShape
from overlap_runtime.tp_linear import ColumnParallelLinear, RowParallelLinear
from overlap_runtime.uncertainty import spread

HEAD_DIM = 128
"""Head width when the shape names no head count (and it divides evenly), as in most models of today."""
ASYNC_TP = "torch_async_tp"


def heads_of(shape: ModelShape) -> tuple[int, int]:
    """(heads, key/value groups): the shape's, or hidden / HEAD_DIM heads (tp heads where that does not divide)."""
    if shape.num_heads is not None:
        return shape.num_heads, shape.num_query_groups or shape.num_heads
    heads = shape.hidden // HEAD_DIM
    if shape.hidden % HEAD_DIM or heads % shape.tp:
        heads = shape.tp
    return heads, heads


class TPTransformerLayer(nn.Module):
    """See the module docstring; ``async_tp``: PyTorch's fused ops in every linear instead of ours."""

    def __init__(self, shape: ModelShape, overlap: TransformerOverlap, *, process_group: Any, device: Any,
                 dtype: torch.dtype, async_tp: bool = False) -> None:  # fmt: skip
        super().__init__()
        tp = dist.get_world_size(process_group)
        if shape.tp != tp:
            raise ShapeError("tp", f"must equal the process group's size {tp}", shape.tp)
        self.heads, self.groups = heads_of(shape)
        self.head_dim = shape.hidden // self.heads
        self.tp, self.gated = tp, shape.gated
        kw = {"device": device, "dtype": dtype}
        tokens = shape.tokens
        if async_tp:
            from overlap_runtime.torch_async_tp import AsyncTPColumnParallelLinear as Column
            from overlap_runtime.torch_async_tp import AsyncTPRowParallelLinear as Row
        else:
            Column, Row = ColumnParallelLinear, RowParallelLinear
        common = {"process_group": process_group, "tokens": tokens, **kw}
        self.norm1 = nn.LayerNorm(shape.hidden, **kw)
        self.qkv = Column(shape.hidden, shape.qkv_width, overlap=overlap.qkv, layer="qkv", **common)
        self.proj = Row(shape.hidden, shape.hidden, overlap=overlap.proj, layer="proj", **common)
        self.norm2 = nn.LayerNorm(shape.hidden, **kw)
        self.fc1 = Column(shape.hidden, shape.fc1_width, overlap=overlap.fc1, layer="fc1", **common)
        self.fc2 = Row(shape.ffn, shape.hidden, overlap=overlap.fc2, layer="fc2", **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(self._attention(self.qkv(self.norm1(x))))
        a = self.fc1(self.norm2(h))
        if self.gated:
            gate, up = a.chunk(2, dim=-1)
            a = nn.functional.silu(gate) * up
        else:
            a = nn.functional.gelu(a)
        return h + self.fc2(a)

    def _attention(self, qkv: torch.Tensor) -> torch.Tensor:
        """[s, b, (heads + 2 groups) * d / tp] -> [s, b, heads * d / tp], causal, this rank's heads."""
        s, b, _ = qkv.shape
        d, heads, groups = self.head_dim, self.heads // self.tp, self.groups // self.tp
        q, k, v = qkv.split([heads * d, groups * d, groups * d], dim=-1)

        def split(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.reshape(s, b, n, d).permute(1, 2, 0, 3)  # [b, n, s, d]

        out = nn.functional.scaled_dot_product_attention(
            split(q, heads), split(k, groups), split(v, groups), is_causal=True, enable_gqa=groups != heads
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


@dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    """One way to run the layer: our layers with ``overlap``, or PyTorch's async TP."""

    name: str
    overlap: TransformerOverlap = field(default_factory=TransformerOverlap)
    async_tp: bool = False


def step_task(ctx: RankContext, shape: ModelShape, variants: list[Variant], *, steps: int, warmup: int,
              rounds: int, seed: int = 0) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per variant: every timed step's ms (the slowest rank's), median and spread; variants interleaved over
    ``rounds`` of ``steps`` steps each, ``warmup`` untimed steps per variant first."""
    cuda = ctx.backend == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    group = dist.group.WORLD
    torch.manual_seed(seed + ctx.rank)
    layers = {v.name: TPTransformerLayer(shape, v.overlap, process_group=group, device=ctx.device, dtype=dtype,
                                         async_tp=v.async_tp) for v in variants}  # fmt: skip
    rows = shape.seq // shape.cp // shape.tp
    x = torch.randn(rows, shape.mbs, shape.hidden, device=ctx.device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def step(layer: nn.Module) -> None:
        layer(x).backward(grad)

    def timed(layer: nn.Module) -> float:
        dist.barrier(group=group)
        if cuda:
            torch.cuda.synchronize(ctx.device)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(layer)
            stop.record()
            torch.cuda.synchronize(ctx.device)
            return start.elapsed_time(stop)
        t0 = time.perf_counter()
        step(layer)
        return (time.perf_counter() - t0) * 1e3

    for layer in layers.values():
        for _ in range(warmup):
            step(layer)
    samples: dict[str, list[float]] = {name: [] for name in layers}
    for _ in range(rounds):
        for name, layer in layers.items():
            samples[name] += [timed(layer) for _ in range(steps)]
    out = {}
    for name, mine in samples.items():
        local = torch.tensor(mine, dtype=torch.float64, device=ctx.device)
        every = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, local, group=group)
        worst = torch.stack(every).max(dim=0).values.tolist()
        out[name] = {"median_ms": statistics.median(worst), "spread": spread(worst), "samples_ms": worst}
    return out
