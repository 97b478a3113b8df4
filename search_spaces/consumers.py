"""Who runs a preset, and with which switches: Megatron-LM, Megatron-Bridge, te.TransformerLayer, TE modules.

A ``ub_cfgs`` preset says *how* each slot overlaps.  *Whether* a slot overlaps, and whether qkv_dgrad and
fc1_dgrad run bulk or reduce-scatter, is decided by each TE module's own arguments (`Arg`), and every
consumer sets those arguments its own way (docs/te_rules.md, Consumers):

- ``megatron`` (Megatron-LM) passes one TransformerConfig field each to every module alike, with
  ``tp_comm_overlap_disable_qkv`` / ``_fc1`` as the only per-layer exceptions (config fields, no CLI flag);
- ``bridge`` (Megatron-Bridge and NeMo 2) applies its dataclass preset and leaves the same fields to the
  model config;
- ``te-layer`` (``te.TransformerLayer``) takes one set of arguments for all its modules;
- ``te-modules`` (hand-built ``LayerNormLinear`` / ``Linear`` modules, Megatron's TE spec) takes them per module.

So a preset with qkv_dgrad bulk beside fc1_dgrad reduce-scatter cannot run as measured in Megatron-LM: the
modes of the coupled slots are a joint choice.  `choose` makes it from what each slot measured per mode
(`SlotModes`), over every setting of the consumer's `Switch`es, and `check` says what a consumer runs of a
preset as written.  Each rule below cites its source in `RULES`, and docs/te_rules.md lists them.
"""

from __future__ import annotations

import enum
import functools
import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from overlap_runtime.config import OverlapConfig, uses_rs_dgrad
from overlap_runtime.errors import InputError
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import Slot
from search_spaces.catalog import RS_DGRAD_WGRAD, SLOT_ORDER, slot_info, suggest


class Consumer(enum.StrEnum):
    MEGATRON = "megatron"
    BRIDGE = "bridge"
    TE_LAYER = "te-layer"
    TE_MODULES = "te-modules"


CONSUMER_HELP = {
    Consumer.MEGATRON: "Megatron-LM: --tp-comm-overlap-cfg plus its CLI flags and TransformerConfig fields",
    Consumer.BRIDGE: "Megatron-Bridge / NeMo 2: CommOverlapConfig plus the model config's tp_comm_* fields",
    Consumer.TE_LAYER: "te.TransformerLayer: one set of ub_* arguments for all its modules",
    Consumer.TE_MODULES: "hand-built TE modules (LayerNormLinear, Linear): ub_* arguments per module",
}


class Module(enum.StrEnum):
    """A TE module of a transformer layer, by its ``ub_name``."""

    QKV = "qkv"
    PROJ = "proj"
    FC1 = "fc1"
    FC2 = "fc2"


COLUMN = (Module.QKV, Module.FC1)
"""Column-parallel modules (LayerNormLinear): all-gather before fprop, bulk or RS-dgrad in backward."""
ROW = (Module.PROJ, Module.FC2)
"""Row-parallel modules (Linear): reduce-scatter after fprop, all-gather of dY before dgrad."""


class Arg(enum.StrEnum):
    """A TE module's userbuffers argument."""

    AG = "ub_overlap_ag"
    RS = "ub_overlap_rs"
    RS_DGRAD = "ub_overlap_rs_dgrad"
    BULK_DGRAD = "ub_bulk_dgrad"
    BULK_WGRAD = "ub_bulk_wgrad"


MODULE_ARGS: Mapping[Module, tuple[Arg, ...]] = MappingProxyType(
    {m: (Arg.AG, Arg.RS_DGRAD, Arg.BULK_DGRAD, Arg.BULK_WGRAD) for m in COLUMN} | {m: (Arg.AG, Arg.RS) for m in ROW}
)
"""The arguments a module of each kind reads (a column module ignores ub_overlap_rs, a row module the rest)."""


class Mode(enum.StrEnum):
    """How a slot runs under its module's arguments."""

    OVERLAP = "overlap"
    """Its own overlap: the ring/pipeline all-gather or reduce-scatter of its entry."""
    BULK = "bulk"
    """qkv/fc1 dgrad and wgrad: bulk overlap of an independent collective."""
    RS_DGRAD = "rs_dgrad"
    """qkv/fc1 dgrad: the dgrad GEMM pipelined with the reduce-scatter of its output."""
    OFF = "off"
    """No userbuffers overlap: the module runs the plain collective."""
    NO_COMM = "no_comm"
    """qkv/fc1 wgrad beside an RS-dgrad: the reduce-scatter moved into the dgrad, the wgrad GEMM runs alone."""


