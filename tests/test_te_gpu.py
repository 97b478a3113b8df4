"""The te backend on two GPUs with TransformerEngine installed (the H200 pair): a slot measured through TE
under the measurement contract, and a whole layer's step for ``autotune validate``.  Skipped elsewhere."""

from __future__ import annotations

import math

import pytest
import torch

from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.measurement import BaselineSource
from overlap_runtime.shape import ModelShape, Slot
from overlap_runtime.te_backend import TeRuntime, te_group, te_layer_step_ms, te_version

pytestmark = pytest.mark.skipif(
    te_version() is None or not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs TransformerEngine and two CUDA GPUs",
)

SHAPE = ModelShape(hidden=2048, tp=2, seq=2048)
CASES = [
    (Slot.QKV_FPROP, OverlapConfig(method=Method.RING_EXCHANGE, use_ce=True)),
    (Slot.PROJ_FPROP, OverlapConfig(method=Method.PIPELINE, num_splits=4, num_sm=16, cga_size=2, set_sm_margin=True)),
    (Slot.PROJ_DGRAD, OverlapConfig(method=Method.RING_EXCHANGE, use_ce=False, num_sm=4)),
    (Slot.QKV_DGRAD, OverlapConfig(method=Method.BULK, num_sm=8, cga_size=2, set_sm_margin=True)),
    (Slot.QKV_WGRAD, OverlapConfig(method=Method.BULK, num_sm=16, cga_size=2, set_sm_margin=True)),
]


@pytest.fixture(scope="module")
def runtime() -> TeRuntime:
    with TeRuntime(tp=2) as rt:
        yield rt


@pytest.mark.parametrize(("slot", "config"), CASES, ids=[s.value for s, _ in CASES])
def test_a_slot_measured_through_te_keeps_the_contract(runtime: TeRuntime, slot: Slot, config: OverlapConfig) -> None:
    none = OverlapConfig(method=Method.NONE)
    overlap, serial = runtime.measure_many(SHAPE, slot, [config, none], repeats=20, rounds=2)
    assert overlap.valid and serial.valid, (overlap.rel_err, serial.rel_err)
    assert serial.rel_err == 0.0  # method none runs the reference module itself
    assert overlap.baselines.source == BaselineSource.SAME_ROUNDS and len(overlap.samples) == 40
    # userbuffers initialized once for the config (the same entry in the second round is reused)
    assert overlap.ub_init_ms > 0 and serial.ub_init_ms == 0.0
    for m in (overlap, serial):
        assert all(math.isfinite(t) and t > 0 for t in (m.gemm_ms, m.comm_ms, m.serial_ms, m.overlap_ms))
    # method none is the serial path: its samples and serial's series come from the same module
    assert serial.overlap_ms == pytest.approx(serial.serial_ms, rel=0.25)


def test_a_layer_step_through_te_with_and_without_userbuffers() -> None:
    with te_group(SHAPE.tp) as group:
        plain = te_layer_step_ms(SHAPE, None, steps=5, warmup=2, group=group)
        default = te_layer_step_ms(SHAPE, {}, steps=5, warmup=2, group=group)
        again = te_layer_step_ms(SHAPE, None, steps=5, warmup=2, group=group)
    for steps in (plain, default, again):
        assert len(steps) == 5 and all(math.isfinite(t) and t > 0 for t in steps)
