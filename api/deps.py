"""Route dependencies as `Annotated` aliases: the settings, a database session, the preset registry, a shape
query, auth.

Everything a route needs hangs off ``app.state`` (set once by `api.main.create_app`), so two apps in one
process (tests, the load benchmark) never share a database or a token.  The dependencies are ``async``
although they do no I/O: FastAPI runs a sync dependency in the thread pool, a thread hop per dependency
per request for what is an attribute read.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Query, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr
from sqlalchemy.orm import Session, sessionmaker

import storage
from api.cache import AnswerCache
from api.metrics import Metrics
from api.schemas import ShapeLookup
from api.settings import Settings
from search_spaces import PresetRegistry
from search_spaces.shape_query import ShapeQuery, query_for

bearer = HTTPBearer(auto_error=False, description="The controller's token (AUTOTUNE_TOKEN)")
registration_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="WorkerToken",
    description="The controller's worker token (AUTOTUNE_WORKER_TOKEN); its token (AUTOTUNE_TOKEN) where it has none",
)
admin_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="AdminToken",
    description="The controller's admin token (AUTOTUNE_ADMIN_TOKEN); its token (AUTOTUNE_TOKEN) where it has none",
)
worker_bearer = HTTPBearer(
    auto_error=False, scheme_name="WorkerSecret", description="The worker's own secret, from its registration"
)


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


async def get_wake(request: Request) -> Callable[[], None]:
    """Wakes this process's scheduler for a pass now (`SchedulerThread.wake`); does nothing where the process runs
    none (``AUTOTUNE_SCHEDULER=false``): the leader elsewhere sees the change at its next pass."""
    loop = request.app.state.scheduler
    return _nothing if loop is None else loop.wake


def _nothing() -> None:
    pass


async def get_registry(request: Request) -> PresetRegistry:
    return request.app.state.registry


async def get_best_cache(request: Request) -> AnswerCache:
    return request.app.state.best_cache


async def get_shape_query(params: Annotated[ShapeLookup, Query()]) -> ShapeQuery:
    """Query parameters -> a validated shape (a 422 naming the field when TE could not run it)."""
    return query_for(params.model_dump(exclude_none=True, exclude={"gpu"}), gpu=params.gpu)


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
WakeDep = Annotated[Callable[[], None], Depends(get_wake)]
RegistryDep = Annotated[PresetRegistry, Depends(get_registry)]
BestCacheDep = Annotated[AnswerCache, Depends(get_best_cache)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
ShapeQueryDep = Annotated[ShapeQuery, Depends(get_shape_query)]


async def require_token(
    settings: SettingsDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    """Let the request through with the right bearer token, or when the controller runs without one (--no-auth)."""
    if settings.token is None:
        return
    _require_bearer(
        credentials, settings.token, "the controller's token", "AUTOTUNE_TOKEN",
        other=settings.worker_token,
        other_rule="is the worker token, which only registers workers: send the clients' token (AUTOTUNE_TOKEN)",
    )  # fmt: skip


async def require_registration(
    request: Request,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(registration_bearer)],
) -> None:
    """Let a worker registration through with the controller's worker token, or, where it has none, with the
    clients' token (`require_token`); or with an enrolment token, spent by this registration.

    Registering is what lets a process claim any job's trials and report on them, so with a worker token set
    the clients' token, shared by every user, is refused here; and the worker token passes no client write,
    as `Settings.check_auth` keeps the two different.  An enrolment token (`storage.enrolments`) registers one
    worker, once, before it expires: the database is asked only when no token of the settings matched.
    """
    try:
        await _require_own_token(
            settings, credentials, settings.worker_token, "worker token", "AUTOTUNE_WORKER_TOKEN", "register workers"
        )
    except HTTPException:
        if credentials is None or not await run_in_threadpool(_enrol, request, credentials.credentials):
            raise


def _enrol(request: Request, token: str) -> bool:
    with request.app.state.sessions() as session:
        return storage.use_enrolment(session=session, token=token)


async def require_admin(
    settings: SettingsDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(admin_bearer)]
) -> None:
    """Let a revocation through with the controller's admin token, or, where it has none, with the clients'
    token (`require_token`); under --no-auth, with nothing."""
    await _require_own_token(
        settings, credentials, settings.admin_token, "admin token", "AUTOTUNE_ADMIN_TOKEN", "revoke workers"
    )


async def _require_own_token(
    settings: Settings,
    credentials: HTTPAuthorizationCredentials | None,
    own: SecretStr | None,
    name: str,
    variable: str,
    power: str,
) -> None:
    """Let the request through with the controller's credential ``own`` for ``power``, refusing the clients'
    token by name; where the controller has no such credential, with the clients' token (`require_token`)."""
    if own is None:
        await require_token(settings, credentials)
        return
    _require_bearer(
        credentials, own, f"the controller's {name}", variable,
        other=settings.token,
        other_rule=f"is the clients' token, which does not {power}: send the {name} ({variable})",
    )  # fmt: skip


