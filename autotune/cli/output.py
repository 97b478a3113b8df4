"""Where a command's output goes: the console for tables, and the file an ``--out`` flag names.

`console` is wide when stdout is not a terminal (a pipe, a file, ``tee``): rich would wrap at 80 columns
and cut the knobs off.  `write_out` decides whether ``--out`` is a file or a folder the way users mean it
(docs/cli.md, Output files) and turns a path that cannot be written into `InputError` naming ``out``: it
is the path the user gave that is wrong, so exit 2 with the reason, never a traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console

from overlap_runtime.errors import InputError

PIPE_WIDTH = 200
"""Table width when printing to a pipe or a file: rich's 80 columns would cut the knobs off."""


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader went away (``| head``): leave it to the CLI's one handler (exit 0, quietly), where rich's
        own would exit 1."""
        self.quiet = True
        raise BrokenPipeError


def console() -> Console:
    """A console on stdout: the terminal's width on a terminal, `PIPE_WIDTH` elsewhere."""
    return _Console(width=None if sys.stdout.isatty() else PIPE_WIDTH)


def is_folder(out: str) -> bool:
    """Whether ``--out`` names a folder: one that exists, a path ending in a slash (``presets/``), or a path
    that does not exist and has no suffix (``presets``).  Anything else is a file, an existing one included."""
    path = Path(out)
    return out.endswith(("/", os.sep)) or path.is_dir() or (not path.exists() and not path.suffix)


def write_out(out: str, text: str, *, name: str) -> Path:
    """Write ``text`` to ``out``, or to ``out/name`` when ``out`` is a folder (created if missing, but not its
    parent: a missing parent is more often a typo than a wish); the path written."""
    path = Path(out)
    if not path.is_dir() and not path.parent.is_dir():
        raise InputError("out", f"must be in an existing folder, but {path.parent} does not exist", out)
    try:
        if is_folder(out):
            path.mkdir(exist_ok=True)
            path = path / name
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise InputError("out", f"cannot be written: {e.strerror or e}", str(path)) from None
    return path
