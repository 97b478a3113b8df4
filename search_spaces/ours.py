"""Our own preset format: each slot's fastest config on our runtime, every knob kept, with its numbers.

NeMo YAML and TE's ub_cfgs carry what TE runs (`search_spaces.export`); a winner that uses our Triton GEMM,
the fused ring, copy-engine bulk or a stream count of its own has no TE spelling.  This format keeps it
whole, for our own layers to run: a YAML mapping (JSON is YAML too, so a JSON file loads the same way)

.. code-block:: yaml

    format: overlap-autotune-ours
    version: 1
    gpu: NVIDIA H200            # the GPU model the configs were measured on (null when unknown)
    shape: {hidden: 8192, tp: 2, mbs: 1, seq: 8192, ...}   # ModelShape.as_given()
    slots:
      qkv_fprop:
        config: {method: ring_exchange, use_ce: true, num_max_streams: 1, gemm: cublas}  # OverlapConfig.to_dict()
        measured: {overlap_ms: 2.117, serial_ms: 2.4, ...}  # export's MEASURED_NUMBERS
        te_exact: false         # whether TE runs this config exactly as measured (informative; recomputed)

`write_ours` writes it, `load_ours` reads it back (InputError naming the field for anything else); the
contract is docs/export.md, "Our own format".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import yaml

from overlap_runtime.config import OverlapConfig
from overlap_runtime.errors import InputError
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import ModelShape, Slot
from search_spaces.catalog import SLOT_ORDER
from search_spaces.te_dict import MEASURED_NUMBERS, measured_numbers
from search_spaces.te_exact import is_te_exact

FILE_PREFIX = "ours_"
"""Every file of this format is named ``ours_...`` (`ours_file_name`), so a folder of preset files (what
`autotune tune --out` writes) can tell it from the TE formats beside it."""
FORMAT = "overlap-autotune-ours"
VERSION = 1
"""Bump when a reader of version 1 would misread a file (a field renamed or given another meaning)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OursSlot:
    """One slot's winner on our runtime."""

    config: OverlapConfig
    """Every knob as measured, runtime-only ones (gemm, fused, num_max_streams) included."""
    measured: Mapping[str, Any]
    """The winner's `MEASURED_NUMBERS` (ms, the spread and its repeats)."""

    @classmethod
    def of(cls, config: OverlapConfig, measurement: Measurement | Mapping[str, Any]) -> OursSlot:
        """``config`` with the numbers of its measurement (or of that measurement's ``to_dict()``)."""
        return cls(config=config, measured=measured_numbers(measurement))


@dataclass(frozen=True, kw_only=True, slots=True)
class OursPreset:
    """Each tuned slot's winner on our runtime for one shape and GPU model."""

    shape: ModelShape
    gpu: str | None
    slots: Mapping[Slot, OursSlot] = field(default_factory=dict)
    """In catalog order."""

    def __post_init__(self) -> None:
        slots = {Slot(slot): entry for slot, entry in self.slots.items()}
        object.__setattr__(self, "slots", MappingProxyType({s: slots[s] for s in SLOT_ORDER if s in slots}))

    def te_exact(self, slot: Slot) -> bool:
        """Whether TE runs ``slot``'s winner exactly as it was measured."""
        return is_te_exact(self.slots[Slot(slot)].config, self.shape.tp)


def ours_file_name(preset: OursPreset) -> str:
    """``ours_{gpu}_{shape key}.yaml``, the GPU model in lower case with dashes (``ours_nvidia-h200_h8192_...``)."""
    gpu = re.sub(r"[^a-z0-9]+", "-", (preset.gpu or "unknown").lower()).strip("-")
    return f"{FILE_PREFIX}{gpu}_{preset.shape.key}.yaml"


def write_ours(preset: OursPreset) -> str:
    """``preset`` as our format's YAML."""
    body = {
        "format": FORMAT,
        "version": VERSION,
        "gpu": preset.gpu,
        "shape": preset.shape.as_given(),
        "slots": {
            slot.value: {
                "config": entry.config.to_dict(),
                "measured": dict(entry.measured),
                "te_exact": preset.te_exact(slot),
            }
            for slot, entry in preset.slots.items()
        },
    }
    header = "# overlap-autotune: each slot's fastest config on our runtime (docs/export.md, our own format)\n"
    return header + yaml.safe_dump(body, sort_keys=False)


def load_ours(text: str) -> OursPreset:
    """Our format (YAML or JSON) read back; InputError naming the field that is missing or wrong."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InputError("file", f"must be YAML or JSON ({e})") from None
    if not isinstance(data, dict):
        raise InputError("file", "must be a mapping with format, version, gpu, shape and slots", type(data).__name__)
    if data.get("format") != FORMAT:
        raise InputError("format", f"must be {FORMAT}", data.get("format"))
    if data.get("version") != VERSION:
        raise InputError("version", f"must be {VERSION} (this reader's)", data.get("version"))
    shape = ModelShape(**_mapping(data, "shape"))
    slots: dict[Slot, OursSlot] = {}
    for name, entry in _mapping(data, "slots").items():
        where = f"slots.{name}"
        try:
            slot = Slot(name)
        except ValueError:
            raise InputError("slots", f"must name TE slots such as {Slot.QKV_FPROP.value}", name) from None
        if not isinstance(entry, dict):
            raise InputError(where, "must be a mapping with config and measured", entry)
        measured = _mapping(entry, "measured", where=where)
        missing = [n for n in MEASURED_NUMBERS if n not in measured]
        if missing:
            raise InputError(f"{where}.measured", f"must hold {', '.join(MEASURED_NUMBERS)}", missing)
        config = OverlapConfig.from_dict(_mapping(entry, "config", where=where))
        slots[slot] = OursSlot(config=config, measured=measured)
    gpu = data.get("gpu")
    return OursPreset(shape=shape, gpu=None if gpu is None else str(gpu), slots=slots)


def _mapping(data: Mapping[str, Any], key: str, *, where: str = "") -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise InputError(f"{where}.{key}" if where else key, "must be a mapping", value)
    return value
