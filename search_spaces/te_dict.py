"""TE's ``ub_cfgs`` entries: the keys TE accepts, its defaults, and what it actually runs.

TE merges a user entry over `get_default_config` (docs/te_rules.md, The default ub_cfgs values) and passes it
as keyword arguments to
`add_ub`, so an unknown key is a TypeError, while a key the method does not use is silently ignored.  We
read entries strictly and store the *effective* entry: the keys the method uses, with TE's defaults filled
in.  That makes two entries equal exactly when TE runs them the same way, and lets us write an entry with
only the keys NVIDIA writes plus those that differ from TE's defaults.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from overlap_runtime.config import DEFAULTS, Method, OverlapConfig
from overlap_runtime.knobs import BY_NAME, RUNTIME_ONLY_KNOBS, TE_KEYS, TE_MAX_SMS, Kind
from overlap_runtime.measurement import Measurement
from overlap_runtime.methods import METHODS, TE_METHODS, method_spec
from overlap_runtime.shape import Slot
from search_spaces.catalog import AG, RS, collective, slot_info, suggest
from search_spaces.consumers import rendered
from search_spaces.methods import search_spec
from search_spaces.presets import Preset, PresetError, PresetWarning, check_method, to_slot

_TE_KNOBS = tuple(BY_NAME[key] for key in TE_KEYS)
FLAG_KEYS = frozenset(k.name for k in _TE_KNOBS if k.kind == Kind.FLAG)
_COUNT_KEYS = frozenset(k.name for k in _TE_KNOBS if k.kind == Kind.COUNT)
_PLAIN_DEFAULTS: dict[str, Any] = {k.name: k.te_default for k in _TE_KNOBS if k.te_default is not None}
"""TE's defaults that depend on neither the slot nor the method.  Keys some methods ignore are all here:
giving one at its default is harmless, any other value is a mistake."""


def used_keys(slot: Slot, method: Method) -> tuple[str, ...]:
    """Keys TE's communicator for ``method`` reads (`MethodSpec.te_keys`; aggregate only in an all-gather)."""
    keys = method_spec(method).te_keys
    return tuple(k for k in TE_KEYS if k in keys and (k != "aggregate" or collective(slot, method) == AG))


def te_defaults(slot: Slot, method: Method) -> dict[str, Any]:
    """TE's `get_default_config` for ``slot`` under ``method``, restricted to the keys the method reads: the
    plain defaults, the method's (`SearchSpec.te_defaults`), and an FP8 buffer for every all-gather."""
    own = {k: v for k, v in search_spec(method).te_defaults.items() if v is not None}
    defaults = _PLAIN_DEFAULTS | own | {"fp8_buf": collective(slot, method) == AG}
    return {k: v for k, v in defaults.items() if k in used_keys(slot, method)}


def effective(slot: Slot, method: Method, given: Mapping[str, Any]) -> OverlapConfig:
    """What TE runs for ``given`` (keys the method reads): defaults filled in, fp8_buf merged as TE does.

    TE honours a user's fp8_buf only for the methods that take it (pipeline); all-gather slots always get an
    FP8 buffer and the other slots never do (docs/te_rules.md, The fp8_buf merge rule).
    """
    values = te_defaults(slot, method) | dict(given)
    honoured = "fp8_buf" in method_spec(method).takes and bool(values["fp8_buf"])
    values["fp8_buf"] = collective(slot, method) == AG or honoured
    return OverlapConfig(method=method, **values)


