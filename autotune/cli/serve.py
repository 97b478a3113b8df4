"""`autotune serve`: the controller (REST API, dashboard, scheduler), optionally with a worker of its own.

``autotune serve --local-worker --backend cpu`` is the whole service in one command on the default SQLite
database: the controller, plus one worker process on the local GPUs or the CPU backend that it hands what
it registers with (``--worker-token`` if given, else the token).  Without ``--token``/``AUTOTUNE_TOKEN`` the
controller uses (and on first start creates) the token file of `autotune.cli.local_token`, so it is never
open by accident; ``--no-auth`` runs it open, on a loopback bind only.

``--workers N`` serves the API from N uvicorn processes (one core each at most: Python runs one request at
a time per process).  This command then exports its settings as ``AUTOTUNE_*`` variables (the token too: the
environment, never argv), migrates the database once, and hands uvicorn `worker_app`, which each process
builds from that environment.  Every process runs the scheduler loop and the database's scheduler lease lets
exactly one of them schedule (`api.scheduler`); SQLite in WAL mode serves several processes of one
machine.  ``--local-worker`` still starts one tuning worker, from this (uvicorn's supervising) process, not
one per API process.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import optuna
import typer
import uvicorn
from fastapi import FastAPI
from pydantic import SecretStr, ValidationError
from uvicorn.config import LOGGING_CONFIG

import storage
from api.main import app_from_env, create_app
from api.settings import Settings
from autotune.cli import signals
from autotune.cli.local_token import load_or_create_token, token_path
from autotune.cli.log_level import LogLevel
from autotune.cli.measure import default_backend
from overlap_runtime.errors import AutotuneError, InputError

WORKER_STOP_TIMEOUT_S = 10.0
_CLI_MAIN = "from autotune.cli.app import main; main()"
"""How the local worker is started: this interpreter, the same CLI, so it runs in the same environment."""
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
WORKER_APP = f"{__name__}:worker_app"
"""The factory each uvicorn process of ``--workers N`` imports."""


def serve(
    db: Annotated[
        str | None, typer.Option("--db", help="sqlite:///PATH or postgresql+psycopg://... (default: per-user SQLite)")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000)")] = None,
    local_worker: Annotated[bool, typer.Option("--local-worker", help="Also run a worker on this machine")] = False,
    backend: Annotated[
        str | None, typer.Option(help="Local worker's backend: cpu | cuda | te (default: cuda if GPUs)")
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(help="Bearer token for writes, and for workers without --worker-token (or AUTOTUNE_TOKEN)"),
    ] = None,
    worker_token: Annotated[
        str | None,
        typer.Option(
            help="Bearer token for worker registration only, refusing --token there (or AUTOTUNE_WORKER_TOKEN)"
        ),
    ] = None,
    admin_token: Annotated[
        str | None,
        typer.Option(help="Bearer token for revoking workers only, refusing --token there (or AUTOTUNE_ADMIN_TOKEN)"),
    ] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="No token at all; loopback bind only")] = False,
    max_body_bytes: Annotated[
        int | None,
        typer.Option(help="Largest request body; a larger one is a 413 (default 1 MiB; AUTOTUNE_MAX_BODY_BYTES)"),
    ] = None,
    log_level: LogLevel = "info",
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            min=1,
            help="API processes (uvicorn workers; one schedules, by lease). Not tuning workers: see --local-worker",
        ),
    ] = 1,
) -> None:
    """Run the controller: REST API under /v1, OpenAPI at /docs, dashboard at /."""
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per study and trial would drown the log
    overrides: dict[str, Any] = {
        "db_url": db, "host": host, "port": port, "token": token, "worker_token": worker_token,
        "max_body_bytes": max_body_bytes, "admin_token": admin_token,
    }  # fmt: skip
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if no_auth:
        overrides["no_auth"] = True
    if local_worker:
        backend = backend or default_backend()
        overrides["default_backend"] = backend
    settings = _settings(overrides)
    if settings.token is None and not settings.no_auth:
        settings = settings.model_copy(update={"token": SecretStr(load_or_create_token())})
        typer.echo(f"token: in {token_path()} (clients on this machine read it; others need AUTOTUNE_TOKEN)", err=True)
    # Workers poll for claims every second: access lines only when debugging.
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": log_level,
        "log_config": _log_config(log_level),
        "access_log": log_level == "debug",
    }
    settings.check_auth()
    settings.check_scheduler()
    _check_port(settings)
    _migrate(settings)
    app: FastAPI | str = create_app(settings) if workers == 1 else _export_for_workers(settings)
    signals.stop_on_sigterm()  # uvicorn raises SIGTERM again once it has shut down: stop the local worker then
    for line in _where_to_go(settings, local_worker=local_worker):
        typer.echo(line, err=True)
    with _local_worker(settings, backend) if local_worker else contextlib.nullcontext(_nothing) as stop_worker:
        if workers > 1:
            uvicorn.run(app, workers=workers, factory=True, **options)
        else:  # the local worker stops first, so it can tell the API it stopped (shown stopped, not lost)
            _serve(_Server(uvicorn.Config(app, **options), first=stop_worker))


def worker_app() -> FastAPI:
    """The app of one uvicorn process of ``serve --workers N``: the controller the exported environment describes."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # this process imports optuna anew: quiet it here too
    return app_from_env()


