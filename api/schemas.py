"""Request and response bodies: ``XCreate`` comes in, ``XPublic`` goes out (the FastAPI template's naming).

Every number and string that reaches the database has a bound here, so bad input stops at validation with a
422 naming the field and the rule, and never reaches a driver as an integer overflow or a NUL byte (a 5xx).
The bounds are far above any real model: hidden up to 1M, seq up to 16M tokens, tp up to 1024.  The shape's
models are made from `ModelShape`'s fields, so a field added there is in the request and the query at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING
from datetime import datetime
from types import NoneType
from typing import TYPE_CHECKING, Annotated, Any, Generic, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from autotune.outcome import SlotOutcome
from autotune.proposal import Proposal, Purpose
from overlap_runtime.config import DEFAULTS, OverlapConfig
from overlap_runtime.knobs import BY_NAME, KNOBS, Knob, Origin
from overlap_runtime.shape import ModelShape, ShapeField, shape_fields

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 ._()/:+-]*$"
"""GPU models, host and worker names: what NVML and hostnames produce, nothing that breaks a log line."""

Name = Annotated[str, Field(min_length=1, max_length=128, pattern=NAME_PATTERN)]
Backend = Literal["cpu", "cuda", "te"]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class Strict(BaseModel):
    """Unknown keys are an error (a typo such as ``n_trial`` must not be ignored silently), and no type is
    coerced (``false`` is not 0, ``"4"`` is not 4): what the schema says is what the API takes."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _unicode_text(cls, value: Any) -> Any:
        """Every string in a body is valid Unicode: JSON may carry a lone surrogate (``"\\ud800"``), which no
        database driver can encode, so it is a 422 here rather than a 500 at the driver."""
        if _has_lone_surrogate(value):
            raise ValueError("must be valid Unicode text (no lone surrogates such as \\ud800)")
        return value


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(map(_has_lone_surrogate, value))
    return False


def _shape_fields(base: type[BaseModel], *, lookup: bool) -> type[BaseModel]:
    """``base`` with one field per `ModelShape` field (as a ``lookup`` takes them), bounded by its `FieldFacts`."""
    fields: dict[str, Any] = {}
    for f in shape_fields(lookup=lookup):
        value = _value_type(f)
        default = ... if f.default is MISSING else f.default
        fields[f.name] = (value if default is not None else value | None, Field(default, description=f.facts.help))
    return create_model(f"{base.__name__}Shape", __base__=base, **fields)


def _value_type(f: ShapeField) -> Any:
    """The field's type without None, with the API's bounds: a positive int up to ``most``, a str of ``choices``."""
    (value,) = [t for t in get_args(f.type) or (f.type,) if t is not NoneType]
    if f.facts.choices:
        return Literal[f.facts.choices]
    if value is int:
        return Annotated[int, Field(ge=1, le=f.facts.most)]
    return value


class ShapeCreate(_shape_fields(Strict, lookup=False)):  # type: ignore[misc]
    """A transformer layer shape under tensor + sequence parallelism (`overlap_runtime.shape.ModelShape`)."""

    def to_shape(self) -> ModelShape:
        """The validated shape; `ShapeError` (a 422) when the sizes do not divide as TE needs."""
        return ModelShape(**self.model_dump())


class ShapeLookup(_shape_fields(BaseModel, lookup=True)):  # type: ignore[misc]
    """The query of ``GET /v1/best`` and ``GET /v1/presets``: hidden, tp, seq (and mbs) name the dimensions;
    each filter field given narrows the answer to the shapes that agree with it.  Unknown parameters are
    ignored, as FastAPI ignores them elsewhere (``format`` of /v1/presets is one)."""

    gpu: Name | None = Field(None, description="GPU model, as NVML names it (NVIDIA H200) or short (h200)")


class ConfigBody(Strict):
    """One overlap config (`overlap_runtime.config.OverlapConfig`), as `to_dict` writes it: method first,
    then only the knobs set to something other than unset."""

    def to_config(self) -> OverlapConfig:
        return OverlapConfig.from_dict(self.model_dump())


def _knob_type(knob: Knob) -> Any:
    """The type of a set value of ``knob``: its kind and range from the table."""
    annotation: Any = Literal[knob.choices] if knob.choices else knob.value_type
    if knob.bounds is not None:
        annotation = Annotated[annotation, Field(ge=knob.bounds[0], le=knob.bounds[1])]
    return annotation


def _knob_field(knob: Knob) -> tuple[Any, Any]:
    """(annotation, pydantic field) of ``knob``: its kind, range and help from the table; a knob at its unset
    value is left out of the JSON, as `OverlapConfig.to_dict` leaves it out."""
    annotation = _knob_type(knob)
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


def _te_key_field(knob: Knob) -> tuple[Any, Any]:
    """(annotation, pydantic field) of a TE key: method always, any other key where the entry gives it."""
    if knob.name == "method":
        return _knob_type(knob), Field(description=knob.help)
    return _knob_type(knob) | None, Field(None, description=knob.help, exclude_if=lambda value: value is None)


