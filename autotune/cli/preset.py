"""`autotune preset`: check and convert presets in every format of `search_spaces.formats` (NeMo/Megatron
YAML, Megatron-Bridge / NeMo 2 Python modules, TE ub_cfgs JSON, our own format), and say what a consumer
(`--for`) runs of one."""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer
import yaml

from autotune.cli.consumer_options import For, Sets, fixed_switches
from autotune.cli.output import write_out
from search_spaces import (
    FORMATS,
    Exported,
    FormatName,
    Preset,
    PresetError,
    PresetFormat,
    PresetWarning,
    preset_json,
    read_file,
)
from search_spaces.consumers import Consumer, check, rendered, why
from search_spaces.formats import exported_of
from search_spaces.ours import OursPreset, write_ours

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Check and convert TE userbuffers presets.")

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


@app.command()
def validate(
    file: PresetFile,
    preset: PresetName = None,
    partial: Annotated[
        bool, typer.Option("--partial", help="Accept a file that configures only some slots (warn instead)")
    ] = False,
    consumer: For = None,
    sets: Sets = None,
) -> None:
    """Print the preset's normalized configs (TE's effective ub_cfgs) as JSON; exit 2 on a bad file, or on one
    that leaves slots out (a truncated file, say) unless ``--partial``.  With ``--for``, also what that consumer
    runs of it per slot and the switches it needs; exit 2 naming the slots and the rule when it cannot run the
    file as written (``--set`` states switches you have fixed on purpose)."""
    found, caught = _read(file, preset)
    exported = exported_of(found)
    read = exported.preset
    # An empty file is NVIDIA's hydra dummy (`_read` warned already); a Bridge module cannot leave a slot out
    # by accident: every layer slot is a required field of its dataclass, and None is how it opts out.
    if read.missing and not read.empty and file.suffix != ".py" and exported.ours is None:
        names = ", ".join(slot.value for slot in read.missing)
        rule = f"leaves out {len(read.missing)} slots: {names}"
        if not partial:
            raise PresetError("file", f"{rule} (TE would run its defaults there); pass --partial if that is meant")
        caught.append(f"{rule}: TE runs its defaults there")
        print(f"warning: {caught[-1]}", file=sys.stderr)
    view = preset_json(read) | {"warnings": caught}
    if exported.ours is not None:  # our format: its own view, then what TE runs of it
        view = {"ours": yaml.safe_load(write_ours(exported.ours))} | view
    if consumer is not None:
        runs, problems = _consumer_runs(read, consumer, sets)
        view["runs"] = runs | {"problems": [{"slot": slot, "rule": rule} for slot, rule in problems]}
        print(json.dumps(view, indent=2))
        if problems:
            raise PresetError(", ".join(slot for slot, _ in problems), "; ".join(rule for _, rule in problems))
        return
    print(json.dumps(view, indent=2))


def _consumer_runs(
    read: Preset, consumer: Consumer, sets: list[str] | None
) -> tuple[dict[str, object], list[tuple[str, str]]]:
    """What ``consumer`` runs of ``read`` per slot under the switches it needs (those the file records for
    this consumer, then ``--set``), and the entries it cannot run as written, each with its rule."""
    result = check(consumer, read.configs, fixed=_fixed(read, consumer, sets))
    view: dict[str, object] = {
        "consumer": consumer.value,
        "switches": rendered(consumer, result.setting),
        "slots": {
            run.slot.value: {"runs": run.mode.value, "asked": None if run.asked is None else run.asked.value}
            for run in result.runs
        },
    }
    return view, [(run.slot.value, why(run, consumer, read.configs)) for run in result.not_as_written]


def _fixed(read: Preset, consumer: Consumer, sets: list[str] | None) -> dict[str, bool]:
    """The switches held when checking ``read`` for ``consumer``: those its header records for that consumer,
    then ``--set``."""
    recorded = dict(read.setting) if read.consumer == consumer else {}
    return recorded | fixed_switches(consumer, sets)


@app.command()
def convert(
    file: PresetFile,
    to: Annotated[
        FormatName,
        typer.Option("--to", help="; ".join(f"{f.name.value}: {f.help}" for f in FORMATS.values())),
    ],
    out: Annotated[
        str | None,
        typer.Option(help="File to write, or a folder (made if missing) for NVIDIA's file name (default: stdout)"),
    ] = None,
    preset: PresetName = None,
    consumer: For = None,
    sets: Sets = None,
) -> None:
    """Convert a preset to another format (our own format's winners convert to TE's as TE runs them); with
    ``--for``, headed with the switches that make that consumer run it as written (exit 2 when none does)."""
    found, _ = _read(file, preset)
    exported = exported_of(found)
    if consumer is not None:
        _, problems = _consumer_runs(exported.preset, consumer, sets)
        if problems:
            raise PresetError(", ".join(slot for slot, _ in problems), "; ".join(rule for _, rule in problems))
        setting = check(consumer, exported.preset.configs, fixed=_fixed(exported.preset, consumer, sets)).setting
        made = dataclasses.replace(exported.preset, consumer=consumer, setting=setting, choice=())
        exported = dataclasses.replace(exported, preset=made)
    fmt = FORMATS[to]
    text = fmt.write(exported)
    if out is None:
        sys.stdout.write(text)
        return
    print(write_out(out, text, name=_file_name(fmt, exported, file)))


def _read(file: Path, name: str | None) -> tuple[Preset | OursPreset, list[str]]:
    """The preset (by suffix and content: `search_spaces.formats.read_file`) and its warnings, also on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PresetWarning)
        preset = read_file(file, name=name)
    messages = [str(w.message) for w in caught if issubclass(w.category, PresetWarning)]
    for message in messages:
        print(f"warning: {message}", file=sys.stderr)
    return preset, messages


def _file_name(fmt: PresetFormat, exported: Exported, source: Path) -> str:
    """The format's file name; a preset whose shape is unknown keeps the source's name with the format's suffix."""
    if exported.preset.shape is None:
        return source.with_suffix(fmt.suffix).name
    return fmt.file_name(exported)
