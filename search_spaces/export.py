"""From per-slot tuning results to a preset, under the export rule (docs/export.md).

Each slot exports its TE-exact winner: the fastest config TE runs exactly as measured
(`search_spaces.te_exact`), with its measurement, so the entry's number is the one a TE user gets and no
"measured with ..." caveat applies.  A slot without a TE-exact measurement exports the nearest TE entry to its
overall winner and says so first.  The overall winner, our runtime's, is exported in our own format
(`search_spaces.ours`).

NeMo/Megatron YAML and TE's ub_cfgs cannot switch one slot off (a slot left out gets TE's defaults, which
overlap).  So when no overlap (the baseline, none) wins a slot, the preset still carries the slot's best overlap
config, and its note says that no overlap was faster, by how much, and which switch turns that overlap
off.  When a dgrad slot wins with a reduce-scatter dgrad (ring_exchange / pipeline), TE refuses an entry
for its wgrad slot, so that slot is dropped with a note.

For a consumer (`search_spaces.consumers`: megatron, bridge, te-layer, te-modules) the slots the consumer's
switches couple are chosen jointly (`consumers.choose`): each slot exports the TE-exact config of the mode the
chosen switches make it run, and the preset carries the switches (`Preset.setting`), which every format
writes in its header.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from overlap_runtime.config import Method, OverlapConfig, uses_rs_dgrad
from overlap_runtime.errors import InputError
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import ModelShape, Slot
from search_spaces.catalog import RS_DGRAD_WGRAD, off_switch, slot_info
from search_spaces.consumers import (
    Consumer,
    ConsumerChoice,
    Measured,
    Mode,
    SlotModes,
    check,
    choose,
    describe,
    entry_mode,
    why,
)
from search_spaces.presets import Preset
from search_spaces.te_dict import te_config
from search_spaces.te_exact import te_deviations


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotResult:
    """The outcome of tuning one slot: the best config overall, the best one that overlaps, and the best one
    TE runs exactly as measured."""

    best: OverlapConfig
    """The fastest valid config, no overlap included."""
    best_ms: float
    best_overlap: OverlapConfig | None = None
    """The fastest valid config that overlaps (what the preset carries when none wins); may equal best."""
    best_overlap_ms: float | None = None
    te_exact: OverlapConfig | None = None
    """The fastest valid TE-exact config (`te_exact.is_te_exact`): what the preset carries; None when none ran."""
    te_exact_measurement: Measurement | None = None
    modes: SlotModes | None = None
    """The fastest TE-exact config of each mode the slot ran (`consumers.SlotModes`); None: only the TE-exact
    winner's mode, and no overlap where that won, are known (a verdict stored before modes were kept)."""

    def __post_init__(self) -> None:
        if (self.te_exact is None) != (self.te_exact_measurement is None):
            raise InputError("te_exact_measurement", "must be given with te_exact", self.te_exact_measurement)
        if (self.best_overlap is None) != (self.best_overlap_ms is None):
            raise InputError("best_overlap_ms", "must be given with best_overlap", self.best_overlap_ms)
        if self.best_overlap is not None and not self.best_overlap.overlaps:
            method = self.best_overlap.method.value
            raise InputError("best_overlap", f"must be a config that overlaps, not {method}", method)


