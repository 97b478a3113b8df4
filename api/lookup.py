"""Answering "what is the best config for this shape": stored winners first, else the nearest known preset.

Both ``GET /v1/best`` and ``GET /v1/presets`` ask the same question.  A measured answer comes from the best
configs this service stored for exactly (hidden, tp, mbs, seq), narrowed by each filter field given
(ffn_hidden, gated, cp, ...: `ModelShape`'s fields marked as filters; one left out matches any value); when
there are none, the nearest of NVIDIA's presets answers instead, and every response says ``measured: false``
with its source and distance, so a guess is never passed off as a measurement.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from sqlalchemy.orm import Session

import storage
from api.schemas import (
    AlternativePublic,
    BestGroup,
    BestLayer,
    ConsumerEntry,
    ConsumerPublic,
    NearestLayer,
    NearestPublic,
    OutcomePublic,
    OverlapConfigBody,
    TeEntryBody,
    TeExactPublic,
)
from autotune.tuner.gpu import gpu_matches, preset_gpu_name
from overlap_runtime.errors import InputError
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import Consumer, OursPreset, OursSlot, Preset, PresetRegistry, SlotResult, preset_from_results
from search_spaces.consumers import rendered
from search_spaces.export import consumer_choice
from search_spaces.registry import result_distance
from search_spaces.shape_query import FILTERS, ShapeQuery
from search_spaces.te_dict import te_entry
from storage import BestConfig


def measured_groups(*, session: Session, query: ShapeQuery) -> list[BestGroup]:
    """The stored winners for the shape, one group per GPU model and shape key, slots in catalog order."""
    rows = storage.get_best(session=session, shape=query.shape, dtype=query.dtype)
    rows = [r for r in rows if query.matches(ModelShape(**r.shape))]
    if query.gpu is not None:
        rows = [r for r in rows if gpu_matches(r.gpu, query.gpu)]
    return _groups(rows)


def _groups(rows: list[BestConfig]) -> list[BestGroup]:
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
    outcome = row.outcome
    te_exact = None
    if row.te_exact_config is not None and row.te_exact_measurement is not None:
        te_exact = TeExactPublic(
            config=OverlapConfigBody.model_validate(row.te_exact_config), measurement=row.te_exact_measurement
        )
    return BestLayer(
        slot=row.slot,
        config=OverlapConfigBody.model_validate(row.config),
        measurement=row.measurement,
        te_exact=te_exact,
        outcome=None if outcome is None else OutcomePublic.model_validate(outcome),
        job_id=row.job_id,
        updated_at=row.updated_at,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class TunedNearby:
    """A shape tuned here, and how far it is from the one asked for (`search_spaces.registry`'s distance)."""

    result: storage.TunedResult
    distance: float

    def text(self) -> str:
        return f"{self.result.shape.key} on {self.result.gpu} ({self.distance:.3g} doublings away)"


def tuned_nearby(*, session: Session, query: ShapeQuery) -> list[TunedNearby]:
    """Every shape tuned here, nearest first, by the distance NVIDIA's presets are ranked by."""
    gpu, dtype = _wanted(query)
    found = [
        TunedNearby(
            result=r,
            distance=result_distance(query.shape, r.shape, _short(r.gpu), r.dtype, gpu=gpu, dtype=dtype),
        )
        for r in storage.tuned_results(session=session)
    ]
    return sorted(found, key=lambda t: (t.distance, t.result.shape.key, t.result.gpu))


def nearest(
    *, registry: PresetRegistry, session: Session, query: ShapeQuery, consumer: Consumer | None = None
) -> tuple[Preset, NearestPublic, list[NearestLayer]]:
    """The nearest preset, described, with its per-slot TE entries (and no measurement): a shape tuned here
    (its TE-exact winners for ``consumer``) or a known preset (NVIDIA's), whichever is nearer, a tuned one
    at a tie.  A query without a dtype asks for the shape's default (bf16): an FP8 preset is further away."""
    gpu, dtype = _wanted(query)
    preset, distance = registry.nearest(query.shape, gpu=gpu, dtype=dtype)
    for near in tuned_nearby(session=session, query=query):
        if near.distance > distance:
            break
        if (made := _tuned_preset(session, near.result, consumer)) is not None:
            preset, distance = made, near.distance
            break
    described = NearestPublic(
        source=preset.source or "unknown",
        distance=round(distance, 4),
        shape=preset.shape.to_dict() if preset.shape is not None else {},
        gpu=preset.gpu,
        dtype=preset.dtype,
    )
    layers = [
        NearestLayer(
            slot=slot.value,
            config=TeEntryBody.model_validate(te_entry(slot, config)),
            measurement=None,
            note=preset.notes.get(slot),
        )
        for slot, config in preset.configs.items()
    ]
    return preset, described, layers


def _tuned_preset(session: Session, result: storage.TunedResult, consumer: Consumer | None) -> Preset | None:
    """The preset a tuned result exports for ``consumer``; None where its winners break TE's rules (rows
    written by hand, not by a tuner)."""
    rows = storage.get_best(session=session, shape=result.shape, gpu=result.gpu, dtype=result.dtype)
    (group,) = _groups([r for r in rows if r.shape_key == result.shape.key])
    try:
        preset = measured_preset(group, consumer=consumer)
    except InputError:
        return None
    return dataclasses.replace(preset, source=f"tuned here: {result.gpu} {result.shape.key}")


def nearest_line(described: NearestPublic) -> str:
    """The nearest preset in one line: its distance, GPU and dtype (the file's header, the CLI's warning)."""
    return f"{described.source}, {described.distance:g} doublings away, GPU {described.gpu or 'any'}, dtype {described.dtype or 'unknown'}"


def _wanted(query: ShapeQuery) -> tuple[str | None, str]:
    """The GPU (NVIDIA's short name) and dtype a query asks for, as the distance compares them."""
    gpu = None if query.gpu is None else _short(query.gpu)
    return gpu, query.dtype or query.shape.dtype


def _short(gpu: str) -> str:
    return preset_gpu_name(gpu) or gpu.lower()


def measured_preset(group: BestGroup, *, consumer: Consumer | None = None) -> Preset:
    """The preset a measured group exports for ``consumer`` (None: per slot), under the export rule
    (docs/export.md, `preset_from_results`)."""
    results = {Slot(layer.slot): _slot_result(layer) for layer in group.layers}
    shape = ModelShape(**group.shape)
    return preset_from_results(shape, results, gpu=preset_gpu_name(group.gpu), consumer=consumer)


def with_consumer(group: BestGroup, consumer: Consumer) -> BestGroup:
    """``group`` with ``consumer``'s joint winner (`search_spaces.consumers.choose`) beside its per-slot ones."""
    return group.model_copy(update={"consumer": consumer_view(group.layers, consumer)})


def rows_view(rows: list[BestConfig], consumer: Consumer) -> ConsumerPublic:
    """``consumer``'s joint winner over stored winner rows (a job's)."""
    return consumer_view([_layer(row) for row in rows], consumer)


def consumer_view(layers: list[BestLayer], consumer: Consumer) -> ConsumerPublic:
    """``consumer``'s joint winner over stored winners: the switches, each slot's mode and config, and the
    other settings' summed times."""
    results = {Slot(layer.slot): _slot_result(layer) for layer in layers}
    choice = consumer_choice(results, consumer)
    entries = {
        slot.value: ConsumerEntry(
            mode=mode.value,
            config=None
            if (e := choice.entries.get(slot)) is None
            else OverlapConfigBody.model_validate(e.config.to_dict()),
            measurement=None if e is None else e.measurement.to_dict(),
        )
        for slot, mode in choice.chosen.modes.items()
        if slot in results
    }
    alternatives = [
        AlternativePublic(
            label=a.label(),
            changed=dict(a.changed),
            total_ms=a.total_ms,
            modes={slot.value: mode.value for slot, mode in a.modes.items() if slot in choice.coupled},
            unmeasured=[slot.value for slot in a.unmeasured],
        )
        for a in choice.alternatives
    ]
    return ConsumerPublic(
        consumer=consumer.value,
        switches=rendered(consumer, choice.chosen.setting),
        setting=dict(choice.chosen.setting),
        coupled=[slot.value for slot in choice.coupled],
        slots=entries,
        alternatives=alternatives,
    )


def measured_ours(group: BestGroup) -> OursPreset:
    """A measured group's overall winners (our runtime's), in our own format (`search_spaces.ours`)."""
    slots = {Slot(layer.slot): OursSlot.of(layer.config.to_config(), layer.measurement or {}) for layer in group.layers}
    return OursPreset(shape=ModelShape(**group.shape), gpu=group.gpu, slots=slots)


def _slot_result(layer: BestLayer) -> SlotResult:
    """The export input of one stored winner; without the tuner's outcome (a winner recorded by another writer,
    such as an older `autotune tune`), only the winner itself is known, and the export rule says so."""
    if layer.outcome is not None:
        return layer.outcome.to_outcome().slot_result()
    best_ms = (layer.measurement or {}).get("overlap_ms")
    exact = layer.te_exact
    return SlotResult(
        best=layer.config.to_config(),
        best_ms=math.inf if best_ms is None else best_ms,
        te_exact=None if exact is None else exact.config.to_config(),
        te_exact_measurement=None if exact is None else Measurement.from_dict(exact.measurement),
    )


def one_group(groups: list[BestGroup]) -> BestGroup:
    """The single group a preset can be made of; a 422 naming what to add to the query when several match."""
    gpus = sorted({g.gpu for g in groups})
    if len(gpus) > 1:
        raise InputError("gpu", f"several GPU models have results for this shape; pick one of: {', '.join(gpus)}")
    if len(groups) > 1:
        keys = ", ".join(sorted(g.shape_key for g in groups))
        names = f"{', '.join(FILTERS[:-1])} or {FILTERS[-1]}"
        raise InputError(FILTERS[0], f"several shapes match; add {names} to pick one of: {keys}")
    return groups[0]
