"""The preset formats, in one registry: each one's name, file suffix, media type, default consumer, writer and reader.

``GET /v1/presets?format=``, ``autotune export --format``, ``autotune preset convert --to`` and ``validate``,
``autotune tune --out`` and `load_ub_cfgs` all go through `FORMATS`, so a format is added here and nowhere else:

- ``nemo``: NeMo/Megatron userbuffers YAML (`nemo_yaml`), what ``--tp-comm-overlap-cfg`` loads; made for
  megatron by default;
- ``te``: TE's ``initialize_ub(ub_cfgs=...)`` dict as JSON (`te_dict`), bare, since TE silently ignores keys it
  does not know; made for te-modules by default;
- ``bridge``: a Megatron-Bridge / NeMo 2 module of its dataclasses (`bridge`); made for megatron's switches
  (Bridge's model config has the same fields) by default;
- ``ours``: each slot's overall winner on our runtime, every knob kept (`ours`), for our own layers.

The TE formats carry the TE-exact winners chosen for a consumer (`search_spaces.export`); ours the overall ones.
Reading (`read_file`) tells them apart by suffix, and our format by its ``format`` key.  A TE JSON comes in two
forms: a bare ``ub_cfgs`` dict, whose shape, GPU and dtype come from its NVIDIA-style file name as a YAML's
do, and the normalized view (`te_dict.preset_json`: ``shape``, ``gpu``, ``dtype``, ``ub_cfgs``, ``notes``) that
carries them itself.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import yaml

from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape
from search_spaces.bridge import bridge_file_name, read_bridge, write_bridge
from search_spaces.consumers import Consumer, defaults, parse_consumer, parse_setting
from search_spaces.export import SlotResult, preset_from_results
from search_spaces.nemo_yaml import (
    TOO_DEEP,
    parse_file_name,
    preset_file_name,
    read_nemo,
    read_text,
    te_file_name,
    write_nemo,
)
from search_spaces.ours import FILE_PREFIX as OURS_FILE_PREFIX
from search_spaces.ours import FORMAT as OURS_FORMAT
from search_spaces.ours import OursPreset, load_ours, ours_file_name, write_ours
from search_spaces.presets import Preset, PresetError
from search_spaces.te_dict import parse_ub_cfgs, to_te_dict


class FormatName(enum.StrEnum):
    NEMO = "nemo"
    TE = "te"
    BRIDGE = "bridge"
    OURS = "ours"


@dataclass(frozen=True, kw_only=True, slots=True)
class Exported:
    """What an export writes from: the TE-exact winners as a preset, and the overall winners where measured."""

    preset: Preset
    ours: OursPreset | None = None
    """None where nothing was measured for the shape (a nearest preset) or the preset came from a TE file."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PresetFormat:
    name: FormatName
    suffix: str
    """The suffix of the files it writes; `read_file` also takes ``.yml`` for YAML."""
    media_type: str
    help: str
    consumer: Consumer | None
    """Who its files are made for unless asked otherwise (docs/export.md); None for ours (our own layers)."""
    write: Callable[[Exported], str]
    file_name: Callable[[Exported], str]


def _ours(exported: Exported) -> OursPreset:
    if exported.ours is None:
        raise PresetError("format", "ours holds the overall winners of a tuned shape; this preset has none", "ours")
    return exported.ours


def _te_json(exported: Exported) -> str:
    return json.dumps(to_te_dict(exported.preset), indent=2) + "\n"


FORMATS: Mapping[FormatName, PresetFormat] = MappingProxyType(
    {
        FormatName.NEMO: PresetFormat(
            name=FormatName.NEMO,
            suffix=".yaml",
            media_type="application/yaml",
            help="NeMo/Megatron ub_cfg YAML (--tp-comm-overlap-cfg)",
            consumer=Consumer.MEGATRON,
            write=lambda e: write_nemo(e.preset),
            file_name=lambda e: preset_file_name(e.preset),
        ),
        FormatName.TE: PresetFormat(
            name=FormatName.TE,
            suffix=".json",
            media_type="application/json",
            help="TE's initialize_ub(ub_cfgs=...) dict as JSON",
            consumer=Consumer.TE_MODULES,
            write=_te_json,
            file_name=lambda e: te_file_name(e.preset),
        ),
        FormatName.BRIDGE: PresetFormat(
            name=FormatName.BRIDGE,
            suffix=".py",
            media_type="text/x-python",
            help="a Megatron-Bridge / NeMo 2 module of its TP-overlap dataclasses",
            consumer=Consumer.MEGATRON,
            write=lambda e: write_bridge(e.preset),
            file_name=lambda e: bridge_file_name(e.preset),
        ),
        FormatName.OURS: PresetFormat(
            name=FormatName.OURS,
            suffix=".yaml",
            media_type="application/yaml",
            help="our runtime's overall winners, every knob kept (our own layers)",
            consumer=None,
            write=lambda e: write_ours(_ours(e)),
            file_name=lambda e: ours_file_name(_ours(e)),
        ),
    }
)

