"""Preset files -> the configs of the library layers (`overlap_runtime.layers.TransformerOverlap`).

A preset is one of:

- our own format (`search_spaces.ours`: the overall winners, runtime configs as measured on our runtime), run
  as they are, for the one shape it was tuned for;
- any preset file TE reads (`formats.read_file`: NeMo/Megatron YAML, TE's ``ub_cfgs`` JSON, a
  Megatron-Bridge module), a ``ub_cfgs`` mapping, or a `Preset`: TE's effective entries, each turned into the
  runtime config that runs it on the backend (`defaults.as_runnable`).

Slots a preset leaves out run no overlap in the layers (TE would run its defaults there; `te_defaults` gives
those).  A slot the backend cannot run is an `InputError` naming it, or, with ``strict=False`` (NVIDIA's
nearest preset, made for another shape), TE's default for the slot, with the reason kept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlap_runtime.config import DeviceLimits, OverlapConfig, check_config
from overlap_runtime.errors import ConfigError, InputError
from overlap_runtime.layers import TransformerOverlap
from overlap_runtime.shape import EXTERNAL_SLOTS, ModelShape, Slot, slot_gemm
from search_spaces.catalog import tunable_slots
from search_spaces.defaults import as_runnable, te_default
from search_spaces.formats import read_file
from search_spaces.ours import FORMAT, OursPreset, load_ours
from search_spaces.presets import Preset
from search_spaces.te_dict import parse_ub_cfgs


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotConfigs:
    """A preset's runtime config per slot, and why any slot runs something else than the preset says."""

    configs: Mapping[Slot, OverlapConfig]
    notes: tuple[str, ...] = ()

    def layers(self) -> TransformerOverlap:
        return TransformerOverlap.from_slots(self.configs)


def layer_configs_from_preset(
    source: str | Path | Mapping[Any, Any] | Preset,
    shape: ModelShape,
    *,
    backend: str,
    limits: DeviceLimits | None = None,
) -> TransformerOverlap:
    """The layers' configs for ``shape`` on ``backend`` from a preset file, its parsed data, or a `Preset`."""
    return slot_configs(source, shape, backend=backend, limits=limits).layers()


def slot_configs(
    source: str | Path | Mapping[Any, Any] | Preset | OursPreset,
    shape: ModelShape,
    *,
    backend: str,
    limits: DeviceLimits | None = None,
    strict: bool = True,
) -> SlotConfigs:
    """Every slot the preset configures, as a runtime config for ``shape`` (module docstring)."""
    read = _read(source)
    if isinstance(read, OursPreset):
        return SlotConfigs(configs=_ours(read, shape, backend=backend, limits=limits))
    return _runnable(read, shape, backend=backend, limits=limits, strict=strict)


def te_defaults(shape: ModelShape, *, backend: str, limits: DeviceLimits | None = None) -> TransformerOverlap:
    """What TE runs in every slot when ub_cfgs leaves it out, as the layers' configs."""
    slots = {slot: te_default(shape, slot, backend=backend, limits=limits) for slot in tunable_slots(shape)}
    return TransformerOverlap.from_slots(slots)


def _ours(
    ours: OursPreset, shape: ModelShape, *, backend: str, limits: DeviceLimits | None
) -> dict[Slot, OverlapConfig]:
    """Our own format's winners, run as measured (`search_spaces.ours`), each checked against the backend's
    rules.  The format is for one shape, so another shape is refused."""
    if ours.shape.key != shape.key:
        raise InputError("shape", f"must be the shape the preset was tuned for, {ours.shape.key}", shape.key)
    configs = {slot: entry.config for slot, entry in ours.slots.items() if slot not in EXTERNAL_SLOTS}
    for slot, config in configs.items():
        try:
            check_config(config, slot_gemm(shape, slot), backend=backend, limits=limits)
        except ConfigError as e:
            raise InputError(f"{slot.value}.{e.field}", f"cannot run on {backend}: {e.rule}", e.value) from None
    return configs


def _read(source: str | Path | Mapping[Any, Any] | Preset | OursPreset) -> Preset | OursPreset:
    """The preset a source holds: a file in any format (`formats.read_file`), a ``ub_cfgs`` mapping (bare or
    under ``ub_cfgs``) or our format's mapping, or the preset itself."""
    if isinstance(source, Preset | OursPreset):
        return source
    if isinstance(source, Mapping):
        if source.get("format") == FORMAT:
            return load_ours(json.dumps(source))
        entries = source["ub_cfgs"] if isinstance(source.get("ub_cfgs"), Mapping) else source
        return Preset(configs=parse_ub_cfgs(entries))
    return read_file(source)


def _runnable(
    preset: Preset, shape: ModelShape, *, backend: str, limits: DeviceLimits | None, strict: bool
) -> SlotConfigs:
    configs: dict[Slot, OverlapConfig] = {}
    notes = []
    for slot, entry in preset.configs.items():
        if slot in EXTERNAL_SLOTS:
            continue
        try:
            configs[slot] = as_runnable(shape, slot, entry, backend=backend, limits=limits)
        except ConfigError as e:
            if strict:
                raise InputError(f"{slot.value}.{e.field}", f"cannot run on {backend}: {e.rule}", e.value) from None
            configs[slot] = te_default(shape, slot, backend=backend, limits=limits)
            notes.append(f"{slot.value}: {e} on {backend}; TE's default instead")
    return SlotConfigs(configs=configs, notes=tuple(notes))
