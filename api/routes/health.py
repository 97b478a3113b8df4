"""``GET /healthz``: the process answers and its database does (a load balancer's readiness probe).

It also says who schedules: whether this process holds the scheduler lease, and who does.  Several
controller processes answer on one address (replicas, ``serve --workers N``), so ``leading`` describes
whichever one answered, while ``leader`` is the same for all of them.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

import storage
from api.deps import SettingsDep
from api.schemas import HealthPublic

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz(request: Request, settings: SettingsDep) -> HealthPublic:
    """200 with the schema revision when the database answers; 503 (a `StorageError`) when it does not."""
    engine = request.app.state.engine
    with request.app.state.sessions() as session:
        leader = storage.get_leader(session=session, name=storage.SCHEDULER)
    loop = request.app.state.scheduler
    return HealthPublic(
        status="ok",
        database=engine.dialect.name,
        revision=storage.current_revision(engine=engine),
        scheduler=settings.scheduler,
        leading=loop is not None and leader is not None and leader.holder == loop.scheduler.leadership.holder,
        leader=None if leader is None else leader.holder,
        auth=settings.auth_required,
    )
