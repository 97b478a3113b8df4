"""NeMo / Megatron userbuffers YAML, read strictly and written as NVIDIA writes it.

Megatron passes ``yaml.safe_load`` of this file straight to TE's ``initialize_ub(ub_cfgs=...)``, and TE
silently ignores a slot name it does not know, so reading is strict: unknown slots (with the close name
suggested), unknown keys, wrong types, methods a slot cannot run, YAML tags, duplicate keys and files over
1 MiB are errors.  The shape, GPU and dtype come from the file name (NVIDIA's header comments are not
reliable: docs/te_rules.md, NVIDIA's preset files), the dtype from the header's last field (``.../FP8``)
where the name gives none: most of NVIDIA's H100 files name no dtype and say FP8 there.
Writing follows NVIDIA's files: a header comment, slots grouped and ordered
as NVIDIA orders them, NVIDIA's keys per method plus any key that differs from TE's default, flags as 0/1.
Notes become comments; they are not read back.  A preset made for a consumer (`search_spaces.consumers`) opens
with the switches it needs, and their record (``# autotune-switches (megatron): ...``) is read back.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Hashable
from dataclasses import replace
from pathlib import Path, PurePath

import yaml

from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape, Slot
from search_spaces.consumers import parse_switch_record, switch_lines, switch_record
from search_spaces.presets import Preset, PresetError, PresetWarning
from search_spaces.te_dict import FLAG_KEYS, parse_ub_cfgs, te_entry

MAX_PRESET_BYTES = 1 << 20

FILE_NAME = re.compile(
    r"ub_cfg_(?:(?!(?:bf16|fp8)_)(?P<gpu>[a-z][a-z0-9]*)_)?(?:(?P<dtype>bf16|fp8)_)?"
    r"h(?P<hidden>\d+)_tp(?P<tp>\d+)(?:_cp(?P<cp>\d+))?_mbs(?P<mbs>\d+)_seqlen(?P<seq>\d+)\.ya?ml"
)
"""NVIDIA's names: ``ub_cfg_h100_bf16_h16384_tp8_cp2_mbs1_seqlen8192.yaml`` (gpu, dtype and cp optional)."""
HEADER_DTYPE = re.compile(r"#\s*Model configs:.*/(?P<dtype>BF16|FP8)\s*$", re.IGNORECASE | re.MULTILINE)
"""The precision at the end of NVIDIA's header line ``# Model configs: H100/70B/TP8/MBS1/SeqLen8K/FP8``."""

_SECTIONS = (
    ("# Bulk overlap with AllGather / ReduceScatter", (Slot.QKV_DGRAD, Slot.QKV_WGRAD, Slot.FC1_DGRAD, Slot.FC1_WGRAD)),
    ("## Ring-exchange overlap with AllGather", (Slot.QKV_FPROP, Slot.PROJ_DGRAD, Slot.FC1_FPROP, Slot.FC2_DGRAD)),
    ("# Chunked-collective overlap with ReduceScatter", (Slot.PROJ_FPROP, Slot.FC2_FPROP)),
    ("# External overlap (MXFP8 wgrad all-gather)", (Slot.PROJ_WGRAD, Slot.FC2_WGRAD)),
)
"""NVIDIA's section comments and slot order."""


def read_nemo(path: str | Path) -> Preset:
    """The preset in a NeMo/Megatron YAML file; PresetError naming the field and rule when TE would misread it."""
    path = Path(path)
    return parse_nemo(read_text(path), name=path.name)