def parse_entry(slot: Slot, raw: object) -> OverlapConfig:
    """One ``ub_cfgs`` entry as a user wrote it -> TE's effective entry; PresetError on anything TE would misread."""
    where = slot.value
    if not isinstance(raw, Mapping):
        raise PresetError(where, "must be a mapping of TE ub_cfgs keys", raw)
    for key in raw:
        if key not in TE_KEYS:
            raise PresetError(f"{where}.{key}", f"is not a TE ub_cfgs key (TE raises TypeError){suggest(key, TE_KEYS)}")
    method = _method(slot, raw.get("method", slot_info(slot).default_method.value))
    given = {key: _value(f"{where}.{key}", key, value) for key, value in raw.items() if key != "method"}
    expected_rs = collective(slot, method) == RS
    if given.pop("is_reduce_scatter", expected_rs) != expected_rs:
        raise PresetError(
            f"{where}.is_reduce_scatter",
            f"must be {int(expected_rs)}: {where} under {method.value} runs a {collective(slot, method).value}",
            int(not expected_rs),
        )
    used = used_keys(slot, method)
    for key, value in given.items():
        if (
            key == "fp8_buf"
            and "fp8_buf" not in method_spec(method).takes
            and value != te_defaults(slot, method)["fp8_buf"]
        ):
            warnings.warn(
                f"{where}.fp8_buf: TE honours fp8_buf only for pipeline and ignores {int(value)} here",
                PresetWarning,
                stacklevel=2,
            )
        elif key not in used and not _harmless(key, value, method):
            raise PresetError(
                f"{where}.{key}",
                f"{method.value} on {where} ignores {key} (TE would drop it silently); leave it out",
                value,
            )
    if given.get("num_sm", 0) > TE_MAX_SMS:
        warnings.warn(
            f"{where}.num_sm: {given['num_sm']} is above userbuffers' NVTE_MAX_SMS={TE_MAX_SMS}",
            PresetWarning,
            stacklevel=2,
        )
    return effective(slot, method, {k: v for k, v in given.items() if k in used})


def parse_ub_cfgs(data: Mapping[object, object]) -> dict[Slot, OverlapConfig]:
    """A whole ``ub_cfgs`` mapping (slot name -> entry) read strictly, as `parse_entry` reads each entry."""
    return {to_slot(key): parse_entry(to_slot(key), entry) for key, entry in data.items()}


def _harmless(key: str, value: object, method: Method) -> bool:
    """An ignored key given at TE's default changes nothing (a method's own default of it may depend on the
    shape: ring_exchange's num_splits is tp)."""
    own = search_spec(method).te_defaults
    return key in _PLAIN_DEFAULTS and key not in own and value == _PLAIN_DEFAULTS[key]


def _method(slot: Slot, value: object) -> Method:
    names = [m.value for m in TE_METHODS]
    if isinstance(value, str) and value in METHODS and value not in names:
        raise PresetError(
            f"{slot.value}.method",
            f"{value} is not a TE method; leave the slot out or switch its overlap off in Megatron/TE",
            value,
        )
    if not isinstance(value, str) or value not in names:
        raise PresetError(f"{slot.value}.method", f"must be one of {', '.join(names)}{suggest(value, names)}", value)
    method = Method(value)
    check_method(slot, method)
    return method


def _value(field: str, key: str, value: object) -> bool | int:
    if key in FLAG_KEYS:
        if isinstance(value, bool) or (type(value) is int and value in (0, 1)):
            return bool(value)
        raise PresetError(field, "must be a flag: 0, 1, true or false", value)
    if type(value) is not int:
        raise PresetError(field, "must be an integer", value)
    if key in _COUNT_KEYS and value < 1:
        raise PresetError(field, "must be a positive integer", value)
    low, high = BY_NAME[key].bounds or (value, value)
    if not low <= value <= high:  # the knob table's range: 10**23 SMs is a typo, not a config to warn about
        raise PresetError(field, f"must be between {low} and {high}", value)
    return value


