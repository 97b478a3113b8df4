"""The decision for one slot, and the gains it is worth, as the CLI table and the service report them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from overlap_runtime.config import OverlapConfig
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import Slot
from search_spaces.consumers import Measured, Mode, SlotModes
from search_spaces.export import SlotResult


@dataclass(frozen=True, kw_only=True)
class SlotOutcome:
    """The winner of one slot, measured interleaved beside the other finalists, and what it beat.

    Every measurement here comes from the finalist batch (same rounds, same moments), so the gains compare
    numbers taken together; only when the finalists could not be re-measured do they come from the search,
    and ``notes`` says so.
    """

    slot: Slot
    best: OverlapConfig
    """The fastest valid config; no overlap when nothing overlapping was faster."""
    best_measurement: Measurement
    best_overlap: OverlapConfig | None
    """The fastest valid config that overlaps (what a preset carries when none wins); may equal best."""
    best_overlap_measurement: Measurement | None
    te_default_measurement: Measurement | None
    """TE's default config for the slot, re-measured with the finalists; None when it failed or was not run."""
    spread: float
    """The winner's cv over its finalist repeats (std / mean)."""
    n_trials: int
    """Configs measured during the search (baselines included, duplicates and finalists not)."""
    n_failed: int
    """Of those, configs that crashed, hung or computed wrong numbers."""
    te_exact: OverlapConfig | None = None
    """The fastest valid config that TE runs exactly as measured (`search_spaces.te_exact`): what the TE
    exports carry; may equal best; None when no TE-exact config ran correctly."""
    te_exact_measurement: Measurement | None = None
    modes: Mapping[Mode, Measured] = field(default_factory=dict)
    """The fastest TE-exact config of each mode the slot ran (`search_spaces.consumers.Mode`: bulk or
    reduce-scatter for qkv/fc1 dgrad, its overlap elsewhere, and no overlap as off): what a consumer's joint
    choice picks from.  Empty in a verdict stored before modes were kept."""
    notes: tuple[str, ...] = ()
    """Why a baseline was skipped, why the finalists were not re-measured, ..."""

    @property
    def gain_vs_te_default(self) -> float | None:
        """Share of TE's default time saved by the winner (0.2 = 20% faster); None without a TE default."""
        if self.te_default_measurement is None:
            return None
        return _saved(self.te_default_measurement.overlap_ms, self.best_measurement.overlap_ms)

    @property
    def gain_vs_serial(self) -> float:
        """Share of the serial (collective then GEMM) time saved by the winner."""
        return _saved(self.best_measurement.serial_ms, self.best_measurement.overlap_ms)

    def slot_result(self) -> SlotResult:
        """What `search_spaces.export.preset_from_results` needs from this slot."""
        overlap = self.best_overlap_measurement
        return SlotResult(
            best=self.best,
            best_ms=self.best_measurement.overlap_ms,
            best_overlap=self.best_overlap,
            best_overlap_ms=None if overlap is None else overlap.overlap_ms,
            te_exact=self.te_exact,
            te_exact_measurement=self.te_exact_measurement,
            modes=SlotModes(by_mode=self.modes) if self.modes else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot.value,
            "best": self.best.to_dict(),
            "best_measurement": self.best_measurement.to_dict(),
            "best_overlap": _optional(self.best_overlap),
            "best_overlap_measurement": _optional(self.best_overlap_measurement),
            "te_default_measurement": _optional(self.te_default_measurement),
            "te_exact": _optional(self.te_exact),
            "te_exact_measurement": _optional(self.te_exact_measurement),
            "modes": {
                mode.value: {"config": m.config.to_dict(), "measurement": m.measurement.to_dict()}
                for mode, m in self.modes.items()
            },
            "spread": self.spread,
            "n_trials": self.n_trials,
            "n_failed": self.n_failed,
            "notes": list(self.notes),
            "gain_vs_te_default": self.gain_vs_te_default,
            "gain_vs_serial": self.gain_vs_serial,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SlotOutcome:
        def measurement(key: str) -> Measurement | None:
            return None if data.get(key) is None else Measurement.from_dict(data[key])

        return cls(
            slot=Slot(data["slot"]),
            best=OverlapConfig.from_dict(data["best"]),
            best_measurement=Measurement.from_dict(data["best_measurement"]),
            best_overlap=None if data.get("best_overlap") is None else OverlapConfig.from_dict(data["best_overlap"]),
            best_overlap_measurement=measurement("best_overlap_measurement"),
            te_default_measurement=measurement("te_default_measurement"),
            te_exact=None if data.get("te_exact") is None else OverlapConfig.from_dict(data["te_exact"]),
            te_exact_measurement=measurement("te_exact_measurement"),
            modes={
                Mode(mode): Measured(
                    config=OverlapConfig.from_dict(m["config"]), measurement=Measurement.from_dict(m["measurement"])
                )
                for mode, m in (data.get("modes") or {}).items()
            },
            spread=float(data["spread"]),
            n_trials=int(data["n_trials"]),
            n_failed=int(data["n_failed"]),
            notes=tuple(data.get("notes", ())),
        )


class TeExactColumns(TypedDict):
    te_exact_config: dict[str, Any] | None
    te_exact_measurement: dict[str, Any] | None


def te_exact_columns(outcome: SlotOutcome) -> TeExactColumns:
    """The TE-exact winner as `storage.upsert_best` takes it (``te_exact_config``, ``te_exact_measurement``)."""
    return TeExactColumns(
        te_exact_config=_optional(outcome.te_exact), te_exact_measurement=_optional(outcome.te_exact_measurement)
    )


def _saved(before_ms: float, after_ms: float) -> float:
    return (before_ms - after_ms) / before_ms if before_ms > 0 else 0.0


def _optional(value: OverlapConfig | Measurement | None) -> dict[str, Any] | None:
    return None if value is None else value.to_dict()
