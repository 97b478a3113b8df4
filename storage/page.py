"""Offset pagination shared by every list endpoint: a page of rows plus the total, in one call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

T = TypeVar("T")

MAX_PAGE_SIZE = 1000
"""Caps a page so one request cannot pull a whole trials table into memory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Page(Generic[T]):
    items: list[T]
    total: int
    """Rows matching the filter, on all pages."""
    limit: int
    offset: int


def paginate(*, session: Session, stmt: Select[Any], limit: int, offset: int) -> Page[Any]:
    """Run ``stmt`` (already filtered and ordered) for one page, and count all its rows."""
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ValueError(f"limit: must be between 1 and {MAX_PAGE_SIZE} (got {limit})")
    if offset < 0:
        raise ValueError(f"offset: must be >= 0 (got {offset})")
    total = session.scalar(select(func.count()).select_from(stmt.order_by(None).subquery())) or 0
    items = list(session.scalars(stmt.limit(limit).offset(offset)))
    return Page(items=items, total=total, limit=limit, offset=offset)
