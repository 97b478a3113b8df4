"""The model-shape options of every command that takes a shape, made from `ModelShape`'s fields (`takes`).

`takes_shape` gives a command that tunes or measures a validated `ModelShape`; `takes_shape_filter` gives a
lookup (best, export) the fields given, since there a field left out means any value and the controller
validates the rest.
"""

from __future__ import annotations

from dataclasses import MISSING

from autotune.cli.field_options import REQUIRED, Command, FieldOption, takes
from overlap_runtime.shape import ModelShape, shape_fields


def takes_shape(command: Command) -> Command:
    """The command's ``shape`` parameter becomes the shape's options (``--hidden``, ``--tp``, ...)."""
    return takes("shape", _options(lookup=False), ModelShape)(command)


def takes_shape_filter(command: Command) -> Command:
    """The command's ``shape`` parameter becomes the lookup's options; it gets the fields given, by name."""
    return takes("shape", _options(lookup=True), _given)(command)


def _options(*, lookup: bool) -> list[FieldOption]:
    return [
        FieldOption(
            name=f.name, type=f.type, help=f.facts.help, default=REQUIRED if f.default is MISSING else f.default
        )
        for f in shape_fields(lookup=lookup)
    ]


def _given(**values: object) -> dict[str, object]:
    return {name: value for name, value in values.items() if value is not None}
