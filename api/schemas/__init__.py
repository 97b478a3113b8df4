"""The wire contract: every request and response body of the REST API, as pydantic models.

``XCreate`` comes in, ``XPublic`` goes out (the FastAPI template's naming).  This package is a layer of its
own, below the controller (`api`) and the programs that talk to it (`autotune`): it imports pydantic and the
packages below it, never FastAPI, so the CLI, the worker and `load_ub_cfgs` read answers with the very models
the controller serves without loading the server (tests/test_layers.py holds both).
"""

from api.schemas.best import (
    BestGroup,
    BestLayer,
    BestPublic,
    NearestLayer,
    NearestPublic,
    OutcomePublic,
    SlotAnswer,
    TeExactPublic,
)
from api.schemas.common import (
    NAME_PATTERN,
    Backend,
    ConfigBody,
    Finite,
    Name,
    OverlapConfigBody,
    ProposalBody,
    ShapeCreate,
    ShapeLookup,
    Strict,
    TeEntry,
    TeEntryBody,
)
from api.schemas.errors import ErrorItem, ErrorPublic
from api.schemas.health import HealthPublic
from api.schemas.jobs import (
    MAX_FIRST_CONFIGS,
    BestSoFar,
    JobAccepted,
    JobCreate,
    JobPublic,
    JobsPage,
    JobSummary,
    Progress,
    SlotPublic,
    TrialPublic,
    TrialsPage,
)
from api.schemas.workers import (
    BaselinesCreate,
    ClaimPublic,
    GpuInfo,
    LeasePublic,
    MeasurementCreate,
    SeriesCreate,
    TrialPublicState,
    TrialReport,
    WorkerCreate,
    WorkerCreated,
    WorkerPublic,
)

__all__ = [
    "MAX_FIRST_CONFIGS",
    "NAME_PATTERN",
    "Backend",
    "BaselinesCreate",
    "BestGroup",
    "BestLayer",
    "BestPublic",
    "BestSoFar",
    "ClaimPublic",
    "ConfigBody",
    "ErrorItem",
    "ErrorPublic",
    "Finite",
    "GpuInfo",
    "HealthPublic",
    "JobAccepted",
    "JobCreate",
    "JobPublic",
    "JobSummary",
    "JobsPage",
    "LeasePublic",
    "MeasurementCreate",
    "Name",
    "NearestLayer",
    "NearestPublic",
    "OutcomePublic",
    "OverlapConfigBody",
    "Progress",
    "ProposalBody",
    "SeriesCreate",
    "ShapeCreate",
    "ShapeLookup",
    "SlotAnswer",
    "SlotPublic",
    "Strict",
    "TeEntry",
    "TeEntryBody",
    "TeExactPublic",
    "TrialPublic",
    "TrialPublicState",
    "TrialReport",
    "TrialsPage",
    "WorkerCreate",
    "WorkerCreated",
    "WorkerPublic",
]