def _slot(module: Module, gemm: str) -> Slot:
    return Slot(f"{module.value}_{gemm}")


def slot_modes(args: Mapping[Module, Mapping[Arg, bool]]) -> dict[Slot, Mode]:
    """What each tuned slot runs under its modules' arguments (TE's module rule, `RULES` te-module-mode)."""
    modes: dict[Slot, Mode] = {}
    for module in COLUMN:
        on = args[module]
        modes[_slot(module, "fprop")] = Mode.OVERLAP if on[Arg.AG] else Mode.OFF
        if on[Arg.RS_DGRAD]:  # TE turns both bulk arguments off under ub_overlap_rs_dgrad
            modes[_slot(module, "dgrad")], modes[_slot(module, "wgrad")] = Mode.RS_DGRAD, Mode.NO_COMM
        else:
            modes[_slot(module, "dgrad")] = Mode.BULK if on[Arg.BULK_DGRAD] else Mode.OFF
            modes[_slot(module, "wgrad")] = Mode.BULK if on[Arg.BULK_WGRAD] else Mode.OFF
    for module in ROW:
        modes[_slot(module, "fprop")] = Mode.OVERLAP if args[module][Arg.RS] else Mode.OFF
        modes[_slot(module, "dgrad")] = Mode.OVERLAP if args[module][Arg.AG] else Mode.OFF
    return {slot: modes[slot] for slot in SLOT_ORDER if slot in modes}


def entry_mode(slot: Slot, config: OverlapConfig) -> Mode:
    """The mode a ub_cfgs entry asks for: RS-dgrad for a dgrad slot under any method but bulk, bulk for the
    bulk slots, the slot's own overlap otherwise."""
    if uses_rs_dgrad(slot, config.method):
        return Mode.RS_DGRAD
    bulk = {_slot(module, gemm) for module in COLUMN for gemm in ("dgrad", "wgrad")}
    return Mode.BULK if Slot(slot) in bulk else Mode.OVERLAP


@dataclass(frozen=True, kw_only=True, slots=True)
class Switch:
    """One setting a consumer exposes that sets TE module arguments."""

    name: str
    """The consumer's own name: a TransformerConfig field (megatron, bridge) or a TE argument."""
    default: bool
    modules: tuple[Module, ...]
    """The modules whose arguments it sets."""
    sets: tuple[Arg, ...]
    """The arguments it sets to its value; a `disables` switch turns them off instead when true."""
    disables: bool = False
    flag: str | None = None
    """Megatron-LM's CLI flag that gives the non-default value; None where there is none."""

    def __post_init__(self) -> None:
        for module in self.modules:
            unread = [arg for arg in self.sets if arg not in MODULE_ARGS[module]]
            if unread:
                raise InputError("sets", f"{module.value} reads no {unread[0].value}", self.name)


def _megatron_switches(*, flags: bool) -> tuple[Switch, ...]:
    """Megatron-LM's TransformerConfig fields (docs/te_rules.md, Consumers); Bridge sets the same fields on
    its model config and has no flags."""

    def flag(text: str) -> str | None:
        return text if flags else None

    all_modules = (*COLUMN, *ROW)
    return (
        Switch(name="tp_comm_overlap_ag", default=True, modules=all_modules, sets=(Arg.AG,), flag=flag("--disable-tp-comm-overlap-ag")),
        Switch(name="tp_comm_overlap_rs", default=True, modules=ROW, sets=(Arg.RS,), flag=flag("--disable-tp-comm-overlap-rs")),
        Switch(name="tp_comm_overlap_rs_dgrad", default=False, modules=COLUMN, sets=(Arg.RS_DGRAD,), flag=flag("--tp-comm-overlap-rs-dgrad")),
        Switch(name="tp_comm_bulk_dgrad", default=True, modules=COLUMN, sets=(Arg.BULK_DGRAD,), flag=flag("--disable-tp-comm-bulk-dgrad")),
        Switch(name="tp_comm_bulk_wgrad", default=True, modules=COLUMN, sets=(Arg.BULK_WGRAD,), flag=flag("--disable-tp-comm-bulk-wgrad")),
        Switch(name="tp_comm_overlap_disable_qkv", default=False, modules=(Module.QKV,), sets=(Arg.AG, Arg.RS_DGRAD), disables=True),
        Switch(name="tp_comm_overlap_disable_fc1", default=False, modules=(Module.FC1,), sets=(Arg.AG, Arg.RS_DGRAD), disables=True),
    )  # fmt: skip