def preset_from_results(
    shape: ModelShape,
    results: Mapping[Slot, SlotResult],
    *,
    gpu: str | None = None,
    consumer: Consumer | None = None,
    fixed: Mapping[str, bool] | None = None,
) -> Preset:
    """The preset a tuning job exports: each slot's TE-exact winner with its measurement (else the nearest TE
    entry to its winner, saying so), with the export rule's notes.  With a ``consumer``, the slots its
    switches couple take the TE-exact config of the mode the joint choice (``fixed`` switches held) makes them
    run, and the preset carries the switches.  InputError for a ``te_exact`` that TE does not run as measured."""
    configs: dict[Slot, OverlapConfig] = {}
    notes: dict[Slot, str] = {}
    measurements: dict[Slot, Measurement] = {}
    results = {Slot(s): r for s, r in results.items()}
    choice = None if consumer is None else consumer_choice(results, consumer, fixed=fixed)
    if choice is not None and choice.chosen.total_ms is None:
        choice = None  # no mode of the coupled slots was measured (winners stored before modes were kept)
    for slot, result in results.items():
        if choice is not None and _joint(choice, slot, result, shape, configs, notes, measurements):
            continue
        if result.te_exact is not None and result.te_exact_measurement is not None:
            configs[slot] = te_config(slot, _exact(result.te_exact, shape.tp))
            measurements[slot] = result.te_exact_measurement
            _note(notes, slot, _te_exact_note(slot, result, result.te_exact, result.te_exact_measurement))
            continue
        _note(notes, slot, NO_TE_EXACT)
        chosen = result.best
        if not chosen.overlaps:
            if result.best_overlap is None or result.best_overlap_ms is None:
                switch = off_switch(slot, slot_info(slot).default_method)
                _note(
                    notes,
                    slot,
                    f"no overlap was fastest and no overlap config ran; TE's default overlap applies unless turned off with {switch}",
                )
                continue
            chosen = result.best_overlap
            _note(
                notes, slot, _none_won(slot, chosen.method, none_ms=result.best_ms, overlap_ms=result.best_overlap_ms)
            )
        configs[slot] = te_config(slot, chosen)
        _note(notes, slot, _runtime_caveat(chosen, shape.tp))
    for dgrad, wgrad in RS_DGRAD_WGRAD.items():
        if dgrad in configs and uses_rs_dgrad(dgrad, configs[dgrad].method):
            method = configs[dgrad].method.value
            if choice is None:
                _note(
                    notes,
                    dgrad,
                    f"{method} reduce-scatters the dgrad output: run Megatron with --tp-comm-overlap-rs-dgrad (TE ub_overlap_rs_dgrad=True)",
                )
            configs.pop(wgrad, None)
            if wgrad in results:
                notes[wgrad] = (
                    f"left out: TE refuses a {wgrad.value} entry while {dgrad.value} uses {method} (reduce-scatter dgrad)"
                )
    if consumer is None:
        return Preset(configs=configs, shape=shape, gpu=gpu, dtype=shape.dtype, notes=notes, measurements=measurements)
    if choice is None:
        setting = _as_written(consumer, configs, notes, fixed)
        return Preset(
            configs=configs,
            shape=shape,
            gpu=gpu,
            dtype=shape.dtype,
            notes=notes,
            measurements={s: m for s, m in measurements.items() if s in configs},
            consumer=consumer,
            setting=setting,
        )
    return Preset(
        configs=configs,
        shape=shape,
        gpu=gpu,
        dtype=shape.dtype,
        notes=notes,
        measurements=measurements,
        consumer=choice.consumer,
        setting=choice.chosen.setting,
        choice=tuple(describe(choice.alternatives[:ALTERNATIVES_SHOWN], choice.coupled)),
    )


def _as_written(
    consumer: Consumer, configs: dict[Slot, OverlapConfig], notes: dict[Slot, str], fixed: Mapping[str, bool] | None
) -> Mapping[str, bool]:
    """The consumer's switches that run most of the per-slot winners as written (`consumers.check`); an entry it
    cannot run is left out (TE's default takes the slot, in the mode the switches give it) and says why."""
    result = check(consumer, configs, fixed=fixed)
    for run in result.not_as_written:
        notes[run.slot] = f"left out for {consumer.value}: {why(run, consumer, configs)}"
        configs.pop(run.slot)
    return result.setting


def consumer_choice(
    results: Mapping[Slot, SlotResult], consumer: Consumer, *, fixed: Mapping[str, bool] | None = None
) -> ConsumerChoice:
    """The consumer's joint choice over the slots' results (`consumers.choose`)."""
    return choose(consumer, {Slot(slot): _modes_of(Slot(slot), r) for slot, r in results.items()}, fixed=fixed)


ALTERNATIVES_SHOWN = 4
"""The joint choice's alternatives a preset's header lists (fastest first; the chosen one leads)."""


def _modes_of(slot: Slot, result: SlotResult) -> SlotModes:
    """What the slot measured per mode: its modes, or for an older verdict its TE-exact winner's mode alone."""
    if result.modes is not None:
        return result.modes
    if result.te_exact is None or result.te_exact_measurement is None:
        return SlotModes(by_mode={})
    exact = Measured(config=result.te_exact, measurement=result.te_exact_measurement)
    return SlotModes(by_mode={entry_mode(slot, result.te_exact): exact})


