"""TP=8 on the CPU backend: eight gloo ranks run every method (aggregated rings included) and reproduce the
serial result.  The 8-GPU hosts are not lent yet; this is the part of that check the CPUs can do."""

from __future__ import annotations

import pytest

from overlap_runtime.config import OverlapConfig
from overlap_runtime.runtime import Runtime
from overlap_runtime.shape import ModelShape, Slot

SHAPE = ModelShape(hidden=128, tp=8, seq=64, num_heads=8, num_query_groups=8)
CASES = [
    (Slot.QKV_FPROP, OverlapConfig(method="ring_exchange")),
    (Slot.QKV_FPROP, OverlapConfig(method="ring_exchange", aggregate=True)),
    (Slot.FC2_DGRAD, OverlapConfig(method="ring_exchange", aggregate=True)),
    (Slot.PROJ_FPROP, OverlapConfig(method="ring_exchange")),
    (Slot.FC2_FPROP, OverlapConfig(method="pipeline", num_splits=4, pipeline_rs_overlap_first_gemm=True)),
    (Slot.FC1_DGRAD, OverlapConfig(method="pipeline", num_splits=2)),
    (Slot.QKV_DGRAD, OverlapConfig(method="bulk")),
    (Slot.FC1_WGRAD, OverlapConfig(method="bulk")),
    (Slot.PROJ_DGRAD, OverlapConfig(method="none")),
]


@pytest.fixture(scope="module")
def runtime():
    with Runtime(tp=8, backend="cpu", trial_timeout_s=120) as rt:
        yield rt


@pytest.mark.parametrize(("slot", "config"), CASES, ids=lambda v: str(getattr(v, "to_dict", lambda: v)()))
def test_tp8_methods_reproduce_the_serial_result(runtime: Runtime, slot: Slot, config: OverlapConfig) -> None:
    m = runtime.measure(SHAPE, slot, config, repeats=3, warmup=1)
    assert m.valid and m.rel_err < 1e-5, (config, m)
