"""The replay backend: answers like `Runtime.measure_many` from a recorded landscape, with the recorded noise."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest_tuner import SHAPE, landscape_dict, synthetic_landscape

from autotune.tuner.drive import drive
from autotune.tuner.replay import Landscape, ReplayBackend
from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.errors import InputError, TrialFailure
from overlap_runtime.shape import ModelShape, Slot

REPO = Path(__file__).resolve().parents[1]
SLOT = Slot.FC2_FPROP


def test_each_call_draws_repeats_from_the_recorded_samples_with_a_seed() -> None:
    landscape = synthetic_landscape(SLOT, noise=0.05)
    configs = list(landscape.results)[:3]
    first = ReplayBackend([landscape], seed=7).measure_many(SHAPE, SLOT, configs, repeats=4, rounds=3)
    again = ReplayBackend([landscape], seed=7).measure_many(SHAPE, SLOT, configs, repeats=4, rounds=3)
    assert first == again
    for config, m in zip(configs, first, strict=True):
        recorded = landscape.results[config]
        assert not isinstance(recorded, str)
        assert len(m.samples) == m.repeats == 12
        assert set(m.samples) <= set(recorded.samples)
        assert m.overlap_ms == statistics.median(m.samples)
        assert (m.gemm_ms, m.comm_ms, m.serial_ms, m.valid) == (
            recorded.gemm_ms,
            recorded.comm_ms,
            recorded.serial_ms,
            recorded.valid,
        )
    later = ReplayBackend([landscape], seed=7)
    later.measure_many(SHAPE, SLOT, configs, repeats=4)
    assert later.measure_many(SHAPE, SLOT, configs, repeats=4, rounds=3) != first  # fresh draws per call


def test_a_recorded_failure_fails_the_whole_batch_like_the_runtime() -> None:
    landscape = synthetic_landscape(SLOT, failing=lambda c: "hung: synthetic" if c.num_splits == 8 else None)
    bad = next(c for c in landscape.results if c.num_splits == 8)
    good = OverlapConfig(method=Method.NONE)
    with pytest.raises(TrialFailure, match="hung: synthetic"):
        ReplayBackend([landscape]).measure_many(SHAPE, SLOT, [good, bad], repeats=3)
    assert landscape.truth(bad) == float("inf")
    assert landscape.optimum()[0] != bad


def test_a_config_or_slot_that_was_not_recorded_is_a_clear_error() -> None:
    data = landscape_dict(SLOT)
    data["configs"] = data["configs"][1:]
    missing = OverlapConfig.from_dict(landscape_dict(SLOT)["configs"][0]["config"])
    replay = ReplayBackend([Landscape.from_dict(data, source="h8192.json")])
    with pytest.raises(InputError, match=r"config: was not recorded in the landscape h8192\.json"):
        replay.measure_many(SHAPE, SLOT, [missing], repeats=3)
    with pytest.raises(InputError, match="no landscape recorded for proj_fprop"):
        replay.measure_many(SHAPE, Slot.PROJ_FPROP, [missing], repeats=3)


@pytest.mark.slow
def test_a_landscape_recorded_on_the_cpu_replays_through_a_whole_study(tmp_path: Path) -> None:
    record = ["--shape", "h4096_s4096", "--slot", "proj_fprop", "--backend", "cpu", "--hidden-scale", "64"]
    subprocess.run(
        [sys.executable, "bench/record_landscape.py", *record, "--repeats", "3", "--out", str(tmp_path)],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=120,
    )
    landscape = Landscape.load(next(tmp_path.glob("*.json")))
    assert landscape.shape == ModelShape(hidden=64, tp=2, seq=64, ffn_hidden=224)
    assert set(landscape.results) == set(landscape.space().configs())
    outcome = drive(landscape.study(n_trials=20, seed=0), measurer=ReplayBackend([landscape], seed=0))
    assert outcome is not None and outcome.best in landscape.results
    assert landscape.truth(outcome.best) < float("inf")
