"""The torch side of `overlap_runtime.layers`: the per-group context, the autograd functions and the modules.

Streams: on CUDA every op of a layer runs on the context's own "layer" stream, which first waits for the
caller's current stream and which the caller's stream waits for afterwards (the methods' flag waits must never
meet the legacy default stream's implicit synchronization); outputs are allocated on the caller's stream
before, so the caching allocator keeps them in its order.  On CPU the emulated streams run the op and the call
returns once they are idle (`HostDevice.synchronize`), so tensors are ready when autograd sees them.
"""

from __future__ import annotations

import atexit
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from overlap_runtime.config import Method, OverlapConfig, check_config, uses_rs_dgrad
from overlap_runtime.device import CudaDevice, Device
from overlap_runtime.emulation import HostDevice
from overlap_runtime.errors import ConfigError, ShapeError
from overlap_runtime.layers import COLUMN_LAYERS, DEFAULT_WAIT_TIMEOUT_S, NO_OVERLAP, ROW_LAYERS, LinearOverlap
from overlap_runtime.methods.common import BULK_GATHERED, Operands, Plan, run
from overlap_runtime.shape import Collective, Slot, SlotGemm
from overlap_runtime.watchdog import Watchdog


def _tp_group(process_group: Any, mesh_dim: int | str | None) -> Any:
    """The process group of ``process_group`` (a group, a DeviceMesh and its ``mesh_dim``, or None: WORLD)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(process_group, DeviceMesh):
        if mesh_dim is None and process_group.ndim > 1:
            raise ShapeError("mesh_dim", "must name the TP dimension of a DeviceMesh of several dims", None)
        return process_group.get_group(mesh_dim or 0)
    if mesh_dim is not None:
        raise ShapeError("mesh_dim", "is given only with a DeviceMesh", mesh_dim)
    return dist.group.WORLD if process_group is None else process_group


class TPContext:
    """One process's overlap runtime on one TP group: its `Device` and the `Operands` of every GEMM problem run
    on it, by (problem, dtype), reused by every layer, call and step (symmetric memory and flags are mapped
    collectively, once).  `of` keeps one per group, device and timeout in this process."""

    _contexts: ClassVar[dict[tuple[str, str, float], TPContext]] = {}
    """Per-process registry, as torch keeps its groups': every layer on a group must share one context, or
    each would map its own symmetric buffers and flags."""

    def __init__(self, group: Any, device: torch.device, *, wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S) -> None:
        if wait_timeout_s <= 0:
            raise ShapeError("wait_timeout_s", "must be positive", wait_timeout_s)
        self.group = group
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.backend = "cuda" if device.type == "cuda" else "cpu"
        self.dev: Device
        self.watchdog: Watchdog | None = None
        if self.backend == "cuda":
            self.dev = CudaDevice(rank=rank, tp=tp, device=device, group=group)
            self.watchdog = Watchdog(wait_timeout_s)
        else:
            self.dev = HostDevice(rank=rank, tp=tp, device=device, group=group, wait_limit_s=wait_timeout_s)
        self._operands: dict[tuple[SlotGemm, torch.dtype], Operands] = {}

    @classmethod
    def of(cls, group: Any, device: torch.device, *, wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S) -> TPContext:
        key = (group.group_name, str(device), wait_timeout_s)
        if not cls._contexts:
            atexit.register(cls.release_all)
        if key not in cls._contexts:
            cls._contexts[key] = cls(group, device, wait_timeout_s=wait_timeout_s)
        return cls._contexts[key]

    @classmethod
    def release_all(cls) -> None:
        """Let go of every context's process groups (run at exit, before the interpreter finalizes).

        Kept alive by this registry, a group the user destroyed would keep its worker threads until
        finalization, and a gloo worker that drops its last work then (the tensors of the training loop's last
        all-reduce) needs the GIL, cannot have it, and aborts the process: "terminate called without an active
        exception".  Released here, the group's destructor joins its workers while Python still runs."""
        for context in cls._contexts.values():
            context.dev.release_groups()
            context.group = None
        cls._contexts.clear()

    @property
    def tp(self) -> int:
        return self.dev.tp

    def operands(self, gemm: SlotGemm, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Operands:
        """The problem's operands with this call's tensors (scratch and peer buffers kept)."""
        key = (gemm, a.dtype)
        if key not in self._operands:
            self._operands[key] = Operands(gemm=gemm, a=a, b=b, out=out)
        ops = self._operands[key]
        ops.a, ops.b, ops.out, ops.x, ops.y, ops.keep_gathered = a, b, out, None, None, False
        return ops

    def run(self, ops: Operands, plan: Plan) -> None:
        """Run ``plan`` on ``ops``: on return the outputs are the caller's (module docstring)."""
        if self.backend == "cpu":
            run(self.dev, ops, plan)
            self.dev.synchronize()
            return
        caller = torch.cuda.current_stream(self.dev.device)
        side = self.dev.stream("layer")
        side.wait_stream(caller)
        with self.dev.on(side):
            run(self.dev, ops, plan)
            done = self.dev.mark()
        caller.wait_stream(side)
        assert self.watchdog is not None
        self.watchdog.watch(done.query, f"{ops.gemm.slot.value} ({plan.method.value})")

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """A plain all-gather (what RS-dgrad's weight gradient needs and no slot overlaps)."""
        dist.all_gather_into_tensor(out, shard, group=self.group)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Gemm:
    """One GEMM of a layer: its slot's problem, config and plan."""

    gemm: SlotGemm
    config: OverlapConfig
    plan: Plan


def _column_gemms(layer: str, tokens: int, in_f: int, out_f: int, tp: int, dgrad: Method) -> dict[str, SlotGemm]:
    """The problems of a column-parallel layer (module docstring of `layers`), sized as `shape.gemm_dims`."""
    common = {"tokens": tokens, "hidden": in_f, "tp": tp}
    rs_dgrad = uses_rs_dgrad(Slot(f"{layer}_dgrad"), dgrad)
    ag, rs = Collective.ALL_GATHER, Collective.REDUCE_SCATTER
    return {
        "fprop": SlotGemm(slot=Slot(f"{layer}_fprop"), m=tokens, n=out_f // tp, k=in_f, collective=ag, coupled=True,
                          **common),
        "dgrad": SlotGemm(slot=Slot(f"{layer}_dgrad"), m=tokens, n=in_f, k=out_f // tp,
                          collective=rs if rs_dgrad else ag, coupled=rs_dgrad, **common),
        "wgrad": SlotGemm(slot=Slot(f"{layer}_wgrad"), m=out_f // tp, n=in_f, k=tokens, collective=rs, coupled=False,
                          **common),
    }  # fmt: skip


def _row_gemms(layer: str, tokens: int, in_f: int, out_f: int, tp: int) -> dict[str, SlotGemm]:
    common = {"tokens": tokens, "hidden": out_f, "tp": tp, "coupled": True}
    return {
        "fprop": SlotGemm(slot=Slot(f"{layer}_fprop"), m=tokens, n=out_f, k=in_f // tp,
                          collective=Collective.REDUCE_SCATTER, **common),
        "dgrad": SlotGemm(slot=Slot(f"{layer}_dgrad"), m=tokens, n=in_f // tp, k=out_f,
                          collective=Collective.ALL_GATHER, **common),
    }  # fmt: skip


class _ParallelLinear(nn.Module):
    """What both layers share: the group, the shard, the parameters and the per-token-count GEMM plans."""

    layers: ClassVar[tuple[str, ...]]
    roles: ClassVar[tuple[str, ...]]
    sharded: ClassVar[str]
    """Which of in_features / out_features the TP group splits."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        process_group: Any = None,
        mesh_dim: int | str | None = None,
        overlap: LinearOverlap | None = None,
        layer: str | None = None,
        tokens: int | None = None,
        wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        group = _tp_group(process_group, mesh_dim)
        device = torch.device(device) if device is not None else torch.empty(0).device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.context = TPContext.of(group, device, wait_timeout_s=wait_timeout_s)
        self.tp = tp = self.context.tp
        self.layer = layer or self.layers[0]
        if self.layer not in self.layers:
            raise ShapeError("layer", f"must be one of {', '.join(self.layers)}", self.layer)
        features = {"in_features": in_features, "out_features": out_features}
        for name, value in features.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ShapeError(name, "must be a positive integer", value)
        if features[self.sharded] % tp:
            raise ShapeError(self.sharded, f"must be divisible by the TP group's size {tp}", features[self.sharded])
        self.in_features, self.out_features = in_features, out_features
        self.overlap = overlap or LinearOverlap()
        for role in ("fprop", "dgrad", "wgrad"):
            if role not in self.roles and getattr(self.overlap, role) != NO_OVERLAP:
                raise ConfigError(
                    f"{self.layer}_{role}", "a row-parallel weight gradient has no collective to overlap; leave it none"
                )
        kw = {"device": device, "dtype": dtype}
        shard = (
            (out_features // tp, in_features) if self.sharded == "out_features" else (out_features, in_features // tp)
        )
        self.weight = nn.Parameter(torch.empty(shard, **kw))
        bias_len = out_features // tp if self.sharded == "out_features" else out_features
        self.bias = nn.Parameter(torch.empty(bias_len, **kw)) if bias else None
        self._gemms: dict[int, dict[str, _Gemm]] = {}
        self.reset_parameters()
        self.gemms(tokens or tp)  # every config checked against the shape now, not at the first step

    def reset_parameters(self) -> None:
        """nn.Linear's uniform bound over the full fan-in for the weight shard (Megatron shards an initialized
        full weight); biases start at zero, as in Megatron, so a replicated bias is equal on every rank."""
        bound = 1 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp={self.tp}, layer={self.layer}"
        )

    def problems(self, tokens: int) -> dict[str, SlotGemm]:
        raise NotImplementedError

    def gemms(self, tokens: int) -> dict[str, _Gemm]:
        """The layer's GEMMs at ``tokens`` tokens of the TP group, each config checked (once per token count)."""
        if tokens not in self._gemms:
            if tokens % self.tp:
                raise ShapeError("tokens", f"must be divisible by the TP group's size {self.tp} (sequence parallel)",
                                 tokens)  # fmt: skip
            gemms = {}
            for role, gemm in self.problems(tokens).items():
                config = getattr(self.overlap, role)
                try:
                    check_config(config, gemm, backend=self.context.backend)
                except ConfigError as e:
                    raise ConfigError(f"{gemm.slot.value}.{e.field}", e.rule, e.value) from None
                gemms[role] = _Gemm(gemm=gemm, config=config, plan=Plan.resolve(config, self.context.dev))
            self._check_pair(gemms)
            self._gemms[tokens] = gemms
        return self._gemms[tokens]

    def _check_pair(self, gemms: dict[str, _Gemm]) -> None:
        pass


