"""bulk's search side: one independent collective beside one full GEMM, on the qkv / fc1 dgrad and wgrad slots.

Our runtime can push the collective with the copy engine (``use_ce``); TE always runs it as SM kernels of
num_sm CTAs (``CommOverlapBase`` hard-codes use_ce=false), so a TE entry runs with use_ce=false here and a
copy-engine config is not what TE runs.
"""

from __future__ import annotations

from dataclasses import MISSING, replace
from typing import TYPE_CHECKING, Any

from overlap_runtime.config import OverlapConfig
from overlap_runtime.knobs import Method
from overlap_runtime.shape import Collective, Slot, SlotGemm
from search_spaces.methods.spec import ENTRY, KERNEL_DEFAULTS, CfgClass, Deviation, SearchSpec, Tree
from search_spaces.methods.trees import cga, priorities

if TYPE_CHECKING:
    from search_spaces.space import SlotSpace

_SLOTS = frozenset({Slot.QKV_DGRAD, Slot.QKV_WGRAD, Slot.FC1_DGRAD, Slot.FC1_WGRAD})
_KEYS = ("num_sm", "cga_size", "set_sm_margin")


def _tree(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """Copy-engine pushes (our runtime's) or TE's SM kernel, whose SMs, cluster shape and margin are the knobs."""
    if space.cpu:
        return {}
    knobs: dict[str, Any] = {}
    knobs["use_ce"] = yield space.params["use_ce"]
    if knobs["use_ce"]:
        # Copy-engine pushes take no SM: num_sm only means the SMs a margin keeps off the GEMM.
        knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
        if knobs["set_sm_margin"]:
            knobs["num_sm"] = yield space.params["num_sm"]
        knobs["gemm"] = yield space.params["gemm"]
        return knobs
    knobs["num_sm"] = num_sm = yield space.params["num_sm"]
    knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
    knobs["cga_size"] = yield from cga(space, KERNEL_DEFAULTS["cga_size"], num_sm)
    knobs["gemm"] = yield space.params["gemm"]
    return knobs


def _te_tree(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """TE's bulk: one SM-kernel collective (TE's bulk never uses the copy engine) beside the GEMM."""
    knobs: dict[str, Any] = {}
    knobs["num_sm"] = yield space.params["num_sm"]
    knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
    knobs["cga_size"] = yield from cga(space, KERNEL_DEFAULTS["cga_size"], knobs["num_sm"])
    return knobs | (yield from priorities(space))


def _runnable(config: OverlapConfig, backend: str) -> OverlapConfig:
    return replace(config, use_ce=False) if backend == "cuda" else config


def _deviations(config: OverlapConfig) -> tuple[Deviation, ...]:
    if not config.use_ce:
        return ()
    return (
        Deviation(
            knob="use_ce",
            measured="copy-engine bulk transfers",
            te_runs="TE's bulk always runs SM kernels of num_sm CTAs",
        ),
    )


SPEC = SearchSpec(
    method=Method.BULK,
    tree=_tree,
    te_tree=_te_tree,
    te_slots=_SLOTS,
    te_default_slots=_SLOTS,
    te_defaults=KERNEL_DEFAULTS,
    nvidia_keys={Collective.ALL_GATHER: _KEYS, Collective.REDUCE_SCATTER: _KEYS},
    bridge=CfgClass(
        name="BulkOverlapCfg",
        base=ENTRY,
        fields={"num_sm": MISSING, "cga_size": MISSING, "set_sm_margin": MISSING, "method": "bulk"},
    ),
    runnable=_runnable,
    deviations=_deviations,
)
