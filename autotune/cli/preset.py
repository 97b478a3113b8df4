"""`autotune preset`: check and convert TE userbuffers presets (NeMo/Megatron YAML, Megatron-Bridge / NeMo 2
Python modules, TE ub_cfgs JSON)."""

from __future__ import annotations

import enum
import json
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer

from search_spaces import (
    Preset,
    PresetWarning,
    bridge_file_name,
    preset_file_name,
    preset_json,
    read_preset,
    to_te_dict,
    write_bridge,
    write_nemo,
)

app = typer.Typer(no_args_is_help=True, help="Check and convert TE userbuffers presets.")

PresetFile = Annotated[
    Path,
    typer.Argument(
        exists=True,
        dir_okay=False,
        readable=True,
        help="NeMo/Megatron ub_cfg YAML, a Megatron-Bridge / NeMo 2 module (.py, read, never run) or TE ub_cfgs JSON",
    ),
]
PresetName = Annotated[
    str | None, typer.Option("--preset", help="The preset to read from a .py module that defines several")
]


class Format(enum.StrEnum):
    NEMO = "nemo"
    TE = "te"
    BRIDGE = "bridge"


@app.command()
def validate(file: PresetFile, preset: PresetName = None) -> None:
    """Print the preset's normalized configs (TE's effective ub_cfgs) as JSON; exit 2 on a bad file."""
    read, caught = _read(file, preset)
    print(json.dumps(preset_json(read) | {"warnings": caught}, indent=2))


@app.command()
def convert(
    file: PresetFile,
    to: Annotated[
        Format,
        typer.Option(
            "--to",
            help="nemo: NeMo/Megatron YAML; te: initialize_ub(ub_cfgs=...) as JSON; bridge: a Megatron-Bridge / "
            "NeMo 2 Python module",
        ),
    ],
    out: Annotated[
        Path | None, typer.Option(help="File to write, or a folder for NVIDIA's file name (default: stdout)")
    ] = None,
    preset: PresetName = None,
) -> None:
    """Convert a preset to NeMo YAML, TE's ub_cfgs dict or a Megatron-Bridge module."""
    read, _ = _read(file, preset)
    text = preset_text(read, to)
    if out is None:
        sys.stdout.write(text)
        return
    target = out / _file_name(read, to, file) if out.is_dir() else out
    target.write_text(text, encoding="utf-8")
    print(target)


def preset_text(preset: Preset, to: Format) -> str:
    if to == Format.NEMO:
        return write_nemo(preset)
    if to == Format.BRIDGE:
        return write_bridge(preset)
    return json.dumps(to_te_dict(preset), indent=2) + "\n"


def _read(file: Path, name: str | None) -> tuple[Preset, list[str]]:
    """The preset (by suffix: `search_spaces.preset_files`) and its warnings, also on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PresetWarning)
        preset = read_preset(file, name=name)
    messages = [str(w.message) for w in caught if issubclass(w.category, PresetWarning)]
    for message in messages:
        print(f"warning: {message}", file=sys.stderr)
    return preset, messages


def _file_name(preset: Preset, to: Format, source: Path) -> str:
    if to == Format.BRIDGE:
        return bridge_file_name(preset)
    name = preset_file_name(preset) if preset.shape is not None else source.name
    return Path(name).with_suffix(".yaml" if to == Format.NEMO else ".json").name
