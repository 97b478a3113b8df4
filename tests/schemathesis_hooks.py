"""Schemathesis hooks (``SCHEMATHESIS_HOOKS=schemathesis_hooks``): besides the bodies and queries it makes
from the schema, every operation also gets them with one value replaced by something JSON or a URL can
carry but a careful server must refuse with a 4xx: a non-finite number (``NaN``, ``Infinity``, sent as
Python's ``json`` writes them), a lone surrogate, a NUL, and odd but valid Unicode.

Schemathesis only makes what the schema allows, and JSON Schema has no NaN, so without these the run never
sent the bodies that got 500s (issue 21, item 6).
"""

from __future__ import annotations

import json
import math
from typing import Any

import schemathesis
from hypothesis import strategies as st

ODD_TEXT = ("\U0010ffff", "\u202eevil", "ｈ２００", "e\u0301", "🙂" * 40, "\ufeff", "")
"""Valid Unicode that breaks naive code: the last code point, right-to-left override, full-width letters, a
combining accent, astral emoji, a byte-order mark, the empty string."""
BODY_VALUES: tuple[Any, ...] = (math.nan, math.inf, -math.inf, 1e308, -0.0, "\ud800", "a\udfffb", "\x00", *ODD_TEXT)
QUERY_VALUES = ("NaN", "Infinity", "-Infinity", "1e999", "-0", *ODD_TEXT)
"""A URL carries text only, and cannot carry a lone surrogate at all."""


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _leaves(v, (*path, k))] or [path]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _leaves(v, (*path, i))] or [path]
    return [path]


def _replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replaced(value[head], rest, new)}
    copy = list(value)
    copy[head] = _replaced(copy[head], rest, new)
    return copy


@schemathesis.hook
def flatmap_body(_context: Any, body: Any) -> st.SearchStrategy[Any]:
    nasty = st.tuples(st.sampled_from(_leaves(body)), st.sampled_from(BODY_VALUES))
    return st.one_of(st.just(body), nasty.map(lambda change: _replaced(body, *change)))


@schemathesis.hook
def flatmap_query(_context: Any, query: dict[str, Any] | None) -> st.SearchStrategy[Any]:
    if not query:
        return st.just(query)
    nasty = st.tuples(st.sampled_from(sorted(query)), st.sampled_from(QUERY_VALUES))
    return st.one_of(st.just(query), nasty.map(lambda change: {**query, change[0]: change[1]}))


@schemathesis.serializer("application/json")
def json_with_non_finite_numbers(_context: Any, value: Any) -> bytes:
    """JSON as Python's ``json`` writes it, ``NaN`` and ``Infinity`` included: the HTTP client's own encoder
    refuses to send them, and sending them is the point."""
    return value if isinstance(value, bytes) else json.dumps(value).encode()
