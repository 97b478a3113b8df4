"""The worker each launcher starts on a node or in a pod: its backend, GPUs and when it exits."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.tuner.gpu import CPU
from overlap_runtime.errors import InputError
from overlap_runtime.knobs import BACKENDS

ENV_CONTROLLER = "AUTOTUNE_CONTROLLER"
ENV_WORKER_TOKEN = "AUTOTUNE_WORKER_TOKEN"
"""Where `autotune worker` reads the controller's URL and its worker token from."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FleetWorker:
    backend: str = "cuda"
    gpus: int = 8
    """GPUs of each node or pod, all of them the worker's (0 on the cpu backend)."""
    exit_when_idle_s: float = 300.0
    max_jobs: int | None = None

    def check(self, *, gpus_flag: str) -> None:
        """Raise `InputError` naming the flag that breaks its rule (``gpus_flag``: the launcher's GPU flag)."""
        if self.backend not in BACKENDS:
            raise InputError("--backend", f"must be one of {', '.join(BACKENDS)}", self.backend)
        if self.backend == CPU and self.gpus != 0:
            raise InputError(gpus_flag, "must be 0 for the cpu backend", self.gpus)
        if self.backend != CPU and self.gpus < 1:
            raise InputError(gpus_flag, f"must be at least 1 for the {self.backend} backend", self.gpus)
        if self.exit_when_idle_s <= 0:
            raise InputError(
                "--exit-when-idle",
                "must be above 0 s (a worker that never exits never completes)",
                self.exit_when_idle_s,
            )
        if self.max_jobs is not None and self.max_jobs < 1:
            raise InputError("--max-jobs", "must be at least 1", self.max_jobs)

    def argv(self) -> list[str]:
        """The command line, which reads the controller and the token from `ENV_CONTROLLER`, `ENV_WORKER_TOKEN`."""
        argv = ["autotune", "worker", "--backend", self.backend, "--exit-when-idle", f"{self.exit_when_idle_s:g}"]
        if self.max_jobs is not None:
            argv += ["--max-jobs", str(self.max_jobs)]
        return argv
