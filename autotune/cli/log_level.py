"""``--log-level`` of the long-running commands (`serve`, `worker`): checked as the flag is read, so a level
logging does not know is exit 2 naming the flag, not a ValueError from `logging` (exit 1)."""

from __future__ import annotations

from typing import Annotated

import typer

from overlap_runtime.errors import InputError

LEVELS = ("debug", "info", "warning", "error")


def _level(value: str) -> str:
    if value.lower() not in LEVELS:
        raise InputError("log_level", f"must be one of {', '.join(LEVELS)}", value)
    return value.lower()


LogLevel = Annotated[str, typer.Option(callback=_level, help=" | ".join(LEVELS))]