def _te_layer_switches() -> tuple[Switch, ...]:
    """``te.TransformerLayer``'s arguments, passed to all its modules alike (its defaults)."""
    defaults = {Arg.AG: True, Arg.RS: True, Arg.RS_DGRAD: False, Arg.BULK_DGRAD: True, Arg.BULK_WGRAD: True}
    return tuple(
        Switch(name=arg.value, default=default, modules=tuple(m for m in Module if arg in MODULE_ARGS[m]), sets=(arg,))
        for arg, default in defaults.items()
    )


def _te_modules_switches() -> tuple[Switch, ...]:
    """Each module's own arguments (TE's module defaults are all off: a hand-built module overlaps only what it
    is told to)."""
    return tuple(
        Switch(name=f"{module.value}.{arg.value}", default=False, modules=(module,), sets=(arg,))
        for module in Module
        for arg in MODULE_ARGS[module]
    )


SWITCHES: Mapping[Consumer, tuple[Switch, ...]] = MappingProxyType(
    {
        Consumer.MEGATRON: _megatron_switches(flags=True),
        Consumer.BRIDGE: _megatron_switches(flags=False),
        Consumer.TE_LAYER: _te_layer_switches(),
        Consumer.TE_MODULES: _te_modules_switches(),
    }
)

Setting = Mapping[str, bool]
"""A value for each of a consumer's switches, by name."""


def defaults(consumer: Consumer) -> dict[str, bool]:
    return {s.name: s.default for s in SWITCHES[consumer]}


def module_args(consumer: Consumer, setting: Setting) -> dict[Module, dict[Arg, bool]]:
    """The TE arguments each module gets under ``setting`` (switches it leaves out at their defaults): the
    plain switches first, then the per-layer ones that turn arguments off (Megatron applies them last)."""
    values = defaults(consumer) | dict(setting)
    args = {module: dict.fromkeys(MODULE_ARGS[module], False) for module in Module}
    ordered = sorted(SWITCHES[consumer], key=lambda s: s.disables)
    for switch in ordered:
        for module in switch.modules:
            for arg in switch.sets:
                if not switch.disables:
                    args[module][arg] = values[switch.name]
                elif values[switch.name]:
                    args[module][arg] = False
    return args


def parse_setting(consumer: Consumer, given: Mapping[str, object]) -> dict[str, bool]:
    """``given`` switch values checked against the consumer's switches (InputError naming the switch)."""
    names = [s.name for s in SWITCHES[consumer]]
    setting: dict[str, bool] = {}
    for name, value in given.items():
        if name not in names:
            raise InputError("switch", f"{consumer.value} has no switch {name}{suggest(name, names)}", name)
        if not isinstance(value, bool):
            raise InputError(f"switch.{name}", "must be true or false", value)
        setting[name] = value
    return setting


def settings(consumer: Consumer, fixed: Setting | None = None) -> Iterator[dict[str, bool]]:
    """Every setting of the consumer's switches (``fixed`` ones held), those closest to its defaults first,
    one per distinct set of slot modes: a setting that changes nothing more is never offered."""
    for setting, _ in _alternatives(consumer, tuple(sorted((fixed or {}).items()))):
        yield dict(setting)


@functools.lru_cache(maxsize=64)
def _alternatives(
    consumer: Consumer, fixed: tuple[tuple[str, bool], ...]
) -> tuple[tuple[Mapping[str, bool], Mapping[Slot, Mode]], ...]:
    """`settings` with the slot modes of each, computed once per consumer and fixed switches (te-modules has
    4096 settings to walk)."""
    held = dict(fixed)
    switches = [s for s in SWITCHES[consumer] if s.name not in held]
    base = defaults(consumer) | held
    candidates = (
        base | {s.name: not s.default for s in flipped}
        for n in range(len(switches) + 1)
        for flipped in itertools.combinations(switches, n)
    )
    found: dict[tuple[Mode, ...], tuple[Mapping[str, bool], Mapping[Slot, Mode]]] = {}
    for setting in candidates:
        modes = slot_modes(module_args(consumer, setting))
        found.setdefault(tuple(modes.values()), (MappingProxyType(setting), MappingProxyType(modes)))
    return tuple(found.values())


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    """A consumer rule this module encodes, with the source it was read from (docs/te_rules.md, Consumers)."""

    id: str
    consumers: tuple[Consumer, ...]
    text: str
    source: str
    """``repository@commit:path:lines``."""


