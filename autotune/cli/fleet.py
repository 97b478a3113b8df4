"""`autotune fleet slurm | k8s`: print what puts workers on a cluster's GPU nodes (docs/fleet.md).

Each prints to stdout (pipe it to a file, ``sbatch`` or ``kubectl apply -f -``); a flag that breaks its rule
exits 2 naming it.
"""

from __future__ import annotations

from typing import Annotated

import typer

from autotune.cli.client import Controller
from autotune.fleet.k8s import K8sFleet, manifest
from autotune.fleet.slurm import SlurmFleet, sbatch_script
from autotune.fleet.worker_command import FleetWorker

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Print a Slurm sbatch script or a Kubernetes Job that runs workers.",
)

BackendFlag = Annotated[str, typer.Option(help="cuda | te | cpu: what every worker measures on")]
ExitWhenIdle = Annotated[
    float, typer.Option(help="Seconds with nothing to claim before a worker exits 0 and its task completes")
]
MaxJobs = Annotated[
    int | None, typer.Option(help="A worker exits, once idle, when this many jobs it ran trials for have ended")
]


@app.command()
def slurm(
    array: Annotated[int | None, typer.Option(help="Array tasks of one node each (or --nodes)")] = None,
    nodes: Annotated[int | None, typer.Option(help="Nodes of one job, started together (default 1)")] = None,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs of each node (0 for the cpu backend)")] = 8,
    backend: BackendFlag = "cuda",
    cpus_per_task: Annotated[int | None, typer.Option(help="CPUs of each worker (Slurm's default: 1)")] = None,
    partition: Annotated[str | None, typer.Option()] = None,
    account: Annotated[str | None, typer.Option()] = None,
    time: Annotated[str | None, typer.Option(help="Time limit, as sbatch takes it (e.g. 2:00:00)")] = None,
    job_name: Annotated[str, typer.Option()] = "autotune-workers",
    container_image: Annotated[str | None, typer.Option(help="Pyxis: run the workers in this image")] = None,
    container_mounts: Annotated[str | None, typer.Option(help="Pyxis: SRC:DST[,SRC:DST...] into the image")] = None,
    exit_when_idle: ExitWhenIdle = 300.0,
    max_jobs: MaxJobs = None,
) -> None:
    """An sbatch script: one `autotune worker` per node, reading the controller URL and the worker token from
    the environment at run time (export AUTOTUNE_CONTROLLER and AUTOTUNE_WORKER_TOKEN, then sbatch it)."""
    fleet = SlurmFleet(
        array=array,
        nodes=nodes if nodes is not None or array is not None else 1,
        worker=FleetWorker(backend=backend, gpus=gpus_per_node, exit_when_idle_s=exit_when_idle, max_jobs=max_jobs),
        cpus_per_task=cpus_per_task,
        partition=partition,
        account=account,
        time=time,
        job_name=job_name,
        container_image=container_image,
        container_mounts=container_mounts,
    )
    typer.echo(sbatch_script(fleet), nl=False)


@app.command()
def k8s(
    image: Annotated[str, typer.Option(help="The worker image (docker/Dockerfile.worker)")],
    controller: Controller,
    completions: Annotated[int, typer.Option(help="Pods in all, one worker each")] = 1,
    parallelism: Annotated[int | None, typer.Option(help="Pods at once (default: all)")] = None,
    gpus_per_pod: Annotated[int, typer.Option(help="nvidia.com/gpu of each pod (0 for the cpu backend)")] = 8,
    backend: BackendFlag = "cuda",
    cpus: Annotated[int, typer.Option(help="CPUs each pod requests")] = 4,
    name: Annotated[str, typer.Option(help="The Job's name")] = "autotune-workers",
    namespace: Annotated[str | None, typer.Option()] = None,
    secret: Annotated[
        str, typer.Option(help="The Secret holding the worker token under the key worker-token")
    ] = "autotune-worker-token",
    queue: Annotated[str | None, typer.Option(help="Kueue LocalQueue: the Job waits, suspended, for admission")] = None,
    exit_when_idle: ExitWhenIdle = 300.0,
    max_jobs: MaxJobs = None,
) -> None:
    """An Indexed Job: one `autotune worker` per pod, the worker token read from a Secret."""
    fleet = K8sFleet(
        image=image,
        controller=controller,
        worker=FleetWorker(backend=backend, gpus=gpus_per_pod, exit_when_idle_s=exit_when_idle, max_jobs=max_jobs),
        completions=completions,
        parallelism=parallelism,
        name=name,
        namespace=namespace,
        secret=secret,
        queue=queue,
        cpus=cpus,
    )
    typer.echo(manifest(fleet), nl=False)
