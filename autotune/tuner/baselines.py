"""The configs every study measures first: its sampler (`autotune.tuner.sampler`) proposes them before any other.

They answer the questions a user asks before "what is best": is overlap worth it at all (no overlap), what
does TE do by itself (its default), what would copying NVIDIA's nearest preset give (or one we tuned
before), and do the winners of neighbouring shapes carry over (warm start).  They also seed TPE with good
points, which is most of why it needs few trials.  A baseline that cannot run here (a preset knob the
runtime lacks) or lies outside the space is skipped, and the reason is kept for the report; a config that a
job asked to measure first only needs to run here (the study measures one outside the space as given).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from autotune.tuner.gpu import preset_gpu_name
from overlap_runtime.config import NO_OVERLAP, OverlapConfig
from overlap_runtime.errors import InputError
from search_spaces.defaults import as_runnable, substitutions, te_default
from search_spaces.registry import PresetRegistry
from search_spaces.space import SlotSpace

NONE = "none"
TE_DEFAULT = "te_default"
PRESET = "preset"
MEASURE_FIRST = "measure_first"
WARM_START = "warm_start"


@dataclass(frozen=True, kw_only=True, slots=True)
class Baseline:
    """One config to measure first, and every reason it is a baseline (TE's default may also be the preset's)."""

    config: OverlapConfig
    labels: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Baselines:
    configs: tuple[Baseline, ...]
    """Distinct configs in this order: none, TE default, preset, the configs to measure first, warm starts
    (the sampler proposes those of the space in this order; any outside it wait, enqueued, ahead of them)."""
    skipped: tuple[str, ...]
    """One line per baseline left out, saying why."""
    caveats: tuple[str, ...] = ()
    """One line per baseline measured as the nearest runnable equivalent of what its source says (a TE preset's
    atomic GEMM, `search_spaces.defaults.substitutions`)."""

    def to_dict(self) -> dict[str, Any]:
        """The study user attr ``baselines``: written when the study is created, read back on every restart."""
        listed = [{"config": b.config.to_dict(), "labels": list(b.labels)} for b in self.configs]
        return {"configs": listed, "skipped": list(self.skipped), "caveats": list(self.caveats)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Baselines:
        configs = (
            Baseline(config=OverlapConfig.from_dict(b["config"]), labels=tuple(b["labels"])) for b in data["configs"]
        )
        # studies created before caveats were kept have none
        return cls(configs=tuple(configs), skipped=tuple(data["skipped"]), caveats=tuple(data.get("caveats", ())))


def baselines(
    space: SlotSpace,
    *,
    gpu: str,
    measure_first: Sequence[OverlapConfig] = (),
    warm_start: Sequence[OverlapConfig] = (),
    registry: PresetRegistry | None = None,
) -> Baselines:
    """The baselines of ``space``'s slot on ``gpu``, deduplicated, each checked against the space (the
    configs to measure first only against the runtime's rules, `SlotSpace.check`); the preset is the nearest of
    ``registry`` (None: NVIDIA's presets)."""
    preset_caveats: list[str] = []

    def preset() -> OverlapConfig:
        config, caveats = nearest_preset(space, gpu=gpu, registry=registry)
        preset_caveats.extend(caveats)
        return config

    sources: list[tuple[str, Callable[[], OverlapConfig]]] = [
        (NONE, lambda: NO_OVERLAP),
        (TE_DEFAULT, partial(te_default, space.shape, space.slot, backend=space.backend, limits=space.limits)),
        (PRESET, preset),
    ]
    sources += [(MEASURE_FIRST, partial(_given, given)) for given in measure_first]
    sources += [(WARM_START, partial(_given, given)) for given in warm_start]
    found: dict[OverlapConfig, list[str]] = {}
    skipped: list[str] = []
    for label, make in sources:
        try:
            config = make()
            space.check(config)
        except InputError as e:
            skipped.append(f"{label}: {e}")
            continue
        if config not in space and label != MEASURE_FIRST:
            skipped.append(f"{label}: {config.to_dict()} is not in the search space of {space.slot.value}")
            continue
        found.setdefault(config, []).append(label)
    measured = {label for labels in found.values() for label in labels}
    return Baselines(
        configs=tuple(Baseline(config=c, labels=tuple(labels)) for c, labels in found.items()),
        skipped=tuple(skipped),
        caveats=tuple(preset_caveats) if PRESET in measured else (),
    )


def _given(config: OverlapConfig) -> OverlapConfig:
    return config


def nearest_preset_config(space: SlotSpace, *, gpu: str) -> OverlapConfig:
    """The nearest known preset's entry for the slot, as a runtime config (InputError when there is none)."""
    return nearest_preset(space, gpu=gpu)[0]


def nearest_preset(
    space: SlotSpace, *, gpu: str, registry: PresetRegistry | None = None
) -> tuple[OverlapConfig, tuple[str, ...]]:
    """`nearest_preset_config` and its caveats: one line per knob scored as its nearest runnable equivalent.
    ``registry``: where the presets come from (None: NVIDIA's, `search_spaces.registry.nearest`)."""
    registry = registry or PresetRegistry.with_nvidia()
    preset, distance = registry.nearest(space.shape, gpu=preset_gpu_name(gpu), dtype=space.shape.dtype)
    entry = preset.configs.get(space.slot)
    where = f"{preset.source} (distance {distance:.2f})"
    if entry is None:
        raise InputError(where, f"has no entry for {space.slot.value}")
    try:
        config = as_runnable(space.shape, space.slot, entry, backend=space.backend, limits=space.limits)
    except InputError as e:
        raise InputError(where, f"is not runnable here ({e})") from None
    return config, tuple(f"{PRESET}: {where} {space.slot.value}: {line}" for line in substitutions(space.shape, entry))
