"""Races planted in the copy-engine and fused methods: each wait they issue left out in turn, each flag they
write raised ahead of the data or reads it publishes, and the harness's numerical check fails every time.

On CPU the methods run on the emulated GPU of `overlap_runtime.emulation` (gloo ranks, shared memory, a
thread per stream); the same test runs on two GPUs (skipped without them).  A plant is caught when the
check's error passes the bf16 limit (NaN included: a read of a poisoned buffer) or the call fails (a bounded
wait that timed out kills the group)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from overlap_runtime.config import OverlapConfig
from overlap_runtime.errors import TrialFailure
from overlap_runtime.group import TPGroup
from overlap_runtime.measurement import REL_ERR_LIMIT
from overlap_runtime.races import FaultPlan, SiteKind
from overlap_runtime.shape import ModelShape, Slot

RING_CE = OverlapConfig(method="ring_exchange", use_ce=True)
FUSED = OverlapConfig(method="ring_exchange", fused=True, gemm="triton")
BULK_CE = OverlapConfig(method="bulk", use_ce=True)
PUSH_SHARD = {"push_shard.inputs": "wait", "push_shard.acked": "wait", "push_shard.ready": "signal"}
FINISH = {"finish.join": "wait", "finish.read": "wait", "finish.ack": "signal"}
CASES = {
    # name: (slot, config, every wait and flag-write site its calls issue)
    "ring_ag_ce": (Slot.QKV_FPROP, RING_CE, {**PUSH_SHARD, "ring_ag_ce.arrived": "wait", **FINISH}),
    "ring_rs_ce": (
        Slot.PROJ_FPROP,
        RING_CE,
        {
            "ring_rs_ce.computed": "wait",
            "ring_rs_ce.acked": "wait",
            "ring_rs_ce.ready": "signal",
            "ring_rs_ce.arrived": "wait",
            **FINISH,
        },
    ),
    "fused_ag": (Slot.QKV_FPROP, FUSED, {**PUSH_SHARD, "fused_ag.arrived": "wait", **FINISH}),
    "fused_rs": (
        Slot.PROJ_FPROP,
        FUSED,
        {
            "fused_rs.arrived": "wait",
            "fused_rs.acked": "wait",
            "fused_rs.counted": "wait",
            "fused_rs.ready": "signal",
            **FINISH,
        },
    ),
    "bulk_ag": (
        Slot.QKV_DGRAD,
        BULK_CE,
        {
            "bulk.inputs": "wait",
            "bulk_gather.clear": "signal",
            "bulk_gather.cleared": "wait",
            "bulk_gather.ready": "signal",
            "bulk_gather.arrived": "wait",
            "bulk.join": "wait",
        },
    ),
    "bulk_rs": (
        Slot.QKV_WGRAD,
        BULK_CE,
        {
            "bulk.inputs": "wait",
            "bulk_scatter.acked": "wait",
            "bulk_scatter.ready": "signal",
            "bulk_scatter.arrived": "wait",
            "bulk_scatter.ack": "signal",
            "bulk.join": "wait",
        },
    ),
}


def _check(ctx, shape: ModelShape, slot: Slot, config: OverlapConfig, faults: FaultPlan) -> tuple[float, dict]:
    """The numerical check of ``config`` with ``faults`` planted, on operands of its own (a planted fault
    leaves its buffers and flags in any state): (worst-rank error, every site the check's calls issued)."""
    from overlap_runtime import harness
    from overlap_runtime.config import problem
    from overlap_runtime.methods.common import Plan

    dev = harness.device_of(ctx)
    ops, sets = harness.make_operands(dev, problem(shape, slot, config.method), seed=1)
    candidate = harness._Candidate(config=config, ops=ops, sets=sets, plan=Plan.resolve(config, dev))
    dev.sites.clear()
    with dev.planted(faults):
        return harness._check_numerics(dev, candidate), dict(dev.sites)


def _caught(group: TPGroup, shape: ModelShape, slot: Slot, config: OverlapConfig, faults: FaultPlan) -> str:
    """How the check caught ``faults``: "error <e>", "failed: <reason>", or "" when it passed."""
    try:
        error = group.run(_check, shape, slot, config, faults, timeout_s=120)[0][0]
    except TrialFailure as e:
        return f"failed: {e.reason}"
    return f"error {error:.2g}" if not math.isfinite(error) or error > REL_ERR_LIMIT[shape.dtype] else ""


BACKENDS = {
    "cpu": lambda tp: ModelShape(hidden=32 * tp, tp=tp, seq=16 * tp, mbs=2, ffn_hidden=64 * tp),
    "cuda": lambda tp: ModelShape(hidden=1024, tp=tp, seq=1024, ffn_hidden=4096),
}


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


def _every_plant_is_caught(group: TPGroup, backend: str, case: str, dtype: str = "bf16") -> None:
    slot, config, sites = CASES[case]
    shape = dataclasses.replace(BACKENDS[backend](group.tp), dtype=dtype)
    clean, seen = group.run(_check, shape, slot, config, FaultPlan())[0]
    assert clean < (1e-5 if backend == "cpu" else 1e-2), clean
    assert seen == sites  # the plants below cover every site the method issues
    missed = [
        site
        for site, kind in sites.items()
        if not _caught(group, shape, slot, config, FaultPlan.at(site, SiteKind(kind)))
    ]
    assert not missed, f"{case}: the check passed with these planted: {missed}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "case"), [*((2, case) for case in CASES), (4, "ring_rs_ce"), (4, "fused_ag"), (4, "bulk_ag")]
)
def test_every_planted_race_fails_the_numerical_check_on_cpu(groups, tp: int, case: str) -> None:
    _every_plant_is_caught(groups("cpu", tp), "cpu", case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ring_ag_ce", "fused_ag", "bulk_ag"])
def test_every_planted_race_on_fp8_data_fails_the_numerical_check_on_cpu(groups, case: str) -> None:
    """The all-gathers of an fp8 shape move E4M3 bytes: a race on them shows as on bf16 data (the CPU's result
    is exact there, so the clean check stays below 1e-5)."""
    _every_plant_is_caught(groups("cpu", 2), "cpu", case, "fp8")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("case", list(CASES))
def test_every_planted_race_fails_the_numerical_check_on_two_gpus(groups, monkeypatch, case: str) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the ranks run our compiled kernels
    _every_plant_is_caught(groups("cuda", 2), "cuda", case)