TE = "NVIDIA/TransformerEngine@d0067d0"
MEGATRON = "NVIDIA/Megatron-LM@d98e8a6"
BRIDGE = "NVIDIA-NeMo/Megatron-Bridge@067f987"

RULES: tuple[Rule, ...] = (
    Rule(id="rs-dgrad-entry", consumers=tuple(Consumer), text="a ub_cfgs entry for qkv_dgrad or fc1_dgrad whose method is not bulk makes that slot a reduce-scatter, and an entry for its wgrad then raises ValueError", source=f"{TE}:transformer_engine/pytorch/module/base.py:516-536"),
    Rule(id="te-module-mode", consumers=tuple(Consumer), text="a module's own arguments decide what its slots run; ub_overlap_rs_dgrad turns ub_bulk_dgrad and ub_bulk_wgrad off", source=f"{TE}:transformer_engine/pytorch/module/layernorm_linear.py:1389-1405; layernorm_mlp.py:2035-2042"),
    Rule(id="rs-dgrad-on-bulk", consumers=tuple(Consumer), text="a reduce-scatter dgrad on a communicator built as bulk silently runs a pipelined GEMM+RS with the bulk entry's num_sm and num_splits", source=f"{TE}:transformer_engine/common/comm_gemm_overlap/comm_gemm_overlap.cpp (CommOverlapBase serves bulk and pipeline alike); layernorm_linear.py:695-703"),
    Rule(id="bulk-on-ring", consumers=tuple(Consumer), text="a bulk dgrad on a ring_exchange communicator raises NVTE_ERROR('Operation not supported.')", source=f"{TE}:transformer_engine/common/include/transformer_engine/comm_gemm_overlap.h:298-303"),
    Rule(id="shared-dgrad-mode", consumers=(Consumer.MEGATRON, Consumer.BRIDGE, Consumer.TE_LAYER), text="qkv and fc1 get the same ub_overlap_rs_dgrad, ub_bulk_dgrad and ub_bulk_wgrad (Megatron: tp_comm_overlap_rs_dgrad, tp_comm_bulk_dgrad, tp_comm_bulk_wgrad; te.TransformerLayer: its own arguments)", source=f"{MEGATRON}:megatron/core/extensions/transformer_engine.py:1456-1472; {TE}:transformer_engine/pytorch/transformer.py:338-368"),
    Rule(id="shared-ag-rs", consumers=(Consumer.MEGATRON, Consumer.BRIDGE, Consumer.TE_LAYER), text="every module gets the same ub_overlap_ag and ub_overlap_rs (tp_comm_overlap_ag, tp_comm_overlap_rs)", source=f"{MEGATRON}:megatron/core/extensions/transformer_engine.py:1189-1200, 1462-1466"),
    Rule(id="per-layer-disable", consumers=(Consumer.MEGATRON, Consumer.BRIDGE), text="tp_comm_overlap_disable_qkv / _fc1 turn that layer's ub_overlap_ag and ub_overlap_rs_dgrad off, and have no CLI flag", source=f"{MEGATRON}:megatron/core/extensions/transformer_engine.py:1473-1479; megatron/training/arguments.py:2313-2314"),
    Rule(id="megatron-flags", consumers=(Consumer.MEGATRON,), text="the TransformerConfig fields become flags: --tp-comm-overlap-rs-dgrad, --disable-tp-comm-bulk-dgrad, --disable-tp-comm-bulk-wgrad, --disable-tp-comm-overlap-ag, --disable-tp-comm-overlap-rs; --tp-comm-overlap-cfg goes to TE as is", source=f"{MEGATRON}:megatron/core/model_parallel_config.py:265-335; megatron/training/argument_utils.py:189-196; megatron/training/initialize.py:211-245"),
    Rule(id="bridge-model-config", consumers=(Consumer.BRIDGE,), text="CommOverlapConfig.setup hands asdict() of the preset minus None values to TE and sets no rs-dgrad or bulk flag: those are model config fields", source=f"{BRIDGE}:src/megatron/bridge/training/comm_overlap.py:604-630"),
    Rule(id="te-modules-own-args", consumers=(Consumer.TE_MODULES,), text="hand-built LayerNormLinear / Linear modules take every ub_* argument per module, all off by default", source=f"{TE}:transformer_engine/pytorch/module/layernorm_linear.py:1327-1331; linear.py"),
    Rule(id="cublasmp", consumers=tuple(Consumer), text="with_cublasmp=True drops bulk and external (both dgrads default to ring_exchange, a bulk entry raises ValueError) and its communicators take only num_sm and atomic_gemm: num_splits, cga_size, aggregate, set_sm_margin, use_ce and the priorities are ignored", source=f"{TE}:transformer_engine/pytorch/module/base.py:415-419, 539-558; common/include/transformer_engine/comm_gemm_overlap.h:97-99, 200-203, 286-289"),
)  # fmt: skip
"""Every rule of the consumers, by id; docs/te_rules.md lists them and tests/test_consumers.py tests each."""

