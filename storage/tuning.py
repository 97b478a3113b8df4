"""The one tuning driver's storage side: what the scheduler and `autotune tune` share to tune a slot.

Both drive `SlotStudy` (`autotune.tuner.studies`) the same way: the study lives in Optuna's storage in our
own database (`optuna_storage`), starts from the winners of neighbouring shapes (`open_study`), decides through
its finalist batch, and its outcome becomes the slot's winner row (`record_winner`).  They differ only in who
measures: the scheduler hands proposals to workers over REST, `autotune tune` measures them itself
(`autotune.tuner.drive`).  So a slot tuned either way is stored the same way and exports the same preset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optuna
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from autotune.tuner.outcome import SlotOutcome
from autotune.tuner.studies import SlotStudy
from overlap_runtime.config import DeviceLimits, OverlapConfig
from overlap_runtime.shape import ModelShape, Slot
from storage.best import upsert_best
from storage.engine import SQLITE_BUSY_TIMEOUT_MS
from storage.models import BestConfig
from storage.warm_start import neighbour_winners


def optuna_storage(engine: Engine) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on ``engine``'s database: SQLite writers wait for the lock as our engine does,
    PostgreSQL keeps a small pool of checked connections."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one INFO line per trial would drown logs and bars
    url = engine.url.render_as_string(hide_password=False)
    if engine.dialect.name == "sqlite":
        kwargs: dict[str, Any] = {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}}
    else:
        kwargs = {"pool_pre_ping": True, "pool_size": 2, "max_overflow": 4}
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


def open_study(
    *,
    session: Session,
    storage: optuna.storages.BaseStorage,
    gpu: str,
    shape: ModelShape,
    slot: Slot,
    backend: str,
    limits: DeviceLimits | None,
    n_trials: int,
    measure_first: Sequence[OverlapConfig] = (),
    seed: int | None = None,
) -> SlotStudy:
    """The slot's study, created or resumed, warm-started from the stored winners of the nearest shapes on the
    same GPU model (`storage.warm_start`)."""
    return SlotStudy(
        storage=storage,
        gpu=gpu,
        shape=shape,
        slot=slot,
        backend=backend,
        limits=limits,
        n_trials=n_trials,
        measure_first=measure_first,
        warm_start=neighbour_winners(session=session, gpu=gpu, shape=shape, slot=slot),
        seed=seed,
    )


def record_winner(
    *,
    session: Session,
    gpu: str,
    shape: ModelShape,
    outcome: SlotOutcome,
    trial_id: int | None = None,
    job_id: str | None = None,
) -> BestConfig:
    """The slot's two winners (overall and TE-exact) and the tuner's whole verdict, as one best-config row;
    ``trial_id`` is the trial row that measured the winner, where a service job did."""
    te_exact, te_measurement = outcome.te_exact, outcome.te_exact_measurement
    return upsert_best(
        session=session,
        gpu=gpu,
        shape=shape,
        slot=outcome.slot.value,
        config=outcome.best.to_dict(),
        measurement=outcome.best_measurement.to_dict(),
        outcome=outcome.to_dict(),
        trial_id=trial_id,
        te_exact_config=None if te_exact is None else te_exact.to_dict(),
        te_exact_measurement=None if te_measurement is None else te_measurement.to_dict(),
        job_id=job_id,
    )
