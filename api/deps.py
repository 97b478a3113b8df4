"""Route dependencies as `Annotated` aliases: the settings, a database session, the preset registry, auth.

Everything a route needs hangs off ``app.state`` (set once by `api.main.create_app`), so two apps in one
process (tests, the load benchmark) never share a database or a token.  The dependencies are ``async``
although they do no I/O: FastAPI runs a sync dependency in the thread pool, a thread hop per dependency
per request for what is an attribute read.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from api.cache import AnswerCache
from api.metrics import Metrics
from api.settings import Settings
from search_spaces import PresetRegistry

bearer = HTTPBearer(auto_error=False, description="The controller's token (AUTOTUNE_TOKEN)")


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_sessions(request: Request) -> sessionmaker[Session]:
    """The session factory itself, for work that runs beside a request's session (events, cached answers)."""
    return request.app.state.sessions


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session for one request, closed on the event loop.

    Async on purpose: FastAPI runs a sync generator's exit in the thread pool, and under load every pool
    thread can be a route waiting for a connection that only such an exit would return: a deadlock until
    the pool's timeout.  Closing here needs no thread, so connections come back as soon as routes finish.
    """
    session = request.app.state.sessions()
    try:
        yield session
    finally:
        session.close()


async def get_registry(request: Request) -> PresetRegistry:
    return request.app.state.registry


async def get_best_cache(request: Request) -> AnswerCache:
    return request.app.state.best_cache


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
RegistryDep = Annotated[PresetRegistry, Depends(get_registry)]
BestCacheDep = Annotated[AnswerCache, Depends(get_best_cache)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]


async def require_token(
    settings: SettingsDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    """Let the request through with the right bearer token, or when the controller runs without one (--no-auth)."""
    if settings.token is None:
        return
    if credentials is None:
        rule = "is required: send 'Authorization: Bearer <token>' (the controller's AUTOTUNE_TOKEN)"
    elif not secrets.compare_digest(credentials.credentials.encode(), settings.token.get_secret_value().encode()):
        rule = "bearer token does not match the controller's token"
    else:
        return
    raise HTTPException(
        status_code=status.HTTP_401_UNAUTHORIZED,
        detail=[{"field": "Authorization", "rule": rule, "value": None}],
        headers={"WWW-Authenticate": "Bearer"},
    )


Authorized = Depends(require_token)
"""Put in a route's ``dependencies=[...]`` for writes and worker calls."""
