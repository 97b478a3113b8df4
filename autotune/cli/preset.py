"""`autotune preset`: check and convert TE userbuffers presets (NeMo/Megatron YAML, TE ub_cfgs dict)."""

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
    preset_file_name,
    preset_json,
    read_nemo,
    te_file_name,
    to_te_dict,
    write_nemo,
)

app = typer.Typer(no_args_is_help=True, help="Check and convert TE userbuffers presets.")

PresetFile = Annotated[
    Path, typer.Argument(exists=True, dir_okay=False, readable=True, help="NeMo/Megatron ub_cfg YAML")
]


class Format(enum.StrEnum):
    NEMO = "nemo"
    TE = "te"


@app.command()
def validate(
    file: PresetFile,
    partial: Annotated[
        bool, typer.Option("--partial", help="Accept a file that configures only some slots (warn instead)")
    ] = False,
) -> None:
    """Print the preset's normalized configs (TE's effective ub_cfgs) as JSON; exit 2 on a bad file, or on one
    that leaves slots out (a truncated file, say) unless ``--partial``."""
    preset, caught = _read(file)
    if preset.missing and not preset.empty:  # an empty file is NVIDIA's hydra dummy: `_read` warned already
        names = ", ".join(slot.value for slot in preset.missing)
        rule = f"leaves out {len(preset.missing)} slots: {names}"
        if not partial:
            raise PresetError("file", f"{rule} (TE would run its defaults there); pass --partial if that is meant")
        caught.append(f"{rule}: TE runs its defaults there")
        print(f"warning: {caught[-1]}", file=sys.stderr)
    print(json.dumps(preset_json(preset) | {"warnings": caught}, indent=2))


@app.command()
def convert(
    file: PresetFile,
    to: Annotated[
        Format, typer.Option("--to", help="nemo: NeMo/Megatron YAML; te: initialize_ub(ub_cfgs=...) as JSON")
    ],
    out: Annotated[
        str | None,
        typer.Option(help="File to write, or a folder (made if missing) for NVIDIA's file name (default: stdout)"),
    ] = None,
) -> None:
    """Convert a preset to NeMo YAML or to TE's ub_cfgs dict."""
    preset, _ = _read(file)
    text = write_nemo(preset) if to == Format.NEMO else json.dumps(to_te_dict(preset), indent=2) + "\n"
    if out is None:
        sys.stdout.write(text)
        return
    print(write_out(out, text, name=_file_name(preset, to, file)))


def _read(file: Path) -> tuple[Preset, list[str]]:
    """The preset and its warnings, the warnings also on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PresetWarning)
        preset = read_nemo(file)
    messages = [str(w.message) for w in caught if issubclass(w.category, PresetWarning)]
    for message in messages:
        print(f"warning: {message}", file=sys.stderr)
    return preset, messages


def _file_name(preset: Preset, to: Format, source: Path) -> str:
    name = preset_file_name(preset) if preset.shape is not None else source.name
    return name if to == Format.NEMO else te_file_name(name)
