"""The steps that several methods' knob trees share, and the choice lists they ask from
(`search_spaces.space`: one name, one choice list per space)."""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from overlap_runtime.knobs import TE_NUM_MAX_STREAMS
from search_spaces.methods.spec import Param, Tree

if TYPE_CHECKING:
    from search_spaces.space import SlotSpace

CGA_SIZES = (1, 2, 4)
"""Comm kernel cluster sizes; Megatron-Bridge's guide: 1-4, at most num_sm."""
STREAMS = tuple(range(1, TE_NUM_MAX_STREAMS + 1))
"""Compute streams the chunk GEMMs rotate over; TE fixes 3."""


def cga(space: SlotSpace, te_default: int, num_sm: int) -> Generator[Param, Any, int]:
    """The comm kernel's cluster size: asked from num_sm 4 on, where every size fits; below, TE's default
    capped at num_sm."""
    if num_sm >= max(CGA_SIZES):
        return (yield space.params["cga_size"])
    return min(te_default, num_sm)


def streams(space: SlotSpace, chunks: int, *, always: bool) -> Generator[Param, Any, int]:
    """Compute streams the ``chunks`` chunk GEMMs rotate over; TE fixes min(3, chunks).

    Copy-engine ring exchange asks it ``always``: on the H200s one stream often wins at tp=2 even with
    cuBLAS (bench/results), which TE's fixed count never tries.  Pipeline asks it with our Triton GEMM only, where
    the streams decide how its SM-bounded chunks overlap; with cuBLAS it runs as TE runs it, which also
    keeps the pipeline grids (the largest of the catalog) to a few hundred configs.
    """
    if always or chunks >= len(STREAMS):
        return (yield space.params["num_max_streams"])
    return min(TE_NUM_MAX_STREAMS, chunks)


def priorities(space: SlotSpace) -> Tree:
    """The stream priorities, on the te backend: TE's default or swapped (`search_spaces.te_space`)."""
    knobs: dict[str, Any] = {}
    knobs["comm_priority"] = yield space.params["comm_priority"]
    knobs["gemm_priority"] = yield space.params["gemm_priority"]
    return knobs
