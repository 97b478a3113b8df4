"""Storage of the tuning service: SQLAlchemy models and the only functions that touch SQL.

Routes, the controller and workers call these functions (keyword arguments only) and never write SQL; the
controllers sharing a database also decide here which one of them schedules (`storage.leader`).
SQLite (WAL, the default, at a per-user data path) serves one machine; PostgreSQL serves scale-out, with
Optuna's `RDBStorage` tables in the same database beside ours (ours are all prefixed ``autotune_``).
Typical start-up::

    engine = create_engine_for(url=None)  # or "postgresql+psycopg://user@host/db"
    upgrade(engine=engine)
    Session = session_factory(engine=engine)
    with Session() as session:
        job = create_job(session=session, shape=shape, layers=["qkv_fprop"], n_trials=20, backend=Backend.CUDA)
"""

from storage.best import TunedResult, get_best, list_winners, tuned_results, tuned_shapes, upsert_best
from storage.counts import StateCounts, state_counts
from storage.engine import create_engine_for, default_sqlite_path, session_factory
from storage.enrolments import issue_enrolment, use_enrolment
from storage.errors import Conflict, NotFound, StorageError, public_reason
from storage.health import probe_read, probe_write, reclaim
from storage.jobs import cancel_job, create_job, first_configs, get_job, jobs_in, list_jobs, set_job_status
from storage.leader import SCHEDULER, acquire_leadership, get_leader, release_leadership
from storage.migrate import VERSION_TABLE, alembic_config, current_revision, upgrade
from storage.models import (
    Backend,
    BestConfig,
    Job,
    JobStatus,
    LayerStudy,
    LeaderLease,
    Purpose,
    Trial,
    TrialState,
    Worker,
    WorkerStatus,
)
from storage.page import Page
from storage.revocation import REVOKED, Revocation, revoke_worker
from storage.studies import add_layer_study, get_layer_study, list_layer_studies, study_names_in, update_layer_study
from storage.trials import (
    LEASE_EXPIRED,
    Claim,
    add_trial,
    claim_trial,
    complete_trial,
    expire_leases,
    fail_trial,
    get_trial,
    list_trials,
    release_trial,
    renew_lease,
    seen_gemm_ms,
)
from storage.tuning import open_study, optuna_storage, record_winner
from storage.workers import (
    authenticate_worker,
    get_worker,
    heartbeat,
    list_workers,
    mark_lost_workers,
    register_worker,
    stop_worker,
)

__all__ = [
    "LEASE_EXPIRED",
    "REVOKED",
    "SCHEDULER",
    "VERSION_TABLE",
    "Backend",
    "BestConfig",
    "Claim",
    "Conflict",
    "Job",
    "JobStatus",
    "LayerStudy",
    "LeaderLease",
    "NotFound",
    "Page",
    "Purpose",
    "Revocation",
    "StateCounts",
    "StorageError",
    "Trial",
    "TrialState",
    "TunedResult",
    "Worker",
    "WorkerStatus",
    "acquire_leadership",
    "add_layer_study",
    "add_trial",
    "alembic_config",
    "authenticate_worker",
    "cancel_job",
    "claim_trial",
    "complete_trial",
    "create_engine_for",
    "create_job",
    "current_revision",
    "default_sqlite_path",
    "expire_leases",
    "fail_trial",
    "first_configs",
    "get_best",
    "get_job",
    "get_layer_study",
    "get_leader",
    "get_trial",
    "get_worker",
    "heartbeat",
    "issue_enrolment",
    "jobs_in",
    "list_jobs",
    "list_layer_studies",
    "list_trials",
    "list_winners",
    "list_workers",
    "mark_lost_workers",
    "open_study",
    "optuna_storage",
    "probe_read",
    "probe_write",
    "public_reason",
    "reclaim",
    "record_winner",
    "register_worker",
    "release_leadership",
    "release_trial",
    "renew_lease",
    "revoke_worker",
    "seen_gemm_ms",
    "session_factory",
    "set_job_status",
    "state_counts",
    "stop_worker",
    "study_names_in",
    "tuned_results",
    "tuned_shapes",
    "update_layer_study",
    "upgrade",
    "upsert_best",
    "use_enrolment",
]
