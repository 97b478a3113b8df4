"""The `autotune` console script: thin commands over library calls.

Exit codes: 0 success, 1 failure, 2 usage or validation error, 130 interrupted.
"""

from __future__ import annotations

import sys

import typer

from autotune.cli import client, measure, preset, serve, tune, worker
from overlap_runtime.errors import InputError
from storage.errors import StorageError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
app.command("measure")(measure.measure)
app.add_typer(preset.app, name="preset")
app.command("serve")(serve.serve)
app.command("worker")(worker.worker)
app.command("tune")(tune.tune)
for _command in (client.submit, client.status, client.best, client.export, client.cancel):
    app.command()(_command)


def main() -> None:
    try:
        app()
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except StorageError as e:  # a database the user pointed us at is unreachable or broken
        print(f"error: database: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
