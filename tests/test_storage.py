"""Storage conformance suite: every test runs on SQLite and on a real PostgreSQL (no mocks).

Like Optuna's storage tests, one suite pins the contract for both backends: migrations, coexistence with
Optuna's tables, job and trial lifecycles, the atomic claim with its capability filter, leases, best configs,
workers, and concurrent claimers that must never share a trial.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import optuna
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import JSON, Engine, bindparam, inspect, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

import storage
from overlap_runtime.errors import InputError, LeaseLost
from overlap_runtime.shape import ModelShape
from storage import (
    Backend,
    BestConfig,
    Conflict,
    Job,
    JobStatus,
    LayerStudy,
    NotFound,
    Purpose,
    StorageError,
    Trial,
    TrialState,
    Worker,
    WorkerStatus,
)
from storage.migrate import VERSION_TABLE, alembic_config, include_name
from storage.models import Base, utcnow

pytest_plugins = ("conftest_storage",)  # db_url, engine, session and the databases they stand on

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SEC = timedelta(seconds=1)
LEASE = 30 * SEC
SHAPE = ModelShape(hidden=8192, tp=2, mbs=1, seq=8192)
H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"


def new_job(
    session: Session, *, shape: ModelShape = SHAPE, gpu: str | None = None, backend: Backend = Backend.CUDA
) -> Job:
    return storage.create_job(
        session=session, shape=shape, layers=["qkv_fprop", "fc2_fprop"], n_trials=8, backend=backend, gpu=gpu, now=T0
    )


def new_study(session: Session, job_id: str, slot: str = "qkv_fprop") -> LayerStudy:
    return storage.add_layer_study(session=session, job_id=job_id, slot=slot, optuna_study_name=f"{job_id}:{slot}")


def new_worker(
    session: Session, *, gpu_model: str | None = H200, n_gpus: int = 2, backend: Backend = Backend.CUDA
) -> Worker:
    gpus = [{"name": gpu_model, "memory": 141 << 30, "nvlink": True, "sm_count": 132}] * n_gpus
    return storage.register_worker(
        session=session, name="w", host="node1", gpus=gpus, gpu_model=gpu_model, n_gpus=n_gpus, backend=backend, now=T0
    )


def queue(session: Session, study_id: int, n: int) -> list[int]:
    return [
        storage.add_trial(session=session, study_id=study_id, optuna_trial_number=i, config={"method": "bulk"}).id
        for i in range(n)
    ]


def our_schema_drift(engine: Engine) -> list[object]:
    """Differences between the models and the migrated database, looking at our tables only."""
    with engine.connect() as conn:
        opts = {"include_name": include_name, "compare_type": True, "version_table": VERSION_TABLE}
        return compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata)


def test_upgrade_brings_an_empty_database_to_head_and_matches_the_models(db_url: str) -> None:
    engine = storage.create_engine_for(url=db_url)
    try:
        assert storage.current_revision(engine=engine) is None
        # Controllers starting together each run upgrade on start: one migrates, the others wait and no-op.
        run_in_threads(4, lambda _: upgrade_with_own_engine(db_url))
        storage.upgrade(engine=engine)
        with engine.connect() as conn:
            head = ScriptDirectory.from_config(alembic_config(connection=conn)).get_current_head()
        assert storage.current_revision(engine=engine) == head
        tables = set(inspect(engine).get_table_names())
        assert {t.name for t in Base.metadata.sorted_tables} | {VERSION_TABLE} == tables
        assert our_schema_drift(engine) == []
    finally:
        engine.dispose()


def test_revision_0008_keeps_the_services_verdict_and_drops_the_old_local_spread(db_url: str) -> None:
    """``spread`` held two shapes (the service's verdict and trial, `autotune tune`'s cv and repeats): after
    0008 the verdict is ``outcome``, the trial ``trial_id``, and the cv-only rows have no verdict."""
    engine = storage.create_engine_for(url=db_url)
    try:
        storage.upgrade(engine=engine, revision="0007")
        columns = "gpu, shape_key, slot, hidden, tp, mbs, seq, dtype, shape, config, measurement, spread, updated_at"
        insert = text(
            f"INSERT INTO autotune_best_configs ({columns}) VALUES (:gpu, :key, :slot, 8192, 2, 1, 8192, 'bf16', "
            ":shape, :config, :measurement, :spread, :now)"
        ).bindparams(*(bindparam(name, type_=JSON) for name in ("shape", "config", "measurement", "spread")))
        verdict = {"slot": "qkv_fprop", "best": {"method": "none"}, "n_trials": 12}
        common = {"gpu": "NVIDIA H200", "key": "k", "shape": {"hidden": 8192}, "config": {"method": "none"}}
        with engine.begin() as conn:
            for slot, spread in (
                ("qkv_fprop", {"outcome": verdict, "trial_id": 41}),
                ("fc1_fprop", {"cv": 0.01, "repeats": 60}),
            ):
                conn.execute(insert, common | {"slot": slot, "measurement": {}, "spread": spread, "now": utcnow()})
        storage.upgrade(engine=engine)
        with storage.session_factory(engine=engine)() as session:
            rows = {row.slot: row for row in session.scalars(select(BestConfig))}
        assert (rows["qkv_fprop"].outcome, rows["qkv_fprop"].trial_id) == (verdict, 41)
        assert (rows["fc1_fprop"].outcome, rows["fc1_fprop"].trial_id) == (None, None)
        assert "spread" not in {c["name"] for c in inspect(engine).get_columns("autotune_best_configs")}
    finally:
        engine.dispose()


def upgrade_with_own_engine(url: str) -> None:
    engine = storage.create_engine_for(url=url)
    try:
        storage.upgrade(engine=engine)
    finally:
        engine.dispose()


def run_in_threads(n: int, target: Callable[[int], None]) -> None:
    """Run ``target(i)`` for i in range(n) on n threads released together; re-raise the first error."""
    start = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            start.wait()
            target(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]


def test_coexists_with_optuna_rdb_storage_in_the_same_database(db_url: str) -> None:
    engine = storage.create_engine_for(url=db_url)
    storage.upgrade(engine=engine)
    rdb = optuna.storages.RDBStorage(db_url)  # Optuna creates its tables and its own alembic_version here
    try:
        storage.upgrade(engine=engine)  # and ours still sees itself at head, with Optuna's tables present
        tables = set(inspect(engine).get_table_names())
        assert {"studies", "trials", "version_info", "alembic_version", VERSION_TABLE} <= tables
        assert our_schema_drift(engine) == []  # autogenerate would neither drop nor touch Optuna's tables
        assert rdb.get_current_version() == rdb.get_head_version()

        study = optuna.create_study(storage=rdb, study_name="h8192:qkv_fprop", direction="minimize")
        trial = study.ask()
        num_sm = trial.suggest_int("num_sm", 1, 132)
        with storage.session_factory(engine=engine)() as session:
            job = new_job(session)
            st = new_study(session, job.id)
            ours = storage.add_trial(
                session=session, study_id=st.id, optuna_trial_number=trial.number, config={"num_sm": num_sm}
            )
        study.tell(trial, 1.5)
        assert optuna.storages.RDBStorage(db_url).get_all_studies()[0].study_name == "h8192:qkv_fprop"
        assert study.best_trial.number == ours.optuna_trial_number
    finally:
        rdb.engine.dispose()
        engine.dispose()


def test_job_lifecycle_from_queued_to_a_terminal_status(session: Session) -> None:
    job = new_job(session, gpu=H200)
    assert job.status == JobStatus.QUEUED
    assert job.shape_key == "h8192_tp2_mbs1_seq8192_f32768_q24576_bf16_cp1"
    assert job.shape["ffn_hidden"] is None and job.shape["dtype"] == "bf16"
    session.expunge_all()  # read back from the database, not the identity map
    got = storage.get_job(session=session, job_id=job.id)
    assert (got.gpu, got.tp, got.layers, got.n_trials) == (H200, 2, ["qkv_fprop", "fc2_fprop"], 8)
    assert got.created_at == T0 and got.created_at.tzinfo is UTC and got.finished_at is None

    qkv = new_study(session, job.id)
    assert new_study(session, job.id).id == qkv.id  # a restarted controller gets the same study back
    with pytest.raises(Conflict, match="already tracks Optuna study"):
        storage.add_layer_study(session=session, job_id=job.id, slot="qkv_fprop", optuna_study_name="other")
    fc2 = new_study(session, job.id, "fc2_fprop")
    assert [s.slot for s in storage.list_layer_studies(session=session, job_id=job.id)] == ["qkv_fprop", "fc2_fprop"]

    later = T0 + timedelta(minutes=5)
    assert (
        storage.set_job_status(session=session, job_id=job.id, status=JobStatus.RUNNING, now=later).finished_at is None
    )
    storage.update_layer_study(session=session, study_id=qkv.id, status=JobStatus.SUCCEEDED)
    done = storage.set_job_status(session=session, job_id=job.id, status=JobStatus.SUCCEEDED, now=later)
    assert (done.status, done.updated_at, done.finished_at) == (JobStatus.SUCCEEDED, later, later)
    with pytest.raises(Conflict, match="already succeeded"):
        storage.cancel_job(session=session, job_id=job.id)
    with pytest.raises(Conflict, match="already succeeded"):
        storage.set_job_status(session=session, job_id=job.id, status=JobStatus.RUNNING)

    other = new_job(session)
    other_study = new_study(session, other.id)
    cancelled = storage.cancel_job(session=session, job_id=other.id, now=later)
    assert (cancelled.status, cancelled.finished_at) == (JobStatus.CANCELLED, later)
    assert storage.get_layer_study(session=session, study_id=other_study.id).status == JobStatus.CANCELLED
    assert storage.get_layer_study(session=session, study_id=fc2.id).status == JobStatus.QUEUED  # other job's

    failed = new_job(session)
    failed = storage.set_job_status(session=session, job_id=failed.id, status=JobStatus.FAILED, error="no worker fits")
    assert failed.error == "no worker fits"
    with pytest.raises(NotFound, match="job 'nope' not found"):
        storage.get_job(session=session, job_id="nope")
    with pytest.raises(NotFound):
        storage.cancel_job(session=session, job_id="nope")


def test_list_jobs_pages_newest_first_with_the_total(session: Session) -> None:
    ids = [
        storage.create_job(
            session=session, shape=SHAPE, layers=["qkv_fprop"], n_trials=1, backend=Backend.CPU, now=T0 + timedelta(s)
        ).id
        for s in range(7)
    ]
    storage.cancel_job(session=session, job_id=ids[0])
    pages = [storage.list_jobs(session=session, limit=3, offset=o) for o in (0, 3, 6)]
    assert [p.total for p in pages] == [7, 7, 7]
    assert [j.id for p in pages for j in p.items] == ids[::-1]
    assert storage.list_jobs(session=session, limit=3, offset=9).items == []
    cancelled = storage.list_jobs(session=session, status=JobStatus.CANCELLED)
    assert (cancelled.total, [j.id for j in cancelled.items]) == (1, [ids[0]])
    with pytest.raises(ValueError, match="limit: must be between 1 and 1000"):
        storage.list_jobs(session=session, limit=0)


def test_the_schedulers_queries_take_every_job_of_a_status_and_the_study_names_of_its_jobs(session: Session) -> None:
    running = [new_job(session) for _ in range(3)]
    queued = new_job(session)
    for job in running:
        storage.set_job_status(session=session, job_id=job.id, status=JobStatus.RUNNING)
    names = {
        new_study(session, job.id, slot).optuna_study_name for job in running for slot in ("qkv_fprop", "fc2_fprop")
    }
    new_study(session, queued.id)
    ids = [j.id for j in storage.list_jobs(session=session, status=JobStatus.RUNNING).items]
    assert [j.id for j in storage.jobs_in(session=session, status=JobStatus.RUNNING)] == ids  # newest first, as listed
    assert [j.id for j in storage.jobs_in(session=session, status=JobStatus.QUEUED)] == [queued.id]
    assert storage.study_names_in(session=session, status=JobStatus.RUNNING) == names
    assert storage.jobs_in(session=session, status=JobStatus.FAILED) == []


def test_list_trials_pages_one_jobs_trials_in_queue_order(session: Session) -> None:
    job, other = new_job(session), new_job(session)
    qkv, fc2 = new_study(session, job.id), new_study(session, job.id, "fc2_fprop")
    ids = queue(session, qkv.id, 3) + queue(session, fc2.id, 2)
    queue(session, new_study(session, other.id).id, 4)
    storage.fail_trial(session=session, trial_id=ids[1], reason="config rejected by the runtime")

    first, rest = (storage.list_trials(session=session, job_id=job.id, limit=3, offset=o) for o in (0, 3))
    assert (first.total, [t.id for t in first.items + rest.items]) == (5, ids)
    assert [t.id for t in storage.list_trials(session=session, job_id=job.id, study_id=fc2.id).items] == ids[3:]
    failed = storage.list_trials(session=session, job_id=job.id, state=TrialState.FAILED)
    assert [(t.id, t.error) for t in failed.items] == [(ids[1], "config rejected by the runtime")]


def test_claims_go_oldest_first_to_workers_that_can_run_them(session: Session) -> None:
    h200_2 = new_worker(session, gpu_model=H200, n_gpus=2)
    h100_8 = new_worker(session, gpu_model=H100, n_gpus=8)
    cpu = new_worker(session, gpu_model=None, n_gpus=0, backend=Backend.CPU)

    tp4 = ModelShape(hidden=8192, tp=4, mbs=1, seq=8192)
    tp8 = ModelShape(hidden=1024, tp=8, mbs=1, seq=1024)
    any_gpu = new_study(session, new_job(session).id)
    only_h100 = new_study(session, new_job(session, gpu=H100).id)
    needs_4 = new_study(session, new_job(session, shape=tp4).id)
    on_cpu = new_study(session, new_job(session, shape=tp8, backend=Backend.CPU).id)
    cancelled = new_job(session)
    in_cancelled = new_study(session, cancelled.id)
    finished_study = new_study(session, new_job(session).id)
    trials = {}
    for name, study in [
        ("cancelled", in_cancelled),
        ("any_gpu", any_gpu),
        ("only_h100", only_h100),
        ("needs_4", needs_4),
        ("on_cpu", on_cpu),
        ("finished_study", finished_study),
    ]:
        trials[name] = queue(session, study.id, 2)
    storage.cancel_job(session=session, job_id=cancelled.id)
    storage.update_layer_study(session=session, study_id=finished_study.id, status=JobStatus.SUCCEEDED)

    def claim_all(worker_id: str) -> list[int]:
        claimed = []
        while claim := storage.claim_trial(session=session, worker_id=worker_id, lease=LEASE, now=T0):
            claimed.append(claim.trial.id)
        return claimed

    first = storage.claim_trial(session=session, worker_id=h200_2.id, lease=LEASE, now=T0)
    assert first is not None
    assert (first.trial.id, first.study.slot, first.job.shape["tp"]) == (trials["any_gpu"][0], "qkv_fprop", 2)
    t = first.trial
    assert (t.state, t.worker_id, t.attempts, t.started_at) == (TrialState.RUNNING, h200_2.id, 1, T0)
    assert t.lease_expires_at == T0 + LEASE
    assert storage.get_worker(session=session, worker_id=h200_2.id).status == WorkerStatus.BUSY

    assert claim_all(h200_2.id) == trials["any_gpu"][1:]  # not H100-only, not tp=4 on 2 GPUs
    assert claim_all(h100_8.id) == trials["only_h100"] + trials["needs_4"]
    assert claim_all(cpu.id) == trials["on_cpu"]  # CPU workers run any tp on gloo ranks
    session.expunge_all()
    left = storage.list_trials(session=session, job_id=cancelled.id, state=TrialState.WAITING)
    assert [t.id for t in left.items] == trials["cancelled"]
    with pytest.raises(NotFound, match="worker 'ghost' not found"):
        storage.claim_trial(session=session, worker_id="ghost", lease=LEASE)


def test_an_expired_lease_fails_the_trial_once_and_loses_the_late_result(session: Session) -> None:
    worker = new_worker(session)
    study = new_study(session, new_job(session).id)
    (trial_id,) = queue(session, study.id, 1)
    nonce = storage.claim_trial(session=session, worker_id=worker.id, lease=LEASE, now=T0).nonce

    renewed = storage.renew_lease(
        session=session, trial_id=trial_id, worker_id=worker.id, nonce=nonce, lease=LEASE, now=T0 + 20 * SEC
    )
    assert renewed == T0 + 50 * SEC
    assert storage.expire_leases(session=session, now=T0 + 40 * SEC) == []
    expired = storage.expire_leases(session=session, now=T0 + 51 * SEC)
    assert [(t.id, t.state, t.error) for t in expired] == [(trial_id, TrialState.FAILED, storage.LEASE_EXPIRED)]
    assert storage.expire_leases(session=session, now=T0 + 99 * SEC) == []
    assert storage.get_layer_study(session=session, study_id=study.id).n_failed == 1

    with pytest.raises(LeaseLost, match=r"it is failed \(lease expired \(worker lost\)\)"):
        storage.complete_trial(
            session=session,
            trial_id=trial_id,
            worker_id=worker.id,
            nonce=nonce,
            measurement={"overlap_ms": 1.0},
            now=T0 + 52 * SEC,
        )
    with pytest.raises(LeaseLost):
        storage.renew_lease(
            session=session, trial_id=trial_id, worker_id=worker.id, nonce=nonce, lease=LEASE, now=T0 + 52 * SEC
        )
    assert storage.get_trial(session=session, trial_id=trial_id).measurement is None


def test_completing_needs_a_live_lease_held_by_the_reporting_worker(session: Session) -> None:
    mine, other = new_worker(session), new_worker(session)
    study = new_study(session, new_job(session).id)
    first, second, third = queue(session, study.id, 3)
    nonce = storage.claim_trial(session=session, worker_id=mine.id, lease=LEASE, now=T0).nonce
    result = {"gemm_ms": 1.0, "overlap_ms": 1.2, "exposed_ms": 0.2, "rel_err": 0.0}

    def complete(trial_id: int, worker_id: str, lease_nonce: str, at: datetime) -> Trial:
        return storage.complete_trial(
            session=session, trial_id=trial_id, worker_id=worker_id, nonce=lease_nonce, measurement=result, now=at
        )

    with pytest.raises(LeaseLost, match="lease expired at"):  # stale: past its lease, reaper not yet run
        complete(first, mine.id, nonce, T0 + 31 * SEC)
    with pytest.raises(LeaseLost, match=f"leased to worker '{mine.id}'"):
        complete(first, other.id, nonce, T0)
    with pytest.raises(LeaseLost, match="nonce is not the one its claim handed out"):  # the holder's id, not its claim
        complete(first, mine.id, "forged", T0)
    with pytest.raises(NotFound):
        complete(10_000, mine.id, nonce, T0)

    done = complete(first, mine.id, nonce, T0 + 30 * SEC)
    assert (done.state, done.measurement, done.finished_at) == (TrialState.COMPLETE, result, T0 + 30 * SEC)
    with pytest.raises(LeaseLost, match="it is complete"):
        complete(first, mine.id, nonce, T0)
    assert storage.get_worker(session=session, worker_id=mine.id).status == WorkerStatus.IDLE

    nonce = storage.claim_trial(session=session, worker_id=mine.id, lease=LEASE, now=T0).nonce
    crashed = storage.fail_trial(
        session=session, trial_id=second, worker_id=mine.id, nonce=nonce, reason="NCCL hang", now=T0
    )
    assert (crashed.state, crashed.error) == (TrialState.FAILED, "NCCL hang")
    storage.fail_trial(session=session, trial_id=third, reason="job stopped early")  # controller, waiting trial
    with pytest.raises(Conflict, match="already complete"):
        storage.fail_trial(session=session, trial_id=first, reason="too late")
    counts = storage.get_layer_study(session=session, study_id=study.id)
    assert (counts.n_complete, counts.n_failed) == (1, 2)

    storage.update_layer_study(session=session, study_id=study.id, best_trial_id=first)
    assert storage.get_layer_study(session=session, study_id=study.id).best_trial_id == first
    foreign = queue(session, new_study(session, new_job(session).id).id, 1)[0]
    with pytest.raises(Conflict, match="best_trial_id"):
        storage.update_layer_study(session=session, study_id=study.id, best_trial_id=foreign)


def test_best_config_upsert_replaces_the_winner_and_lookup_filters(session: Session) -> None:
    job = new_job(session)
    fp8 = ModelShape(hidden=8192, tp=2, mbs=1, seq=8192, dtype="fp8")
    gated = ModelShape(
        hidden=8192, tp=2, mbs=1, seq=8192, ffn_hidden=28672, num_heads=64, num_query_groups=8, gated=True
    )
    measured = {"overlap_ms": 2.0, "exposed_ms": 0.3, "hidden_frac": 0.8}

    def best(shape: ModelShape, gpu: str, config: dict[str, object], at: datetime) -> BestConfig:
        return storage.upsert_best(
            session=session,
            gpu=gpu,
            shape=shape,
            slot="qkv_fprop",
            config=config,
            measurement=measured,
            outcome={"n_trials": 12},
            trial_id=7,
            job_id=job.id,
            now=at,
        )

    first = best(SHAPE, H200, {"method": "bulk"}, T0)
    replaced = best(SHAPE, H200, {"method": "ring_exchange"}, T0 + SEC)
    assert replaced.id == first.id
    best(fp8, H200, {"method": "pipeline", "num_splits": 4}, T0)
    best(gated, H200, {"method": "bulk"}, T0)
    best(SHAPE, H100, {"method": "bulk"}, T0)
    session.expunge_all()

    rows = storage.get_best(session=session, shape=SHAPE, gpu=H200, dtype="bf16")
    assert [(r.shape_key, r.config) for r in rows] == [
        ("h8192_tp2_mbs1_seq8192_f28672g_q10240_bf16_cp1", {"method": "bulk"}),
        ("h8192_tp2_mbs1_seq8192_f32768_q24576_bf16_cp1", {"method": "ring_exchange"}),
    ]
    assert (rows[1].updated_at, rows[1].outcome, rows[1].trial_id, rows[1].measurement) == (
        T0 + SEC,
        {"n_trials": 12},
        7,
        measured,
    )
    assert len(storage.get_best(session=session, shape=gated)) == 4
    assert [r.gpu for r in storage.get_best(session=session, shape=SHAPE, dtype="fp8")] == [H200]
    assert storage.get_best(session=session, shape=ModelShape(hidden=8192, tp=4, mbs=1, seq=8192)) == []


def test_a_best_config_row_keeps_the_te_exact_winner_beside_the_overall_one(session: Session) -> None:
    job = new_job(session)
    ours = {"method": "ring_exchange", "gemm": "triton", "num_max_streams": 1}
    exact = {"method": "ring_exchange", "gemm": "cublas", "num_max_streams": 2}
    times = {"overlap_ms": 2.0, "serial_ms": 2.4}
    exact_times = {"overlap_ms": 2.1, "serial_ms": 2.4}

    def best(**te_exact: dict[str, object] | None) -> BestConfig:
        return storage.upsert_best(
            session=session, gpu=H200, shape=SHAPE, slot="qkv_fprop", config=ours, measurement=times,
            job_id=job.id, **te_exact,
        )  # fmt: skip

    best(te_exact_config=exact, te_exact_measurement=exact_times)
    session.expunge_all()
    (row,) = storage.get_best(session=session, shape=SHAPE)
    assert (row.config, row.measurement) == (ours, times)
    assert (row.te_exact_config, row.te_exact_measurement) == (exact, exact_times)
    best()  # a later job that measured no TE-exact config replaces both winners
    session.expunge_all()
    (row,) = storage.get_best(session=session, shape=SHAPE)
    assert (row.te_exact_config, row.te_exact_measurement) == (None, None)
    with pytest.raises(InputError, match="te_exact_measurement"):
        best(te_exact_config=exact)


def test_workers_register_heartbeat_and_go_lost_when_silent(session: Session) -> None:
    a, b = new_worker(session), new_worker(session, gpu_model=None, n_gpus=0, backend=Backend.CPU)
    assert a.gpus[0]["sm_count"] == 132 and a.registered_at == T0
    storage.heartbeat(session=session, worker_id=a.id, now=T0 + 50 * SEC)
    lost = storage.mark_lost_workers(session=session, timeout=timedelta(seconds=60), now=T0 + 70 * SEC)
    assert [w.id for w in lost] == [b.id]
    assert storage.mark_lost_workers(session=session, timeout=timedelta(seconds=60), now=T0 + 70 * SEC) == []
    assert [w.id for w in storage.list_workers(session=session, status=WorkerStatus.LOST)] == [b.id]
    back = storage.heartbeat(session=session, worker_id=b.id, now=T0 + 80 * SEC)
    assert (back.status, back.last_heartbeat) == (WorkerStatus.IDLE, T0 + 80 * SEC)
    assert [w.id for w in storage.list_workers(session=session)] == [b.id, a.id]
    with pytest.raises(NotFound):
        storage.heartbeat(session=session, worker_id="ghost")


def test_driver_errors_surface_as_storage_errors_and_leave_the_session_usable(session: Session) -> None:
    with pytest.raises(StorageError, match="add_trial failed") as info:
        storage.add_trial(session=session, study_id=424242, optuna_trial_number=0, config={})  # no such study
    assert isinstance(info.value.__cause__, IntegrityError)
    with pytest.raises(StorageError, match="timezone-aware"):
        storage.create_job(
            session=session, shape=SHAPE, layers=[], n_trials=1, backend=Backend.CPU, now=datetime(2026, 1, 1)
        )
    assert storage.list_jobs(session=session).total == 0


def test_concurrent_claimers_never_share_a_trial_and_drain_the_queue(engine: Engine, db_url: str) -> None:
    with storage.session_factory(engine=engine)() as session:
        study = new_study(session, new_job(session).id)
        trial_ids = set(queue(session, study.id, 200))
        workers = [new_worker(session).id for _ in range(4)]
    claimed: list[list[int]] = [[] for _ in workers]

    def claimer(i: int) -> None:
        own = storage.create_engine_for(url=db_url)  # like a separate process: its own pool and connections
        try:
            sessions = storage.session_factory(engine=own)
            while True:
                with sessions() as s:
                    claim = storage.claim_trial(session=s, worker_id=workers[i], lease=LEASE)
                if claim is None:
                    return
                claimed[i].append(claim.trial.id)
        finally:
            own.dispose()

    run_in_threads(len(workers), claimer)
    every = [t for c in claimed for t in c]
    assert len(every) == len(set(every)) == 200 and set(every) == trial_ids
    assert sum(1 for c in claimed if c) > 1, "one claimer took everything: the test did not exercise concurrency"
    with storage.session_factory(engine=engine)() as session:
        running = storage.list_trials(session=session, job_id=study.job_id, state=TrialState.RUNNING, limit=1000)
        assert running.total == 200 and {t.attempts for t in running.items} == {1}


def test_default_engine_is_sqlite_in_wal_mode_under_the_user_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    engine = storage.create_engine_for()
    try:
        assert engine.url.database == str(tmp_path / "overlap-autotune" / "autotune.db")
        with engine.connect() as conn:
            pragmas = [conn.exec_driver_sql(f"PRAGMA {p}").scalar() for p in ("journal_mode", "foreign_keys")]
        assert pragmas == ["wal", 1]
    finally:
        engine.dispose()
    pg = storage.create_engine_for(url="postgresql://postgres@127.0.0.1:5432/test")
    assert pg.url.drivername == "postgresql+psycopg"
    pg.dispose()


def test_trial_purpose_is_stored(session: Session) -> None:
    study = new_study(session, new_job(session).id)
    for purpose in Purpose:
        storage.add_trial(session=session, study_id=study.id, optuna_trial_number=0, config={}, purpose=purpose)
    session.expunge_all()
    page = storage.list_trials(session=session, job_id=study.job_id)
    assert [t.purpose for t in page.items] == list(Purpose)


def test_the_default_sqlite_file_gets_its_folder_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "new" / "deeper"))
    storage.upgrade(engine=storage.create_engine_for())
    assert storage.default_sqlite_path().exists() and storage.default_sqlite_path().is_relative_to(tmp_path)


def test_an_explicit_sqlite_url_in_a_missing_folder_is_refused_and_creates_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new' / 'deeper' / 'autotune.db'}"
    with pytest.raises(InputError, match=r"^db_url: must name a file in an existing folder, but .*new/deeper does"):
        storage.create_engine_for(url=url)
    assert not (tmp_path / "new").exists()