def read_text(path: Path) -> str:
    """A preset file's text: at most `MAX_PRESET_BYTES` of UTF-8 (a preset is a few hundred bytes)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_PRESET_BYTES + 1)  # never more
    except OSError as e:  # a read error (/proc/self/mem) carries no file name of its own: give it one
        raise OSError(e.errno, e.strerror, str(path)) from None
    if len(data) > MAX_PRESET_BYTES:
        raise PresetError("file", f"must be at most {MAX_PRESET_BYTES} bytes (1 MiB); this one is larger", path.name)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PresetError("file", "must be UTF-8 text", str(e)) from None


TOO_DEEP = "nests too deeply to be a preset (one is a few levels deep)"
"""The rule a file breaks whose nesting outgrows the parser (a preset is a few levels deep, never hundreds)."""


def parse_nemo(text: str, *, name: str | None = None) -> Preset:
    """The preset in YAML ``text``; ``name`` is the file name that carries the shape, GPU and dtype."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: plain data only
    except yaml.YAMLError as e:
        if isinstance(e, yaml.MarkedYAMLError) and "constructor for the tag" in str(e.problem):
            rule = "YAML tags such as !!python/object are not allowed (TE presets are read with yaml.safe_load)"
            raise PresetError(
                "file", rule, f"line {e.problem_mark.line + 1 if e.problem_mark else '?'}: {e.problem}"
            ) from None
        if "maximum nesting depth" in str(e):  # libyaml's own limit, where the Python parser hits RecursionError
            raise PresetError("file", TOO_DEEP, name) from None
        raise PresetError("file", f"is not valid YAML: {e}") from None
    shape, gpu, dtype = parse_file_name(name)
    shape, dtype = _with_header_dtype(text, shape, dtype, name)
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise PresetError("file", "must be a mapping of TE slot names to ub_cfgs entries", type(data).__name__)
    if not data:
        warnings.warn(
            f"{name or 'preset'}: configures no slot (NVIDIA's hydra dummy file?); TE defaults apply to every slot",
            PresetWarning,
            stacklevel=2,
        )
    configs = parse_ub_cfgs(data)
    made_for = next(filter(None, map(parse_switch_record, _comments(text))), None)
    consumer, setting = made_for if made_for is not None else (None, {})
    return Preset(configs=configs, shape=shape, gpu=gpu, dtype=dtype, source=name, consumer=consumer, setting=setting)


def _comments(text: str) -> list[str]:
    """The text of each whole-line comment, the header's first."""
    return [line.strip()[1:] for line in text.splitlines() if line.strip().startswith("#")]


def consumer_header(preset: Preset) -> list[str]:
    """The lines a preset made for a consumer opens with (as comments): who runs it with which switches, the
    machine-readable record of them (`consumers.switch_record`), and the joint choice's alternatives."""
    if preset.consumer is None:
        return []
    lines = [f"Made for {preset.consumer.value}, run with:"]
    lines += [f"  {line}" for line in switch_lines(preset.consumer, preset.setting)]
    lines.append(switch_record(preset.consumer, preset.setting))
    if preset.choice:
        lines.append("Joint choice (summed ms of the slots the switches couple; chosen first):")
        lines += [f"  {line}" for line in preset.choice]
    return lines


def _with_header_dtype(
    text: str, shape: ModelShape | None, dtype: str | None, name: str | None
) -> tuple[ModelShape | None, str | None]:
    """The name's dtype, else the header's for the shape; a warning where the two disagree."""
    match = HEADER_DTYPE.search(text)
    said = match["dtype"].lower() if match else None
    if said is None or said == dtype:
        return shape, dtype
    if dtype is not None:
        warnings.warn(
            f"{name}: the header says {said.upper()} but the file name says {dtype}; the file name is used",
            PresetWarning,
            stacklevel=3,
        )
        return shape, dtype
    return (None if shape is None else replace(shape, dtype=said)), said


def parse_file_name(name: str | None) -> tuple[ModelShape | None, str | None, str | None]:
    """(shape, gpu, dtype) from an NVIDIA-style file name; Nones when the name does not follow the pattern."""
    return shape_from_name(FILE_NAME.fullmatch(name or ""), name)