def _fprop(
    ctx: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layer: Any,
    *,
    tokens: int,
    out_rows: int,
) -> torch.Tensor:
    """The forward of either layer: its fprop slot's overlapped GEMM over ``tokens`` into ``out_rows`` rows."""
    c, g = layer.context, layer.gemms(tokens)
    x = x.contiguous()
    out = torch.empty(out_rows, weight.shape[0], dtype=x.dtype, device=x.device)
    c.run(c.operands(g["fprop"].gemm, x, weight.t(), out), g["fprop"].plan)
    ctx.save_for_backward(x, weight)
    ctx.layer, ctx.has_bias = layer, bias is not None
    return out if bias is None else out + bias


class _ColumnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Any) -> torch.Tensor:
        # The local shard all-gathered into the GEMM: tp times its rows in the output.
        return _fprop(ctx, x, weight, bias, layer, tokens=x.shape[0] * layer.tp, out_rows=x.shape[0] * layer.tp)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        c, dy = layer.context, dy.contiguous()
        g = layer.gemms(dy.shape[0])
        dgrad, wgrad = g["dgrad"], g["wgrad"]
        tokens, rows = dy.shape[0], x.shape[0]
        dw = torch.empty_like(weight)
        if dgrad.gemm.coupled:  # RS-dgrad: dX reduce-scattered with the GEMM; x gathered on its own
            dx = torch.empty_like(x)
            c.run(c.operands(dgrad.gemm, dy, weight, dx), dgrad.plan)
            gathered = torch.empty(tokens, x.shape[1], dtype=x.dtype, device=x.device)
            c.all_gather(gathered, x)
            torch.mm(dy.t(), gathered, out=dw)
        else:  # bulk: x gathered beside dX = dY @ W, then dX reduce-scattered beside dW = dY.T @ x
            dx_full = torch.empty(tokens, x.shape[1], dtype=x.dtype, device=x.device)
            ops = c.operands(dgrad.gemm, dy, weight, dx_full)
            ops.x = x
            if dgrad.plan.use_ce:  # the copy-engine bulk all-gather pushes straight into y's peer buffer
                ops.y = ops.peer_buffer(c.dev, BULK_GATHERED, (tokens, x.shape[1]), x.dtype).local
            else:
                ops.y = ops.buffer("x_gathered", (tokens, x.shape[1]), x.dtype)
            c.run(ops, dgrad.plan)
            dx = torch.empty(rows, x.shape[1], dtype=x.dtype, device=x.device)
            ops = c.operands(wgrad.gemm, dy.t(), ops.y, dw)
            ops.x, ops.y = dx_full, dx
            c.run(ops, wgrad.plan)
        db = dy.sum(0) if ctx.has_bias else None
        return dx, dw, db, None


