"""A preset: one OverlapConfig per TE slot for one shape and GPU, checked against TE's cross-slot rules.

A preset holds TE's *effective* entries (every key TE would use, with TE's defaults filled in; see
`te_dict.py`), never the no-overlap baseline (TE cannot switch one slot off: docs/export.md) and never our
runtime-only knobs (`overlap_runtime.knobs.RUNTIME_ONLY_KNOBS`), so it converts to NeMo YAML or a TE
``ub_cfgs`` dict without loss.  Slots left out take TE's defaults when TE reads the preset.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from overlap_runtime.config import DEFAULTS, Method, OverlapConfig, uses_rs_dgrad
from overlap_runtime.errors import InputError
from overlap_runtime.knobs import RUNTIME_ONLY_KNOBS
from overlap_runtime.measurement import Measurement
from overlap_runtime.methods import method_spec
from overlap_runtime.shape import DTYPES, ModelShape, Slot
from search_spaces.catalog import (
    ATOMIC_PAIRS,
    CATALOG,
    EXTERNAL_PARTNER,
    RS_DGRAD_WGRAD,
    SLOT_ORDER,
    slot_info,
    suggest,
)
from search_spaces.consumers import Consumer
from search_spaces.methods import search_spec


class PresetError(InputError):
    """A preset that TE would refuse, or would silently read differently from what it says."""


class PresetWarning(UserWarning):
    """Something TE accepts but ignores, or a file that configures nothing."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    """Per-slot TE configs for one shape, as NeMo/Megatron YAML or TE's ``initialize_ub(ub_cfgs=...)`` carry them."""

    configs: Mapping[Slot, OverlapConfig]
    """TE's effective entry per slot, in catalog order; slots left out take TE's defaults."""
    shape: ModelShape | None = None
    """The shape the preset was made for; None when the file name does not say."""
    gpu: str | None = None
    """GPU name as in NVIDIA's file names (``h100``, ``a100``; stored lower-case); None when unknown."""
    dtype: str | None = None
    """The dtype the preset names (bf16, fp8); None when its name does not say."""
    notes: Mapping[Slot, str] = field(default_factory=dict)
    """Remarks per slot, e.g. that no overlap beat the slot's config and which switch turns it off."""
    measurements: Mapping[Slot, Measurement] = field(default_factory=dict)
    """Per slot, the measurement of its entry exactly as TE runs it (a TE-exact winner's); slots without one
    are left out (a preset read from a file, an entry TE runs otherwise than it was measured)."""
    source: str | None = None
    """Where the preset came from (a file name); not part of its content."""
    consumer: Consumer | None = None
    """Who the preset was made for (`search_spaces.consumers`); None: any, per slot."""
    setting: Mapping[str, bool] = field(default_factory=dict)
    """The consumer's switches that make it run the preset as measured (those at their defaults included)."""
    choice: tuple[str, ...] = ()
    """The joint choice's alternatives with their summed times, the chosen one first (informative)."""

    def __post_init__(self) -> None:
        configs = {to_slot(slot): config for slot, config in self.configs.items()}
        for slot, config in configs.items():
            _check_entry(slot, config)
        _check_pairs(configs, self.dtype)
        if self.gpu is not None:
            object.__setattr__(self, "gpu", self.gpu.lower())
        if self.gpu is not None and not re.fullmatch(r"[a-z][a-z0-9]*", self.gpu):
            raise PresetError(
                "gpu", "must be letters then digits, such as h100 (it becomes part of the file name)", self.gpu
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise PresetError("dtype", f"must be one of {', '.join(DTYPES)}", self.dtype)
        if self.shape is not None and self.dtype is not None and self.shape.dtype != self.dtype:
            raise PresetError("dtype", f"must match the shape's dtype {self.shape.dtype}", self.dtype)
        ordered = {slot: configs[slot] for slot in SLOT_ORDER if slot in configs}
        object.__setattr__(self, "configs", MappingProxyType(ordered))
        notes = {to_slot(slot): note for slot, note in self.notes.items()}
        object.__setattr__(self, "notes", MappingProxyType({s: notes[s] for s in SLOT_ORDER if s in notes}))
        measured = {to_slot(slot): m for slot, m in self.measurements.items()}
        object.__setattr__(self, "measurements", MappingProxyType({s: measured[s] for s in ordered if s in measured}))

    @property
    def empty(self) -> bool:
        return not self.configs

    @property
    def missing(self) -> tuple[Slot, ...]:
        """The slots a tuning job tunes (TE's ten, not the external wgrad ones) that the preset leaves out:
        TE runs its defaults there, which a truncated file does by accident.  A wgrad beside a reduce-scatter
        dgrad is not missing: TE refuses an entry for it."""
        dropped = {wgrad for dgrad, wgrad in RS_DGRAD_WGRAD.items() if self._rs_dgrad(dgrad)}
        return tuple(
            info.slot for info in CATALOG if info.tuned and info.slot not in self.configs and info.slot not in dropped
        )

    def _rs_dgrad(self, dgrad: Slot) -> bool:
        """Whether the entry of ``dgrad`` reduce-scatters (TE then refuses, and never reads, its wgrad's)."""
        return dgrad in self.configs and uses_rs_dgrad(dgrad, self.configs[dgrad].method)


def to_slot(name: object) -> Slot:
    """The slot called ``name``; PresetError with the close name for a misspelling, which TE would ignore."""
    try:
        return Slot(str(name))
    except ValueError:
        names = [s.value for s in SLOT_ORDER]
        rule = f"is not a TE userbuffers slot (TE would silently ignore it){suggest(name, names)}"
        raise PresetError(str(name), rule) from None


def _check_entry(slot: Slot, config: OverlapConfig) -> None:
    where = slot.value
    if not method_spec(config.method).te:
        raise PresetError(
            f"{where}.method",
            f"{config.method.value} is not a TE method (TE cannot switch one slot off): carry the best overlap "
            "config and say so in a note",
            config.method.value,
        )
    check_method(slot, config.method)
    for name in RUNTIME_ONLY_KNOBS:
        if getattr(config, name) != DEFAULTS[name]:
            raise PresetError(f"{where}.{name}", "is our runtime's knob, not a TE ub_cfgs key", getattr(config, name))


def check_method(slot: Slot, method: Method) -> None:
    """Raise unless TE runs ``slot`` with ``method`` (docs/te_rules.md, Legal methods per slot)."""
    legal = slot_info(slot).te_methods
    if method not in legal:
        names = " or ".join(m.value for m in legal)
        refusal = search_spec(method).te_refusal
        rule = f"TE runs {slot.value} only with {names}" if refusal is None else f"{refusal}; this slot takes {names}"
        raise PresetError(f"{slot.value}.method", rule, method.value)


def _check_pairs(configs: Mapping[Slot, OverlapConfig], dtype: str | None) -> None:
    """TE's rules that involve two slots (docs/te_rules.md: RS-dgrad, External wgrads, Atomic pairs)."""
    for dgrad, wgrad in RS_DGRAD_WGRAD.items():
        if dgrad in configs and wgrad in configs and uses_rs_dgrad(dgrad, configs[dgrad].method):
            raise PresetError(
                wgrad.value,
                f"cannot be given while {dgrad.value} uses the non-bulk method {configs[dgrad].method.value} "
                "(reduce-scatter dgrad); TE raises ValueError. Leave it out",
            )
    for external, partner in EXTERNAL_PARTNER.items():
        if external not in configs or partner not in configs:
            continue
        borrows = search_spec(configs[external].method).borrows
        if borrows is not None and configs[partner].method != borrows:
            raise PresetError(
                f"{partner.value}.method",
                f"must be {borrows.value} while {external.value} is {configs[external].method.value}",
                configs[partner].method.value,
            )
    for ag, rs in ATOMIC_PAIRS:
        if _atomic_ring(configs.get(ag)) != _atomic_ring(configs.get(rs)):
            raise PresetError(
                f"{ag.value}.atomic_gemm",
                f"atomic ring_exchange on {ag.value} and on {rs.value} go together: the all-gather shuffles chunks "
                "that the reduce-scatter un-shuffles (TE raises ValueError)",
            )
    for slot, config in configs.items():
        if config.atomic_gemm and dtype is not None and dtype != "fp8":
            raise PresetError(f"{slot.value}.atomic_gemm", "needs FP8 GEMMs (TE raises ValueError otherwise)", dtype)


def _atomic_ring(config: OverlapConfig | None) -> bool:
    return config is not None and config.atomic_gemm and search_spec(config.method).atomic_pairs
