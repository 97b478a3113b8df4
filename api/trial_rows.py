"""Reading the service's trial rows: the tuner's proposal in ``config``, the worker's results in ``measurement``.

A trial row stores `Proposal.to_dict()` as its config and ``{"measurements": [...]}`` (one
`Measurement.to_dict()` per proposed config, in order) as its measurement; the scheduler, the API and the
tests all read them back through here so the layout lives in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autotune.tuner.proposal import Proposal
from overlap_runtime.config import OverlapConfig
from overlap_runtime.measurement import Measurement
from storage import Trial


def measurement_json(measurements: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What a trial row's ``measurement`` column holds, from the `Measurement.to_dict()` forms a worker sends."""
    return {"measurements": [dict(m) for m in measurements]}


def proposal_of(trial: Trial) -> Proposal:
    return Proposal.from_dict(trial.config)


def measurements_of(trial: Trial) -> list[Measurement]:
    return [Measurement.from_dict(m) for m in (trial.measurement or {}).get("measurements", [])]


def fastest(
    trial: Trial, *, where: Callable[[OverlapConfig], bool] = lambda config: True
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(config, measurement) of the trial's fastest valid measurement of a config ``where`` accepts, as JSON;
    None if it has none."""
    pairs = [
        (config, m)
        for config, m in zip(proposal_of(trial).configs, measurements_of(trial), strict=False)
        if m.valid and where(config)
    ]
    if not pairs:
        return None
    config, m = min(pairs, key=lambda p: p[1].overlap_ms)
    return config.to_dict(), m.to_dict()