class TeEntry(Strict):
    """One TE ``ub_cfgs`` entry as `search_spaces.te_dict.te_entry` writes it: every key the method reads,
    TE's defaults included, in the order NVIDIA's files write them (no ``is_reduce_scatter``)."""


if TYPE_CHECKING:
    TeEntryBody = TeEntry
else:
    TeEntryBody = create_model(
        "TeEntryBody",
        __base__=TeEntry,
        __doc__=TeEntry.__doc__,
        **{knob.name: _te_key_field(knob) for knob in KNOBS if knob.origin == Origin.TE and knob.field},
    )


class ProposalBody(BaseModel):
    """`autotune.proposal.Proposal.to_dict()`: configs to measure together on one slot, and how often."""

    number: int
    """The Optuna trial it tells into."""
    configs: list[OverlapConfigBody]
    purpose: Purpose
    repeats: int
    rounds: int
    labels: list[str] = []
    """A baseline's reasons (``none``, ``te_default``, ``preset``, ``measure_first``, ``warm_start``); empty otherwise."""

    def to_proposal(self) -> Proposal:
        return Proposal.from_dict(self.model_dump())


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
    search proposes anything.  Each must be one the runtime runs for the slot on the job's backend, else a
    422 names the slot and the knob; one outside the slot's search space is measured as given.  They seed a study when it is created: a shape, slot and GPU model
    already tuned keep the study they have."""


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
    error: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class JobPublic(JobSummary):
    progress: Progress
    slots: list[SlotPublic]
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


class OutcomePublic(BaseModel):
    """`autotune.outcome.SlotOutcome.to_dict()`: the tuner's verdict on one slot."""

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
    nearest_layers: list[NearestLayer]
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
    te_version: Annotated[str, Field(max_length=64, pattern=NAME_PATTERN)] | None = None
    """TransformerEngine's version on the worker's host, None without it: te jobs run only where it is set."""


class WorkerPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    host: str
    backend: str
    gpus: list[dict[str, Any]]
    gpu_model: str | None
    n_gpus: int
    te_version: str | None
    status: str
    registered_at: datetime
    last_heartbeat: datetime


class WorkerCreated(WorkerPublic):
    """The answer to a registration: the only time the worker's secret is shown."""

    secret: str
    """Send as ``Authorization: Bearer <secret>`` on this worker's heartbeats, claims, renewals and results."""


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
    lease_nonce: str
    """Send as ``X-Lease-Nonce`` with this lease's renewals and its result."""


class LeasePublic(BaseModel):
    lease_expires_at: datetime


Samples = Annotated[list[Finite | None], Field(max_length=1 << 16)]
Positions = Annotated[list[Annotated[int, Field(ge=0, le=1 << 48)]], Field(max_length=1 << 12)]


class SeriesCreate(Strict):
    """`overlap_runtime.uncertainty.Series.to_dict()`: every repeat, and where each round ran."""

    samples: Annotated[list[Finite], Field(min_length=1, max_length=1 << 16)]
    positions: Positions = []


class BaselinesCreate(Strict):
    """`overlap_runtime.measurement.Baselines.to_dict()`: what a measurement is scored against."""

    source: Literal["same_rounds", "cached"]
    collective: Literal["all_gather", "reduce_scatter"]
    gemm: SeriesCreate
    comm: SeriesCreate
    serial: SeriesCreate


class MeasurementCreate(Strict):
    """One config's `overlap_runtime.measurement.Measurement.to_dict()`; None stands for an infinite time.
    ``positions``, ``baselines``, ``hidden_ci`` and ``ub_init_ms`` came later: a worker that leaves them out is still heard."""

    gemm_ms: Finite | None
    comm_ms: Finite | None
    serial_ms: Finite | None
    overlap_ms: Finite | None
    rel_err: Finite | None
    cv: Finite | None
    repeats: Annotated[int, Field(ge=0, le=1 << 20)]
    valid: bool
    samples: Samples = []
    positions: Positions = []
    baselines: BaselinesCreate | None = None
    hidden_ci: Annotated[list[Finite], Field(min_length=2, max_length=2)] | None = None
    ub_init_ms: Annotated[float, Field(ge=0, le=1e9)] | None = None
    """The te backend's userbuffers (re)initialization time in this trial; None elsewhere."""
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
    status: Literal["ok", "degraded"]
    """ok: the database answers and takes writes; degraded (a 503): it answers but writes fail."""
    writable: bool = True
    problem: str | None = None
    """Why writes fail, in public words (read-only, disk full, ...; never the server's address)."""
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
    """Whether writes need the clients' token (false only under ``--no-auth`` on loopback)."""
    worker_auth: bool
    """Whether workers register with a token of their own (``AUTOTUNE_WORKER_TOKEN``), not the clients'."""


class ErrorItem(BaseModel):
    field: str
    rule: str
    value: Any = None


class ErrorPublic(BaseModel):
    """Every 4xx: each problem names the field and the rule it broke."""

    detail: list[ErrorItem]
