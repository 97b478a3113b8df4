"""none's search side: the baseline, searched in every tuned slot on every backend, with nothing to choose.
TE cannot express it, so no preset carries it (`search_spaces.presets`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlap_runtime.knobs import Method
from overlap_runtime.shape import SlotGemm
from search_spaces.methods.spec import SearchSpec, Tree

if TYPE_CHECKING:
    from search_spaces.space import SlotSpace


def no_overlap(space: SlotSpace, gemm: SlotGemm) -> Tree:
    """Collective then GEMM: nothing to choose."""
    yield from ()
    return {}


SPEC = SearchSpec(method=Method.NONE, tree=no_overlap, te_tree=no_overlap)