CUBLASMP_IGNORED = ("num_splits", "cga_size", "aggregate", "set_sm_margin", "use_ce", "comm_priority", "gemm_priority")
"""The ub_cfgs keys TE's cuBLASMp communicators ignore (rule cublasmp): they take num_sm and atomic_gemm only."""


# -- the joint choice ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """A config and its measurement."""

    config: OverlapConfig
    measurement: Measurement


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotModes:
    """What a slot measured per mode: the fastest TE-exact config of each mode (`Mode.OFF`: no overlap)."""

    by_mode: Mapping[Mode, Measured]

    def time_ms(self, mode: Mode) -> float | None:
        """The slot's time under ``mode``; None when nothing was measured for it.

        A wgrad beside an RS-dgrad runs its GEMM alone (any measurement of the slot has that GEMM's time).
        An RS-dgrad runs, as TE does it, beside an asynchronous NCCL all-gather of the LayerNorm output that
        the wgrad needs; that all-gather is not measured with it, so it counts as hidden behind the dgrad up
        to its own time alone: the larger of the two (docs/export.md, Consumers).
        """
        if mode == Mode.NO_COMM:
            any_one = next(iter(self.by_mode.values()), None)
            return None if any_one is None else any_one.measurement.gemm_ms
        measured = self.by_mode.get(mode)
        if measured is None:
            return None
        if mode == Mode.RS_DGRAD:
            gather = next((m.measurement.comm_ms for k, m in self.by_mode.items() if k != Mode.RS_DGRAD), 0.0)
            return max(measured.measurement.overlap_ms, gather)
        return measured.measurement.overlap_ms


@dataclass(frozen=True, kw_only=True, slots=True)
class Alternative:
    """One setting of the consumer's switches, the slot modes it makes, and their summed time."""

    setting: Mapping[str, bool]
    changed: Mapping[str, bool]
    """The switches it sets away from the consumer's defaults."""
    modes: Mapping[Slot, Mode]
    total_ms: float | None
    """The summed time of the slots whose modes differ between alternatives; None if one was not measured."""
    unmeasured: tuple[Slot, ...] = ()
    """Slots whose mode here was never measured."""

    def label(self) -> str:
        if not self.changed:
            return "defaults"
        return ", ".join(f"{name}={str(value).lower()}" for name, value in self.changed.items())


@dataclass(frozen=True, kw_only=True, slots=True)
class ConsumerChoice:
    """The consumer's winner: a setting of its switches and, per slot, the config of the mode it runs."""

    consumer: Consumer
    chosen: Alternative
    alternatives: tuple[Alternative, ...]
    """Every distinct alternative, the measured ones fastest first."""
    coupled: tuple[Slot, ...]
    """The slots whose modes differ between alternatives (the ones the sums add up)."""
    entries: Mapping[Slot, Measured] = field(default_factory=dict)
    """Per slot the TE-exact config of the mode it runs, with its measurement (none for a slot switched off or
    a wgrad beside an RS-dgrad)."""


