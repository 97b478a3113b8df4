"""A unit of work the tuner hands out: configs to measure on one slot, and how often.

A proposal is plain data so the service can store it in its trial row, hand it to a worker over REST and
give it back to `SlotStudy.tell` after a controller restart: `to_dict` / `from_dict` round-trip exactly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from overlap_runtime.config import OverlapConfig
from overlap_runtime.errors import InputError
from overlap_runtime.measurement import BaselineSource


class Purpose(enum.StrEnum):
    """Why the tuner wants the measurement; the service stores it in each trial row (`storage.Trial.purpose`)."""

    BASELINE = "baseline"
    """A known config measured before the search's own: no overlap, TE's default, a preset, a warm start."""
    SEARCH = "search"
    """Any other config the sampler proposed: its model's, or a local move."""
    FINALIST = "finalist"
    """The top configs re-measured together, interleaved, before the winner is declared."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Proposal:
    """Configs to measure for one slot: one for a baseline or search trial, several for the finalists."""

    number: int
    """The Optuna trial this proposal tells into (finalists too: their batch holds a trial of its own)."""
    configs: tuple[OverlapConfig, ...]
    """Measure these together (``measure_many``), in this order; finalists interleaved over ``rounds``."""
    purpose: Purpose
    repeats: int
    """Timed repeats per config and round."""
    rounds: int = 1
    """Interleaved rounds (A B C A B C ...): 1 except for finalists."""
    labels: tuple[str, ...] = ()
    """A baseline's reasons (`autotune.tuner.baselines`: ``none``, ``te_default``, ``preset``, ...), so whoever shows
    a trial (the dashboard) can say it is TE's default or NVIDIA's preset; empty for any other proposal."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "purpose", Purpose(self.purpose))
        object.__setattr__(self, "configs", tuple(self.configs))
        object.__setattr__(self, "labels", tuple(self.labels))
        if not self.configs:
            raise InputError("configs", "must hold at least one config")
        for name in ("repeats", "rounds"):
            if getattr(self, name) < 1:
                raise InputError(name, "must be a positive integer", getattr(self, name))

    @property
    def baselines(self) -> BaselineSource:
        """The finalists, whose numbers decide and are reported, are scored against baselines timed in their
        own rounds; a baseline or search trial, which only ranks, against the cheaper cached ones."""
        return BaselineSource.SAME_ROUNDS if self.purpose == Purpose.FINALIST else BaselineSource.CACHED

    def to_dict(self) -> dict[str, Any]:
        """The proposal as JSON; ``labels`` only when there are some, so other proposals read as they always did."""
        out: dict[str, Any] = {
            "number": self.number,
            "configs": [c.to_dict() for c in self.configs],
            "purpose": self.purpose.value,
            "repeats": self.repeats,
            "rounds": self.rounds,
        }
        if self.labels:
            out["labels"] = list(self.labels)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Proposal:
        try:
            return cls(
                number=int(data["number"]),
                configs=tuple(OverlapConfig.from_dict(c) for c in data["configs"]),
                purpose=Purpose(data["purpose"]),
                repeats=int(data["repeats"]),
                rounds=int(data.get("rounds", 1)),
                labels=tuple(str(label) for label in data.get("labels", ())),
            )
        except KeyError as e:
            raise InputError(f"proposal.{e.args[0]}", "is required") from None
        except ValueError as e:
            if isinstance(e, InputError):
                raise
            raise InputError("proposal", str(e)) from None
