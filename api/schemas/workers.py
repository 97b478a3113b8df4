"""Workers: registration, claims, leases and the results they report."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.schemas.common import (
    NAME_PATTERN,
    BackendField,
    Finite,
    Name,
    ProposalBody,
    Strict,
)


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
    backend: BackendField
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


class EnrolmentCreate(Strict):
    ttl_s: Annotated[float, Field(gt=0, le=7 * 86400)] = 600.0
    """How long the token registers a worker: 10 minutes unless told, a week at most."""


class EnrolmentCreated(BaseModel):
    """The answer to ``POST /v1/workers/enrolments``: the only time the token is shown."""

    token: str
    """Register one worker with it (``Authorization: Bearer <token>`` on ``POST /v1/workers``), once."""
    expires_at: datetime


class WorkerRevoked(BaseModel):
    """The answer to ``DELETE /v1/workers/{id}``: what revoking the worker changed."""

    worker_id: str
    requeued: int
    """Trials it held, waiting again for other workers."""
    withdrawn: int
    """Its complete trials, failed now with the reason that they were revoked."""
    winners_removed: int
    """Best configs it had measured, removed from ``/v1/best``."""


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
    gemm_ours: SeriesCreate | None = None
    """Our GEMM alone beside the library's (``gemm_ms`` is the faster); None where it was not timed."""


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
