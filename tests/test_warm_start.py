"""Warm start: the winners of neighbouring shapes in the database become a new study's first trials."""

from __future__ import annotations

from pathlib import Path

import optuna

import storage
from autotune.tuner.studies import SlotStudy
from overlap_runtime.config import OverlapConfig
from overlap_runtime.shape import ModelShape, Slot
from storage.warm_start import neighbour_winners

GPU = "NVIDIA H200"
SHAPE = ModelShape(hidden=64, tp=2, seq=64)


def _record(session, shape: ModelShape, config: OverlapConfig, *, gpu: str = GPU) -> None:
    measurement = {"overlap_ms": 1.0, "valid": True}
    storage.upsert_best(
        session=session, gpu=gpu, shape=shape, slot="proj_fprop", config=config.to_dict(), measurement=measurement
    )


def test_nearest_winners_of_the_same_gpu_tp_and_dtype_come_first(tmp_path: Path) -> None:
    engine = storage.create_engine_for(url=f"sqlite:///{tmp_path / 'a.db'}")
    storage.upgrade(engine=engine)
    near = OverlapConfig(method="pipeline", num_splits=2)
    far = OverlapConfig(method="pipeline", num_splits=4)
    with storage.session_factory(engine=engine)() as session:
        _record(session, SHAPE, OverlapConfig(method="ring_exchange"))  # the shape itself: never its own seed
        _record(session, ModelShape(hidden=64, tp=2, seq=128), near)  # one doubling of tokens away
        _record(session, ModelShape(hidden=256, tp=2, seq=512), far)  # four doublings away
        _record(session, ModelShape(hidden=64, tp=2, seq=32), OverlapConfig(method="none"))  # none: a baseline anyway
        _record(session, ModelShape(hidden=64, tp=4, seq=64), OverlapConfig(method="bulk"))  # other tp
        _record(session, ModelShape(hidden=64, tp=2, seq=128), OverlapConfig(method="bulk"), gpu="cpu")
        assert neighbour_winners(session=session, gpu=GPU, shape=SHAPE, slot=Slot.PROJ_FPROP) == (near, far)
        assert neighbour_winners(session=session, gpu=GPU, shape=SHAPE, slot=Slot.PROJ_FPROP, limit=1) == (near,)
        assert neighbour_winners(session=session, gpu=GPU, shape=SHAPE, slot=Slot.QKV_FPROP) == ()


def test_warm_start_configs_are_among_the_first_trials_of_a_new_study() -> None:
    warm = (OverlapConfig(method="pipeline", num_splits=2, pipeline_rs_overlap_first_gemm=True),)
    study = SlotStudy(
        storage=optuna.storages.InMemoryStorage(),
        gpu="cpu",
        shape=SHAPE,
        slot=Slot.PROJ_FPROP,
        backend="cpu",
        limits=None,
        n_trials=10,
        warm_start=warm,
        seed=0,
    )
    first = [study.ask() for _ in range(4)]
    assert any(p is not None and warm[0] in p.configs for p in first)
