"""A lookup's shape: the dimensions asked about and the filter fields that narrow the answer.

``GET /v1/best``, ``GET /v1/presets`` and `load_ub_cfgs` all ask "what was tuned for this shape" the same way:
hidden, tp, seq (and mbs) name the dimensions, and each filter field given (ffn_hidden, gated, cp, ...:
`ModelShape`'s fields marked as filters; one left out matches any value) narrows the answer to the stored
shapes that agree with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from overlap_runtime.errors import ShapeError
from overlap_runtime.shape import ModelShape, shape_fields

FILTERS = tuple(f.name for f in shape_fields() if f.facts.filter)
"""The shape fields a lookup narrows by, in field order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeQuery:
    """The shape asked about, the filter fields that were given, and the optional GPU model."""

    shape: ModelShape
    """The fields given, the others at their defaults: the dimensions looked up, and the nearest preset's target."""
    filters: tuple[tuple[str, Any], ...]
    """(field, value) of each filter given; a stored shape matches when it agrees with every one."""
    gpu: str | None

    @property
    def dtype(self) -> str | None:
        dtype = dict(self.filters).get("dtype")
        return None if dtype is None else str(dtype)

    def matches(self, stored: ModelShape) -> bool:
        """Whether ``stored`` agrees with each filter: given the filters' values it stays the same shape key,
        so a filter agrees with a field that spells the same size another way (ffn_hidden=4*hidden, unset)."""
        try:
            return replace(stored, **dict(self.filters)).key == stored.key
        except ShapeError:  # the filters cannot even describe this shape (num_query_groups without its heads)
            return False


def query_for(given: Mapping[str, object], *, gpu: str | None = None) -> ShapeQuery:
    """The lookup of the shape fields ``given`` (each filter field given narrows it), as a query asks it."""
    filters = tuple((name, given[name]) for name in FILTERS if name in given)
    return ShapeQuery(shape=ModelShape(**given), filters=filters, gpu=gpu)  # type: ignore[arg-type]