def _joint(
    choice: ConsumerChoice,
    slot: Slot,
    result: SlotResult,
    shape: ModelShape,
    configs: dict[Slot, OverlapConfig],
    notes: dict[Slot, str],
    measurements: dict[Slot, Measurement],
) -> bool:
    """Export ``slot`` as the consumer's choice makes it run; False to leave it to the per-slot rule (a slot the
    choice does not couple, or whose chosen mode has no TE-exact measurement)."""
    mode = choice.chosen.modes.get(slot)
    entry = choice.entries.get(slot)
    if slot not in choice.coupled or mode is None:
        return False
    if entry is not None:
        configs[slot] = te_config(slot, _exact(entry.config, shape.tp))
        measurements[slot] = entry.measurement
        _note(notes, slot, _te_exact_note(slot, result, entry.config, entry.measurement))
        if mode == Mode.RS_DGRAD:
            _note(
                notes, slot, f"runs a reduce-scatter dgrad under the switches in the header ({choice.consumer.value})"
            )
        return True
    if mode == Mode.NO_COMM:
        notes[slot] = (
            f"left out: its dgrad reduce-scatters under the switches in the header ({choice.consumer.value}), and TE refuses a {slot.value} entry then"
        )
        return True
    if mode == Mode.OFF:
        _note(
            notes,
            slot,
            f"overlap off under the switches in the header ({choice.consumer.value}: {choice.chosen.label()})",
        )
        return False  # the entry still says how it would overlap, as for a slot no overlap won
    return False


NO_TE_EXACT = (
    "no TE-exact config was measured for this slot: this entry is the nearest TE config to our runtime's winner"
)
"""The note that opens a slot exported without a TE-exact measurement (a winner stored before both winners
were kept, or a slot where no TE-exact config ran correctly)."""


def measured_text(measurement: Measurement) -> str:
    """A measurement's numbers on one line, as the export's notes give them."""
    return (
        f"overlap {measurement.overlap_ms:.4g} ms, serial {measurement.serial_ms:.4g} ms, "
        f"exposed {measurement.exposed_ms:.3g} ms, spread {measurement.cv:.1%} over {measurement.repeats} repeats"
    )


def _exact(config: OverlapConfig, tp: int) -> OverlapConfig:
    differs = te_deviations(config, tp)
    if differs:
        raise InputError("te_exact", f"must be a config TE runs as measured, but it has {differs[0]}", config.to_dict())
    return config


def _te_exact_note(slot: Slot, result: SlotResult, config: OverlapConfig, measurement: Measurement) -> str:
    """The TE-exact winner's numbers, and what beat it: no overlap (with the switch), or our runtime's winner."""
    text = f"TE-exact: {measured_text(measurement)}"
    te_ms = measurement.overlap_ms
    if not result.best.overlaps and result.best_ms < te_ms:
        return f"{text}; {_none_won(slot, config.method, none_ms=result.best_ms, overlap_ms=te_ms)}"
    if result.best != config and result.best_ms < te_ms:
        share = 100.0 * (te_ms - result.best_ms) / te_ms if te_ms > 0 else 0.0
        return f"{text}; our runtime's winner ran {result.best_ms:.4g} ms ({share:.1f}% faster, export format ours)"
    return text


def _note(notes: dict[Slot, str], slot: Slot, text: str) -> None:
    if text:
        notes[slot] = f"{notes[slot]}; {text}" if slot in notes else text


def _none_won(slot: Slot, method: Method, *, none_ms: float, overlap_ms: float) -> str:
    gain = overlap_ms - none_ms
    share = 100.0 * gain / overlap_ms if overlap_ms > 0 else 0.0
    return (
        f"no overlap was {gain:.3g} ms ({share:.1f}%) faster than this config ({none_ms:.3g} vs {overlap_ms:.3g} ms); "
        f"turn this overlap off with {off_switch(slot, method)}"
    )


def _runtime_caveat(config: OverlapConfig, tp: int) -> str:
    """What TE runs differently from what was measured (`te_exact.te_deviations`)."""
    differs = te_deviations(config, tp)
    return f"measured with {' and '.join(str(d) for d in differs)}" if differs else ""
