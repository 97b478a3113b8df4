"""The runtime's front door: measure configs on a TP group that lives across many calls.

Torch is imported only when a group runs (the harness, inside the rank processes; in this process only to
read a GPU's limits), so the CLI and the service can import this module in well under a second, and a
measurement on the CPU backend costs this process no torch import at all.  Counting GPUs needs torch only
where NVIDIA's driver is loaded: a Linux host without it has none.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from overlap_runtime.config import DeviceLimits, OverlapConfig, check_backend_size, check_config, problem
from overlap_runtime.errors import ConfigError, ShapeError
from overlap_runtime.group import RankContext, TPGroup
from overlap_runtime.knobs import BACKENDS, RUNTIME_BACKENDS, TE
from overlap_runtime.measurement import BaselineSource, Measurement
from overlap_runtime.shape import ModelShape, Slot, fp8_misfit

NVIDIA_DRIVER_FILES = (Path("/dev/nvidiactl"), Path("/proc/driver/nvidia/version"))
"""What a Linux host (or a container given GPUs) has while NVIDIA's kernel driver is loaded."""


def available_gpus() -> int:
    """The CUDA devices this process sees (``CUDA_VISIBLE_DEVICES`` applies); 0 without NVIDIA's driver."""
    if sys.platform.startswith("linux") and not any(f.exists() for f in NVIDIA_DRIVER_FILES):
        return 0  # what torch would say, without its 2.5 CPU-seconds of import
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class Runtime:
    """Measures (shape, slot, config) triples on ``tp`` ranks of ``backend``; reuse it for many configs.

    A config that hangs or crashes the group raises `TrialFailure` (the group restarts on the next call);
    a config or shape this runtime cannot honour raises `ConfigError` / `ShapeError` before anything runs.
    """

    def __init__(self, *, tp: int, backend: str, trial_timeout_s: float = 180.0) -> None:
        if backend not in self.backends:
            raise ConfigError("backend", f"must be one of {', '.join(self.backends)}", backend)
        if backend != "cpu" and available_gpus() < tp:
            raise ConfigError("backend", f"{backend} needs tp={tp} GPUs but this host has {available_gpus()}", backend)
        self.tp = tp
        self.backend = backend
        self.trial_timeout_s = trial_timeout_s
        self.group = self._group()
        self._limits: DeviceLimits | None = None

    backends: tuple[str, ...] = RUNTIME_BACKENDS
    """The backends this class measures on (`te_backend.TeRuntime` takes the te backend)."""

    def _group(self) -> TPGroup:
        return TPGroup(tp=self.tp, backend=self.backend)

    def _measure_task(self) -> Callable[..., list[Measurement]]:
        """The rank task that measures a batch of configs (`harness.measure_task`'s arguments)."""
        return measure_task

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.group.close()

    @property
    def limits(self) -> DeviceLimits | None:
        """The GPU's SM count and stream priorities (None on CPU), read from rank 0's device once."""
        if self.backend != "cpu" and self._limits is None:
            from overlap_runtime.harness import limits_task

            self._limits = self.group.run(limits_task)[0]
        return self._limits

    def check(self, shape: ModelShape, slot: Slot, config: OverlapConfig) -> None:
        """Raise unless this runtime can measure ``config`` for ``slot`` of ``shape``."""
        if shape.tp != self.tp:
            raise ShapeError("tp", f"this runtime's TP group has {self.tp} ranks", shape.tp)
        check_backend_size(shape, self.backend)
        if self.backend == TE and shape.dtype != "bf16":
            raise ShapeError("dtype", "the te backend measures TE's bf16 GEMMs only (no FP8 recipe yet)", shape.dtype)
        misfit = fp8_misfit(problem(shape, Slot(slot), config.method))
        if misfit is not None:
            raise ShapeError("dtype", misfit, shape.dtype)
        check_config(config, problem(shape, Slot(slot), config.method), backend=self.backend, limits=self.limits)

    def measure(
        self,
        shape: ModelShape,
        slot: Slot,
        config: OverlapConfig,
        *,
        repeats: int = 20,
        warmup: int = 5,
        rounds: int = 1,
        baselines: BaselineSource = BaselineSource.SAME_ROUNDS,
    ) -> Measurement:
        return self.measure_many(
            shape, slot, [config], repeats=repeats, warmup=warmup, rounds=rounds, baselines=baselines
        )[0]

    def measure_many(
        self,
        shape: ModelShape,
        slot: Slot,
        configs: list[OverlapConfig],
        *,
        repeats: int = 20,
        warmup: int = 5,
        rounds: int = 1,
        baselines: BaselineSource = BaselineSource.SAME_ROUNDS,
    ) -> list[Measurement]:
        """Measure several configs in one go, interleaved over ``rounds`` (A B C A B C ...): the way to
        compare finalists on a noisy machine.  One failure fails them all: measure suspects alone first.

        ``baselines``: the gemm, comm and serial times each config is scored against, timed in the same rounds
        (the default: what a result you quote needs) or cached per process and problem (search trials)."""
        for config in configs:
            self.check(shape, slot, config)
        measure_task = self._measure_task()

        # Same-round baselines time three more regions per problem and round.
        problems = {problem(shape, Slot(slot), c.method) for c in configs}
        timed = len(configs) + (3 * len(problems) if baselines == BaselineSource.SAME_ROUNDS else 0)
        timeout = self.trial_timeout_s * max(1, timed * rounds)
        results = self.group.run(
            measure_task,
            shape,
            Slot(slot),
            configs,
            repeats=repeats,
            warmup=warmup,
            rounds=rounds,
            baselines=baselines,
            timeout_s=timeout,
        )
        return results[0]


def measure_task(ctx: RankContext, *args: Any, **kwargs: Any) -> list[Measurement]:
    """`harness.measure_task`, imported by the rank that runs it: a task travels by name, so this one spares the
    parent the import of torch (over a second of CPU for every `autotune measure` and `tune`).  It has the
    harness's name, which the group's failure messages quote."""
    from overlap_runtime import harness

    return harness.measure_task(ctx, *args, **kwargs)


def open_runtime(*, tp: int, backend: str, trial_timeout_s: float = 180.0) -> Runtime:
    """The runtime of ``backend``: ours (cpu, cuda), or TE's (te), which fails at once without TE installed."""
    if backend == TE:
        from overlap_runtime.te_backend import TeRuntime

        return TeRuntime(tp=tp, trial_timeout_s=trial_timeout_s)
    if backend not in BACKENDS:
        raise ConfigError("backend", f"must be one of {', '.join(BACKENDS)}", backend)
    return Runtime(tp=tp, backend=backend, trial_timeout_s=trial_timeout_s)
