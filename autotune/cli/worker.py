"""`autotune worker`: run trials for a controller on this machine's GPUs (or the CPU backend) until stopped."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from autotune.cli import signals
from autotune.cli.client import controller_url
from autotune.cli.local_token import read_token
from autotune.cli.log_level import LogLevel
from autotune.cli.measure import BACKEND_HELP, default_backend
from autotune.cli.worker_loop import WorkerOptions, run_worker
from overlap_runtime.errors import InputError
from overlap_runtime.knobs import BACKENDS, TE
from overlap_runtime.te_backend import require_te


def worker(
    controller: Annotated[
        str,
        typer.Option(
            envvar="AUTOTUNE_CONTROLLER", callback=controller_url, help="Controller URL, e.g. http://host:8000"
        ),
    ],
    backend: Annotated[str | None, typer.Option(help=BACKEND_HELP)] = None,
    worker_token: Annotated[
        str | None,
        typer.Option(envvar="AUTOTUNE_WORKER_TOKEN", help="The controller's worker token, to register with"),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="AUTOTUNE_TOKEN", help="The controller's token, to register with where it has no worker token"
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(help="Name on the dashboard (default: the Slurm job and task, or the pod, else host-pid)"),
    ] = None,
    poll_s: Annotated[
        float, typer.Option(min=0.05, help="Pause when there is no work (doubling, up to 8x, while none comes)")
    ] = 1.0,
    heartbeat_s: Annotated[float, typer.Option(min=0.1)] = 10.0,
    trial_timeout_s: Annotated[
        float, typer.Option(min=0.001, help="Per config and round before a trial is hung")
    ] = 180.0,
    exit_when_idle: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Exit 0 after this many seconds with nothing to claim (exit 1 if the controller stayed "
            "unreachable that long): the end of a Slurm array task or a Kubernetes Job",
        ),
    ] = None,
    max_jobs: Annotated[
        int | None,
        typer.Option(min=1, help="Exit 0, once idle, when this many of the jobs it ran trials for have ended"),
    ] = None,
    log_level: LogLevel = "info",
    parent_pid: Annotated[
        int | None, typer.Option(hidden=True, help="Exit when this process, the serve that started it, dies")
    ] = None,
) -> None:
    """Register with the controller, then claim, measure and report trials; a failing config never stops it.

    It registers with the worker token if given one, else with the clients' token (a controller without a
    worker token takes that); every later call speaks with the secret the registration returned.  SIGTERM
    hands the trial it measures back to the queue and ends its rank processes (exit 130).
    """
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise InputError("backend", f"must be one of {', '.join(BACKENDS)}", backend)
    if backend == TE:
        require_te()  # at once, before registering: a te worker without TE could run nothing
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per claim poll otherwise
    signals.stop_on_sigterm()  # docker stop / serve's shutdown: close the TP group on the way out
    if parent_pid is not None:
        signals.exit_with_parent(parent_pid)
    options = WorkerOptions(
        backend=backend,
        name=name,
        poll_s=poll_s,
        heartbeat_s=heartbeat_s,
        trial_timeout_s=trial_timeout_s,
        exit_when_idle_s=exit_when_idle,
        max_jobs=max_jobs,
    )
    run_worker(controller=controller, token=worker_token or token or read_token(), options=options)
