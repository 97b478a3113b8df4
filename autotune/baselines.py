"""The configs every study measures first: its sampler (`autotune.sampler`) proposes them before any other.

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

from autotune.gpu import preset_gpu_name
from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.errors import InputError
from search_spaces.defaults import as_runnable, te_default
from search_spaces.registry import nearest
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

    def to_dict(self) -> dict[str, Any]:
        """The study user attr ``baselines``: written when the study is created, read back on every restart."""
        listed = [{"config": b.config.to_dict(), "labels": list(b.labels)} for b in self.configs]
        return {"configs": listed, "skipped": list(self.skipped)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Baselines:
        configs = (
            Baseline(config=OverlapConfig.from_dict(b["config"]), labels=tuple(b["labels"])) for b in data["configs"]
        )
        return cls(configs=tuple(configs), skipped=tuple(data["skipped"]))


def baselines(
    space: SlotSpace,
    *,
    gpu: str,
    measure_first: Sequence[OverlapConfig] = (),
    warm_start: Sequence[OverlapConfig] = (),
) -> Baselines:
    """The baselines of ``space``'s slot on ``gpu``, deduplicated, each checked against the space (the
    configs to measure first only against the runtime's rules, `SlotSpace.check`)."""
    sources: list[tuple[str, Callable[[], OverlapConfig]]] = [
        (NONE, lambda: OverlapConfig(method=Method.NONE)),
        (TE_DEFAULT, partial(te_default, space.shape, space.slot, backend=space.backend, limits=space.limits)),
        (PRESET, partial(nearest_preset_config, space, gpu=gpu)),
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
    return Baselines(
        configs=tuple(Baseline(config=c, labels=tuple(labels)) for c, labels in found.items()),
        skipped=tuple(skipped),
    )


def _given(config: OverlapConfig) -> OverlapConfig:
    return config


def nearest_preset_config(space: SlotSpace, *, gpu: str) -> OverlapConfig:
    """The nearest known preset's entry for the slot, as a runtime config (InputError when there is none)."""
    preset, distance = nearest(space.shape, gpu=preset_gpu_name(gpu), dtype=space.shape.dtype)
    entry = preset.configs.get(space.slot)
    where = f"{preset.source} (distance {distance:.2f})"
    if entry is None:
        raise InputError(where, f"has no entry for {space.slot.value}")
    try:
        return as_runnable(space.shape, space.slot, entry, backend=space.backend, limits=space.limits)
    except InputError as e:
        raise InputError(where, f"is not runnable here ({e})") from None
