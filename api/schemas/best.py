"""Answers to "what is the best config for this shape": ``GET /v1/best`` and the job view's verdicts."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from api.schemas.common import (
    OverlapConfigBody,
    TeEntryBody,
)
from autotune.tuner.outcome import SlotOutcome


class OutcomePublic(BaseModel):
    """`autotune.tuner.outcome.SlotOutcome.to_dict()`: the tuner's verdict on one slot."""

    slot: str
    best: OverlapConfigBody
    best_measurement: dict[str, Any]
    best_overlap: OverlapConfigBody | None = None
    """The fastest config that overlaps (what a preset carries when no overlap wins); may equal best."""
    best_overlap_measurement: dict[str, Any] | None = None
    te_default_measurement: dict[str, Any] | None = None
    """TE's default config re-measured with the finalists; None when it failed or was not run."""
    te_exact: OverlapConfigBody | None = None
    """The fastest config that TE runs exactly as measured; None when none ran correctly."""
    te_exact_measurement: dict[str, Any] | None = None
    modes: dict[str, dict[str, Any]] = {}
    """The fastest TE-exact config of each mode (bulk, rs_dgrad, overlap, off) with its measurement."""
    spread: float
    n_trials: int
    n_failed: int
    notes: list[str] = []
    gain_vs_te_default: float | None = None
    gain_vs_serial: float

    def to_outcome(self) -> SlotOutcome:
        return SlotOutcome.from_dict(self.model_dump())


Config = TypeVar("Config", bound=BaseModel)


class SlotAnswer(BaseModel, Generic[Config]):
    """One slot of an answer to "what is the best config for this shape"."""

    slot: str
    config: Config
    measurement: dict[str, Any] | None
    """The winner's measurement; None in a nearest-shape answer (nothing was measured for this shape)."""
    outcome: OutcomePublic | None = None
    """The tuner's verdict: the best overlap config, TE's default re-measured, spread, gains, trial counts."""
    job_id: str | None = None
    updated_at: datetime | None = None
    note: str | None = None


class TeExactPublic(BaseModel):
    """A slot's TE-exact winner: the fastest config TE runs exactly as measured, and that measurement."""

    config: OverlapConfigBody
    measurement: dict[str, Any]


class BestLayer(SlotAnswer[OverlapConfigBody]):
    """A stored winner of a slot, as measured: the overall winner (our runtime's) in ``config``."""

    te_exact: TeExactPublic | None = None
    """The slot's TE-exact winner, what the TE exports carry; None when none was measured."""


class NearestLayer(SlotAnswer[TeEntryBody]):
    """The nearest known preset's TE entry for a slot: nothing measured."""


class AlternativePublic(BaseModel):
    """One setting of a consumer's switches and the summed time of the slots they couple."""

    label: str
    """The switches it sets away from the consumer's defaults (``defaults`` when none)."""
    changed: dict[str, bool]
    total_ms: float | None
    """None when a mode it needs was never measured."""
    modes: dict[str, str]
    """What each slot runs under it (`search_spaces.consumers.Mode`)."""
    unmeasured: list[str] = []


class ConsumerEntry(BaseModel):
    mode: str
    config: OverlapConfigBody | None
    """The TE-exact config it runs in that mode; None for a slot switched off or a wgrad beside an RS-dgrad."""
    measurement: dict[str, Any] | None


class ConsumerPublic(BaseModel):
    """A consumer's winner (``?consumer=``): the switches it needs and what each slot then runs."""

    consumer: str
    switches: dict[str, Any]
    """In the consumer's own terms (`search_spaces.consumers.rendered`): megatron flags and config fields,
    Bridge's model config fields, te.TransformerLayer's or each TE module's arguments."""
    setting: dict[str, bool]
    coupled: list[str]
    """The slots whose modes the switches couple: the ones the sums add up."""
    slots: dict[str, ConsumerEntry]
    alternatives: list[AlternativePublic]
    """Every distinct setting, the chosen one first, then fastest first."""


class BestGroup(BaseModel):
    gpu: str
    dtype: str
    shape_key: str
    shape: dict[str, Any]
    layers: list[BestLayer]
    consumer: ConsumerPublic | None = None
    """With ``?consumer=``: that consumer's joint winner; the layers keep the per-slot winners."""


class NearestPublic(BaseModel):
    source: str
    """Where the preset comes from (an NVIDIA preset file)."""
    distance: float
    """How far its shape is from the one asked for, in doublings (`search_spaces.registry`)."""
    shape: dict[str, Any]
    gpu: str | None
    dtype: str | None


class BestPublic(BaseModel):
    measured: bool
    """True: measured by this service for exactly this shape. False: the nearest known preset, not measured."""
    results: list[BestGroup]
    """One group per GPU model and shape key that was measured (empty when ``measured`` is false)."""
    nearest: NearestPublic | None
    nearest_layers: list[NearestLayer]
    """The nearest preset's configs when nothing was measured (never passed off as measured)."""