def choose(consumer: Consumer, measured: Mapping[Slot, SlotModes], *, fixed: Setting | None = None) -> ConsumerChoice:
    """The setting of ``consumer``'s switches (``fixed`` ones held) under which the slots run fastest in total.

    Only the slots whose modes differ between settings are summed (the others run the same in all).  Ties,
    and alternatives not measured, go to the setting closest to the consumer's defaults; a setting one of
    whose modes was never measured cannot win, nor one that changes the mode of a slot not tuned at all.
    """
    known = _alternatives(consumer, tuple(sorted((fixed or {}).items())))
    alternatives = [setting for setting, _ in known]
    modes = [slot_mode for _, slot_mode in known]
    coupled = tuple(slot for slot in SLOT_ORDER if slot in measured and len({m.get(slot) for m in modes}) > 1)
    base = defaults(consumer)
    start = modes[0]  # the setting closest to the defaults (all of them, fixed ones aside)
    scored: list[Alternative] = []
    for setting, slot_mode in zip(alternatives, modes, strict=True):
        times = {slot: measured[slot].time_ms(slot_mode[slot]) for slot in coupled}
        # A slot that was not tuned is known only in the mode it runs by default: changing it cannot be scored.
        untuned = tuple(slot for slot in _TUNED if slot not in measured and slot_mode[slot] != start[slot])
        unmeasured = tuple(slot for slot, t in times.items() if t is None) + untuned
        total = None if unmeasured else sum(t for t in times.values() if t is not None)
        changed = {name: value for name, value in setting.items() if value != base[name]}
        scored.append(
            Alternative(setting=setting, changed=changed, modes=slot_mode, total_ms=total, unmeasured=unmeasured)
        )
    ranked = sorted(scored, key=lambda a: (a.total_ms is None, a.total_ms or 0.0))
    chosen = ranked[0]
    entries: dict[Slot, Measured] = {}
    for slot, slot_measured in measured.items():
        mode = chosen.modes.get(slot)
        if mode in (Mode.OVERLAP, Mode.BULK, Mode.RS_DGRAD) and mode in slot_measured.by_mode:
            entries[slot] = slot_measured.by_mode[mode]
    return ConsumerChoice(
        consumer=consumer, chosen=chosen, alternatives=tuple(ranked), coupled=coupled, entries=entries
    )


# -- what a consumer runs of a preset ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotRun:
    """What a consumer runs for one slot of a preset."""

    slot: Slot
    mode: Mode
    """What the module's arguments make it run."""
    asked: Mode | None
    """What the preset's entry asks for; None when the preset leaves the slot out (TE's default entry)."""

    @property
    def as_written(self) -> bool:
        return self.asked is None or self.asked == self.mode


@dataclass(frozen=True, kw_only=True, slots=True)
class PresetCheck:
    """How a consumer runs a preset: the setting closest to its defaults that runs the most entries as written."""

    consumer: Consumer
    setting: Mapping[str, bool]
    changed: Mapping[str, bool]
    runs: tuple[SlotRun, ...]
    fixed: Mapping[str, bool]
    """The switches the user fixed."""

    @property
    def not_as_written(self) -> tuple[SlotRun, ...]:
        """Entries the consumer does not run as written, except those the user switched off on purpose."""
        off_on_purpose = _switched_off(self.consumer, self.fixed)
        return tuple(r for r in self.runs if not r.as_written and r.slot not in off_on_purpose)

    @property
    def ok(self) -> bool:
        return not self.not_as_written


def check(consumer: Consumer, entries: Mapping[Slot, OverlapConfig], *, fixed: Setting | None = None) -> PresetCheck:
    """What ``consumer`` runs of a preset's ``entries`` under the setting (``fixed`` switches held) that runs
    most of them as written; `PresetCheck.ok` says whether all of them are."""
    asked = {slot: entry_mode(slot, config) for slot, config in entries.items() if slot in _TUNED}
    best: tuple[int, Mapping[str, bool], Mapping[Slot, Mode]] | None = None
    for setting, modes in _alternatives(consumer, tuple(sorted((fixed or {}).items()))):
        missed = sum(modes[slot] != mode for slot, mode in asked.items())
        if best is None or missed < best[0]:
            best = (missed, setting, modes)
    assert best is not None  # settings() yields the defaults at least
    _, setting, modes = best
    base = defaults(consumer)
    return PresetCheck(
        consumer=consumer,
        setting=setting,
        changed={name: value for name, value in setting.items() if value != base[name]},
        runs=tuple(SlotRun(slot=slot, mode=modes[slot], asked=asked.get(slot)) for slot in modes),
        fixed=dict(fixed or {}),
    )


_TUNED = tuple(slot for slot in SLOT_ORDER if slot_info(slot).tuned)


def _switched_off(consumer: Consumer, fixed: Setting) -> set[Slot]:
    """Slots that the user's own switches turn off (their entries then are not run, knowingly)."""
    if not fixed:
        return set()
    with_fixed = slot_modes(module_args(consumer, fixed))
    return {slot for slot, mode in with_fixed.items() if mode in (Mode.OFF, Mode.NO_COMM)}


