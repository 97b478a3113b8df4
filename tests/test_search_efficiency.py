"""The search benchmark (`bench/search_efficiency.py`), its held-out cost-model landscapes (`bench/cost_model.py`)
and the properties of the tuner that should hold on any landscape, not only on the six it was tuned on."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
from conftest_tuner import synthetic_landscape
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.tuner.neighbours import family
from autotune.tuner.replay import Landscape
from bench import cost_model
from bench import search_efficiency as se
from bench.overlap_bench import ANCHORS
from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.shape import Slot

REPO = Path(__file__).resolve().parents[1]
optuna.logging.set_verbosity(optuna.logging.WARNING)
ANCHORS_MEASURED = cost_model.anchors(REPO / se.OVERLAP_RESULT, dims=ANCHORS)
TUNING = [Landscape.load(REPO / se.LANDSCAPES / name) for name in se.TUNING_SET]
HELD_OUT_ANCHORS = [a for a in ANCHORS_MEASURED if all((a.shape.key, a.slot) != (t.shape.key, t.slot) for t in TUNING)]


def held_out(index: int, *, seed: int = se.COST_MODEL_SEED) -> Landscape:
    anchor = HELD_OUT_ANCHORS[index % len(HELD_OUT_ANCHORS)]
    return Landscape.from_dict(cost_model.landscape_dict(anchor, seed=seed), source=f"synthetic {anchor.slot.value}")


# --- the benchmark's bookkeeping -----------------------------------------------------------------------------


def test_summary_reports_the_median_the_worst_landscape_and_pooled_miss_rates() -> None:
    def runs(arrivals: list[float], gaps: list[float]) -> dict[str, object]:
        return se.score([se.Run(arrival=a, trials=30, pick_gap=g) for a, g in zip(arrivals, gaps, strict=True)])

    a = runs([3, 5, math.inf], [0.0, 0.01, 0.03])
    b = runs([10, 20, 30], [0.001, 0.004, 0.006])
    rows = [
        {"landscape": "A", **dict.fromkeys(se.STRATEGIES, a)},
        {"landscape": "B", **dict.fromkeys(se.STRATEGIES, b)},
    ]
    total = se.summary(rows)["tuner"]
    # By hand: medians 5 and 20; gaps over 0.5%: 0.01, 0.03, 0.006; over 2%: 0.03; pooled median (0.004 + 0.006) / 2.
    assert (a["median_arrival"], a["arrived"], a["miss_rate_2pct"]) == (5, 2, pytest.approx(1 / 3))
    assert total["median_arrival"] == 12.5
    assert total["worst_landscape_arrival"] == {"landscape": "B", "median_arrival": 20}
    assert total["miss_rate_0.5pct"] == pytest.approx(3 / 6)
    assert total["miss_rate_2pct"] == pytest.approx(1 / 6)
    assert total["worst_landscape_miss_rate_2pct"] == {"landscape": "A", "miss_rate_2pct": pytest.approx(1 / 3)}
    assert total["median_pick_gap"] == pytest.approx(0.005)
    assert total["worst_pick_gap"] == {"landscape": "A", "pick_gap": 0.03}


def test_random_search_draws_distinct_configs_of_the_space_after_the_baselines() -> None:
    landscape = synthetic_landscape(Slot.PROJ_FPROP)
    baselines = se.baseline_configs(landscape)
    assert baselines[0] == OverlapConfig(method=Method.NONE) and len(baselines) >= 2
    order = list(itertools.islice(se.random_configs(landscape, 3, first=baselines), 40))
    assert order[: len(baselines)] == baselines
    assert len(set(order)) == len(order)
    assert set(order) <= set(landscape.space().configs())
    assert order == list(itertools.islice(se.random_configs(landscape, 3, first=baselines), 40))
    assert order != list(itertools.islice(se.random_configs(landscape, 4, first=baselines), 40))


def test_random_search_spends_the_budget_it_is_given_and_picks_its_fastest_measurement() -> None:
    landscape = synthetic_landscape(Slot.PROJ_FPROP, noise=0.0)  # no noise: the measured order is the true one
    run = se.random_search(landscape, 5, budget=12, repeats=15)
    spent = list(itertools.islice(se.random_configs(landscape, 5), 12))
    optimum = landscape.optimum()[1]
    assert run.trials == 12
    assert run.pick_gap == pytest.approx(min(landscape.truth(c) for c in spent) / optimum - 1)
    assert run.arrival == se.arrival(landscape, list(itertools.islice(se.random_configs(landscape, 5), se.RANDOM_CAP)))


def test_the_held_out_set_is_at_shapes_the_tuning_set_never_saw() -> None:
    sets = se.landscape_sets(REPO / se.LANDSCAPES, REPO / se.OVERLAP_RESULT)
    assert {ls.source for ls in sets["tuning"]} == {ls.source for ls in TUNING}
    assert sorted(Path(ls.source).name for ls in sets["tuning"]) == sorted(se.TUNING_SET)
    shapes = {name: {ls.shape.key for ls in found} for name, found in sets.items()}
    assert not shapes["tuning"] & shapes["held_out"]
    assert len(shapes["held_out"]) == len(ANCHORS) - len(shapes["tuning"]) == 2
    assert len(sets["held_out"]) == 2 * len({a.slot for a in ANCHORS_MEASURED}) == 20
    assert all(ls.source.startswith("synthetic") for ls in sets["held_out"])
    slots = {ls.slot for ls in sets["held_out"]}
    assert {Slot.QKV_DGRAD, Slot.QKV_WGRAD, Slot.FC1_FPROP, Slot.FC2_FPROP} <= slots
    for landscape in sets["held_out"]:
        assert set(landscape.results) == set(landscape.space().configs())


# --- the cost model --------------------------------------------------------------------------------------------

MACHINE = cost_model.Machine(
    triton_ratio=1.1,
    tail=0.02,
    launch_ms=0.01,
    flag_ms=0.005,
    ce_speed=1.2,
    ce_interference=0.03,
    margin_gain=0.0,
    k_sat=16.0,
    k_exp=1.0,
    contention=1.0,
    fused_cost=0.05,
    stream_cost=(0.0, 0.01, 0.02),
    first_gemm=0.1,
    cga=(1.1, 1.0, 0.95),
    bulk_leak=0.1,
    rough=0.0,
    noise=0.0,
)


@pytest.mark.parametrize(
    ("config", "want"),
    [
        # serial: 1.0 + 0.4
        (OverlapConfig(method=Method.NONE), 1.4),
        # copy engine beside cuBLAS: max(1.0 * 1.03, 0.4 * 1.2) + 0.1 * 0.48 + 0.005
        (OverlapConfig(method=Method.BULK, use_ce=True, gemm="cublas"), 1.03 + 0.048 + 0.005),
        # 8 SM-driven CTAs, no margin: GEMM 1.0 * (1 + 8/132), comm 0.4 * 16/8 * cga 2's 1.0
        (
            OverlapConfig(method=Method.BULK, use_ce=False, num_sm=8, cga_size=2, gemm="cublas"),
            (1 + 8 / 132) + 0.1 * 0.8 + 0.005,
        ),
        # fused ring, our GEMM beside copy engines: 1.1 * 1.03 * 1.05 + max(0, 0.48 - 1.133 / 2) + 0.005
        (OverlapConfig(method=Method.RING_EXCHANGE, fused=True, gemm="triton"), 1.1 * 1.03 * 1.05 + 0.005),
        # copy-engine ring, 1 stream: 2 chunks 1.03 * 1.02 + 0.01, exposed max(0, 0.48 - chunks / 2), + flag
        (
            OverlapConfig(method=Method.RING_EXCHANGE, use_ce=True, num_max_streams=1, gemm="cublas"),
            1.03 * 1.02 + 0.01 + 0.005,
        ),
    ],
    ids=["none", "bulk-ce", "bulk-sm", "fused", "ring-ce"],
)
def test_the_cost_model_gives_the_hand_computed_times(config: OverlapConfig, want: float) -> None:
    assert cost_model.config_ms(config, gemm_ms=1.0, comm_ms=0.4, machine=MACHINE, gemm_sms=132) == pytest.approx(want)


def test_a_pipeline_is_paced_by_the_slower_of_its_chunk_gemm_and_chunk_collective() -> None:
    config = OverlapConfig(method=Method.PIPELINE, num_splits=4, num_sm=8, set_sm_margin=True, gemm="cublas")
    gemm = 132 / 124  # 8 SMs kept off the GEMM
    chunk_gemm = (gemm * (1 + 0.02 * 3) + 0.01 * 3) / 4  # 4 chunks: 3 more tails and launches
    chunk_comm = 0.4 * 2 / 4 + 0.01  # 8 SMs of the 16 the comm needs: twice as slow, plus a launch
    want = chunk_gemm + 3 * max(chunk_gemm, chunk_comm) + chunk_comm + 0.01 * gemm  # 2 streams cost 1%
    got = cost_model.config_ms(
        replace(config, num_max_streams=2), gemm_ms=1.0, comm_ms=0.4, machine=MACHINE, gemm_sms=132
    )
    assert got == pytest.approx(want)


def test_a_cost_model_landscape_is_reproducible_and_keeps_the_measured_gemm_and_collective() -> None:
    anchor = HELD_OUT_ANCHORS[0]
    first, again = (cost_model.landscape_dict(anchor, seed=0) for _ in range(2))
    assert first == again
    assert first["configs"] != cost_model.landscape_dict(anchor, seed=1)["configs"]
    landscape = Landscape.from_dict(first)
    none = landscape.results[OverlapConfig(method=Method.NONE)]
    assert not isinstance(none, str)
    assert (none.gemm_ms, none.comm_ms) == anchor.problems[Method.NONE]
    assert none.overlap_ms == pytest.approx(sum(anchor.problems[Method.NONE]), rel=0.05)


def test_the_cost_model_fitted_without_a_recorded_landscape_ranks_it_like_the_gpus_did() -> None:
    """The evidence that the held-out landscapes resemble real ones: fitted on five of the six recorded
    landscapes (every config measured), the model orders the sixth's configs as measured, and fitting helps:
    on average it is nearer the recordings than the landscapes' own unfitted draws."""
    recorded = se.recorded_times(TUNING, REPO / se.OVERLAP_RESULT)
    assert len(recorded) == len(se.TUNING_SET)
    fit = se.cost_model_fit(recorded)
    assert all(r["spearman"] > 0.7 for r in fit["leave_one_out"]), fit["leave_one_out"]
    assert fit["leave_one_out_median_rel_err"] < 0.2
    drawn = [cost_model.error(cost_model.machine_for(r.anchor, seed=se.COST_MODEL_SEED), r) for r in recorded]
    assert _mean_error(fit["in_sample"]) < _mean_error(drawn)


