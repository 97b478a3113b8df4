"""``GET /healthz``: the process answers and its database does (a load balancer's readiness probe)."""

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
    return HealthPublic(
        status="ok",
        database=engine.dialect.name,
        revision=storage.current_revision(engine=engine),
        scheduler=settings.scheduler,
        auth=settings.auth_required,
    )
