"""Any preset file a user has, read by its suffix: NeMo/Megatron YAML, a Megatron-Bridge / NeMo 2 module, or
the TE ``ub_cfgs`` JSON that `autotune tune` and ``GET /v1/presets?format=te`` write.

The JSON comes in two forms: a bare ``ub_cfgs`` dict (`autotune tune --out`, `preset convert --to te`), whose
shape, GPU and dtype come from its NVIDIA-style file name as a YAML's do, and the normalized view
(`te_dict.preset_json`: ``shape``, ``gpu``, ``dtype``, ``ub_cfgs``, ``notes``) that carries them itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape
from search_spaces.bridge import read_bridge
from search_spaces.nemo_yaml import parse_file_name, read_nemo, read_text
from search_spaces.presets import Preset, PresetError
from search_spaces.te_dict import parse_ub_cfgs

SUFFIXES = (".yaml", ".yml", ".json", ".py")
"""The preset files `read_preset` reads; `presets_in` reads a folder's files of these suffixes."""


def read_preset(path: str | Path, *, name: str | None = None) -> Preset:
    """The preset in ``path``: ``.py`` a Bridge module (``name`` picks one of several), ``.json`` TE's
    ``ub_cfgs``, anything else NeMo/Megatron YAML."""
    path = Path(path)
    if path.suffix == ".py":
        return read_bridge(path, name=name)
    if path.suffix == ".json":
        return parse_te_json(read_text(path), name=path.name)
    return read_nemo(path)


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
    return Preset(configs=configs, shape=shape, gpu=data.get("gpu"), dtype=data.get("dtype"), notes=notes, source=name)


def presets_in(folder: str | Path) -> list[Preset]:
    """Every preset file directly in ``folder`` (NVIDIA's layout, or what `autotune tune --out` wrote), by name."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix in SUFFIXES)
    return [read_preset(p) for p in files]
