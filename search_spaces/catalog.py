"""The layer catalog: TE's twelve userbuffers slots, what each communicates and which methods TE allows.

Facts from TE's `initialize_ub` (docs/te_rules.md, Slots and Legal methods per slot): all-gather slots only run
ring_exchange (TE raises for pipeline, bulk fails at the first GEMM); proj_fprop / fc2_fprop take pipeline
or ring_exchange; qkv_wgrad / fc1_wgrad are bulk only; qkv_dgrad / fc1_dgrad are bulk, or switch to a
reduce-scatter of their output under ring_exchange / pipeline ("RS-dgrad"), and TE then refuses an entry for
the matching wgrad slot; proj_wgrad / fc2_wgrad are TE's MXFP8-only `external` path and are not tuned.
Which methods TE runs on a slot, and its default there, are the methods' facts (`SearchSpec.te_slots`,
``te_default_slots``); the no-overlap baseline is searched in every tuned slot.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field

from overlap_runtime.config import Method, uses_rs_dgrad
from overlap_runtime.errors import InputError
from overlap_runtime.methods import BASELINE
from overlap_runtime.shape import EXTERNAL_SLOTS, Collective, ModelShape, Slot
from search_spaces.methods import SEARCH_SPECS, search_spec

AG, RS = Collective.ALL_GATHER, Collective.REDUCE_SCATTER

_AG_OFF = "--disable-tp-comm-overlap-ag (Megatron; turns off every all-gather overlap: qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad)"
_RS_OFF = "--disable-tp-comm-overlap-rs (Megatron; turns off proj_fprop and fc2_fprop)"
_BULK_DGRAD_OFF = "--disable-tp-comm-bulk-dgrad (Megatron; turns off qkv_dgrad and fc1_dgrad bulk overlap)"
_BULK_WGRAD_OFF = "--disable-tp-comm-bulk-wgrad (Megatron; turns off qkv_wgrad and fc1_wgrad bulk overlap)"
_RS_DGRAD_OFF = "leave out --tp-comm-overlap-rs-dgrad (Megatron; the dgrad slot then runs bulk)"
_EXTERNAL_OFF = "nothing to turn off: TE uses the external path only for MXFP8"


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotInfo:
    """One userbuffers slot as TE defines it."""

    slot: Slot
    collective: Collective
    """The collective under the slot's default method (qkv/fc1_dgrad reduce-scatter under RS-dgrad)."""
    tuned: bool
    """Whether a tuning job searches it by default (all but the external wgrad slots)."""
    off_switch: str
    """The Megatron flag or config field that turns this slot's overlap off."""
    te_switch: str
    """The same for code that builds TE modules itself: the module argument to clear."""
    default_method: Method = field(init=False)
    """What TE runs when ub_cfgs leaves the slot out."""
    te_methods: tuple[Method, ...] = field(init=False)
    """Methods TE accepts for the slot, default first."""

    def __post_init__(self) -> None:
        default = next(m for m, spec in SEARCH_SPECS.items() if self.slot in spec.te_default_slots)
        others = (m for m, spec in SEARCH_SPECS.items() if self.slot in spec.te_slots and m != default)
        object.__setattr__(self, "default_method", default)
        object.__setattr__(self, "te_methods", (default, *others))


CATALOG: tuple[SlotInfo, ...] = (
    # Ordered as NVIDIA's preset files list the slots.
    SlotInfo(slot=Slot.QKV_DGRAD, collective=AG, tuned=True, off_switch=_BULK_DGRAD_OFF, te_switch="ub_bulk_dgrad=False on the qkv LayerNormLinear"),
    SlotInfo(slot=Slot.QKV_WGRAD, collective=RS, tuned=True, off_switch=_BULK_WGRAD_OFF, te_switch="ub_bulk_wgrad=False on the qkv LayerNormLinear"),
    SlotInfo(slot=Slot.FC1_DGRAD, collective=AG, tuned=True, off_switch=_BULK_DGRAD_OFF, te_switch="ub_bulk_dgrad=False on LayerNormMLP"),
    SlotInfo(slot=Slot.FC1_WGRAD, collective=RS, tuned=True, off_switch=_BULK_WGRAD_OFF, te_switch="ub_bulk_wgrad=False on LayerNormMLP"),
    SlotInfo(slot=Slot.QKV_FPROP, collective=AG, tuned=True, off_switch="tp_comm_overlap_disable_qkv=True (Megatron TransformerConfig field, no CLI flag)", te_switch="ub_overlap_ag=False on the qkv LayerNormLinear"),
    SlotInfo(slot=Slot.PROJ_DGRAD, collective=AG, tuned=True, off_switch=_AG_OFF, te_switch="ub_overlap_ag=False on the proj Linear"),
    SlotInfo(slot=Slot.FC1_FPROP, collective=AG, tuned=True, off_switch="tp_comm_overlap_disable_fc1=True (Megatron TransformerConfig field, no CLI flag)", te_switch="ub_overlap_ag=False on LayerNormMLP (fc1_fprop and fc2_dgrad)"),
    SlotInfo(slot=Slot.FC2_DGRAD, collective=AG, tuned=True, off_switch=_AG_OFF, te_switch="ub_overlap_ag=False on LayerNormMLP (fc1_fprop and fc2_dgrad)"),
    SlotInfo(slot=Slot.PROJ_FPROP, collective=RS, tuned=True, off_switch=_RS_OFF, te_switch="ub_overlap_rs=False on the proj Linear"),
    SlotInfo(slot=Slot.FC2_FPROP, collective=RS, tuned=True, off_switch=_RS_OFF, te_switch="ub_overlap_rs=False on LayerNormMLP"),
    SlotInfo(slot=Slot.PROJ_WGRAD, collective=AG, tuned=False, off_switch=_EXTERNAL_OFF, te_switch="nothing (MXFP8 only)"),
    SlotInfo(slot=Slot.FC2_WGRAD, collective=AG, tuned=False, off_switch=_EXTERNAL_OFF, te_switch="nothing (MXFP8 only)"),
)  # fmt: skip

