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

from autotune.cli.output import write_out
from search_spaces import (
    Preset,
    PresetError,
    PresetWarning,
    bridge_file_name,
    preset_file_name,
    preset_json,
    read_preset,
    te_file_name,
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
def validate(
    file: PresetFile,
    preset: PresetName = None,
    partial: Annotated[
        bool, typer.Option("--partial", help="Accept a file that configures only some slots (warn instead)")
    ] = False,
) -> None:
    """Print the preset's normalized configs (TE's effective ub_cfgs) as JSON; exit 2 on a bad file, or on one
    that leaves slots out (a truncated file, say) unless ``--partial``."""
    read, caught = _read(file, preset)
    # An empty file is NVIDIA's hydra dummy (`_read` warned already); a Bridge module cannot leave a slot out
    # by accident: every layer slot is a required field of its dataclass, and None is how it opts out.
    if read.missing and not read.empty and file.suffix != ".py":
        names = ", ".join(slot.value for slot in read.missing)
        rule = f"leaves out {len(read.missing)} slots: {names}"
        if not partial:
            raise PresetError("file", f"{rule} (TE would run its defaults there); pass --partial if that is meant")
        caught.append(f"{rule}: TE runs its defaults there")
        print(f"warning: {caught[-1]}", file=sys.stderr)
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
        str | None,
        typer.Option(help="File to write, or a folder (made if missing) for NVIDIA's file name (default: stdout)"),
    ] = None,
    preset: PresetName = None,
) -> None:
    """Convert a preset to NeMo YAML, TE's ub_cfgs dict or a Megatron-Bridge module."""
    read, _ = _read(file, preset)
    text = preset_text(read, to)
    if out is None:
        sys.stdout.write(text)
        return
    print(write_out(out, text, name=_file_name(read, to, file)))


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
    if preset.shape is None:
        return source.with_suffix(".yaml" if to == Format.NEMO else ".json").name
    return preset_file_name(preset) if to == Format.NEMO else te_file_name(preset)