def te_config(slot: Slot, config: OverlapConfig) -> OverlapConfig:
    """TE's effective entry for a config our runtime ran: unset knobs take TE's defaults, runtime-only knobs go.

    ``num_max_streams``, ``gemm`` and ``fused`` have no TE key: TE always rotates over min(3, chunks) streams
    and runs cuBLAS per chunk, so a result measured with other values may not carry over exactly.
    """
    if not method_spec(config.method).te:
        raise PresetError(f"{slot.value}.method", f"{config.method.value} is not a TE method", config.method.value)
    plain = dataclasses.replace(config, **{name: DEFAULTS[name] for name in RUNTIME_ONLY_KNOBS})
    given = {k: getattr(plain, k) for k in used_keys(slot, plain.method) if getattr(plain, k) is not None}
    if plain.num_sm is None:  # the runtime cannot set a margin without num_sm: "no margin" there means "default"
        given.pop("set_sm_margin", None)
    return effective(slot, plain.method, given)


def te_streams(config: OverlapConfig, tp: int) -> int | None:
    """The compute streams TE gives ``config``'s chunk GEMMs: min(3, chunks); None for unchunked methods."""
    return search_spec(config.method).te_streams(config, tp)


def te_entry(slot: Slot, config: OverlapConfig, *, minimal: bool = False) -> dict[str, Any]:
    """``config`` as a TE ``ub_cfgs`` entry (bools for flags, no None values, no ``is_reduce_scatter``).

    ``minimal`` writes what NVIDIA's files write: the keys NVIDIA always gives for the method, plus any key
    whose value differs from TE's default; the rest TE fills in to the same effect.
    """
    defaults = te_defaults(slot, config.method)
    always = _nvidia_keys(slot, config.method)
    used = used_keys(slot, config.method)
    entry: dict[str, Any] = {"method": config.method.value}
    for key in TE_KEYS:
        value = getattr(config, key, None)  # "method" and "is_reduce_scatter" are never in `used`
        if key in used and value is not None and (not minimal or key in always or value != defaults.get(key)):
            entry[key] = value
    return entry


def _nvidia_keys(slot: Slot, method: Method) -> tuple[str, ...]:
    """The keys NVIDIA's preset files always write for a method (docs/te_rules.md, NVIDIA's preset files)."""
    return search_spec(method).nvidia_keys.get(collective(slot, method), ())


def to_te_dict(preset: Preset) -> dict[str, dict[str, Any]]:
    """The ``ub_cfgs`` argument of TE's ``initialize_ub`` for ``preset``: every key the method reads, explicitly."""
    return {slot.value: te_entry(slot, config) for slot, config in preset.configs.items()}


def preset_json(preset: Preset) -> dict[str, Any]:
    """The normalized view of a preset: shape, GPU, dtype, TE's effective ub_cfgs, the notes, the numbers
    measured for each entry exactly as TE runs it (`MEASURED_NUMBERS`), and for a preset made for a consumer
    the switches it needs (`consumers.rendered`) and the joint choice's alternatives."""
    shape = None
    if preset.shape is not None:
        shape = {f.name: getattr(preset.shape, f.name) for f in dataclasses.fields(preset.shape) if f.init}
    return {
        "shape": shape,
        "gpu": preset.gpu,
        "dtype": preset.dtype,
        "ub_cfgs": to_te_dict(preset),
        "notes": {slot.value: note for slot, note in preset.notes.items()},
        "measurements": {slot.value: measured_numbers(m) for slot, m in preset.measurements.items()},
        "consumer": None if preset.consumer is None else preset.consumer.value,
        "switches": None if preset.consumer is None else rendered(preset.consumer, preset.setting),
        "setting": dict(preset.setting),
        "choice": list(preset.choice),
    }


MEASURED_NUMBERS = ("overlap_ms", "serial_ms", "gemm_ms", "comm_ms", "exposed_ms", "hidden_frac", "cv", "repeats")
"""What an export says of a measurement: the times and the spread, not the raw repeats."""


def measured_numbers(measurement: Measurement | Mapping[str, Any]) -> dict[str, Any]:
    """The `MEASURED_NUMBERS` of ``measurement`` or of its `Measurement.to_dict()` (None for a number that is
    not finite or not there)."""
    full = measurement.to_dict() if isinstance(measurement, Measurement) else measurement
    return {name: full.get(name) for name in MEASURED_NUMBERS}
