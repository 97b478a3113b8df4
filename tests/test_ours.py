"""Our own preset format (`search_spaces.ours`): the overall winners, every knob kept, read back as written."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from conftest_tuner import measurement

from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import OursPreset, OursSlot, load_ours, ours_file_name, write_ours
from search_spaces.te_dict import MEASURED_NUMBERS

SHAPE = ModelShape(hidden=8192, tp=2, seq=8192, ffn_hidden=28672, gated=True)
FUSED = OverlapConfig(method=Method.RING_EXCHANGE, fused=True, gemm="triton", set_sm_margin=True, num_sm=4)
EXACT = OverlapConfig(method=Method.RING_EXCHANGE, use_ce=True, gemm="cublas", num_max_streams=2)
PRESET = OursPreset(
    shape=SHAPE,
    gpu="NVIDIA H200",
    slots={
        Slot.FC2_FPROP: OursSlot.of(EXACT, measurement(2.5)),
        Slot.PROJ_FPROP: OursSlot.of(FUSED, measurement(0.75)),
    },
)


def test_a_written_preset_reads_back_the_same_with_its_runtime_only_knobs() -> None:
    text = write_ours(PRESET)
    again = load_ours(text)
    assert again == PRESET and list(again.slots) == [Slot.PROJ_FPROP, Slot.FC2_FPROP]  # catalog order
    assert again.slots[Slot.PROJ_FPROP].config.fused and again.slots[Slot.PROJ_FPROP].measured["overlap_ms"] == 0.75
    assert set(again.slots[Slot.FC2_FPROP].measured) == set(MEASURED_NUMBERS)
    assert (again.te_exact(Slot.PROJ_FPROP), again.te_exact(Slot.FC2_FPROP)) == (False, True)
    assert load_ours(json.dumps(yaml.safe_load(text))) == PRESET  # the same content as JSON
    assert ours_file_name(PRESET) == f"ours_nvidia-h200_{SHAPE.key}.yaml"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.update(format="ub_cfg"), "format"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.pop("shape"), "shape"),
        (lambda d: d["slots"].update(qkv_fprup=d["slots"]["fc2_fprop"]), "slots"),
        (lambda d: d["slots"]["fc2_fprop"].pop("config"), "slots.fc2_fprop.config"),
        (lambda d: d["slots"]["fc2_fprop"]["measured"].pop("serial_ms"), "slots.fc2_fprop.measured"),
    ],
)
def test_a_file_that_is_not_our_format_is_refused_naming_the_field(
    change: Callable[[dict[str, Any]], object], field: str
) -> None:
    data = yaml.safe_load(write_ours(PRESET))
    change(data)
    with pytest.raises(InputError) as info:
        load_ours(yaml.safe_dump(data))
    assert info.value.field == field
