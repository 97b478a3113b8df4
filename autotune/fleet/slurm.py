"""`autotune fleet slurm`: an sbatch script that puts one `autotune worker` on each of N nodes.

Two shapes of fleet: ``--array N`` submits N array tasks of one node each (Slurm schedules each task as
soon as a node frees up, and each completes on its own), ``--nodes N`` one job of N nodes started together
(``srun`` puts one worker on each).  Every worker runs with ``--exit-when-idle``, so the array task or the
job completes (exit 0) once the controller has nothing more for it.  The controller's URL and the worker
token are read from the environment when the job runs (``sbatch`` hands the submitting shell's environment
on): the script holds no secret and can be committed beside the training scripts.  With Pyxis, ``srun``
starts the worker inside ``--container-image`` with ``--container-mounts``.  A GPU worker takes its nodes
whole (``--exclusive``): a neighbour's job on the same GPUs would be measured with ours.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from autotune.fleet.worker_command import ENV_CONTROLLER, ENV_WORKER_TOKEN, FleetWorker
from autotune.tuner.gpu import CPU
from overlap_runtime.errors import InputError

SLURM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
"""Partition, account and job names: what Slurm's own tools print, nothing a shell would read twice."""
SLURM_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$")
"""sbatch's ``--time`` forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
NO_SPACE_OR_QUOTE = re.compile(r"^[^\s'\"\\]+$")


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmFleet:
    """What the sbatch script asks for; `check` says what is wrong with it, naming the flag."""

    array: int | None = None
    """Array tasks of one node each; None with ``nodes``."""
    nodes: int | None = None
    """Nodes of one job; None with ``array``."""
    worker: FleetWorker
    cpus_per_task: int | None = None
    """CPUs of each worker (its ranks and their threads); Slurm's default (one) when None."""
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    job_name: str = "autotune-workers"
    container_image: str | None = None
    container_mounts: str | None = None

    def check(self) -> None:
        """Raise `InputError` naming the first flag that breaks its rule."""
        if (self.array is None) == (self.nodes is None):
            raise InputError("--array", "give one of --array (tasks of one node each) and --nodes (one job), not both")
        for flag, count in (("--array", self.array), ("--nodes", self.nodes)):
            if count is not None and count < 1:
                raise InputError(flag, "must be at least 1", count)
        self.worker.check(gpus_flag="--gpus-per-node")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise InputError("--cpus-per-task", "must be at least 1", self.cpus_per_task)
        for flag, name in (("--partition", self.partition), ("--account", self.account), ("--job-name", self.job_name)):
            if name is not None and not SLURM_NAME.match(name):
                raise InputError(flag, "must be letters, digits, '.', '_' or '-'", name)
        if self.time is not None and not SLURM_TIME.match(self.time):
            raise InputError("--time", "must be minutes, M:S, H:M:S, D-H, D-H:M or D-H:M:S", self.time)
        for flag, text in (("--container-image", self.container_image), ("--container-mounts", self.container_mounts)):
            if text is not None and not NO_SPACE_OR_QUOTE.match(text):
                raise InputError(flag, "must hold no spaces, quotes or backslashes", text)
        if self.container_mounts is not None and self.container_image is None:
            raise InputError("--container-mounts", "needs --container-image (Pyxis mounts into a container)")


def sbatch_script(fleet: SlurmFleet) -> str:
    """The sbatch script of ``fleet`` (checked first)."""
    fleet.check()
    directives = [f"--job-name={fleet.job_name}"]
    if fleet.array is not None:
        directives += [f"--array=0-{fleet.array - 1}", "--nodes=1", "--output=%x-%A_%a.out"]
    else:
        directives += [f"--nodes={fleet.nodes}", "--output=%x-%j.out"]
    directives.append("--ntasks-per-node=1")
    if fleet.cpus_per_task is not None:
        directives.append(f"--cpus-per-task={fleet.cpus_per_task}")
    if fleet.worker.backend != CPU:
        directives += [f"--gpus-per-node={fleet.worker.gpus}", "--exclusive"]
    for flag, value in (("partition", fleet.partition), ("account", fleet.account), ("time", fleet.time)):
        if value is not None:
            directives.append(f"--{flag}={value}")
    srun = ["srun", "--ntasks-per-node=1"]
    if fleet.container_image is not None:
        srun.append(f"--container-image={fleet.container_image}")
    if fleet.container_mounts is not None:
        srun.append(f"--container-mounts={fleet.container_mounts}")
    lines = [
        "#!/bin/bash",
        "# autotune workers: one `autotune worker` per node, claiming trials from the controller until it has had",
        f"# nothing for them for {fleet.worker.exit_when_idle_s:g} s, then exiting 0 (docs/fleet.md).  Submit it with the",
        "# controller's URL and worker token in your environment; sbatch hands them on, the script holds neither:",
        f"#   export {ENV_CONTROLLER}=http://controller:8000 {ENV_WORKER_TOKEN}=...",
        "#   sbatch this-script.sbatch",
        *(f"#SBATCH {d}" for d in directives),
        "set -euo pipefail",
        f': "${{{ENV_CONTROLLER}:?export {ENV_CONTROLLER}, the controller URL, before sbatch}}"',
        f': "${{{ENV_WORKER_TOKEN}:?export {ENV_WORKER_TOKEN}, the controller worker token, before sbatch}}"',
        shlex.join(srun + fleet.worker.argv()),
        "",
    ]
    return "\n".join(lines)
