"""The `autotune` console script: thin commands over library calls.

Each command's module is imported when the command runs (`COMMANDS`), so `autotune preset validate` loads
the preset readers and not the controller, the database or torch: a command starts in a fraction of the
second the whole tree takes to import.

`EXIT_CODES` is the one place an exception becomes an exit code (docs/cli.md, Errors and exit codes):
0 success, 1 failure, 2 bad input (ours, the controller's 401/403/422, and click's usage errors), 130
interrupted.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

COMMANDS: dict[str, tuple[str, str]] = {
    "measure": ("autotune.cli.measure", "measure"),
    "preset": ("autotune.cli.preset", "app"),
    "fleet": ("autotune.cli.fleet", "app"),
    "workers": ("autotune.cli.client", "workers_app"),
    "serve": ("autotune.cli.serve", "serve"),
    "worker": ("autotune.cli.worker", "worker"),
    "tune": ("autotune.cli.tune", "tune"),
    "validate": ("autotune.cli.validate", "validate_command"),
    "submit": ("autotune.cli.client", "submit"),
    "status": ("autotune.cli.client", "status"),
    "best": ("autotune.cli.client", "best"),
    "export": ("autotune.cli.client", "export"),
    "cancel": ("autotune.cli.client", "cancel"),
}
"""Command name -> (module, attribute): a command function, or the `typer.Typer` of a command group."""

EXIT_CODES: dict[str, int] = {
    "builtins.KeyboardInterrupt": 130,  # Ctrl-C, or SIGTERM where a command turns it into one (tune, worker)
    "overlap_runtime.errors.InputError": 2,
    "autotune.cli.rest_client.RequestRejected": 2,
    "overlap_runtime.errors.AutotuneError": 1,  # the rest of the tree: StorageError, ApiError, TrialFailure, ...
    "httpx.TransportError": 1,  # the controller is unreachable
    "builtins.OSError": 1,  # a file that cannot be read or written (a read-only --out, say)
}
"""Exception class (by its import name, so that this module imports none of the libraries a command may raise
from) -> exit code; the nearest class in the exception's MRO decides (InputError before AutotuneError).
Commands exit 1 themselves where the outcome, not an exception, is the failure."""


def _names(e: BaseException) -> list[str]:
    """Import names of the classes in ``e``'s MRO, nearest first."""
    return [f"{cls.__module__}.{cls.__qualname__}" for cls in type(e).__mro__]


def exit_code(e: BaseException) -> int | None:
    """The exit code of an exception the CLI ends on; None for one it does not expect (a bug: a traceback)."""
    return next((EXIT_CODES[name] for name in _names(e) if name in EXIT_CODES), None)


def _message(e: BaseException) -> str:
    names = _names(e)
    if "storage.errors.StorageError" in names:  # a database the user pointed us at is unreachable or broken
        return f"database: {e}"
    if "httpx.TransportError" in names:
        url = e.request.url  # type: ignore[attr-defined]  # every httpx.TransportError carries its request
        return f"controller: cannot reach {url.scheme}://{url.netloc.decode()} ({e})"
    if isinstance(e, OSError) and e.filename is not None:  # "[Errno 5] ..." alone does not say which file
        return f"file: {e.filename}: {e.strerror or e}"
    return str(e)


def _quiet_exit_on_broken_pipe() -> NoReturn:
    """The reader of stdout went away (``| head``): stop quietly with 0, as it asked for no more output.
    stdout is pointed at /dev/null so the interpreter's last flush at exit cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise typer.Exit(0)


class _Commands(TyperGroup):
    """The root group: builds a command from its module when it is asked for (`COMMANDS`), and runs every
    command, subcommands of `preset` included, inside `invoke`: the one place errors end."""

    def list_commands(self, ctx: Any) -> list[str]:  # typer's own click Context, not exported
        return list(COMMANDS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in COMMANDS:
            return None
        module, attribute = COMMANDS[cmd_name]
        target = getattr(importlib.import_module(module), attribute)
        if not isinstance(target, typer.Typer):  # a command function: typer builds it from a one-command app
            function, target = target, typer.Typer(add_completion=False)
            target.command(cmd_name)(function)
        command = typer.main.get_command(target)
        command.name = cmd_name
        return command

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            _quiet_exit_on_broken_pipe()
        except (KeyboardInterrupt, Exception) as e:
            code = exit_code(e)
            if code is None:
                raise
            if not isinstance(e, KeyboardInterrupt):
                typer.echo(f"error: {_message(e)}", err=True)
            raise typer.Exit(code) from None


app = typer.Typer(cls=_Commands, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _root() -> None:
    """Tune TransformerEngine's TP comm-GEMM overlap configs and export them as presets."""


def main() -> None:
    app()
