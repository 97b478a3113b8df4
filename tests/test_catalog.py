"""The layer catalog: TE's slots, their directions, legal methods and which ones a job tunes."""

from __future__ import annotations

import pytest

from overlap_runtime.config import Method
from overlap_runtime.errors import InputError
from overlap_runtime.shape import Collective, ModelShape, Slot
from search_spaces import CATALOG, off_switch, search_methods, slot_info, tunable_slots
from search_spaces.catalog import collective

SHAPE = ModelShape(hidden=4096, tp=4, seq=2048)
AG_SLOTS = (Slot.QKV_FPROP, Slot.FC1_FPROP, Slot.PROJ_DGRAD, Slot.FC2_DGRAD)


def test_catalog_covers_all_twelve_te_slots_once() -> None:
    assert sorted(info.slot for info in CATALOG) == sorted(Slot)


def test_default_job_tunes_ten_slots_and_never_the_external_wgrads() -> None:
    slots = tunable_slots(SHAPE)
    assert len(slots) == 10
    assert Slot.PROJ_WGRAD not in slots and Slot.FC2_WGRAD not in slots


def test_defaults_follow_te_initialize_ub() -> None:
    assert {s for s in Slot if slot_info(s).default_method == Method.RING_EXCHANGE} == set(AG_SLOTS)
    assert {s for s in Slot if slot_info(s).default_method == Method.PIPELINE} == {Slot.PROJ_FPROP, Slot.FC2_FPROP}
    assert {s for s in Slot if slot_info(s).default_method == Method.BULK} == {
        Slot.QKV_DGRAD,
        Slot.QKV_WGRAD,
        Slot.FC1_DGRAD,
        Slot.FC1_WGRAD,
    }
    assert {s for s in Slot if slot_info(s).default_method == Method.EXTERNAL} == {Slot.PROJ_WGRAD, Slot.FC2_WGRAD}


@pytest.mark.parametrize("slot", AG_SLOTS)
def test_all_gather_slots_run_ring_exchange_only(slot: Slot) -> None:
    assert slot_info(slot).te_methods == (Method.RING_EXCHANGE,)
    assert collective(slot, Method.RING_EXCHANGE) == Collective.ALL_GATHER


def test_rs_fprop_slots_take_pipeline_or_ring_exchange() -> None:
    for slot in (Slot.PROJ_FPROP, Slot.FC2_FPROP):
        assert set(slot_info(slot).te_methods) == {Method.PIPELINE, Method.RING_EXCHANGE}


def test_dgrad_slots_switch_to_reduce_scatter_under_ring_exchange_or_pipeline() -> None:
    for slot in (Slot.QKV_DGRAD, Slot.FC1_DGRAD):
        assert set(slot_info(slot).te_methods) == {Method.BULK, Method.RING_EXCHANGE, Method.PIPELINE}
        assert collective(slot, Method.BULK) == Collective.ALL_GATHER
        assert collective(slot, Method.PIPELINE) == Collective.REDUCE_SCATTER
        assert "rs-dgrad" in off_switch(slot, Method.RING_EXCHANGE)


def test_wgrad_bulk_slots_are_bulk_only() -> None:
    assert slot_info(Slot.QKV_WGRAD).te_methods == slot_info(Slot.FC1_WGRAD).te_methods == (Method.BULK,)


def test_every_search_starts_with_the_no_overlap_baseline() -> None:
    for slot in tunable_slots(SHAPE):
        methods = search_methods(slot)
        assert methods[0] == Method.NONE and Method.EXTERNAL not in methods


def test_each_slot_names_the_switch_that_turns_its_overlap_off() -> None:
    assert "tp_comm_overlap_disable_qkv" in off_switch(Slot.QKV_FPROP, Method.RING_EXCHANGE)
    assert "--disable-tp-comm-overlap-rs" in off_switch(Slot.FC2_FPROP, Method.PIPELINE)
    assert "--disable-tp-comm-bulk-dgrad" in off_switch(Slot.QKV_DGRAD, Method.BULK)
    assert "--disable-tp-comm-bulk-wgrad" in off_switch(Slot.FC1_WGRAD, Method.BULK)


def test_named_layers_come_back_in_catalog_order() -> None:
    assert tunable_slots(SHAPE, ["fc2_fprop", "qkv_fprop"]) == (Slot.QKV_FPROP, Slot.FC2_FPROP)


def test_unknown_layer_is_rejected_naming_layers_and_the_close_name() -> None:
    with pytest.raises(InputError) as info:
        tunable_slots(SHAPE, ["qkv_fprop", "fc1_fprp"])
    assert info.value.field == "layers" and "did you mean fc1_fprop" in info.value.rule


def test_external_layer_is_rejected() -> None:
    with pytest.raises(InputError, match="external"):
        tunable_slots(SHAPE, ["proj_wgrad"])


def test_empty_layer_list_is_rejected() -> None:
    with pytest.raises(InputError, match="layers"):
        tunable_slots(SHAPE, [])


def test_tp_1_has_nothing_to_tune() -> None:
    with pytest.raises(InputError) as info:
        tunable_slots(ModelShape(hidden=1024, tp=1, seq=512))
    assert info.value.field == "tp"