SLOT_ORDER: tuple[Slot, ...] = tuple(info.slot for info in CATALOG)

RS_DGRAD_WGRAD: dict[Slot, Slot] = {Slot.QKV_DGRAD: Slot.QKV_WGRAD, Slot.FC1_DGRAD: Slot.FC1_WGRAD}
"""dgrad slot -> the wgrad slot TE drops (and refuses an entry for) when the dgrad reduce-scatters."""

EXTERNAL_PARTNER: dict[Slot, Slot] = {Slot.PROJ_WGRAD: Slot.PROJ_DGRAD, Slot.FC2_WGRAD: Slot.FC2_DGRAD}
"""external wgrad slot -> the dgrad slot whose ring_exchange streams it borrows."""

ATOMIC_PAIRS: tuple[tuple[Slot, Slot], ...] = ((Slot.QKV_FPROP, Slot.PROJ_FPROP), (Slot.FC1_FPROP, Slot.FC2_FPROP))
"""An atomic ring_exchange all-gather shuffles chunks that its reduce-scatter partner must un-shuffle."""

_BY_SLOT = {info.slot: info for info in CATALOG}


def slot_info(slot: Slot | str) -> SlotInfo:
    return _BY_SLOT[Slot(slot)]


def collective(slot: Slot, method: Method) -> Collective:
    """The collective ``slot`` runs under ``method`` (RS-dgrad turns a dgrad all-gather into a reduce-scatter)."""
    return RS if uses_rs_dgrad(slot, method) else slot_info(slot).collective


def search_methods(slot: Slot) -> tuple[Method, ...]:
    """Methods a tuning job tries for ``slot``: the no-overlap baseline first, then TE's legal methods that are
    searched (not TE's external path)."""
    return (BASELINE, *(m for m in slot_info(slot).te_methods if search_spec(m).tree is not None))


def off_switch(slot: Slot, method: Method) -> str:
    """How a user turns the overlap of ``slot`` under ``method`` off, in Megatron and in TE (docs/te_rules.md,
    Turning one slot's overlap off)."""
    info = slot_info(slot)
    if uses_rs_dgrad(slot, method):
        return f"{_RS_DGRAD_OFF}; in TE: ub_overlap_rs_dgrad=False on the module"
    return f"{info.off_switch}; in TE: {info.te_switch}"


def tunable_slots(shape: ModelShape, layers: Iterable[str] | None = None) -> tuple[Slot, ...]:
    """The slots a job tunes: TE's ten by default, or the named subset, in catalog order.

    TP overlap hides a TP collective, so tp=1 has nothing to tune (NeMo and Megatron-Bridge switch TP
    overlap off below tp=2); the external wgrad slots are TE's MXFP8-only path and are never tuned.
    """
    if shape.tp < 2:
        raise InputError("tp", "TP comm overlap needs tp >= 2 (there is no TP collective to hide)", shape.tp)
    if layers is None:
        return tuple(info.slot for info in CATALOG if info.tuned)
    names = list(layers)
    if not names:
        raise InputError("layers", "must name at least one slot")
    known = {info.slot.value for info in CATALOG if info.tuned}
    for name in names:
        if name in {s.value for s in EXTERNAL_SLOTS}:
            raise InputError("layers", f"{name} is TE's external (MXFP8-only) path and is not tuned", name)
        if name not in known:
            raise InputError("layers", f"unknown slot{suggest(name, known)}; slots: {', '.join(sorted(known))}", name)
    return tuple(slot for slot in SLOT_ORDER if slot.value in names)


def suggest(name: object, known: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the closest known name, or nothing."""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f"; did you mean {close[0]}?" if close else ""
