"""external's search side: TE's MXFP8-only wgrad all-gather, catalogued (presets read and write it) and
never searched.  It borrows the streams of its slot's dgrad ring exchange (docs/te_rules.md, External wgrads),
and Bridge has no class for it."""

from __future__ import annotations

from dataclasses import MISSING

from overlap_runtime.knobs import Method
from overlap_runtime.shape import Collective, Slot
from search_spaces.methods.spec import ENTRY, KERNEL_DEFAULTS, CfgClass, SearchSpec

_SLOTS = frozenset({Slot.PROJ_WGRAD, Slot.FC2_WGRAD})

SPEC = SearchSpec(
    method=Method.EXTERNAL,
    te_slots=_SLOTS,
    te_default_slots=_SLOTS,
    te_defaults=KERNEL_DEFAULTS,
    borrows=Method.RING_EXCHANGE,
    nvidia_keys={Collective.ALL_GATHER: ("num_sm", "cga_size", "set_sm_margin")},
    bridge=CfgClass(
        name="ExternalOverlapCfg",
        base=ENTRY,
        fields={"num_sm": MISSING, "cga_size": MISSING, "set_sm_margin": MISSING, "method": "external"},
        doc="TE's external method (the MXFP8 wgrad all-gather), which Bridge has no class for.",
    ),
    bridge_defines=False,
)
