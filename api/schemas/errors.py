"""Every 4xx body: each problem names the field, the rule and the value."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorItem(BaseModel):
    field: str
    rule: str
    value: Any = None


class ErrorPublic(BaseModel):
    """Every 4xx: each problem names the field and the rule it broke."""

    detail: list[ErrorItem]
