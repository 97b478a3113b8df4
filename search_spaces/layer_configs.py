"""Preset files -> the configs of the library layers (`overlap_runtime.layers.TransformerOverlap`).

A preset is read by the first reader in `READERS` that knows its format:

- our own format (the overall winners, runtime configs as measured on our runtime): `_ours`, the one function
  that plugs it in;
- a NeMo/Megatron YAML, or TE's ``ub_cfgs`` dict as JSON (bare, or under ``ub_cfgs`` as `te_dict.preset_json`
  writes it): TE's effective entries, each turned into the runtime config that runs it on the backend
  (`defaults.as_runnable`).

Slots a preset leaves out run no overlap in the layers (TE would run its defaults there; `te_defaults` gives
those).  A slot the backend cannot run is an `InputError` naming it, or, with ``strict=False`` (NVIDIA's
nearest preset, made for another shape), TE's default for the slot, with the reason kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from overlap_runtime.config import DeviceLimits, OverlapConfig
from overlap_runtime.errors import ConfigError, InputError
from overlap_runtime.layers import TransformerOverlap
from overlap_runtime.shape import EXTERNAL_SLOTS, ModelShape, Slot
from search_spaces.catalog import tunable_slots
from search_spaces.defaults import as_runnable, te_default
from search_spaces.nemo_yaml import MAX_PRESET_BYTES, parse_nemo
from search_spaces.presets import Preset, PresetError


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotConfigs:
    """A preset's runtime config per slot, and why any slot runs something else than the preset says."""

    configs: Mapping[Slot, OverlapConfig]
    notes: tuple[str, ...] = ()

    def layers(self) -> TransformerOverlap:
        return TransformerOverlap.from_slots(self.configs)


def layer_configs_from_preset(
    source: str | Path | Mapping[str, Any] | Preset,
    shape: ModelShape,
    *,
    backend: str,
    limits: DeviceLimits | None = None,
) -> TransformerOverlap:
    """The layers' configs for ``shape`` on ``backend`` from a preset file, its parsed data, or a `Preset`."""
    return slot_configs(source, shape, backend=backend, limits=limits).layers()


def slot_configs(
    source: str | Path | Mapping[str, Any] | Preset,
    shape: ModelShape,
    *,
    backend: str,
    limits: DeviceLimits | None = None,
    strict: bool = True,
) -> SlotConfigs:
    """Every slot the preset configures, as a runtime config for ``shape`` (module docstring)."""
    if isinstance(source, Preset):
        return _runnable(source, shape, backend=backend, limits=limits, strict=strict)
    data, name = _load(source) if isinstance(source, str | Path) else (source, None)
    for reader in READERS:
        configs = reader(data, name, shape, backend, limits, strict)
        if configs is not None:
            return configs
    raise PresetError("preset", "is in no format this version reads (NeMo YAML, TE ub_cfgs JSON)", name)


def te_defaults(shape: ModelShape, *, backend: str, limits: DeviceLimits | None = None) -> TransformerOverlap:
    """What TE runs in every slot when ub_cfgs leaves it out, as the layers' configs."""
    slots = {slot: te_default(shape, slot, backend=backend, limits=limits) for slot in tunable_slots(shape)}
    return TransformerOverlap.from_slots(slots)


def _load(path: str | Path) -> tuple[Any, str]:
    path = Path(path)
    with path.open("rb") as f:
        raw = f.read(MAX_PRESET_BYTES + 1)
    if len(raw) > MAX_PRESET_BYTES:
        raise PresetError("file", f"must be at most {MAX_PRESET_BYTES} bytes (1 MiB); this one is larger", path.name)
    try:
        return yaml.safe_load(raw.decode("utf-8")), path.name  # JSON is YAML too
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise PresetError("file", f"is not UTF-8 YAML or JSON: {e}", path.name) from None


Reader = Callable[[Any, str | None, ModelShape, str, DeviceLimits | None, bool], SlotConfigs | None]


def _ours(
    data: Any, name: str | None, shape: ModelShape, backend: str, limits: DeviceLimits | None, strict: bool
) -> SlotConfigs | None:
    """Our own preset format: not defined in this version (the exporter of our runtime's winners defines it);
    its reader goes here and answers None for any other format."""
    return None


def _te_entries(
    data: Any, name: str | None, shape: ModelShape, backend: str, limits: DeviceLimits | None, strict: bool
) -> SlotConfigs | None:
    """NeMo YAML or TE's ub_cfgs dict: read strictly as TE reads it (`nemo_yaml.parse_nemo`)."""
    preset = _te_preset(data, name)
    return None if preset is None else _runnable(preset, shape, backend=backend, limits=limits, strict=strict)


def _te_preset(data: Any, name: str | None) -> Preset | None:
    if isinstance(data, Mapping) and isinstance(data.get("ub_cfgs"), Mapping):
        data = data["ub_cfgs"]
    if data is not None and not isinstance(data, Mapping):
        return None
    return parse_nemo(json.dumps(data or {}), name=name)


def read_preset(source: str | Path | Mapping[str, Any]) -> Preset:
    """A preset in one of TE's formats, as TE reads it (what TE's own layer is given)."""
    data, name = _load(source) if isinstance(source, str | Path) else (source, None)
    preset = _te_preset(data, name)
    if preset is None:
        raise PresetError("preset", "is not a NeMo YAML or TE ub_cfgs file, which TE reads", name)
    return preset


READERS: tuple[Reader, ...] = (_ours, _te_entries)


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
