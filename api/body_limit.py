"""The request body limit, enforced before anything reads, parses or authenticates the body (issue 29).

A pure ASGI middleware, outermost of ours: a ``Content-Length`` over the limit is answered 413 at once,
before a byte of the body is read, and a body without one (chunked) is counted as it streams in and cut
off with the same 413 the moment it passes the limit.  So a 12 MB upload costs the controller one header
check, whichever token it carries (FastAPI reads a body before it solves the auth dependencies), and
nothing a client sends can make a route parse more than the limit.  A slow body only holds its own
request: the middleware awaits nothing but that request's own ``receive``.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, status
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error, respond


def _too_large(limit: int, size: int | None) -> list[dict[str, Any]]:
    return [error("body", f"must be at most {limit} bytes (AUTOTUNE_MAX_BODY_BYTES)", size)]


class BodyLimit:
    """Answer 413 (field ``body``, naming the limit) for a request body over ``max_bytes``."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            # The connection stays open: uvicorn drops the rest of the body as it arrives, so a client that
            # sends its whole body before it reads the answer (httpx, curl) still gets the 413.
            await respond(status.HTTP_413_CONTENT_TOO_LARGE, _too_large(self.max_bytes, int(declared)))(
                scope, receive, send
            )
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # An `HTTPException`: FastAPI turns anything else a body read raises into a 400 "error
                    # parsing the body", but lets this one through to the app's handler (`api.errors`).
                    raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, detail=_too_large(self.max_bytes, None))
            return message

        await self.app(scope, counting_receive, send)
