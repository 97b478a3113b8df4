"""Request and response bodies: ``XCreate`` comes in, ``XPublic`` goes out (the FastAPI template's naming).

Every number and string that reaches the database has a bound here, so bad input stops at validation with a
422 naming the field and the rule, and never reaches a driver as an integer overflow or a NUL byte (a 5xx).
The bounds are far above any real model: hidden up to 1M, seq up to 16M tokens, tp up to 1024.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from autotune.proposal import Purpose
from overlap_runtime.config import DEFAULTS, OverlapConfig
from overlap_runtime.knobs import BY_NAME, Knob
from overlap_runtime.shape import ModelShape

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 ._()/:+-]*$"
"""GPU models, host and worker names: what NVML and hostnames produce, nothing that breaks a log line."""

Size = Annotated[int, Field(ge=1, le=1 << 20)]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=NAME_PATTERN)]
Backend = Literal["cpu", "cuda"]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class Strict(BaseModel):
    """Unknown keys are an error (a typo such as ``n_trial`` must not be ignored silently), and no type is
    coerced (``false`` is not 0, ``"4"`` is not 4): what the schema says is what the API takes."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ShapeCreate(Strict):
    """A transformer layer shape under tensor + sequence parallelism (`overlap_runtime.shape.ModelShape`)."""

    hidden: Size
    tp: Annotated[int, Field(ge=1, le=1024)]
    mbs: Annotated[int, Field(ge=1, le=1 << 16)] = 1
    seq: Annotated[int, Field(ge=1, le=1 << 24)]
    ffn_hidden: Annotated[int, Field(ge=1, le=1 << 22)] | None = None
    num_heads: Annotated[int, Field(ge=1, le=1 << 16)] | None = None
    num_query_groups: Annotated[int, Field(ge=1, le=1 << 16)] | None = None
    gated: bool = False
    dtype: Literal["bf16", "fp8"] = "bf16"
    cp: Annotated[int, Field(ge=1, le=1024)] = 1

    def to_shape(self) -> ModelShape:
        """The validated shape; `ShapeError` (a 422) when the sizes do not divide as TE needs."""
        return ModelShape(**self.model_dump())


class ConfigBody(Strict):
    """One overlap config (`overlap_runtime.config.OverlapConfig`), as `to_dict` writes it: method first,
    then only the knobs set to something other than unset."""

    def to_config(self) -> OverlapConfig:
        return OverlapConfig.from_dict(self.model_dump())


def _knob_field(knob: Knob) -> tuple[Any, Any]:
    """(annotation, pydantic field) of ``knob``: its kind, range and help from the table; a knob at its unset
    value is left out of the JSON, as `OverlapConfig.to_dict` leaves it out."""
    annotation: Any = Literal[knob.choices] if knob.choices else knob.value_type
    if knob.bounds is not None:
        annotation = Annotated[annotation, Field(ge=knob.bounds[0], le=knob.bounds[1])]
    if knob.name not in DEFAULTS:
        return annotation, Field(description=knob.help)
    unset = DEFAULTS[knob.name]
    if unset is None:
        annotation = annotation | None
    return annotation, Field(unset, description=knob.help, exclude_if=lambda value: value == unset)


if TYPE_CHECKING:
    OverlapConfigBody = ConfigBody
else:
    OverlapConfigBody = create_model(
        "OverlapConfigBody",
        __base__=ConfigBody,
        __doc__=ConfigBody.__doc__,
        # In the fields' order, which `to_dict` writes: the JSON stays as the service always served it.
        **{f.name: _knob_field(BY_NAME[f.name]) for f in dataclasses.fields(OverlapConfig)},
    )


class ProposalBody(BaseModel):
    """`autotune.proposal.Proposal.to_dict()`: configs to measure together on one slot, and how often."""

    number: int
    """The Optuna trial it tells into."""
    configs: list[OverlapConfigBody]
    purpose: Purpose
    repeats: int
    rounds: int


MAX_FIRST_CONFIGS = 16
"""Configs a job may ask to measure first per slot: each one is a trial of the slot's budget."""