def shape_from_name(match: re.Match[str] | None, name: str | None) -> tuple[ModelShape | None, str | None, str | None]:
    """(shape, gpu, dtype) from a match of NVIDIA's naming pattern (`FILE_NAME`, Bridge's preset names)."""
    if match is None:
        return None, None, None
    try:
        shape = ModelShape(
            hidden=int(match["hidden"]),
            tp=int(match["tp"]),
            mbs=int(match["mbs"]),
            seq=int(match["seq"]),
            cp=int(match["cp"] or 1),
            dtype=match["dtype"] or "bf16",
        )
    except InputError as e:
        raise PresetError("file name", f"names a shape TE cannot run: {e}", name) from None
    return shape, match["gpu"], match["dtype"]


def preset_file_name(preset: Preset) -> str:
    """``ub_cfg_{gpu}_{dtype}_h{H}_tp{P}[_cp{C}]_mbs{B}_seqlen{S}.yaml``, gpu and dtype where known, as NVIDIA names them."""
    if preset.shape is None:
        raise PresetError("shape", "is needed to name a preset file")
    parts = ["ub_cfg", *(p for p in (preset.gpu, preset.dtype) if p), preset.shape.label()]
    return "_".join(parts) + ".yaml"


def te_file_name(preset: Preset) -> str:
    """The TE dict's (JSON's) file name: NVIDIA's, ending in .json, and naming the dtype even where the preset's
    own name did not (its header said it, `_with_header_dtype`): a TE dict has no header to carry it."""
    if preset.dtype is None and preset.shape is not None:
        preset = dataclasses.replace(preset, dtype=preset.shape.dtype)
    return PurePath(preset_file_name(preset)).with_suffix(".json").name


def write_nemo(preset: Preset) -> str:
    """NeMo/Megatron YAML for ``preset``, laid out like NVIDIA's files; notes as comments."""
    lines = ["# UB communicator configurations", f"# Model configs: {_model_line(preset)}"]
    lines += [f"# {line}" for line in consumer_header(preset)]
    lines += [note_comment(slot, note) for slot, note in preset.notes.items() if slot not in preset.configs]
    for title, slots in _SECTIONS:
        blocks = [_block(preset, slot) for slot in slots if slot in preset.configs]
        if blocks:
            lines += ["", title, *"\n\n".join(blocks).split("\n")]
    return "\n".join(lines) + "\n"


def _block(preset: Preset, slot: Slot) -> str:
    note = [note_comment(slot, preset.notes[slot])] if slot in preset.notes else []
    entry = te_entry(slot, preset.configs[slot], minimal=True)
    keys = [f"  {key}: {int(value) if key in FLAG_KEYS else value}" for key, value in entry.items()]
    return "\n".join([*note, f"{slot.value}:", *keys])


def note_comment(slot: Slot, note: str) -> str:
    """A slot's note as one comment line (YAML's and Python's): a line break in a note would turn the rest of it into YAML."""
    return f"# {slot.value}: {' '.join(note.split())}"


def _model_line(preset: Preset) -> str:
    """NVIDIA's ``H100/70B/TP8/CP2/MBS1/SeqLen8K/FP8``, with the width (``h8192``) where NVIDIA names the model."""
    if preset.shape is None:
        return "unknown shape"
    s = preset.shape
    seq = f"{s.seq // 1024}K" if s.seq % 1024 == 0 else str(s.seq)
    parts = [
        (preset.gpu or "").upper(),
        f"h{s.hidden}",
        f"TP{s.tp}",
        f"CP{s.cp}" if s.cp > 1 else "",
        f"MBS{s.mbs}",
        f"SeqLen{seq}",
        (preset.dtype or "").upper(),  # only a known one: the header is read back (`_with_header_dtype`)
    ]
    return "/".join(p for p in parts if p)


class _StrictLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """yaml.safe_load's loader that refuses duplicate keys (PyYAML keeps the last one silently).  On libyaml's
    parser where PyYAML was built with it (its wheels are): the controller reads NVIDIA's presets for every
    slot's warm start, and the pure-Python parser took 85% of that."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader reports unhashable keys itself
            if key in seen:
                raise PresetError(
                    str(key), f"is given twice (line {key_node.start_mark.line + 1}); YAML would keep only the last"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
