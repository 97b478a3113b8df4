"""Jobs and their trials: what ``POST /v1/jobs`` takes and what the job and trial views answer."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from api.schemas.best import ConsumerPublic
from api.schemas.common import (
    BackendField,
    Name,
    OverlapConfigBody,
    ProposalBody,
    ShapeCreate,
    Strict,
)
from search_spaces.consumers import Consumer

MAX_FIRST_CONFIGS = 16
"""Configs a job may ask to measure first per slot: each one is a trial of the slot's budget."""


class JobCreate(Strict):
    shape: ShapeCreate
    layers: Annotated[list[Annotated[str, Field(max_length=64)]], Field(min_length=1, max_length=16)] | None = None
    """Slots to tune (TE's names); all ten tunable ones when left out."""
    n_trials: Annotated[int, Field(ge=1, le=10_000)] = 30
    """Trials per slot."""
    backend: BackendField | None = None
    """Where trials run; the controller's default (cuda, or its local worker's backend) when left out."""
    gpu: Name | None = None
    """GPU model the trials must run on, as NVML names it (``NVIDIA H200``, any case) or short (``h200``); any
    model when left out.  Once the job starts it carries the full name of the model it runs on."""
    measure_first: (
        Annotated[
            dict[
                Annotated[str, Field(max_length=64)],
                Annotated[list[OverlapConfigBody], Field(min_length=1, max_length=MAX_FIRST_CONFIGS)],
            ],
            Field(max_length=16),
        ]
        | None
    ) = None
    """Configs to measure first, per slot (TE's names, slots the job tunes): with the baselines, before the
    search proposes anything.  Each must be one the runtime runs for the slot on the job's backend, else a
    422 names the slot and the knob; one outside the slot's search space is measured as given.  They seed a study when it is created: a shape, slot and GPU model
    already tuned keep the study they have."""

    consumer: Annotated[Consumer, Field(strict=False)] | None = None  # JSON gives the name: not strict for enums
    """Who will run the presets (megatron, bridge, te-layer, te-modules): the job view then shows that
    consumer's joint winner, the switches it needs and the other settings' summed times."""


class JobAccepted(BaseModel):
    id: str
    status: str


class Progress(BaseModel):
    done: int
    """Trials finished (complete or failed) over all slots."""
    total: int
    """Trials planned: n_trials per slot still running (or what it ran, when finalists took it past that), and
    what a decided slot ran (early stopping ends a slot sooner), so ``done`` never exceeds ``total``."""
    fraction: float
    """0..1, the mean of the slots' fractions; 1 only once every slot is decided, when done equals total."""


class BestSoFar(BaseModel):
    trial_id: int | None
    """The trial that measured it (None when the slot was decided from an earlier job's study)."""
    config: OverlapConfigBody
    measurement: dict[str, Any]
    final: bool
    """True once the slot is decided (the finalists' winner); False for the fastest trial so far."""


class SlotPublic(BaseModel):
    slot: str
    status: str
    n_complete: int
    n_failed: int
    best: BestSoFar | None
    """The fastest valid config measured so far (the final winner once the slot has finished)."""
    te_exact: BestSoFar | None = None
    """The fastest valid config so far that TE runs exactly as measured (the slot's TE-exact winner once it has
    finished); None while none was measured."""


class JobSummary(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    status: str
    shape: dict[str, Any]
    shape_key: str
    layers: list[str]
    n_trials: int
    backend: str
    gpu: str | None
    measure_first: dict[str, list[OverlapConfigBody]] | None
    consumer: str | None = None
    error: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class JobPublic(JobSummary):
    progress: Progress
    slots: list[SlotPublic]
    consumer_choice: ConsumerPublic | None = None
    """For a job that names a consumer, once all its slots are decided: the consumer's joint winner."""
    waiting_reason: str | None = None
    """Why the job makes no progress when no registered worker can run it (none has its backend, GPU model
    or GPU count, or the last one that could was lost); None while some live worker can, and once it ended."""


class JobsPage(BaseModel):
    items: list[JobSummary]
    total: int
    limit: int
    offset: int
    next_offset: int | None
    """Offset of the next page, None on the last one."""


class TrialPublic(BaseModel):
    id: int
    slot: str
    optuna_trial_number: int
    purpose: str
    state: str
    config: ProposalBody
    """The tuner's proposal: the config(s) to measure, repeats and rounds."""
    measurement: dict[str, Any] | None
    """``{"measurements": [...]}``, one per proposed config, once complete."""
    error: str | None
    suspect: str | None = None
    """Why this result lies far outside what other workers measured for its GPU model, shape and slot; the
    tuner is never told it: another worker re-measures the proposal (`api.scheduler`)."""
    worker_id: str | None
    attempts: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class TrialsPage(BaseModel):
    items: list[TrialPublic]
    total: int
    limit: int
    offset: int
    next_offset: int | None
