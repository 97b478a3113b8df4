"""ring_exchange's search side: tp chunks moved point to point while the GEMM works on the chunk in hand, on
every coupled slot (the all-gathers, proj_fprop / fc2_fprop, RS-dgrad).

TE's ring runs over its copy engine by default (use_ce), where num_sm and cga_size only size an SM copy kernel
it does not launch; its cluster size 1 is "no clusters".
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from overlap_runtime.config import OverlapConfig
from overlap_runtime.knobs import TE, TE_NUM_MAX_STREAMS, Method
from overlap_runtime.shape import Collective, Slot, SlotGemm
from search_spaces.methods.spec import ENTRY, CfgClass, SearchSpec, Tree
from search_spaces.methods.trees import priorities, streams

if TYPE_CHECKING:
    from search_spaces.space import SlotSpace

_ALL_GATHERS = frozenset({Slot.QKV_FPROP, Slot.PROJ_DGRAD, Slot.FC1_FPROP, Slot.FC2_DGRAD})


def can_aggregate(gemm: SlotGemm) -> bool:
    """Two chunks per ring step need at least two steps of an even ring: even tp >= 4 (the runtime's rule)."""
    return gemm.collective == Collective.ALL_GATHER and gemm.tp >= 4 and gemm.tp % 2 == 0


def _tree(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """tp chunks (tp/2 aggregated) moved point to point while the GEMM works on the previous one.

    ``fused`` (CUDA, unaggregated rings) first: one launch of our GEMM over every chunk (`_fused_ring`);
    otherwise use_ce picks copy-engine pushes or SM copy kernels (an aggregated ring is always the latter);
    num_sm is asked only where it means something:
    the SM copy kernel's CTAs, or the SMs a margin keeps off the GEMM (NVIDIA's reduce-scatter presets:
    num_sm 1 with a margin).  The SM copies' cluster size is left to the runtime: point-to-point copies
    gain nothing from clusters.
    """
    knobs: dict[str, Any] = {}
    steps = gemm.tp
    if can_aggregate(gemm):
        knobs["aggregate"] = yield space.params["aggregate"]
        if knobs["aggregate"]:
            steps //= 2
    if space.cpu:
        return knobs
    if knobs.get("aggregate"):
        knobs["use_ce"] = False  # the copy-engine all-gather pushes straight to every peer: no steps to pair
    else:
        knobs["fused"] = yield space.params["fused"]
        if knobs["fused"]:
            return (yield from _fused_ring(space))
        knobs["use_ce"] = yield space.params["use_ce"]
    knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
    if not knobs["use_ce"] or knobs["set_sm_margin"]:
        knobs["num_sm"] = yield space.params["num_sm"]
    knobs["gemm"] = yield space.params["gemm"]
    knobs["num_max_streams"] = yield from streams(space, steps, always=knobs["use_ce"] and steps >= 2)
    return knobs


def _fused_ring(space: SlotSpace) -> Tree:
    """One launch of our GEMM that moves the chunks itself: only an SM margin is left to choose (transfers,
    streams and the GEMM are implied by the fusion)."""
    knobs: dict[str, Any] = {"fused": True, "gemm": "triton"}
    knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
    if knobs["set_sm_margin"]:
        knobs["num_sm"] = yield space.params["num_sm"]
    return knobs


def _te_tree(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """TE's ring: aggregated or not (all-gathers at even tp >= 4), copy engine or SM copies, the margin.  Its
    cga_size stays TE's 1: its copy kernel moves point-to-point chunks, which clusters do not speed up."""
    knobs: dict[str, Any] = {}
    if can_aggregate(gemm):
        knobs["aggregate"] = yield space.params["aggregate"]
    knobs["use_ce"] = yield space.params["use_ce"]
    knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
    if not knobs["use_ce"] or knobs["set_sm_margin"]:
        knobs["num_sm"] = yield space.params["num_sm"]
    return knobs | (yield from priorities(space))


def _te_streams(config: OverlapConfig, tp: int) -> int:
    return min(TE_NUM_MAX_STREAMS, tp // 2 if config.aggregate else tp)


def _runnable(config: OverlapConfig, backend: str) -> OverlapConfig:
    """TE's ring on our runtime: with copy engines, TE's num_sm / cga_size only size an SM copy kernel it does
    not launch, so they go, unless set_sm_margin keeps num_sm SMs off the GEMM (then num_sm stays); TE's
    cluster size 1 is the runtime's default.  ``aggregate`` goes with them on cuda: our copy-engine all-gather
    pushes each shard straight to every peer, so TE's pairs of ring steps have no counterpart there and the
    nearest runnable config is that all-gather (also at tp=2, where TE runs one pair).  On te it stays: TE
    pairs ring steps over the copy engine too.  On cpu the ring runs as the emulated send/recv ring, as carried."""
    if backend == "cpu":
        return config
    sm_copies = config.use_ce is False
    runnable = replace(
        config,
        num_sm=config.num_sm if sm_copies or config.set_sm_margin else None,
        cga_size=config.cga_size if sm_copies and config.cga_size != 1 else None,
        aggregate=config.aggregate and sm_copies,
    )
    return replace(runnable, aggregate=config.aggregate) if backend == TE else runnable


SPEC = SearchSpec(
    method=Method.RING_EXCHANGE,
    tree=_tree,
    te_tree=_te_tree,
    te_slots=_ALL_GATHERS | {Slot.PROJ_FPROP, Slot.FC2_FPROP, Slot.QKV_DGRAD, Slot.FC1_DGRAD},
    te_default_slots=_ALL_GATHERS,
    te_defaults={"num_sm": 1, "cga_size": 1, "set_sm_margin": False, "num_splits": None},
    te_streams=_te_streams,
    atomic_pairs=True,
    nvidia_keys={Collective.ALL_GATHER: ("aggregate",), Collective.REDUCE_SCATTER: ("num_sm", "set_sm_margin")},
    bridge=CfgClass(
        name="RingExchangeOverlapCfg",
        base=ENTRY,
        fields={
            "aggregate": False,
            "method": "ring_exchange",
            "num_sm": 1,
            "cga_size": 1,
            "set_sm_margin": False,
            "fp8_buf": False,
            "atomic_gemm": False,
        },
    ),
    runnable=_runnable,
)
