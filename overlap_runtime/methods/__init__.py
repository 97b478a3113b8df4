"""The overlap methods: one spec per method and the registry of them (docs/architecture.md, Methods).

A method's runtime side is its module here (its `MethodSpec`: rules, TE names and keys, rs-dgrad, where its
runner lives) and its runner module (``<method>_run``, written against `overlap_runtime.device.Device`, with
the pieces every method shares in `common`); its search side is one module of `search_spaces.methods`.
Everything else asks `METHODS` instead of naming a method.  This package's modules but the runners and
`common` import no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from overlap_runtime.knobs import Method
from overlap_runtime.methods import bulk, external, none, pipeline, ring_exchange
from overlap_runtime.methods.spec import MethodSpec

METHODS: Mapping[Method, MethodSpec] = MappingProxyType(
    {spec.method: spec for spec in (none.SPEC, ring_exchange.SPEC, pipeline.SPEC, bulk.SPEC, external.SPEC)}
)
"""Every method's spec, in `Method`'s order."""
BASELINE = none.SPEC.method
"""The method that overlaps nothing: every search includes it, and its serial run scores every config."""
TE_METHODS = tuple(method for method, spec in METHODS.items() if spec.te)
"""Every method TE runs (TE switches a slot's overlap off elsewhere, so the baseline is none of them)."""


def method_spec(method: Method | str) -> MethodSpec:
    """The spec of ``method`` (a `Method` or its value)."""
    return METHODS[Method(method)]