def _mean_error(rows: list[dict]) -> float:
    return sum(r["median_rel_err"] for r in rows) / len(rows)


def test_freezing_pins_every_source_of_the_tuner(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    before = se.tuner_hash(tmp_path)
    assert se.tuner_hash(tmp_path) == before
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert se.tuner_hash(tmp_path) != before
    assert se.frozen_hash(tmp_path / "missing.json") is None


# --- properties of the tuner on landscapes it was not tuned on ---------------------------------------------------


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(index=st.integers(0, len(HELD_OUT_ANCHORS) - 1), model_seed=st.integers(0, 999), seed=st.integers(0, 99))
def test_the_tuner_never_decides_on_a_config_slower_than_its_best_baseline(
    index: int, model_seed: int, seed: int
) -> None:
    """It measures the baselines first and re-measures its leaders beside no overlap and TE's default, so
    whatever the landscape, its pick is at least as good as copying a baseline (up to the noise)."""
    landscape = held_out(index, seed=model_seed)
    tuned = se.tuner(landscape, seed)
    best_baseline = min(landscape.truth(c) for c in se.baseline_configs(landscape))
    optimum = landscape.optimum()[1]
    assert optimum * (1 + tuned.run.pick_gap) <= best_baseline * 1.005
    assert tuned.run.trials <= se.DEFAULT_TRIALS


def planted(landscape_data: dict, boosted: tuple) -> Landscape:
    """The landscape with every config of the ``boosted`` family made 3% faster than the old optimum's best:
    whichever family leads the search at first, the optimum now lies in this one."""
    before = Landscape.from_dict(landscape_data)
    members = [c for c in before.results if family(c) == boosted]
    scale = 0.97 * before.optimum()[1] / min(before.truth(c) for c in members)
    for row in landscape_data["configs"]:
        if family(OverlapConfig.from_dict(row["config"])) == boosted:
            row["measurement"]["samples"] = [s * scale for s in row["measurement"]["samples"]]
            row["measurement"]["overlap_ms"] *= scale
    return Landscape.from_dict(landscape_data, source=f"planted {boosted}")


def test_the_tuner_finds_an_optimum_planted_in_any_family_most_of_the_time() -> None:
    """Generalizes the h5120 proj_fprop case (the optimum one family away from the leaders): 20 held-out
    landscapes, each with a random family made the fastest.  Measured when written: 2% missed in 2 of 20
    (5 of 40 in a wider draw), each by staying in the old leading family; the bound keeps that from growing."""
    rng = random.Random(0)
    gaps = []
    for _ in range(20):
        data = cost_model.landscape_dict(rng.choice(HELD_OUT_ANCHORS), seed=rng.randrange(1000))
        families = sorted({family(OverlapConfig.from_dict(r["config"])) for r in data["configs"]}, key=str)
        gaps.append(se.tuner(planted(data, rng.choice(families)), rng.randrange(100)).run.pick_gap)
    assert sum(g > se.TARGET_GAP for g in gaps) <= 4, gaps
