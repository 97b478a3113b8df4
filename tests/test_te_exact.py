"""The TE-exact subspace: what TE runs exactly as measured, and every deviation named by its knob."""

from __future__ import annotations

import pytest

from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import slot_space
from search_spaces.defaults import te_default
from search_spaces.te_exact import is_te_exact, te_deviations

SHAPE = ModelShape(hidden=8192, tp=2, seq=8192)


@pytest.mark.parametrize("slot", [s for s in Slot if s not in (Slot.PROJ_WGRAD, Slot.FC2_WGRAD)])
def test_te_default_of_every_slot_is_te_exact(slot: Slot) -> None:
    assert is_te_exact(te_default(SHAPE, slot, backend="cuda"), SHAPE.tp)


@pytest.mark.parametrize(
    ("config", "knob"),
    [
        (OverlapConfig(method=Method.NONE), "method"),
        (OverlapConfig(method=Method.RING_EXCHANGE, gemm="triton", fused=True), "fused"),
        (OverlapConfig(method=Method.RING_EXCHANGE, gemm="triton", num_max_streams=2), "gemm"),
        (OverlapConfig(method=Method.RING_EXCHANGE, gemm="cublas", num_max_streams=1), "num_max_streams"),
        (OverlapConfig(method=Method.PIPELINE, num_splits=4, num_sm=16, set_sm_margin=True), "num_max_streams"),
        (OverlapConfig(method=Method.BULK, use_ce=True, gemm="cublas"), "use_ce"),
        (OverlapConfig(method=Method.BULK, num_sm=48, use_ce=False, gemm="cublas"), "num_sm"),
    ],
)
def test_each_deviation_is_named_by_its_knob(config: OverlapConfig, knob: str) -> None:
    assert [d.knob for d in te_deviations(config, SHAPE.tp)] == [knob]


def test_pipeline_with_tes_three_streams_and_cublas_is_te_exact() -> None:
    config = OverlapConfig(method=Method.PIPELINE, num_splits=4, num_sm=16, set_sm_margin=True, num_max_streams=3)
    assert is_te_exact(config, SHAPE.tp)


def test_the_cuda_space_of_every_slot_holds_te_exact_configs_and_others() -> None:
    # Both halves must be searchable: the TE-exact winner is tuned, not a by-product of the overall search.
    for slot in (Slot.QKV_FPROP, Slot.PROJ_FPROP, Slot.QKV_WGRAD, Slot.QKV_DGRAD):
        configs = list(slot_space(SHAPE, slot, backend="cuda", limits=None).configs())
        exact = [c for c in configs if is_te_exact(c, SHAPE.tp)]
        assert 0 < len(exact) < len(configs), slot
