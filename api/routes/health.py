"""``GET /livez``, ``GET /readyz`` and ``GET /healthz``: Kubernetes' liveness and readiness probes, and the
full health answer that came before them.

``/livez`` says the process's event loop answers: an ``async`` route with no dependency, so it touches no
database, waits for no thread of the pool (where every sync route queues) and holds no lock; a controller
whose database is down is alive, and restarting it would not help.  ``/readyz`` reads the database once
(``SELECT 1``): 503 while it does not answer, so a load balancer sends requests elsewhere meanwhile.

``GET /healthz``: the process answers and its database does, reads and writes.

It tells the truth about writes: a read-only database or a full disk still answers reads, so the probe
also writes one row (`storage.probe_write`) and answers 503 with ``"status": "degraded"`` and the public
reason when that fails.  On SQLite a failed write also gives the WAL's space back (`storage.reclaim`), which
is how a controller recovers once a full disk has room again.

It also says who schedules: whether this process holds the scheduler lease, and who does.  Several
controller processes answer on one address (replicas, ``serve --workers N``), so ``leading`` describes
whichever one answered, while ``leader`` is the same for all of them.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from sqlalchemy.orm import Session

import storage
from api.deps import SettingsDep
from api.errors import RETRY_AFTER_S
from api.schemas import ErrorPublic, HealthPublic, LivePublic, ReadyPublic

router = APIRouter(tags=["health"])


@router.get("/livez")
async def livez() -> LivePublic:
    """200 while the process's event loop answers; reads nothing, waits for nothing."""
    return LivePublic(status="ok")


@router.get("/readyz", responses={503: {"model": ErrorPublic, "description": "The database does not answer"}})
def readyz(request: Request) -> ReadyPublic:
    """200 when the database answers a read; 503 (a `StorageError`, with ``Retry-After``) when it does not."""
    with request.app.state.sessions() as session:
        storage.probe_read(session=session)
    return ReadyPublic(status="ok", database=request.app.state.engine.dialect.name)


@router.get(
    "/healthz",
    responses={503: {"model": HealthPublic | ErrorPublic, "description": "Writes fail (degraded), or reads too"}},
)
def healthz(request: Request, response: Response, settings: SettingsDep) -> HealthPublic:
    """200 when the database answers and takes a write; 503 with ``"status": "degraded"`` and the reason
    when it answers but writes fail; 503 (a `StorageError`) when it does not answer."""
    engine = request.app.state.engine
    with request.app.state.sessions() as session:
        leader = storage.get_leader(session=session, name=storage.SCHEDULER)
        holder = None if leader is None else leader.holder  # read before the probe: a failed write expires it
        problem = _write_problem(request, session)
    if problem is not None:
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    loop = request.app.state.scheduler
    return HealthPublic(
        status="ok" if problem is None else "degraded",
        writable=problem is None,
        problem=problem,
        database=engine.dialect.name,
        revision=storage.current_revision(engine=engine),
        scheduler=settings.scheduler,
        leading=loop is not None and holder is not None and holder == loop.scheduler.leadership.holder,
        leader=holder,
        auth=settings.auth_required,
        worker_auth=settings.worker_token is not None,
    )


def _write_problem(request: Request, session: Session) -> str | None:
    """None when a write commits; else the public reason.  A failed write also gives SQLite's WAL space back
    (`storage.reclaim`) for the writes that follow; this answer still says it failed, the next probe says
    whether writing works again."""
    try:
        storage.probe_write(session=session)
        return None
    except storage.StorageError as e:
        request.app.state.outage_log.warning("health", "writes fail: %s", e)
        storage.reclaim(engine=request.app.state.engine)
        return f"writes fail: {storage.public_reason(e)}"
