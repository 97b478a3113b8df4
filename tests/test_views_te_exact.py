"""The job view (`api.views.job_view`) on real SQLite and PostgreSQL: each slot's TE-exact winner so far, read
from its completed trials, then the final one that its best config row holds."""

from __future__ import annotations

from datetime import timedelta

from conftest_tuner import measurement
from sqlalchemy.orm import Session

import storage
from api.trial_rows import measurement_json
from api.views import job_view
from autotune.tuner.proposal import Proposal, Purpose
from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.shape import ModelShape
from storage import Backend

pytest_plugins = ("conftest_storage",)  # session, on SQLite and on PostgreSQL

SHAPE = ModelShape(hidden=8192, tp=2, seq=8192)
OURS = OverlapConfig(method=Method.RING_EXCHANGE, use_ce=True, gemm="triton", num_max_streams=1)
EXACT = OverlapConfig(method=Method.RING_EXCHANGE, use_ce=True, gemm="cublas", num_max_streams=2)
SLOWER = OverlapConfig(method=Method.RING_EXCHANGE, use_ce=False, num_sm=8, gemm="cublas", num_max_streams=2)


def measure(session: Session, study_id: int, number: int, times: dict[OverlapConfig, float]) -> None:
    """A trial of ``times``' configs, claimed by a worker and completed with those overlap times."""
    proposal = Proposal(number=number, configs=tuple(times), purpose=Purpose.SEARCH, repeats=5)
    trial = storage.add_trial(session=session, study_id=study_id, optuna_trial_number=number, config=proposal.to_dict())
    worker = storage.register_worker(
        session=session, name="w", host="h", gpus=[{"name": "NVIDIA H200"}] * 2, gpu_model="NVIDIA H200", n_gpus=2,
        backend=Backend.CUDA,
    )  # fmt: skip
    claim = storage.claim_trial(session=session, worker_id=worker.id, lease=timedelta(seconds=60))
    assert claim is not None and claim.trial.id == trial.id
    found = measurement_json([measurement(ms).to_dict() for ms in times.values()])
    storage.complete_trial(
        session=session, trial_id=trial.id, worker_id=worker.id, nonce=claim.nonce, measurement=found
    )


def test_a_slot_shows_its_fastest_te_exact_config_so_far_then_its_te_exact_winner(session: Session) -> None:
    job = storage.create_job(session=session, shape=SHAPE, layers=["qkv_fprop"], n_trials=8, backend=Backend.CUDA)
    study = storage.add_layer_study(session=session, job_id=job.id, slot="qkv_fprop", optuna_study_name="s")
    (slot,) = job_view(session=session, job=job).slots
    assert slot.te_exact is None
    measure(session, study.id, 0, {OURS: 1.0, SLOWER: 1.5})  # a batch: only its TE-exact config counts here
    measure(session, study.id, 1, {EXACT: 1.2})
    (slot,) = job_view(session=session, job=job).slots
    assert slot.te_exact is not None and not slot.te_exact.final
    assert slot.te_exact.config.to_config() == EXACT and slot.te_exact.measurement["overlap_ms"] == 1.2
    storage.upsert_best(
        session=session, gpu="NVIDIA H200", shape=SHAPE, slot="qkv_fprop", config=OURS.to_dict(),
        measurement=measurement(1.0).to_dict(), te_exact_config=SLOWER.to_dict(),
        te_exact_measurement=measurement(1.1).to_dict(), job_id=job.id,
    )  # fmt: skip
    storage.set_job_status(session=session, job_id=job.id, status=storage.JobStatus.RUNNING)
    (slot,) = job_view(session=session, job=storage.get_job(session=session, job_id=job.id)).slots
    assert slot.best is not None and slot.best.final and slot.best.config.to_config() == OURS
    assert slot.te_exact is not None and slot.te_exact.final and slot.te_exact.config.to_config() == SLOWER
