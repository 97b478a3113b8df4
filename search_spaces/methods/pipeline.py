"""pipeline's search side: ``num_splits`` output-feature chunks, the reduce-scatter of chunk i while chunk
i+1 computes, on proj_fprop / fc2_fprop and as RS-dgrad on qkv_dgrad / fc1_dgrad.

Its splits are 2..16 dividing the output width into chunks its dtype can run: the grid grows with the
divisors of the width (hidden 12288: 2, 3, 4, 6, 8, 12, 16), and a slot whose width has none in range runs
no pipeline.
"""

from __future__ import annotations

from dataclasses import MISSING
from typing import TYPE_CHECKING, Any

from overlap_runtime.config import OverlapConfig
from overlap_runtime.knobs import MAX_NUM_SPLITS, TE_NUM_MAX_STREAMS, Method
from overlap_runtime.shape import Collective, Slot, SlotGemm, splits_fit
from search_spaces.methods.spec import ENTRY, KERNEL_DEFAULTS, CfgClass, SearchSpec, Tree
from search_spaces.methods.trees import cga, priorities, streams

if TYPE_CHECKING:
    from search_spaces.space import SlotSpace

PIPELINE_MIN_SPLITS = 2
"""Pipeline with one split is GEMM then reduce-scatter: the no-overlap baseline already measures that."""


def pipeline_splits(gemm: SlotGemm) -> tuple[int, ...]:
    """num_splits values for pipeline: 2..16 dividing the output width into equal chunks the GEMM's dtype can run
    (`overlap_runtime.shape.splits_fit`)."""
    return tuple(n for n in range(PIPELINE_MIN_SPLITS, MAX_NUM_SPLITS + 1) if splits_fit(gemm, n))


def _tree(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """num_splits output chunks; the reduce-scatter of chunk i runs while chunk i+1 computes.

    At FP8 the partials may travel through an FP8 buffer (``fp8_buf``, half the bytes).  The SM margin is implied: without it the next GEMM chunk holds every SM and the chunk's
    reduce-scatter waits for it, which serializes the pipeline (TE's default and every Hopper preset set
    it).  cga_size stays at TE's 2 (every NVIDIA pipeline preset; the guide recommends <= 2): crossing it
    too would triple the largest grid of the catalog.
    """
    knobs: dict[str, Any] = {}
    knobs["num_splits"] = yield space.params["num_splits"]
    knobs["pipeline_rs_overlap_first_gemm"] = yield space.params["pipeline_rs_overlap_first_gemm"]
    if gemm.dtype == "fp8":  # NVIDIA's FP8 presets set it on every pipeline slot; its bf16 ones never
        knobs["fp8_buf"] = yield space.params["fp8_buf"]
    if space.cpu:
        return knobs
    knobs["num_sm"] = yield space.params["num_sm"]
    knobs["set_sm_margin"] = True
    knobs["cga_size"] = min(KERNEL_DEFAULTS["cga_size"], knobs["num_sm"])
    knobs["gemm"] = yield space.params["gemm"]
    if knobs["gemm"] == "triton":
        knobs["num_max_streams"] = yield from streams(space, knobs["num_splits"], always=False)
    else:
        knobs["num_max_streams"] = min(TE_NUM_MAX_STREAMS, knobs["num_splits"])
    return knobs


def _te_tree(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """TE's pipeline: splits, the first-GEMM order, the reduce-scatter kernel's SMs and clusters, the margin."""
    knobs: dict[str, Any] = {}
    knobs["num_splits"] = yield space.params["num_splits"]
    knobs["pipeline_rs_overlap_first_gemm"] = yield space.params["pipeline_rs_overlap_first_gemm"]
    knobs["num_sm"] = yield space.params["num_sm"]
    knobs["set_sm_margin"] = yield space.params["set_sm_margin"]
    knobs["cga_size"] = yield from cga(space, KERNEL_DEFAULTS["cga_size"], knobs["num_sm"])
    return knobs | (yield from priorities(space))


def _te_streams(config: OverlapConfig, tp: int) -> int | None:
    return None if config.num_splits is None else min(TE_NUM_MAX_STREAMS, config.num_splits)


SPEC = SearchSpec(
    method=Method.PIPELINE,
    tree=_tree,
    te_tree=_te_tree,
    choices={"num_splits": pipeline_splits},
    te_slots=frozenset({Slot.QKV_DGRAD, Slot.FC1_DGRAD, Slot.PROJ_FPROP, Slot.FC2_FPROP}),
    te_default_slots=frozenset({Slot.PROJ_FPROP, Slot.FC2_FPROP}),
    te_defaults=KERNEL_DEFAULTS,
    te_refusal="pipeline overlap is not supported for AllGather (TE raises ValueError)",
    te_streams=_te_streams,
    nvidia_keys={Collective.REDUCE_SCATTER: ("num_sm", "cga_size", "num_splits", "set_sm_margin")},
    bridge=CfgClass(
        name="PipelineOverlapCfg",
        base=ENTRY,
        fields={
            "num_sm": MISSING,
            "cga_size": MISSING,
            "num_splits": MISSING,
            "set_sm_margin": MISSING,
            "fp8_buf": (False,),  # sic: Bridge's default, a truthy tuple
            "atomic_gemm": False,
            "method": "pipeline",
        },
    ),
)
