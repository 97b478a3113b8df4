"""The `autotune` console script: thin commands over library calls.

`EXIT_CODES` is the one place an exception becomes an exit code (docs/cli.md, Errors and exit codes):
0 success, 1 failure, 2 bad input (ours, the controller's 401/403/422, and click's usage errors), 130
interrupted.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import httpx
import typer
from typer.core import TyperGroup

from autotune.cli import client, fleet, measure, preset, serve, tune, validate, worker
from autotune.client import RequestRejected
from overlap_runtime.errors import AutotuneError, InputError
from storage.errors import StorageError

EXIT_CODES: dict[type[BaseException], int] = {
    KeyboardInterrupt: 130,  # Ctrl-C, or SIGTERM where a command turns it into one (tune, worker)
    InputError: 2,
    RequestRejected: 2,
    AutotuneError: 1,  # the rest of the tree: StorageError, ApiError, TrialFailure, LeaseLost
    httpx.TransportError: 1,  # the controller is unreachable
    OSError: 1,  # a file that cannot be read or written (a read-only --out, say)
}
"""Exception class -> exit code; the nearest class in the exception's MRO decides (InputError before
AutotuneError).  Commands exit 1 themselves where the outcome, not an exception, is the failure."""


def exit_code(e: BaseException) -> int:
    return next(EXIT_CODES[cls] for cls in type(e).__mro__ if cls in EXIT_CODES)


def _message(e: BaseException) -> str:
    if isinstance(e, StorageError):  # a database the user pointed us at is unreachable or broken
        return f"database: {e}"
    if isinstance(e, httpx.TransportError):
        url = e.request.url
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


class _ExitCodes(TyperGroup):
    """Every command, subcommands of `preset` included, runs inside this `invoke`: the one place errors end."""

    def invoke(self, ctx: Any) -> Any:  # typer's own click Context, not exported
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            _quiet_exit_on_broken_pipe()
        except tuple(EXIT_CODES) as e:
            code = exit_code(e)
            if not isinstance(e, KeyboardInterrupt):
                typer.echo(f"error: {_message(e)}", err=True)
            raise typer.Exit(code) from None


app = typer.Typer(cls=_ExitCodes, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
app.command("measure")(measure.measure)
app.add_typer(preset.app, name="preset")
app.add_typer(fleet.app, name="fleet")
app.add_typer(client.workers_app, name="workers")
app.command("serve")(serve.serve)
app.command("worker")(worker.worker)
app.command("tune")(tune.tune)
app.command("validate")(validate.validate_command)
for _command in (client.submit, client.status, client.best, client.export, client.cancel):
    app.command()(_command)


def main() -> None:
    app()