def _settings(overrides: dict[str, Any]) -> Settings:
    """The settings from the flags and the ``AUTOTUNE_*`` environment; `InputError` naming the first field that
    breaks its rule (``--port 70000``, ``AUTOTUNE_LEASE_S=-1``), so a bad value is exit 2, not a traceback."""
    try:
        return Settings(**overrides)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise InputError(field, first["msg"], first.get("input")) from None


def _check_port(settings: Settings) -> None:
    """Fail now (exit 1, with the reason) when the address cannot be bound, before the database is migrated
    and the scheduler role taken: uvicorn would find out only after both, and exit 3."""
    with socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((settings.host, settings.port))
        except OSError as e:
            raise AutotuneError(f"port: cannot listen on {settings.host}:{settings.port}: {e.strerror or e}") from None


def _migrate(settings: Settings) -> None:
    """Migrate the database before any server starts, so one that is unreachable, read-only or broken stops
    the command with its reason (`StorageError`, exit 1) instead of uvicorn's start-up failure (exit 3); the
    app finds the schema at head (its own start-up migration is then a no-op)."""
    engine = storage.create_engine_for(url=settings.db_url)
    try:
        storage.upgrade(engine=engine)
    finally:
        engine.dispose()


def _export_for_workers(settings: Settings) -> str:
    """Export ``settings`` for the API processes of ``--workers N``; the name of the app they import."""
    os.environ.update(settings.to_environment())  # spawned processes inherit it
    return WORKER_APP


def _log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging plus ours (the scheduler's, the API's) on stderr at ``level``.

    uvicorn applies it in every process it runs the app in; its worker processes are spawned, so they
    inherit none of this process's logging set-up.
    """
    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["autotune"] = {"format": LOG_FORMAT}
    config["handlers"]["autotune"] = {
        "class": "logging.StreamHandler",
        "formatter": "autotune",
        "stream": "ext://sys.stderr",
    }
    config["root"] = {"handlers": ["autotune"], "level": level.upper()}
    return config


class _Server(uvicorn.Server):
    """uvicorn's server, which calls ``first`` (in a thread: the API keeps answering) before it shuts down."""

    def __init__(self, config: uvicorn.Config, *, first: Callable[[], None]) -> None:
        super().__init__(config)
        self._first = first

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await asyncio.to_thread(self._first)
        await super().shutdown(sockets=sockets)


def _serve(server: uvicorn.Server) -> None:
    """Run ``server`` as `uvicorn.run` does: the signal it re-raises once shut down (Ctrl-C, or SIGTERM as
    `signals` turns it into one) is a clean stop; a server that never started is a failure."""
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        raise AutotuneError("serve: the server did not start (its log above says why)")


def _nothing() -> None:
    """No local worker to stop."""


@contextlib.contextmanager
def _local_worker(settings: Settings, backend: str | None) -> Iterator[Callable[[], None]]:
    """A worker process for this controller, stopped with it; it waits for the controller to come up.  Yields
    a callable that stops it, so it can go while the API still answers."""
    env = dict(os.environ)
    # The environment, not argv: ps shows argv.  With a worker token the worker gets that one only: it
    # registers with it, and needs no client write.
    if settings.worker_token is not None:
        env.pop("AUTOTUNE_TOKEN", None)
        env["AUTOTUNE_WORKER_TOKEN"] = settings.worker_token.get_secret_value()
    elif settings.token is not None:
        env["AUTOTUNE_TOKEN"] = settings.token.get_secret_value()
    command = [sys.executable, "-c", _CLI_MAIN, "worker", "--controller", _url(settings), "--backend", backend or "cpu"]
    command += ["--parent-pid", str(os.getpid())]  # it stops itself should this process die without stopping it
    worker = subprocess.Popen(command, env=env)

    def stop() -> None:
        if worker.poll() is not None:
            return
        worker.terminate()
        try:
            worker.wait(WORKER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()

    try:
        yield stop
    finally:
        stop()


FIRST_JOB = "submit --hidden 256 --tp 2 --seq 256 --trials 4 --follow"
"""The next command `serve` suggests: the README's first job, sized for the CPU backend."""


def _where_to_go(settings: Settings, *, local_worker: bool) -> list[str]:
    """What a newcomer needs once the migration lines have scrolled by: the dashboard's URL and the next command
    (a first job where this controller has a worker of its own, else how to start one)."""
    url = _url(settings)
    command = _this_command()
    then = f"{command} {FIRST_JOB}" if local_worker else f"{command} worker --controller {url} (on a GPU node)"
    return [f"dashboard: {url}/  (REST API docs: {url}/docs)", f"next, in another terminal: {then}"]


def _this_command() -> str:
    """How this shell reached the console script: relative to the working folder (``.venv/bin/autotune``, as
    `make run` starts it) when it lies inside it, else its name."""
    script = Path(sys.argv[0]).resolve()  # "-c" where the CLI was started as python -c (the tests, a local worker)
    inside = script.is_file() and script.is_relative_to(Path.cwd())
    return str(script.relative_to(Path.cwd())) if inside else "autotune"


def _url(settings: Settings) -> str:
    """Where a worker on this machine reaches the controller (a wildcard bind is reached on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(settings.host, settings.host)
    return f"http://[{host}]:{settings.port}" if ":" in host else f"http://{host}:{settings.port}"
