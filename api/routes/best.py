"""``GET /v1/best``: each slot's winning config for a shape, with the measurement that made it win.

The answer is served from `api.cache` for up to ``AUTOTUNE_BEST_CACHE_S`` (1 s): launch scripts ask this
often, and winners change minutes apart.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from sqlalchemy.orm import Session

from api.deps import BestCacheDep, RegistryDep, SessionsDep, ShapeQueryDep
from api.lookup import measured_groups, nearest
from api.schemas import BestPublic, ErrorPublic
from search_spaces import PresetRegistry
from search_spaces.shape_query import ShapeQuery

router = APIRouter(prefix="/v1", tags=["best"])


@router.get("/best", response_model=BestPublic, responses={422: {"model": ErrorPublic}})
async def get_best(query: ShapeQueryDep, sessions: SessionsDep, registry: RegistryDep, cache: BestCacheDep) -> Response:
    """Measured winners for exactly this shape; else the nearest known preset, marked ``measured: false``."""

    def answer() -> bytes:
        with sessions() as session:
            return _answer(session=session, registry=registry, query=query).model_dump_json().encode()

    return Response(await cache.get(query, answer), media_type="application/json")


def _answer(*, session: Session, registry: PresetRegistry, query: ShapeQuery) -> BestPublic:
    groups = measured_groups(session=session, query=query)
    if groups:
        return BestPublic(measured=True, results=groups, nearest=None, nearest_layers=[])
    _, described, layers = nearest(registry=registry, query=query)
    return BestPublic(measured=False, results=[], nearest=described, nearest_layers=layers)
