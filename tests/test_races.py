"""Races planted in the copy-engine and fused methods (`bench/race_plants.py`, `overlap_runtime.races`): each
site of every method's path, the library layers' included, gets the widest race of its kind and the narrowest
that is still wrong (a wait left out or one epoch early or one count short, a flag raised ahead of its data, a
read moved after the release), and the harness's numerical check fails under every one of several seeds of its
random delays (within `TRIES` runs of each).

On CPU the methods run on the emulated GPU of `overlap_runtime.emulation` (gloo ranks, shared memory, a
thread per stream), on a shape whose reduce-scatter segments hold several tiles (so a counter one short is
not a counter left out); the same test runs on two GPUs (skipped without them).  A plant is caught when the
check's error passes the bf16 limit (NaN included: a read of a poisoned buffer) or the call fails (a bounded
wait that timed out kills the group)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from bench import race_plants
from bench.race_plants import CASES, SHAPES, caught, check, planted, plants
from overlap_runtime.config import problem
from overlap_runtime.group import TPGroup
from overlap_runtime.races import FaultPlan
from overlap_runtime.shape import Slot

TRIES = 2
"""Runs of a plant under one seed before it counts as missed.  A race shows only while the slowed stream really
is behind, and a machine loaded by the other test files can leave the peer rank unscheduled for longer than the
slow-down (`HostDevice.jitter`), hiding the race once now and then (twice in six full runs)."""


@pytest.fixture(scope="module")
def groups():
    """One group per (backend, tp), shared by the module's tests."""
    started: dict[tuple[str, int], TPGroup] = {}

    def group(backend: str, tp: int) -> TPGroup:
        if (backend, tp) not in started:
            started[backend, tp] = TPGroup(tp=tp, backend=backend)
        return started[backend, tp]

    yield group
    for g in started.values():
        g.close()


def _every_plant_is_caught(group: TPGroup, backend: str, name: str, dtype: str = "bf16") -> None:
    case = CASES[name]
    shape = dataclasses.replace(SHAPES[backend](group.tp), dtype=dtype)
    clean, seen = group.run(check, shape, case, FaultPlan(), 0)[0]
    assert clean < (1e-5 if backend == "cpu" else 1e-2), clean
    assert seen == case.sites  # the plants below cover every site the method issues
    missed = [
        (site, plant.value, seed)
        for site, plant in plants(case)
        for seed in range(race_plants.SEEDS)
        if not any(caught(planted(group, shape, case, FaultPlan.at(site, plant), seed), shape) for _ in range(TRIES))
    ]
    assert not missed, f"{name}: the check passed with these planted (site, plant, seed): {missed}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "name"),
    [*((2, name) for name in CASES), (4, "ring_rs_ce"), (4, "fused_ag"), (4, "fused_rs"), (4, "layer_dgrad_bulk_ag")],
)
def test_every_planted_race_fails_the_numerical_check_on_cpu(groups, tp: int, name: str) -> None:
    _every_plant_is_caught(groups("cpu", tp), "cpu", name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ring_ag_ce", "fused_ag", "layer_dgrad_fused", "layer_dgrad_bulk_ag"])
def test_every_planted_race_on_fp8_data_fails_the_numerical_check_on_cpu(groups, name: str) -> None:
    """The all-gathers of an fp8 shape move E4M3 bytes: a race on them shows as on bf16 data (the CPU's result
    is exact there, so the clean check stays below 1e-5)."""
    _every_plant_is_caught(groups("cpu", 2), "cpu", name, "fp8")


def test_the_cpu_shape_has_segments_of_several_tiles_so_a_count_short_is_not_a_count_left_out() -> None:
    from overlap_runtime import ring_gemm

    shape = SHAPES["cpu"](2)
    gemm = problem(shape, Slot.PROJ_FPROP, "ring_exchange")
    rows = gemm.tokens // shape.tp
    plan = ring_gemm.scatter_plan(
        rows, gemm.n, gemm.k, chunks=shape.tp, dtype=torch.bfloat16, device=torch.device("cpu"), gemm_sms=None
    )
    assert min(seg.tiles for seg in plan.segments) > 1


def test_the_committed_plant_counts_are_of_every_plant_and_every_one_was_caught() -> None:
    """bench/results/race_plants_cpu.json (`python bench/race_plants.py`) holds every plant of every case."""
    data = json.loads(race_plants.OUT.read_text())
    assert data["environment"]["commit"] and data["seeds"] >= 3
    recorded = {(c["case"], r["site"], r["plant"]) for c in data["cases"] for r in c["plants"]}
    assert recorded == {(name, site, plant.value) for name, case in CASES.items() for site, plant in plants(case)}
    assert data["plants"] == data["caught"] == len(recorded) and not data["missed"]
    smallest = [r["smallest_error"] for c in data["cases"] for r in c["plants"] if r["smallest_error"] is not None]
    assert all(e > 0.02 for e in smallest)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("name", list(CASES))
def test_every_planted_race_fails_the_numerical_check_on_two_gpus(groups, monkeypatch, name: str) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the ranks run our compiled kernels
    _every_plant_is_caught(groups("cuda", 2), "cuda", name)
