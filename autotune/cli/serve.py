"""`autotune serve`: the controller (REST API, dashboard, scheduler), optionally with a worker of its own.

``autotune serve --local-worker --backend cpu`` is the whole service in one command on the default SQLite
database: the controller, plus one worker process on the local GPUs or the CPU backend that it hands its
token to.  Without ``--token``/``AUTOTUNE_TOKEN`` the controller uses (and on first start creates) the
token file of `autotune.local_token`, so it is never open by accident; ``--no-auth`` runs it open, on a
loopback bind only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Annotated, Any

import optuna
import typer
import uvicorn
from pydantic import SecretStr

from api.main import create_app
from api.settings import Settings
from autotune.cli.measure import default_backend
from autotune.local_token import load_or_create_token, token_path

WORKER_STOP_TIMEOUT_S = 10.0
_CLI_MAIN = "from autotune.cli.app import main; main()"
"""How the local worker is started: this interpreter, the same CLI, so it runs in the same environment."""


def serve(
    db: Annotated[
        str | None, typer.Option("--db", help="sqlite:///PATH or postgresql+psycopg://... (default: per-user SQLite)")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000)")] = None,
    local_worker: Annotated[bool, typer.Option("--local-worker", help="Also run a worker on this machine")] = False,
    backend: Annotated[
        str | None, typer.Option(help="Local worker's backend: cpu | cuda (default: cuda if GPUs)")
    ] = None,
    token: Annotated[str | None, typer.Option(help="Bearer token for writes and workers (or AUTOTUNE_TOKEN)")] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="No token at all; loopback bind only")] = False,
    log_level: Annotated[str, typer.Option(help="debug | info | warning")] = "info",
) -> None:
    """Run the controller: REST API under /v1, OpenAPI at /docs, dashboard at /."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per study and trial would drown the log
    overrides: dict[str, Any] = {"db_url": db, "host": host, "port": port, "token": token}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if no_auth:
        overrides["no_auth"] = True
    if local_worker:
        backend = backend or default_backend()
        overrides["default_backend"] = backend
    settings = Settings(**overrides)
    if settings.token is None and not settings.no_auth:
        settings = settings.model_copy(update={"token": SecretStr(load_or_create_token())})
        typer.echo(f"token: in {token_path()} (clients on this machine read it; others need AUTOTUNE_TOKEN)", err=True)
    app = create_app(settings)
    with _local_worker(settings, backend) if local_worker else contextlib.nullcontext():
        # Workers poll for claims every second: access lines only when debugging.
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level, access_log=log_level == "debug")


@contextlib.contextmanager
def _local_worker(settings: Settings, backend: str | None) -> Iterator[None]:
    """A worker process for this controller, stopped with it; it waits for the controller to come up."""
    env = dict(os.environ)
    if settings.token is not None:
        env["AUTOTUNE_TOKEN"] = settings.token.get_secret_value()  # the environment, not argv: ps shows argv
    command = [sys.executable, "-c", _CLI_MAIN, "worker", "--controller", _url(settings), "--backend", backend or "cpu"]
    worker = subprocess.Popen(command, env=env)
    try:
        yield
    finally:
        worker.terminate()
        try:
            worker.wait(WORKER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def _url(settings: Settings) -> str:
    """Where a worker on this machine reaches the controller (a wildcard bind is reached on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(settings.host, settings.host)
    return f"http://[{host}]:{settings.port}" if ":" in host else f"http://{host}:{settings.port}"
