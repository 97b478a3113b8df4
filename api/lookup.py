"""Answering "what is the best config for this shape": stored winners first, else the nearest known preset.

Both ``GET /v1/best`` and ``GET /v1/presets`` ask the same question.  A measured answer comes from the best
configs this service stored for exactly (hidden, tp, mbs, seq); when there are none, the nearest of NVIDIA's
presets answers instead, and every response says ``measured: false`` with its source and distance, so a
guess is never passed off as a measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Query
from sqlalchemy.orm import Session

import storage
from api.schemas import BestGroup, BestLayer, NearestPublic
from autotune.gpu import gpu_matches, preset_gpu_name
from autotune.outcome import SlotOutcome
from overlap_runtime.config import OverlapConfig
from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import Preset, PresetRegistry, SlotResult, preset_from_results
from search_spaces.te_dict import te_entry
from storage import BestConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeQuery:
    """The shape asked about, and the optional GPU model and dtype filters."""

    shape: ModelShape
    gpu: str | None
    dtype: str | None
    exact: bool
    """Whether the optional widths (ffn_hidden, heads, gated, cp) were given: then only that shape key matches."""


async def shape_query(
    hidden: Annotated[int, Query(ge=1, le=1 << 20)],
    tp: Annotated[int, Query(ge=1, le=1024)],
    seq: Annotated[int, Query(ge=1, le=1 << 24)],
    mbs: Annotated[int, Query(ge=1, le=1 << 16)] = 1,
    gpu: Annotated[
        str | None, Query(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._()/:+-]*$")
    ] = None,
    dtype: Annotated[str | None, Query(pattern="^(bf16|fp8)$")] = None,
    ffn_hidden: Annotated[int | None, Query(ge=1, le=1 << 22)] = None,
    num_heads: Annotated[int | None, Query(ge=1, le=1 << 16)] = None,
    num_query_groups: Annotated[int | None, Query(ge=1, le=1 << 16)] = None,
    gated: bool | None = None,
    cp: Annotated[int | None, Query(ge=1, le=1024)] = None,
) -> ShapeQuery:
    """Query parameters -> a validated shape (a 422 naming the field when TE could not run it)."""
    shape = ModelShape(
        hidden=hidden,
        tp=tp,
        mbs=mbs,
        seq=seq,
        ffn_hidden=ffn_hidden,
        num_heads=num_heads,
        num_query_groups=num_query_groups,
        gated=bool(gated),
        dtype=dtype or "bf16",
        cp=cp or 1,
    )
    exact = any(v is not None for v in (ffn_hidden, num_heads, num_query_groups, gated, cp))
    return ShapeQuery(shape=shape, gpu=gpu, dtype=dtype, exact=exact)


ShapeQueryDep = Annotated[ShapeQuery, Depends(shape_query)]


def measured_groups(*, session: Session, query: ShapeQuery) -> list[BestGroup]:
    """The stored winners for the shape, one group per GPU model and shape key, slots in catalog order."""
    s = query.shape
    rows = storage.get_best(session=session, hidden=s.hidden, tp=s.tp, mbs=s.mbs, seq=s.seq, dtype=query.dtype)
    if query.gpu is not None:
        rows = [r for r in rows if gpu_matches(r.gpu, query.gpu)]
    if query.exact:
        rows = [r for r in rows if r.shape_key == s.key]
    groups: dict[tuple[str, str], list[BestConfig]] = {}
    for row in rows:
        groups.setdefault((row.gpu, row.shape_key), []).append(row)
    order = {slot.value: i for i, slot in enumerate(Slot)}
    return [
        BestGroup(
            gpu=gpu,
            dtype=members[0].dtype,
            shape_key=key,
            shape=members[0].shape,
            layers=[_layer(r) for r in sorted(members, key=lambda r: order.get(r.slot, len(order)))],
        )
        for (gpu, key), members in groups.items()
    ]


def _layer(row: BestConfig) -> BestLayer:
    outcome = (row.spread or {}).get("outcome")
    return BestLayer(
        slot=row.slot,
        config=row.config,
        measurement=row.measurement,
        outcome=outcome,
        job_id=row.job_id,
        updated_at=row.updated_at,
    )


def nearest(*, registry: PresetRegistry, query: ShapeQuery) -> tuple[Preset, NearestPublic, list[BestLayer]]:
    """The nearest known preset, described, with its per-slot TE entries (and no measurement)."""
    gpu = None if query.gpu is None else preset_gpu_name(query.gpu) or query.gpu.lower()
    preset, distance = registry.nearest(query.shape, gpu=gpu, dtype=query.dtype)
    described = NearestPublic(
        source=preset.source or "unknown",
        distance=round(distance, 4),
        shape=preset.shape.to_dict() if preset.shape is not None else {},
        gpu=preset.gpu,
        dtype=preset.dtype,
    )
    layers = [
        BestLayer(slot=slot.value, config=te_entry(slot, config), measurement=None, note=preset.notes.get(slot))
        for slot, config in preset.configs.items()
    ]
    return preset, described, layers


def measured_preset(group: BestGroup) -> Preset:
    """The preset a measured group exports, under the export rule (docs/export.md, `preset_from_results`)."""
    results = {Slot(layer.slot): _slot_result(layer) for layer in group.layers}
    shape = ModelShape(**group.shape)
    return preset_from_results(shape, results, gpu=preset_gpu_name(group.gpu))


def _slot_result(layer: BestLayer) -> SlotResult:
    """The export input of one stored winner; without the tuner's outcome (a winner recorded by another writer,
    such as an older `autotune tune`), only the winner itself is known, and the export rule says so."""
    if layer.outcome is not None:
        return SlotOutcome.from_dict(layer.outcome).slot_result()
    best_ms = (layer.measurement or {}).get("overlap_ms")
    return SlotResult(best=OverlapConfig.from_dict(layer.config), best_ms=math.inf if best_ms is None else best_ms)


def one_group(groups: list[BestGroup]) -> BestGroup:
    """The single group a preset can be made of; a 422 naming what to add to the query when several match."""
    gpus = sorted({g.gpu for g in groups})
    if len(gpus) > 1:
        raise InputError("gpu", f"several GPU models have results for this shape; pick one of: {', '.join(gpus)}")
    if len(groups) > 1:
        keys = ", ".join(sorted(g.shape_key for g in groups))
        raise InputError(
            "ffn_hidden",
            f"several shapes match; add ffn_hidden, num_heads, num_query_groups, gated or cp to pick one of: {keys}",
        )
    return groups[0]
