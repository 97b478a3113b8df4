"""Every error answer has one shape, ``{"detail": [{"field", "rule", "value"}, ...]}``, whatever raised it.

Bad input is a 4xx that names the field and the rule it broke, never a 5xx: pydantic's validation errors
and our `InputError` become 422, storage's `NotFound` 404, `Conflict` and `LeaseLost` 409.  Only a database
that fails (`StorageError`) is a 5xx: 503, since retrying later is the right reaction.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from overlap_runtime.errors import InputError
from storage import Conflict, LeaseLost, NotFound, StorageError

log = logging.getLogger(__name__)

MAX_VALUE_CHARS = 200
"""Echo at most this much of a bad value back: enough to recognise it, not a copy of a huge body."""
_LOCATIONS = ("body", "query", "path", "header", "cookie")
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def error(field: str, rule: str, value: Any = None) -> dict[str, Any]:
    return {"field": field, "rule": rule, "value": _echo(value)}


def _echo(value: Any) -> Any:
    try:
        encoded = jsonable_encoder(value)
    except Exception:
        encoded = repr(value)
    text = str(encoded)
    return encoded if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS] + "..."


def _respond(code: int, items: list[dict[str, Any]], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=code, content={"detail": items}, headers=headers)


async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
    items = []
    for e in exc.errors():
        loc = [str(p) for p in e.get("loc", ())]
        field = ".".join(loc[1:] if loc and loc[0] in _LOCATIONS and len(loc) > 1 else loc) or "body"
        value = None if e.get("type") == "missing" else e.get("input")
        items.append(error(field, e.get("msg", "is invalid"), value))
    return _respond(status.HTTP_422_UNPROCESSABLE_CONTENT, items)


async def _input(_request: Request, exc: InputError) -> JSONResponse:
    return _respond(status.HTTP_422_UNPROCESSABLE_CONTENT, [error(exc.field, exc.rule, exc.value)])


async def _not_found(request: Request, exc: NotFound) -> JSONResponse:
    field = ", ".join(request.path_params) or "id"
    return _respond(status.HTTP_404_NOT_FOUND, [error(field, str(exc))])


async def _lease_lost(_request: Request, exc: LeaseLost) -> JSONResponse:
    return _respond(status.HTTP_409_CONFLICT, [error("lease", str(exc))])


async def _conflict(_request: Request, exc: Conflict) -> JSONResponse:
    return _respond(status.HTTP_409_CONFLICT, [error("status", str(exc))])


async def _storage(_request: Request, exc: StorageError) -> JSONResponse:
    log.error("database error: %s", exc)
    return _respond(status.HTTP_503_SERVICE_UNAVAILABLE, [error("database", f"is unavailable: {exc}")])


async def _http(request: Request, exc: HTTPException) -> JSONResponse:
    if isinstance(exc.detail, list):
        items = exc.detail
    elif exc.status_code == status.HTTP_404_NOT_FOUND:
        items = [error("path", "no such resource", request.url.path)]
    elif exc.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
        allowed = _allowed_methods(request)
        items = [error("method", f"must be one of {', '.join(allowed)} on {request.url.path}", request.method)]
        return _respond(exc.status_code, items, headers={"Allow": ", ".join(allowed)})
    else:
        items = [error("request", str(exc.detail))]
    return _respond(exc.status_code, items, headers=exc.headers)


def _allowed_methods(request: Request) -> list[str]:
    """Methods some route answers on this path (Starlette's own 405 names only the first route's)."""
    return [
        method
        for method in HTTP_METHODS
        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in request.app.routes)
    ]


def install(app: FastAPI) -> None:
    """Register the handlers; the most specific storage errors first (handlers match by class)."""
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(InputError, _input)
    app.add_exception_handler(NotFound, _not_found)
    app.add_exception_handler(LeaseLost, _lease_lost)
    app.add_exception_handler(Conflict, _conflict)
    app.add_exception_handler(StorageError, _storage)
    app.add_exception_handler(HTTPException, _http)
