"""The te backend's search space: TE's own keys, every one that TE reads, and nothing of our runtime's.

On the te backend a config is a ``ub_cfgs`` entry that TE runs (`overlap_runtime.te_backend`), so the trees
ask TE's keys only: method, num_sm (up to userbuffers' 32 CTAs), cga_size, set_sm_margin, num_splits,
aggregate, use_ce, the stream priorities and pipeline_rs_overlap_first_gemm.  No GEMM, stream count or
fusion is asked: TE runs cuBLAS on min(3, chunks) streams.  Every config here is TE-exact
(`search_spaces.te_exact`), and the runtime's rules on te (`check_config`) accept each one.

What each tree implies rather than asks, and why:

- a ring exchange's cga_size stays TE's 1: its copy kernel moves point-to-point chunks, which clusters do
  not speed up (as on our runtime); num_sm is asked where it means something (SM copies, or the margin);
- the priorities are asked as "TE's default or swapped": comm_priority unset (TE: the most urgent) or the
  least urgent, gemm_priority unset (TE: the least urgent) or the most urgent, from the device's range;
- cga_size is asked from num_sm 4 on (every cluster size fits); below, TE's 2 capped at num_sm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from overlap_runtime.config import DeviceLimits, Method
from overlap_runtime.knobs import MAX_NUM_SM, TE_MAX_SMS
from overlap_runtime.shape import SlotGemm
from search_spaces.space import CGA_SIZES, SlotSpace, Tree, can_aggregate, no_overlap, sm_choices
from search_spaces.te_dict import te_defaults

TE_PARAMS = (
    "num_splits",
    "aggregate",
    "pipeline_rs_overlap_first_gemm",
    "use_ce",
    "set_sm_margin",
    "num_sm",
    "cga_size",
    "comm_priority",
    "gemm_priority",
)
"""The knobs the te trees ask."""


def te_choices(ours: Mapping[str, tuple], limits: DeviceLimits | None) -> dict[str, tuple]:
    """The choice lists of the te space: our runtime's for TE's keys (``ours``), num_sm capped at TE's 32,
    and the priorities (module docstring) from the device's range (the usual (-5, 0) where unknown)."""
    hi, lo = (limits or DeviceLimits(sm_count=MAX_NUM_SM + 1)).priority_range
    choices: dict[str, Any] = {name: ours[name] for name in TE_PARAMS if name in ours}
    choices["num_sm"] = tuple(n for n in sm_choices(limits) if n <= TE_MAX_SMS)
    choices["comm_priority"] = (None, lo)
    choices["gemm_priority"] = (None, hi)
    return choices


def _priorities(space: SlotSpace) -> Tree:
    knobs: dict[str, Any] = {}
    knobs["comm_priority"] = yield space.params["comm_priority"]
    knobs["gemm_priority"] = yield space.params["gemm_priority"]
    return knobs


def _cga(space: SlotSpace, method: Method, num_sm: int) -> Tree:
    if num_sm >= max(CGA_SIZES):
        return (yield space.params["cga_size"])
    return min(te_defaults(space.slot, method)["cga_size"], num_sm)


def _ring_exchange(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """TE's ring: aggregated or not (all-gathers at even tp >= 4), copy engine or SM copies, the margin."""
    knobs: dict[str, Any] = {}
    if can_aggregate(gemm):
        knobs["aggregate"] = yield space.params["aggregate"]
    knobs["use_ce"] = yield space.params["use_ce"]
    knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
    if not knobs["use_ce"] or knobs["set_sm_margin"]:
        knobs["num_sm"] = yield space.params["num_sm"]
    return knobs | (yield from _priorities(space))


def _pipeline(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """TE's pipeline: splits, the first-GEMM order, the reduce-scatter kernel's SMs and clusters, the margin."""
    knobs: dict[str, Any] = {}
    knobs["num_splits"] = yield space.params["num_splits"]
    knobs["pipeline_rs_overlap_first_gemm"] = yield space.params["pipeline_rs_overlap_first_gemm"]
    knobs["num_sm"] = yield space.params["num_sm"]
    knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
    knobs["cga_size"] = yield from _cga(space, Method.PIPELINE, knobs["num_sm"])
    return knobs | (yield from _priorities(space))


def _bulk(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """TE's bulk: one SM-kernel collective (TE's bulk never uses the copy engine) beside the GEMM."""
    knobs: dict[str, Any] = {}
    knobs["num_sm"] = yield space.params["num_sm"]
    knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
    knobs["cga_size"] = yield from _cga(space, Method.BULK, knobs["num_sm"])
    return knobs | (yield from _priorities(space))


TE_TREES = {
    Method.NONE: no_overlap,
    Method.RING_EXCHANGE: _ring_exchange,
    Method.PIPELINE: _pipeline,
    Method.BULK: _bulk,
}
"""The te backend's knob trees (`SlotSpace.trees`)."""