def _require_bearer(
    credentials: HTTPAuthorizationCredentials | None,
    expected: SecretStr,
    name: str,
    variable: str,
    *,
    other: SecretStr | None,
    other_rule: str,
) -> None:
    """Return when ``credentials`` carry ``expected``; else raise the 401 with the rule they broke, which is
    ``other_rule`` when they carry the controller's other credential ``other`` instead."""
    if credentials is None:
        raise _unauthorized(f"is required: send 'Authorization: Bearer <token>' ({name}, {variable})")
    if _matches(credentials, expected):
        return
    if other is not None and _matches(credentials, other):
        raise _unauthorized(other_rule)
    raise _unauthorized(f"bearer token does not match {name}")


def _matches(credentials: HTTPAuthorizationCredentials, expected: SecretStr) -> bool:
    """Compared in constant time: how long the answer takes tells nothing of how much of the token was right."""
    return secrets.compare_digest(credentials.credentials.encode(), expected.get_secret_value().encode())


def require_worker(
    worker_id: uuid.UUID,
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(worker_bearer)],
) -> str:
    """The worker's id once the call carries that worker's own secret (from its registration); 401 otherwise,
    404 for a worker the controller does not know (it registers again).

    Worker ids are public (``GET /v1/workers``) and the clients' token is shared by every user, so neither
    may speak for a worker: only the secret the controller handed to that one registration does.  A sync
    dependency: it reads the database, which must not block the event loop.
    """
    if credentials is None:
        raise _unauthorized("is required: send 'Authorization: Bearer <secret>' (the worker's registration secret)")
    if not storage.authenticate_worker(session=session, worker_id=str(worker_id), secret=credentials.credentials):
        raise _unauthorized(f"is not the secret worker {worker_id} got at registration")
    return str(worker_id)


def _unauthorized(rule: str) -> HTTPException:
    return HTTPException(
        status_code=status.HTTP_401_UNAUTHORIZED,
        detail=[{"field": "Authorization", "rule": rule, "value": None}],
        headers={"WWW-Authenticate": "Bearer"},
    )


Authorized = Depends(require_token)
"""Put in a route's ``dependencies=[...]`` for writes (the clients' token)."""
Registration = Depends(require_registration)
"""Put in the worker registration's ``dependencies=[...]`` (the worker token, or the clients' where there is none;
or an enrolment token)."""
Admin = Depends(require_admin)
"""Put in a revocation's or enrolment's ``dependencies=[...]`` (the admin token, or the clients' where there is
none)."""
WorkerId = Annotated[str, Depends(require_worker)]
"""A worker call's worker id, authenticated by that worker's secret."""
LeaseNonce = Annotated[
    str,
    Header(
        alias="X-Lease-Nonce",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="The lease nonce of the claim (`lease_nonce`): only the holder of this very lease reports on it",
    ),
]
