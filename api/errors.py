"""Every error answer has one shape, ``{"detail": [{"field", "rule", "value"}, ...]}``, whatever raised it.

`STATUS` is the one place an exception becomes an HTTP status (docs/rest.md, Errors).  Bad input is a 4xx
that names the field and the rule it broke, never a 5xx: pydantic's validation errors and our `InputError`
become 422, storage's `NotFound` 404, `LeaseLost` and `Conflict` 409.  Only a database that fails
(`StorageError`) is a 5xx: 503 with ``Retry-After``, since retrying later is the right reaction; its body
says what failed in public words, never the server's address.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from overlap_runtime.errors import InputError, LeaseLost
from storage import Conflict, NotFound, StorageError, public_reason

MAX_VALUE_CHARS = 200
"""Echo at most this much of a bad value back: enough to recognise it, not a copy of a huge body."""
MAX_ITEMS = 30
"""List at most this many errors in one answer, then one item saying how many more were left out: a body
with 20,000 unknown keys answers a few kilobytes, not megabytes (issue 29)."""
_LOCATIONS = ("body", "query", "path", "header", "cookie")
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def error(field: str, rule: str, value: Any = None) -> dict[str, Any]:
    return {"field": json_safe(field), "rule": json_safe(rule), "value": _echo(value)}


def _echo(value: Any) -> Any:
    try:
        encoded = json_safe(jsonable_encoder(value))
    except Exception:
        encoded = json_safe(repr(value))
    text = str(encoded)
    return encoded if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS] + "..."


def json_safe(value: Any) -> Any:
    """``value`` as strict JSON can carry it: a non-finite float becomes the text JSON5 writes (``NaN``,
    ``Infinity``), a lone surrogate its ``\\udXXX`` escape.  The bad value being echoed is often exactly such
    a thing (a body sent ``NaN``), and a handler that cannot encode its own answer is a 500."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def respond(code: int, items: list[dict[str, Any]], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=code, content={"detail": items}, headers=headers)


def _validation_items(_request: Request, exc: RequestValidationError) -> list[dict[str, Any]]:
    found = exc.errors()
    items = []
    for e in found[:MAX_ITEMS]:
        loc = [str(p) for p in e.get("loc", ())]
        field = ".".join(loc[1:] if loc and loc[0] in _LOCATIONS and len(loc) > 1 else loc) or "body"
        value = None if e.get("type") == "missing" else e.get("input")
        items.append(error(field, e.get("msg", "is invalid"), value))
    if len(found) > MAX_ITEMS:
        left_out = len(found) - MAX_ITEMS
        items.append(error("detail", f"{left_out} more errors left out (at most {MAX_ITEMS} are listed)", left_out))
    return items


def _database_items(request: Request, exc: StorageError) -> list[dict[str, Any]]:
    """The public reason only (`storage.public_reason`: no host, port or statement); the whole message goes
    to the log, once per while however many requests fail alike (`api.logs`)."""
    request.app.state.outage_log.warning("database", "requests fail, the database is unavailable: %s", exc)
    return [error("database", f"is unavailable ({public_reason(exc)}); retry later")]


ItemsOf = Callable[[Request, Any], list[dict[str, Any]]]

STATUS: dict[type[Exception], tuple[int, ItemsOf]] = {
    RequestValidationError: (status.HTTP_422_UNPROCESSABLE_CONTENT, _validation_items),
    InputError: (status.HTTP_422_UNPROCESSABLE_CONTENT, lambda _r, e: [error(e.field, e.rule, e.value)]),
    NotFound: (status.HTTP_404_NOT_FOUND, lambda r, e: [error(", ".join(r.path_params) or "id", str(e))]),
    LeaseLost: (status.HTTP_409_CONFLICT, lambda _r, e: [error("lease", str(e))]),
    Conflict: (status.HTTP_409_CONFLICT, lambda _r, e: [error("status", str(e))]),
    StorageError: (status.HTTP_503_SERVICE_UNAVAILABLE, _database_items),
}
"""Exception class -> (HTTP status, the error items that name what went wrong); the nearest class in the
raised exception's MRO decides, as Starlette picks handlers (so `NotFound` wins over `StorageError`)."""


RETRY_AFTER_S = 5
"""What a 503 asks the caller to wait: a database that failed is usually back within seconds."""


async def _answer(request: Request, exc: Exception) -> JSONResponse:
    code, items = next(STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if code == status.HTTP_503_SERVICE_UNAVAILABLE else None
    return respond(code, items(request, exc), headers=headers)


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)  # registered for HTTPException only (Starlette types handlers by Exception)
    if isinstance(exc.detail, list):
        items = exc.detail
    elif exc.status_code == status.HTTP_404_NOT_FOUND:
        items = [error("path", "no such resource", request.url.path)]
    elif exc.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
        allowed = _allowed_methods(request)
        items = [error("method", f"must be one of {', '.join(allowed)} on {request.url.path}", request.method)]
        return respond(exc.status_code, items, headers={"Allow": ", ".join(allowed)})
    else:
        items = [error("request", str(exc.detail))]
    return respond(exc.status_code, items, headers=dict(exc.headers) if exc.headers else None)


def _allowed_methods(request: Request) -> list[str]:
    """Methods some route answers on this path (Starlette's own 405 names only the first route's)."""
    return [
        method
        for method in HTTP_METHODS
        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in request.app.routes)
    ]


def install(app: FastAPI) -> None:
    """Register `_answer` for every class of `STATUS`, and the answer to Starlette's own HTTP errors."""
    for cls in STATUS:
        app.add_exception_handler(cls, _answer)
    app.add_exception_handler(HTTPException, _http)
