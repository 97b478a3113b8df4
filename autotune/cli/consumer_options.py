"""The ``--for CONSUMER`` and ``--set SWITCH=VALUE`` options: who runs a preset, and switches the user has fixed."""

from __future__ import annotations

from typing import Annotated

import typer

from overlap_runtime.errors import InputError
from search_spaces.consumers import CONSUMER_HELP, Consumer, parse_setting

FOR_HELP = "Who runs the preset: " + "; ".join(f"{c.value} ({h})" for c, h in CONSUMER_HELP.items())

For = Annotated[Consumer | None, typer.Option("--for", help=FOR_HELP, show_default=False)]
Sets = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="SWITCH=true|false",
        help="A switch of the consumer you have fixed (repeatable), e.g. tp_comm_overlap_disable_qkv=true",
    ),
]


def fixed_switches(consumer: Consumer, given: list[str] | None) -> dict[str, bool]:
    """``--set`` values as the consumer's switches; InputError naming ``--set`` and the rule otherwise."""
    values: dict[str, object] = {}
    for item in given or []:
        name, sep, value = item.partition("=")
        if not sep or value.lower() not in ("true", "false"):
            raise InputError("--set", "must be SWITCH=true or SWITCH=false", item)
        values[name.strip()] = value.lower() == "true"
    return parse_setting(consumer, values)
