"""Timing series and the uncertainty of the share of comm hidden (docs/measurement.md, "Baselines and
uncertainty").

A series is one timed thing's repeats, round after round.  The interval of ``hidden`` is a two-stage
bootstrap: rounds are drawn with replacement, then the repeats within each drawn round.  Series timed in the
same rounds draw the same rounds, so drift that hits a round hits the config and its baselines alike, as it
did on the machine.  Pure Python: the service stores these numbers without importing torch or numpy.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

REPLICATES = 1000
"""Bootstrap replicates per interval: enough for stable 2.5% / 97.5% percentiles."""
CONFIDENCE = 0.95


def spread(samples: Sequence[float]) -> float:
    """Coefficient of variation: std / mean."""
    mean = statistics.fmean(samples)
    return statistics.pstdev(samples) / mean if mean > 0 else 0.0


def hidden(overlap_ms: float, gemm_ms: float, comm_ms: float) -> float:
    """Share of ``comm_ms`` hidden behind the GEMM: 1 - (overlap - gemm) / comm; below 0 when overlapping
    costs more than it hides, above 1 when the overlapped op beats ``gemm_ms`` alone (the faster of the
    library GEMM and ours, `Baselines.gemm_ms`: above 1 only when chunking itself pays)."""
    return 1.0 - (overlap_ms - gemm_ms) / comm_ms if comm_ms > 0 else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Series:
    """Every repeat's slowest-rank time (ms) of one timed thing, round after round, equal repeats per round."""

    samples: tuple[float, ...]
    positions: tuple[int, ...] = ()
    """Where each round ran in the group's sequence of timed regions (counted from the group's start), one per
    round: series of the same rounds interleave (round r of each lies between round r-1 and r+1 of all)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", tuple(self.samples))
        object.__setattr__(self, "positions", tuple(self.positions))

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def cv(self) -> float:
        return spread(self.samples)

    def by_round(self) -> list[tuple[float, ...]]:
        """The samples split into their rounds (one round when the positions do not split them evenly)."""
        n = len(self.positions)
        if n <= 1 or len(self.samples) % n:
            return [self.samples]
        size = len(self.samples) // n
        return [self.samples[i * size : (i + 1) * size] for i in range(n)]

    def to_dict(self) -> dict[str, list]:
        return {"samples": list(self.samples), "positions": list(self.positions)}

    @classmethod
    def from_dict(cls, data: dict) -> Series:
        return cls(samples=tuple(data.get("samples", ())), positions=tuple(data.get("positions", ())))


def hidden_replicates(
    overlap: Series,
    gemm: Series,
    comm: Series,
    *,
    paired: bool,
    n: int = REPLICATES,
    seed: int = 0,
    gemm_ours: Series | None = None,
) -> list[float]:
    """``n`` bootstrap replicates of `hidden` of the medians.

    Each replicate draws as many rounds as a series has, with replacement, then within each drawn round as
    many repeats as it holds, with replacement, and takes the median of what it drew.  ``paired`` (the
    baselines ran in the same rounds as the config): all series draw the same round indices.  Otherwise the
    config's rounds are drawn apart from the baselines' (which were timed together, so they share theirs).
    ``gemm_ours``: our GEMM alone, beside the library's ``gemm``; each replicate scores against the faster
    of the two drawn medians, as `Baselines.gemm_ms` does.  Deterministic for a given ``seed``.
    """
    rng = random.Random(seed)
    rounds = [s.by_round() for s in (overlap, gemm, comm, *([gemm_ours] if gemm_ours is not None else []))]
    paired = paired and len({len(r) for r in rounds}) == 1
    base_rounds = len(rounds[1]) if len({len(r) for r in rounds[1:]}) == 1 else None
    out = []
    for _ in range(n):
        own = [rng.randrange(len(rounds[0])) for _ in rounds[0]]
        if paired:
            picks = [own] * len(rounds)
        elif base_rounds is not None:
            shared = [rng.randrange(base_rounds) for _ in range(base_rounds)]
            picks = [own, *[shared] * (len(rounds) - 1)]
        else:
            picks = [own, *([rng.randrange(len(r)) for _ in r] for r in rounds[1:])]
        medians = [
            statistics.median([x for i in pick for x in rng.choices(series[i], k=len(series[i]))])
            for series, pick in zip(rounds, picks, strict=True)
        ]
        out.append(hidden(medians[0], min([medians[1], *medians[3:]]), medians[2]))
    return out


def percentile_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The central ``confidence`` share of ``values``: their (1-c)/2 and (1+c)/2 quantiles, interpolated
    linearly between neighbouring order statistics (numpy's default quantile)."""
    if len(values) < 2:
        raise ValueError("an interval needs at least two values")
    tail = (1 - confidence) / 2
    lo, hi = (_quantile(sorted(values), q) for q in (tail, 1 - tail))
    return lo, hi


def _quantile(ordered: Sequence[float], q: float) -> float:
    at = q * (len(ordered) - 1)
    i = min(int(at), len(ordered) - 2)
    return ordered[i] + (ordered[i + 1] - ordered[i]) * (at - i)
