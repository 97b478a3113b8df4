"""The best config per (GPU model, shape, slot): what ``GET /v1/best`` and the preset export read.

Each row holds two winners: the fastest config overall (our runtime's) and the fastest that TE runs exactly
as measured (``te_exact_*``, what the TE exports carry), or NULL where the job measured none.

The tuner decides which trial won; `upsert_best` records that verdict (`storage.tuning.record_winner` is how
both tuning drivers call it), replacing the previous winner for the
same key (a newer job re-measured on the same GPU model is the better-informed answer).  The upsert is one
``INSERT ... ON CONFLICT DO UPDATE``, so two jobs finishing the same shape at once cannot both insert.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape
from storage.errors import wraps_driver_errors
from storage.models import BestConfig, utcnow


@wraps_driver_errors
def upsert_best(
    *,
    session: Session,
    gpu: str,
    shape: ModelShape,
    slot: str,
    config: Mapping[str, Any],
    measurement: Mapping[str, Any],
    outcome: Mapping[str, Any] | None = None,
    trial_id: int | None = None,
    te_exact_config: Mapping[str, Any] | None = None,
    te_exact_measurement: Mapping[str, Any] | None = None,
    job_id: str | None = None,
    now: datetime | None = None,
) -> BestConfig:
    """Record ``config`` as the winner of ``slot`` for ``shape`` on ``gpu`` (the model name, "cpu" for the CPU
    backend), and ``te_exact_config`` as its TE-exact winner (None: the job measured none; it replaces any
    earlier one too, so both winners always come from the same job).  ``outcome`` is the tuner's verdict
    (`SlotOutcome.to_dict()`), ``trial_id`` the trial row that measured the winner (None outside a job)."""
    if (te_exact_config is None) != (te_exact_measurement is None):
        raise InputError("te_exact_measurement", "must be given with te_exact_config", te_exact_measurement)
    row = {
        "gpu": gpu,
        "shape_key": shape.key,
        "slot": slot,
        "hidden": shape.hidden,
        "tp": shape.tp,
        "mbs": shape.mbs,
        "seq": shape.seq,
        "dtype": shape.dtype,
        "shape": shape.as_given(),
        "config": dict(config),
        "measurement": dict(measurement),
        "outcome": None if outcome is None else dict(outcome),
        "trial_id": trial_id,
        "te_exact_config": None if te_exact_config is None else dict(te_exact_config),
        "te_exact_measurement": None if te_exact_measurement is None else dict(te_exact_measurement),
        "job_id": job_id,
        "updated_at": now or utcnow(),
    }
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    stmt = insert(BestConfig).values(row)
    kept = (
        "config",
        "measurement",
        "outcome",
        "trial_id",
        "te_exact_config",
        "te_exact_measurement",
        "job_id",
        "updated_at",
    )
    replaced = {name: stmt.excluded[name] for name in kept}
    stmt = stmt.on_conflict_do_update(index_elements=["gpu", "shape_key", "slot"], set_=replaced)
    best = session.scalars(stmt.returning(BestConfig), execution_options={"populate_existing": True}).one()
    session.commit()
    return best


@wraps_driver_errors
def get_best(
    *, session: Session, shape: ModelShape, gpu: str | None = None, dtype: str | None = None
) -> list[BestConfig]:
    """Every stored winner at ``shape``'s dimensions (hidden, tp, mbs, seq), optionally of one GPU model and
    dtype; the shape's other fields do not narrow it.

    Several shape keys can match (e.g. different ffn widths or dtypes); rows are ordered by GPU, shape key and
    slot so callers can group them.  An empty list means nothing was measured for this shape: the caller
    decides whether to offer a nearest known shape, and must say so.
    """
    stmt = select(BestConfig).where(
        BestConfig.hidden == shape.hidden,
        BestConfig.tp == shape.tp,
        BestConfig.mbs == shape.mbs,
        BestConfig.seq == shape.seq,
    )
    if gpu is not None:
        stmt = stmt.where(BestConfig.gpu == gpu)
    if dtype is not None:
        stmt = stmt.where(BestConfig.dtype == dtype)
    return list(session.scalars(stmt.order_by(BestConfig.gpu, BestConfig.shape_key, BestConfig.slot)))


@wraps_driver_errors
def list_winners(*, session: Session, gpu: str, slot: str, tp: int, dtype: str) -> list[BestConfig]:
    """Every stored winner of ``slot`` on ``gpu`` at this tp and dtype, whatever the other sizes: the
    neighbouring shapes a new study warm-starts from."""
    stmt = select(BestConfig).where(
        BestConfig.gpu == gpu, BestConfig.slot == slot, BestConfig.tp == tp, BestConfig.dtype == dtype
    )
    return list(session.scalars(stmt.order_by(BestConfig.shape_key)))


@wraps_driver_errors
def tuned_shapes(*, session: Session) -> list[ModelShape]:
    """Every shape with stored winners, once each (in shape key order): what a lookup that found nothing can
    name as the nearest tuned shape."""
    return list({result.shape.key: result.shape for result in tuned_results(session=session)}.values())


@dataclass(frozen=True, kw_only=True, slots=True)
class TunedResult:
    """One shape tuned on one GPU model: the stored winners' shape, GPU model (as NVML names it) and dtype."""

    shape: ModelShape
    gpu: str
    dtype: str


@wraps_driver_errors
def tuned_results(*, session: Session) -> list[TunedResult]:
    """Every (shape, GPU model) with stored winners, once each, in shape key then GPU order."""
    stmt = select(BestConfig.shape_key, BestConfig.gpu, BestConfig.shape, BestConfig.dtype)
    rows = session.execute(stmt.order_by(BestConfig.shape_key, BestConfig.gpu))  # a row per slot: one result each
    found = {
        (key, gpu): TunedResult(shape=ModelShape(**shape), gpu=gpu, dtype=dtype) for key, gpu, shape, dtype in rows
    }
    return list(found.values())