class _RowFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Any) -> torch.Tensor:
        # The whole sequence in, its reduce-scattered share out.
        return _fprop(ctx, x, weight, bias, layer, tokens=x.shape[0], out_rows=x.shape[0] // layer.tp)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        c, dy = layer.context, dy.contiguous()
        dgrad = layer.gemms(x.shape[0])["dgrad"]
        dx = torch.empty_like(x)
        ops = c.operands(dgrad.gemm, dy, weight, dx)
        ops.keep_gathered = True  # dW reads the gathered dY
        c.run(ops, dgrad.plan)
        gathered = ops.gathered()
        dw = gathered.t() @ x
        db = gathered.sum(0) if ctx.has_bias else None
        return dx, dw, db, None


class ColumnParallelLinear(_ParallelLinear):
    """``y = all_gather(x) @ W.T + b`` with W split by output features (see `overlap_runtime.layers`).

    ``overlap``: the configs of its fprop, dgrad and wgrad slots (none: no overlap); ``layer``: qkv or fc1, the
    slots it stands for; ``tokens``: the TP group's tokens (seq * mbs), if known, to check the configs at that
    count now (others are checked at their first call); ``process_group`` a group or a DeviceMesh with
    ``mesh_dim``; ``wait_timeout_s``: how long a wait for a peer may block (CPU backend)."""

    layers = COLUMN_LAYERS
    roles = ("fprop", "dgrad", "wgrad")
    sharded = "out_features"
    function: ClassVar[type[torch.autograd.Function]] = _ColumnFn

    def problems(self, tokens: int) -> dict[str, SlotGemm]:
        return _column_gemms(
            self.layer, tokens, self.in_features, self.out_features, self.tp, self.overlap.dgrad.method
        )

    def _check_pair(self, gemms: dict[str, _Gemm]) -> None:
        if gemms["dgrad"].gemm.coupled and self.overlap.wgrad != NO_OVERLAP:
            raise ConfigError(
                f"{self.layer}_wgrad",
                f"cannot overlap while {self.layer}_dgrad reduce-scatters under {self.overlap.dgrad.method.value} "
                "(TE drops the slot); leave it none",
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ShapeError("input", f"last dim must be in_features={self.in_features}", tuple(x.shape))
        lead = (x.shape[0] * self.tp, *x.shape[1:-1])
        y = self.function.apply(x.reshape(-1, self.in_features), self.weight, self.bias, self)
        return y.view(*lead, self.out_features // self.tp)


class RowParallelLinear(_ParallelLinear):
    """``y = reduce_scatter(x @ W.T) + b`` with W split by input features (see `overlap_runtime.layers`);
    arguments as `ColumnParallelLinear`'s (``layer``: proj or fc2; no wgrad slot)."""

    layers = ROW_LAYERS
    roles = ("fprop", "dgrad")
    sharded = "in_features"
    function: ClassVar[type[torch.autograd.Function]] = _RowFn

    def problems(self, tokens: int) -> dict[str, SlotGemm]:
        return _row_gemms(self.layer, tokens, self.in_features, self.out_features, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.in_features // self.tp
        if x.shape[-1] != local:
            raise ShapeError("input", f"last dim must be in_features / tp = {local}", tuple(x.shape))
        if x.shape[0] % self.tp:
            raise ShapeError("input", f"first (sequence) dim must be divisible by tp={self.tp}", tuple(x.shape))
        lead = (x.shape[0] // self.tp, *x.shape[1:-1])
        y = self.function.apply(x.reshape(-1, local), self.weight, self.bias, self)
        return y.view(*lead, self.out_features)
