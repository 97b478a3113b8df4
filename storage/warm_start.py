"""Warm start: the winners of neighbouring shapes already in the database seed a new slot study.

A study for h8192 s8192 on an H200 starts from what won h8192 s4096 and h12288 s8192 on H200s at the same
tp and dtype, nearest first (doublings of tokens and width, `search_spaces.registry.shape_distance`).
They join a new `SlotStudy`'s baselines, measured right after its own; any its space does not hold is skipped.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from overlap_runtime.config import OverlapConfig
from overlap_runtime.shape import ModelShape, Slot
from search_spaces.registry import shape_distance
from storage.best import list_winners

NEIGHBOURS = 2
"""Winners taken: more would crowd out the sampler's own start-up trials for little gain."""


def neighbour_winners(
    *, session: Session, gpu: str, shape: ModelShape, slot: Slot, limit: int = NEIGHBOURS
) -> tuple[OverlapConfig, ...]:
    """The overlap winners of ``slot`` on ``gpu`` for the shapes nearest ``shape`` (never ``shape`` itself)."""
    own = shape.key
    rows = [
        row
        for row in list_winners(session=session, gpu=gpu, slot=Slot(slot).value, tp=shape.tp, dtype=shape.dtype)
        if row.shape_key != own
    ]
    rows.sort(key=lambda row: shape_distance(shape, ModelShape(**row.shape)))
    configs: list[OverlapConfig] = []
    for row in rows:
        config = OverlapConfig.from_dict(row.config)
        if config.overlaps and config not in configs:  # no overlap is a baseline of every study
            configs.append(config)
    return tuple(configs[:limit])