TUNE_FORMATS = (FormatName.NEMO, FormatName.TE, FormatName.OURS)
"""What `autotune tune --out` writes."""


SUFFIXES = (".yaml", ".yml", ".json", ".py")
"""The preset files `read_preset` reads; `presets_in` reads a folder's files of these suffixes."""


def read_file(path: str | Path, *, name: str | None = None) -> Preset | OursPreset:
    """The preset in ``path``: ``.py`` a Bridge module (``name`` picks one of several), ``.json`` TE's ub_cfgs
    (`parse_te_json`) or our format, anything else NeMo YAML or our format (which says so in
    its ``format`` key)."""
    path = Path(path)
    if name is not None and path.suffix != ".py":
        raise PresetError("preset", f"picks one of the presets a .py module defines; {path.name} is not one", name)
    try:
        return _read_file(path, name=name)
    except RecursionError:  # the parsers recurse per level: a preset is a few levels deep, never hundreds
        raise PresetError("file", TOO_DEEP, path.name) from None


def _read_file(path: Path, *, name: str | None) -> Preset | OursPreset:
    if path.suffix == ".py":
        return read_bridge(path, name=name)
    text = read_text(path)
    if _is_ours(text):
        return load_ours(text)
    if path.suffix == ".json":
        return parse_te_json(text, name=path.name)
    return read_nemo(path)


def _is_ours(text: str) -> bool:
    """Whether a file is in our format: a mapping whose ``format`` is ours (a cheap look before a strict read)."""
    if OURS_FORMAT not in text:
        return False
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    return isinstance(data, dict) and data.get("format") == OURS_FORMAT


def exported_of(read: Preset | OursPreset) -> Exported:
    """What a file read by `read_file` exports as: a TE preset as it is, our format as its TE entries too."""
    if isinstance(read, OursPreset):
        return Exported(preset=te_preset_of(read), ours=read)
    return Exported(preset=read)


def te_preset_of(ours: OursPreset) -> Preset:
    """Our format's winners as a TE preset under the per-slot export rule: each slot the TE entry of its winner,
    with a note where TE runs it otherwise than it was measured."""
    results = {
        slot: SlotResult(best=entry.config, best_ms=float(entry.measured.get("overlap_ms") or float("inf")))
        for slot, entry in ours.slots.items()
    }
    return preset_from_results(ours.shape, results, gpu=None)


def read_preset(path: str | Path, *, name: str | None = None) -> Preset:
    """The TE preset in ``path`` (`read_file`); a file of our format as the TE entries of its winners
    (`te_preset_of`)."""
    read = read_file(path, name=name)
    return te_preset_of(read) if isinstance(read, OursPreset) else read


def parse_te_json(text: str, *, name: str | None = None) -> Preset:
    """A TE ``ub_cfgs`` JSON, bare or in the normalized view; ``name`` is its file name."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PresetError("file", f"is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise PresetError("file", "must be a JSON object of TE slot names to ub_cfgs entries", type(data).__name__)
    if "ub_cfgs" not in data:
        shape, gpu, dtype = parse_file_name(None if name is None else str(Path(name).with_suffix(".yaml")))
        return Preset(configs=parse_ub_cfgs(data), shape=shape, gpu=gpu, dtype=dtype, source=name)
    ub_cfgs, notes = data["ub_cfgs"], data.get("notes") or {}
    if not isinstance(ub_cfgs, dict) or not isinstance(notes, dict):
        raise PresetError("ub_cfgs", "must be an object of TE slot names to ub_cfgs entries, notes an object")
    try:
        shape = None if data.get("shape") is None else ModelShape(**data["shape"])
    except (InputError, TypeError) as e:
        raise PresetError("shape", f"is not a shape TE can run: {e}") from None
    configs = parse_ub_cfgs(ub_cfgs)
    consumer = None if data.get("consumer") is None else parse_consumer(str(data["consumer"]))
    setting = {} if consumer is None else defaults(consumer) | parse_setting(consumer, data.get("setting") or {})
    return Preset(
        configs=configs,
        shape=shape,
        gpu=data.get("gpu"),
        dtype=data.get("dtype"),
        notes=notes,
        source=name,
        consumer=consumer,
        setting=setting,
    )


def presets_in(folder: str | Path) -> list[Preset]:
    """Every preset file directly in ``folder`` (NVIDIA's layout, or what `autotune tune --out` wrote), by name;
    our own format's files (`search_spaces.ours`, our runtime's winners, no TE preset) are left out."""
    files = sorted(
        p
        for p in Path(folder).iterdir()
        if p.is_file() and p.suffix in SUFFIXES and not p.name.startswith(OURS_FILE_PREFIX)
    )
    return [read_preset(p) for p in files]
