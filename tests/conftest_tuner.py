"""Landscapes and measurements built by hand for the tuner tests: known optimum, known noise, no GPU.

A synthetic landscape is a real slot space (the CUDA space of an H200-sized shape, which `search_spaces`
builds without a GPU) with a time per config from a formula, written in `bench/record_landscape.py`'s
format so it goes through the same loader as recorded ones.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from typing import Any

from autotune.tuner.replay import Landscape
from overlap_runtime.config import DeviceLimits, Method, OverlapConfig
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import ModelShape, Slot
from search_spaces.space import slot_space

H200 = DeviceLimits(sm_count=132)
SHAPE = ModelShape(hidden=8192, tp=2, seq=8192, ffn_hidden=28672)
GPU = "NVIDIA H200"


def smooth_time(config: OverlapConfig) -> float:
    """Pipeline with 4 splits on 8 SMs, cuBLAS, overlapping the first GEMM is best; no overlap is 1.126 ms."""
    if config.method == Method.NONE:
        return 1.126
    t = {Method.PIPELINE: 0.90, Method.RING_EXCHANGE: 0.96, Method.BULK: 1.0}[config.method]
    t += 0.03 * abs(math.log2((config.num_splits or 4) / 4)) + 0.02 * abs(math.log2((config.num_sm or 8) / 8))
    t += 0.02 * (config.gemm == "triton") - 0.01 * config.pipeline_rs_overlap_first_gemm
    t += 0.01 * abs((config.num_max_streams or 2) - 2) + 0.03 * (config.use_ce is False)
    return t


def landscape_dict(
    slot: Slot,
    *,
    shape: ModelShape = SHAPE,
    backend: str = "cuda",
    time_of: Callable[[OverlapConfig], float] = smooth_time,
    noise: float = 0.01,
    failing: Callable[[OverlapConfig], str | None] = lambda c: None,
    seed: int = 0,
) -> dict[str, Any]:
    """Every config of ``slot``'s space with 10 noisy repeats around ``time_of`` (or ``failing``'s reason), as
    recorded on an H200 (``backend`` "cuda") or on the CPU."""
    rng = random.Random(seed)
    limits = H200 if backend == "cuda" else None
    rows: list[dict[str, Any]] = []
    for config in slot_space(shape, slot, backend=backend, limits=limits).configs():
        reason = failing(config)
        if reason is not None:
            rows.append({"config": config.to_dict(), "error": reason})
            continue
        samples = [time_of(config) * (1 + rng.gauss(0, noise)) for _ in range(10)]
        rows.append(
            {"config": config.to_dict(), "measurement": measurement(statistics.median(samples), samples).to_dict()}
        )
    return {
        "environment": {"gpu": GPU} if backend == "cuda" else {},
        "shape": shape.to_dict(),
        "slot": slot.value,
        "backend": backend,
        "limits": None
        if limits is None
        else {"sm_count": limits.sm_count, "priority_range": list(limits.priority_range)},
        "repeats": 10,
        "configs": rows,
    }


def synthetic_landscape(slot: Slot, **kwargs: Any) -> Landscape:
    return Landscape.from_dict(landscape_dict(slot, **kwargs), source=f"synthetic {slot.value}")


def measurement(overlap_ms: float, samples: list[float] | None = None, *, valid: bool = True) -> Measurement:
    """A measurement of a 0.86 ms GEMM and 0.38 ms of comm (1.126 ms serial) taking ``overlap_ms``."""
    samples = samples or [overlap_ms] * 5
    mean = sum(samples) / len(samples)
    spread = math.sqrt(sum((s - mean) ** 2 for s in samples) / len(samples)) / mean
    return Measurement(
        gemm_ms=0.86,
        comm_ms=0.38,
        serial_ms=1.126,
        overlap_ms=overlap_ms,
        rel_err=1e-3 if valid else 0.5,
        cv=spread,
        repeats=len(samples),
        valid=valid,
        samples=tuple(samples),
    )
