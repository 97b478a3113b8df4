"""What every trial reports (the measurement contract: docs/measurement.md)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

REL_ERR_LIMIT = {"bf16": 2e-2}
"""Largest relative error (||out - ref|| / ||ref||) against the serial reference that counts as correct."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """One config of one slot of one shape on one TP group; times in ms, slowest rank, median of repeats."""

    gemm_ms: float
    """The full GEMM alone, all SMs, the library GEMM (cached per shape and slot)."""
    comm_ms: float
    """The collective alone, NCCL / gloo (cached per shape and slot)."""
    serial_ms: float
    """Collective and GEMM back to back: what you pay without overlap."""
    overlap_ms: float
    """The overlapped op under this config."""
    rel_err: float
    """||out - serial reference|| / ||reference||, worst rank."""
    cv: float
    """Spread of the overlap repeats: std / mean of the per-repeat slowest-rank times."""
    repeats: int
    valid: bool
    """False when the output is wrong (rel_err over the limit or not finite): never a best config."""
    samples: tuple[float, ...] = ()
    """Every repeat's slowest-rank time (ms): the raw data behind overlap_ms and cv."""

    @property
    def exposed_ms(self) -> float:
        return self.overlap_ms - self.gemm_ms

    @property
    def hidden_frac(self) -> float:
        """Share of comm_ms hidden behind the GEMM; below 0 when overlapping costs more than it hides."""
        return 1.0 - self.exposed_ms / self.comm_ms if self.comm_ms > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["samples"] = list(self.samples)
        out["exposed_ms"] = self.exposed_ms
        out["hidden_frac"] = self.hidden_frac
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: (math.inf if v is None and k != "valid" else v) for k, v in data.items() if k in names}
        fields["samples"] = tuple(fields.get("samples", ()))
        return cls(**fields)