def why(run: SlotRun, consumer: Consumer, entries: Mapping[Slot, OverlapConfig]) -> str:
    """Why ``consumer`` does not run ``run``'s entry of ``entries`` as written, naming the rule and the fix."""
    slot, mode = run.slot, run.mode
    other = next((s for s in RS_DGRAD_WGRAD if s != slot), slot)
    other_mode = None if other not in entries else entry_mode(other, entries[other])
    mixed = other_mode is not None and {run.asked, other_mode} == {Mode.BULK, Mode.RS_DGRAD}
    shared = consumer != Consumer.TE_MODULES
    because = (
        f"{consumer.value} sets the dgrad mode of qkv and fc1 with one switch ({_shared(consumer)}) and "
        f"{other.value} is {other_mode.value if other_mode else 'its default'}"
        if mixed and shared
        else f"{_shared(consumer)} is {'on' if mode == Mode.RS_DGRAD else 'off'} for it under these switches"
    )
    bulk = (slot if run.asked == Mode.BULK else other).value.split("_")[0]
    fix = (
        f"; to run both as written, set tp_comm_overlap_disable_{bulk}=true, which also turns off "
        f"{bulk}_fprop's all-gather overlap"
        if mixed and consumer in (Consumer.MEGATRON, Consumer.BRIDGE)
        else ""
    )
    if mode == Mode.RS_DGRAD and run.asked == Mode.BULK:
        return (
            f"{slot.value} is bulk, but {because}: TE then runs a pipelined GEMM+RS with the bulk entry's num_sm "
            f"and num_splits (rules shared-dgrad-mode, rs-dgrad-on-bulk){fix}"
        )
    if mode == Mode.BULK and run.asked == Mode.RS_DGRAD:
        method = entries[slot].method.value
        return (
            f"{slot.value} uses {method} (a reduce-scatter dgrad), but {because}: it would run bulk on a {method} "
            f"communicator, which raises NVTE_ERROR (rules shared-dgrad-mode, bulk-on-ring){fix}"
        )
    if mode in (Mode.OFF, Mode.NO_COMM):
        return f"{slot.value} runs no overlap under the switches the other entries need"
    return f"{slot.value} runs {mode.value}, not {run.asked.value if run.asked else 'its default'}"


def _shared(consumer: Consumer) -> str:
    return {
        Consumer.MEGATRON: "--tp-comm-overlap-rs-dgrad",
        Consumer.BRIDGE: "the model config's tp_comm_overlap_rs_dgrad",
        Consumer.TE_LAYER: "te.TransformerLayer's ub_overlap_rs_dgrad",
        Consumer.TE_MODULES: "the module's ub_overlap_rs_dgrad",
    }[consumer]


def wgrad_of(dgrad: Slot) -> Slot:
    return RS_DGRAD_WGRAD[dgrad]


def rendered(consumer: Consumer, setting: Setting) -> dict[str, object]:
    """The switches a consumer needs to run as measured, in its own terms (for headers and ``--json``):
    megatron: ``flags`` (CLI) and ``config`` (TransformerConfig fields without a flag); bridge: ``model_config``
    fields; te-layer: ``transformer_layer`` arguments; te-modules: ``modules`` (arguments per ub_name)."""
    values = defaults(consumer) | dict(setting)
    changed = {s.name: values[s.name] for s in SWITCHES[consumer] if values[s.name] != s.default}
    if consumer == Consumer.MEGATRON:
        by_name = {s.name: s for s in SWITCHES[consumer]}
        flags = ["--tp-comm-overlap", *(flag for n in changed if (flag := by_name[n].flag) is not None)]
        config = {n: v for n, v in changed.items() if by_name[n].flag is None}
        return {"flags": flags, "config": config}
    if consumer == Consumer.BRIDGE:
        return {"model_config": {"tp_comm_overlap": True, **changed}}
    if consumer == Consumer.TE_LAYER:
        return {"transformer_layer": {"ub_tp_comm_overlap": True, **values}}
    args = module_args(consumer, values)
    return {"modules": {m.value: {a.value: v for a, v in args[m].items()} for m in Module}}


