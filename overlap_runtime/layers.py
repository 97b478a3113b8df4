"""Tensor-parallel linear layers for PyTorch models whose collectives overlap their GEMMs (Megatron/TE semantics,
sequence parallel), configured per GEMM from a tuned preset.

Shapes per rank (T tokens of the TP group, P = its size, rows = T/P; leading dims are kept, the first one is the
sequence dimension that sequence parallelism splits, as in Megatron's [s, b, h]):

- `ColumnParallelLinear(in, out)` (qkv, fc1): input [rows, in] -> output [T, out/P]; weight [out/P, in].
  fprop: all-gather(x) @ W.T (slot ``<layer>_fprop``, coupled all-gather); dgrad: dY @ W, reduce-scattered
  to [rows, in] (``<layer>_dgrad``: under bulk the all-gather of x for the weight gradient runs beside it, under
  ring_exchange or pipeline its output is reduce-scattered chunk by chunk, TE's RS-dgrad); wgrad: dY.T @
  all-gather(x) (``<layer>_wgrad``: under bulk the reduce-scatter of dX runs beside it; none under RS-dgrad,
  where TE drops the slot).
- `RowParallelLinear(in, out)` (proj, fc2): input [T, in/P] -> output [rows, out]; weight [out, in/P].
  fprop: reduce-scatter(x @ W.T) (``<layer>_fprop``); dgrad: all-gather(dY) @ W (``<layer>_dgrad``); wgrad:
  all-gather(dY).T @ x from the dgrad's gathered dY (no collective of its own).

Each GEMM runs the config of its slot in a `LinearOverlap` (`methods`: ring_exchange, pipeline, bulk, none);
with none given, nothing overlaps.  ``search_spaces.layer_configs`` turns a preset file into
`TransformerOverlap`.  A layer runs on the process group it is given (or one dimension of a ``DeviceMesh``)
and checks at construction that its configs can run its shape (`ConfigError` / `ShapeError` naming the slot's
field).  All layers of a process on one group share one `TPContext`: its device and the operands of every
GEMM problem (symmetric buffers, flags, scratch), set up on first use and reused across calls and steps.

A peer that stops answering (a rank died) fails the waiting rank after ``wait_timeout_s``: on the CPU backend
every wait (flag, event, collective) is bounded and the call raises; on CUDA, where a stream's wait cannot be
stopped, `watchdog` reports the op and ends the process (docs/architecture.md, Library layers).

This module imports no torch: `ColumnParallelLinear`, `RowParallelLinear` and `TPContext` are loaded from
`overlap_runtime.tp_linear` on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from overlap_runtime.config import NO_OVERLAP, OverlapConfig
from overlap_runtime.shape import EXTERNAL_SLOTS, Slot

DEFAULT_WAIT_TIMEOUT_S = 60.0
"""How long a layer's wait for a peer (flag, event, collective) may block before the rank fails: far above any
one op of a layer, far below "forever"."""
COLUMN_LAYERS = ("qkv", "fc1")
ROW_LAYERS = ("proj", "fc2")
ROLES = ("fprop", "dgrad", "wgrad")
_LAZY = ("ColumnParallelLinear", "RowParallelLinear", "TPContext")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearOverlap:
    """The overlap configs of one linear layer's three GEMMs (each runtime config, `OverlapConfig`)."""

    fprop: OverlapConfig = NO_OVERLAP
    dgrad: OverlapConfig = NO_OVERLAP
    wgrad: OverlapConfig = NO_OVERLAP
    """Column-parallel layers only (a row-parallel layer's weight gradient has no collective)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformerOverlap:
    """A transformer layer's four linear layers, as a preset configures them."""

    qkv: LinearOverlap = LinearOverlap()
    proj: LinearOverlap = LinearOverlap()
    fc1: LinearOverlap = LinearOverlap()
    fc2: LinearOverlap = LinearOverlap()

    @classmethod
    def from_slots(cls, configs: Mapping[Slot, OverlapConfig]) -> TransformerOverlap:
        """One runtime config per slot -> the layers' configs; slots left out run no overlap.  TE's external
        wgrad slots (MXFP8 only) configure nothing here: a row-parallel wgrad has no collective."""
        by_slot = {Slot(slot): config for slot, config in configs.items() if Slot(slot) not in EXTERNAL_SLOTS}
        layers = {}
        for name in (*COLUMN_LAYERS, *ROW_LAYERS):
            roles = {role: by_slot[Slot(f"{name}_{role}")] for role in ROLES if Slot(f"{name}_{role}") in by_slot}
            layers[name] = LinearOverlap(**roles)
        return cls(**layers)

    def slots(self) -> dict[Slot, OverlapConfig]:
        """The configs by slot (what `from_slots` reads back), no-overlap ones included."""
        out = {}
        for name in (*COLUMN_LAYERS, *ROW_LAYERS):
            linear = getattr(self, name)
            for role in ROLES if name in COLUMN_LAYERS else ROLES[:2]:
                out[Slot(f"{name}_{role}")] = getattr(linear, role)
        return out

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {slot.value: config.to_dict() for slot, config in self.slots().items()}


def __getattr__(name: str) -> Any:
    # The torch classes load on first use, so `import overlap_runtime.layers` stays torch-free.
    if name in _LAZY:
        from overlap_runtime import tp_linear

        return getattr(tp_linear, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
