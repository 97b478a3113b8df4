"""Measure and tell until a slot's study is decided: the loop of `autotune tune` (`autotune.cli.local_tuning`), of
the benchmarks that replay recorded landscapes, and of the tuner's tests.  The controller's scheduler drives the
same `SlotStudy` with measurements that workers send over REST instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from autotune.tuner.outcome import SlotOutcome
from autotune.tuner.proposal import Proposal
from autotune.tuner.studies import SlotStudy
from overlap_runtime.config import OverlapConfig
from overlap_runtime.errors import ConfigError, TrialFailure
from overlap_runtime.measurement import BaselineSource, Measurement
from overlap_runtime.shape import ModelShape, Slot

DEFAULT_TRIALS = 60
"""Configs measured per slot at most (baselines included; the finalist batch comes on top)."""


class Measurer(Protocol):
    """What measures proposals: `Runtime` on GPUs or CPU, `autotune.tuner.replay.ReplayBackend` from landscapes."""

    def measure_many(
        self,
        shape: ModelShape,
        slot: Slot,
        configs: list[OverlapConfig],
        *,
        repeats: int = ...,
        warmup: int = ...,
        rounds: int = ...,
        baselines: BaselineSource = ...,
    ) -> list[Measurement]: ...


def drive(
    study: SlotStudy, *, measurer: Measurer, on_told: Callable[[Proposal], None] | None = None
) -> SlotOutcome | None:
    """Measure and tell until ``study`` is decided; proposals left out by a killed run go first."""
    pending = list(study.outstanding())
    while (proposal := pending.pop(0) if pending else study.ask()) is not None:
        try:
            measured = measurer.measure_many(
                study.shape,
                study.slot,
                list(proposal.configs),
                repeats=proposal.repeats,
                rounds=proposal.rounds,
                baselines=proposal.baselines,
            )
        except TrialFailure as e:
            study.tell(proposal, failure=e.reason)
        except ConfigError as e:  # a baseline the runtime refuses on this device: a failed trial, not bad input
            study.tell(proposal, failure=f"refused by the runtime: {e}")
        else:
            study.tell(proposal, measurements=measured)
        if on_told is not None:
            on_told(proposal)
    return study.outcome()