def layer_arguments(consumer: Consumer, setting: Setting) -> dict[str, bool]:
    """The one set of ``ub_*`` arguments a ``te.TransformerLayer`` would need to run as ``consumer`` does under
    ``setting``; InputError naming the switch when the consumer's modules get different ones (a per-layer
    disable, or te-modules set apart), which one layer-wide set cannot express."""
    args = module_args(consumer, setting)
    merged: dict[str, bool] = {}
    for arg in Arg:
        values = {args[m][arg] for m in Module if arg in MODULE_ARGS[m]}
        if len(values) > 1:
            raise InputError(
                "for",
                f"{consumer.value} gives its modules different {arg.value} under these switches, and "
                "te.TransformerLayer takes one set for all: validate with --for te-layer, or without per-layer switches",
                consumer.value,
            )
        merged[arg.value] = values.pop()
    return merged


def switch_lines(consumer: Consumer, setting: Setting) -> list[str]:
    """`rendered` as the lines a preset's header shows."""
    r = rendered(consumer, setting)
    if consumer == Consumer.MEGATRON:
        lines = [f"Megatron-LM flags: {' '.join(r['flags'])} --tp-comm-overlap-cfg <this file>"]  # type: ignore[arg-type]
        config = r["config"]
        if config:
            fields = ", ".join(f"{k}={v}" for k, v in config.items())  # type: ignore[attr-defined]
            lines.append(f"TransformerConfig (no CLI flag): {fields}")
        return lines
    if consumer == Consumer.BRIDGE:
        fields = ", ".join(f"{k}={v}" for k, v in r["model_config"].items())  # type: ignore[attr-defined]
        return [f"model config: {fields}"]
    if consumer == Consumer.TE_LAYER:
        fields = ", ".join(f"{k}={v}" for k, v in r["transformer_layer"].items())  # type: ignore[attr-defined]
        return [f"te.TransformerLayer({fields})"]
    modules: Mapping[str, Mapping[str, bool]] = r["modules"]  # type: ignore[assignment]
    return [f"{name}: {', '.join(f'{k}={v}' for k, v in args.items())}" for name, args in modules.items()]


SWITCH_MARK = "autotune-switches"
"""Where a preset file's header records, machine-readably, the consumer and the switches it was made for."""
_SWITCH_LINE = re.compile(rf"{SWITCH_MARK} \((?P<consumer>[a-z-]+)\): (?P<values>.*)$")


def switch_record(consumer: Consumer, setting: Setting) -> str:
    """``autotune-switches (megatron): tp_comm_overlap_rs_dgrad=true``: the switches away from the defaults."""
    base = defaults(consumer)
    changed = [f"{name}={str(value).lower()}" for name, value in setting.items() if value != base[name]]
    return f"{SWITCH_MARK} ({consumer.value}): {', '.join(changed) or 'defaults'}"


def parse_switch_record(text: str) -> tuple[Consumer, dict[str, bool]] | None:
    """The consumer and switches of a `switch_record` line (a comment's text); None for any other line."""
    match = _SWITCH_LINE.search(text.strip())
    if match is None:
        return None
    consumer = parse_consumer(match["consumer"])
    given: dict[str, object] = {}
    values = match["values"].strip()
    for item in [] if values == "defaults" else values.split(","):
        name, _, value = item.strip().partition("=")
        given[name] = {"true": True, "false": False}.get(value, value)
    return consumer, defaults(consumer) | parse_setting(consumer, given)


def parse_consumer(value: str) -> Consumer:
    try:
        return Consumer(value)
    except ValueError:
        names = [c.value for c in Consumer]
        raise InputError("consumer", f"must be one of {', '.join(names)}{suggest(value, names)}", value) from None


def coupled_slots(consumer: Consumer) -> tuple[Slot, ...]:
    """The slots whose modes the consumer's switches couple (differ between its settings)."""
    modes = [slot_mode for _, slot_mode in _alternatives(consumer, ())]
    return tuple(slot for slot in _TUNED if len({m[slot] for m in modes}) > 1)


def describe(alternatives: Sequence[Alternative], coupled: Sequence[Slot]) -> list[str]:
    """One line per alternative: its switches, the modes it gives the coupled dgrad slots, its summed time."""
    lines = []
    for alternative in alternatives:
        modes = ", ".join(f"{slot.value}={alternative.modes[slot].value}" for slot in coupled if slot in RS_DGRAD_WGRAD)
        total = "not measured" if alternative.total_ms is None else f"{alternative.total_ms:.4g} ms"
        lines.append(f"{alternative.label()}: {total} ({modes})")
    return lines
