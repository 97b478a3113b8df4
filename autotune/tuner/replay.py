"""Replay: answer trials from recorded landscapes instead of GPUs, so search strategies run on a laptop.

A landscape (`bench/record_landscape.py`) is every config of one slot's space measured on a GPU machine,
with each repeat's time.  `ReplayBackend.measure_many` has `Runtime.measure_many`'s signature, so the local
driver and the benchmarks take either.  Each call draws ``repeats * rounds`` times per config from that
config's recorded samples (with replacement, seeded) and reports their median: the replayed tuner sees the
machine's noise, not one frozen number.  A recorded failure raises `TrialFailure` as the runtime would.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from autotune.tuner.gpu import CPU
from autotune.tuner.studies import SlotStudy
from overlap_runtime.config import DeviceLimits, OverlapConfig
from overlap_runtime.errors import InputError, TrialFailure
from overlap_runtime.measurement import BaselineSource, Measurement
from overlap_runtime.shape import ModelShape, Slot
from search_spaces.space import SlotSpace, slot_space


@dataclass(frozen=True, kw_only=True)
class Landscape:
    """One slot's recorded space: per config its measurement (with samples) or the failure it caused."""

    shape: ModelShape
    slot: Slot
    backend: str
    limits: DeviceLimits | None
    gpu: str
    """The GPU model it was recorded on ("cpu" for the CPU backend)."""
    results: Mapping[OverlapConfig, Measurement | str]
    """A `Measurement` (its ``samples`` hold every repeat) or the failure reason."""
    source: str = ""
    """Where it was read from, for error messages and reports."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "") -> Landscape:
        limits = data.get("limits")
        results: dict[OverlapConfig, Measurement | str] = {}
        for row in data["configs"]:
            config = OverlapConfig.from_dict(row["config"])
            results[config] = row["error"] if "error" in row else Measurement.from_dict(row["measurement"])
        return cls(
            shape=ModelShape(**data["shape"]),
            slot=Slot(data["slot"]),
            backend=data["backend"],
            gpu=str(data.get("environment", {}).get("gpu") or CPU),
            limits=None
            if limits is None
            else DeviceLimits(sm_count=limits["sm_count"], priority_range=tuple(limits["priority_range"])),
            results=results,
            source=source,
        )

    @classmethod
    def load(cls, path: str | Path) -> Landscape:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")), source=str(path))

    def space(self) -> SlotSpace:
        """The search space the landscape was recorded over."""
        return slot_space(self.shape, self.slot, backend=self.backend, limits=self.limits)

    def study(self, *, n_trials: int, seed: int) -> SlotStudy:
        """A fresh in-memory study of this slot as it was recorded (GPU, shape, backend, limits), to drive
        with a `ReplayBackend` of this landscape."""
        return SlotStudy(
            storage=optuna.storages.InMemoryStorage(),
            gpu=self.gpu,
            shape=self.shape,
            slot=self.slot,
            backend=self.backend,
            limits=self.limits,
            n_trials=n_trials,
            seed=seed,
        )

    def truth(self, config: OverlapConfig) -> float:
        """The recorded median time of ``config``; inf for a failed or wrong config (it can never be best)."""
        result = self.result(config)
        return result.overlap_ms if isinstance(result, Measurement) and result.valid else float("inf")

    def optimum(self) -> tuple[OverlapConfig, float]:
        """The config with the best recorded median among the valid ones, and that median."""
        best = min(self.results, key=self.truth)
        return best, self.truth(best)

    def result(self, config: OverlapConfig) -> Measurement | str:
        """What was recorded for ``config``; InputError when the landscape does not hold it."""
        try:
            return self.results[config]
        except KeyError:
            raise InputError(
                "config", f"was not recorded in the landscape {self.source or self.slot.value}", config.to_dict()
            ) from None


class ReplayBackend:
    """Measures by resampling recorded landscapes; one per (shape, slot) it can answer."""

    def __init__(self, landscapes: Iterable[Landscape], *, seed: int | None = None) -> None:
        # Keyed by the shape key: a recorded shape has ffn_hidden resolved, the asked one may leave it None.
        self._landscapes = {(ls.shape.key, ls.slot): ls for ls in landscapes}
        self._rng = random.Random(seed)

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
        """Like `Runtime.measure_many` (``warmup`` has nothing to warm here, and ``baselines`` nothing to time:
        the recorded ones are kept); one failure fails them all."""
        landscape = self._landscapes.get((shape.key, Slot(slot)))
        if landscape is None:
            raise InputError(
                "slot", f"no landscape recorded for {Slot(slot).value} of {shape.label()}", Slot(slot).value
            )
        recorded = [landscape.result(c) for c in configs]
        for result in recorded:
            if isinstance(result, str):
                raise TrialFailure(result)
        return [self._draw(m, repeats * rounds) for m in recorded if isinstance(m, Measurement)]

    def _draw(self, recorded: Measurement, n: int) -> Measurement:
        if not recorded.samples:
            raise InputError("samples", "a replayed landscape needs every repeat's time (record it again)")
        return recorded.resampled(tuple(self._rng.choices(recorded.samples, k=n)))
