"""The overlap methods' search side: one spec per method and the registry of them (docs/architecture.md,
Methods).  A method's runtime side is `overlap_runtime.methods`; everything in `search_spaces` that depends
on the method asks `SEARCH_SPECS` instead of naming it."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from overlap_runtime.knobs import Method
from search_spaces.methods import bulk, external, none, pipeline, ring_exchange
from search_spaces.methods.spec import SearchSpec

SEARCH_SPECS: Mapping[Method, SearchSpec] = MappingProxyType(
    {spec.method: spec for spec in (none.SPEC, ring_exchange.SPEC, pipeline.SPEC, bulk.SPEC, external.SPEC)}
)
"""Every method's search spec, in `Method`'s order (`overlap_runtime.methods.METHODS` has the same keys)."""


def search_spec(method: Method | str) -> SearchSpec:
    """The search spec of ``method`` (a `Method` or its value)."""
    return SEARCH_SPECS[Method(method)]