class JobCreate(Strict):
    shape: ShapeCreate
    layers: Annotated[list[Annotated[str, Field(max_length=64)]], Field(min_length=1, max_length=16)] | None = None
    """Slots to tune (TE's names); all ten tunable ones when left out."""
    n_trials: Annotated[int, Field(ge=1, le=10_000)] = 30
    """Trials per slot."""
    backend: Backend | None = None
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
    search proposes anything.  Each must be one the slot's search space holds on the job's backend, else a
    422 names the slot and the knob.  They seed a study when it is created: a shape, slot and GPU model
    already tuned keep the study they have."""


class JobAccepted(BaseModel):
    id: str
    status: str


class Progress(BaseModel):
    done: int
    """Trials finished (complete or failed) over all slots."""
    total: int
    """Trials planned: n_trials per slot (finalist re-measurements come on top)."""
    fraction: float
    """0..1; 1 only once every slot has finished."""


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
    error: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class JobPublic(JobSummary):
    progress: Progress
    slots: list[SlotPublic]


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


class BestLayer(BaseModel):
    slot: str
    config: dict[str, Any]
    measurement: dict[str, Any] | None
    """The winner's measurement; None in a nearest-shape answer (nothing was measured for this shape)."""
    outcome: dict[str, Any] | None = None
    """The tuner's verdict: the best overlap config, TE's default re-measured, spread, gains, trial counts."""
    job_id: str | None = None
    updated_at: datetime | None = None
    note: str | None = None


class BestGroup(BaseModel):
    gpu: str
    dtype: str
    shape_key: str
    shape: dict[str, Any]
    layers: list[BestLayer]


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
    nearest_layers: list[BestLayer]
    """The nearest preset's configs when nothing was measured (never passed off as measured)."""


class GpuInfo(Strict):
    index: Annotated[int, Field(ge=0, le=1024)]
    name: Name
    uuid: Annotated[str, Field(max_length=128, pattern=NAME_PATTERN)] | None = None
    pci_bus_id: Annotated[str, Field(max_length=64, pattern=NAME_PATTERN)] | None = None
    memory_total_mib: Annotated[int, Field(ge=0, le=1 << 30)] | None = None
    driver: Annotated[str, Field(max_length=64, pattern=NAME_PATTERN)] | None = None
    nvlink_active: Annotated[int, Field(ge=0, le=1024)] = 0
    """Active NVLink links of this GPU."""
    nvlink_supported: bool = False
    sm_count: Annotated[int, Field(ge=1, le=1 << 16)] | None = None
    """From CUDA (NVML has no SM count for a full GPU)."""


class WorkerCreate(Strict):
    name: Name
    host: Name
    backend: Backend
    gpus: Annotated[list[GpuInfo], Field(max_length=1024)] = []
    gpu_model: Name | None = None
    """The model all its GPUs share; None for a CPU worker or a mixed box (it then takes only unpinned jobs)."""
    n_gpus: Annotated[int, Field(ge=0, le=1024)] = 0


class WorkerPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    host: str
    backend: str
    gpus: list[dict[str, Any]]
    gpu_model: str | None
    n_gpus: int
    status: str
    registered_at: datetime
    last_heartbeat: datetime


class ClaimPublic(BaseModel):
    trial_id: int
    job_id: str
    slot: str
    shape: dict[str, Any]
    backend: str
    proposal: ProposalBody
    """What to measure and how often."""
    lease_expires_at: datetime
    lease_s: float
    """Renew well before this runs out (every third of it)."""


class LeasePublic(BaseModel):
    lease_expires_at: datetime


class MeasurementCreate(Strict):
    """One config's `overlap_runtime.measurement.Measurement.to_dict()`; None stands for an infinite time."""

    gemm_ms: Finite | None
    comm_ms: Finite | None
    serial_ms: Finite | None
    overlap_ms: Finite | None
    rel_err: Finite | None
    cv: Finite | None
    repeats: Annotated[int, Field(ge=0, le=1 << 20)]
    valid: bool
    samples: Annotated[list[Finite | None], Field(max_length=1 << 16)] = []
    exposed_ms: Finite | None = None
    hidden_frac: Finite | None = None


class TrialReport(Strict):
    """A worker's result: the measurements (one per proposed config, in order) or why the trial failed."""

    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["measurements"]}, {"required": ["failure"]}]},
    )

    measurements: Annotated[list[MeasurementCreate], Field(min_length=1, max_length=64)] | None = None
    failure: Annotated[str, Field(min_length=1, max_length=10_000, pattern=r"^[^\x00]*$")] | None = None


class TrialPublicState(BaseModel):
    id: int
    state: str


class HealthPublic(BaseModel):
    status: Literal["ok"]
    database: str
    """The backend in use: sqlite or postgresql."""
    revision: str | None
    scheduler: bool
    """Whether this process runs the scheduler loop (off with ``AUTOTUNE_SCHEDULER=false``)."""
    leading: bool
    """Whether this process holds the scheduler lease, i.e. is the one controller process that schedules."""
    leader: str | None
    """Who holds the scheduler lease (``host:pid:random``), None while nobody does."""
    auth: bool


class ErrorItem(BaseModel):
    field: str
    rule: str
    value: Any = None


class ErrorPublic(BaseModel):
    """Every 4xx: each problem names the field and the rule it broke."""

    detail: list[ErrorItem]
