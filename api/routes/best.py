"""``GET /v1/best``: each slot's winning config for a shape, with the measurement that made it win.

The answer is served from `api.cache` for up to ``AUTOTUNE_BEST_CACHE_S`` (1 s): launch scripts ask this
often, and winners change minutes apart.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from sqlalchemy.orm import Session

from api.deps import BestCacheDep, RegistryDep, SessionsDep, ShapeQueryDep
from api.lookup import measured_groups, nearest, with_consumer
from api.schemas import BestPublic, ErrorPublic
from search_spaces import Consumer, PresetRegistry
from search_spaces.shape_query import ShapeQuery

router = APIRouter(prefix="/v1", tags=["best"])


@router.get("/best", response_model=BestPublic, responses={422: {"model": ErrorPublic}})
async def get_best(
    query: ShapeQueryDep,
    sessions: SessionsDep,
    registry: RegistryDep,
    cache: BestCacheDep,
    consumer: Annotated[
        Consumer | None,
        Query(description="Also give this consumer's joint winner: its switches and what each slot runs under them"),
    ] = None,
) -> Response:
    """Measured winners for exactly this shape; else the nearest known preset, marked ``measured: false``."""

    def answer() -> bytes:
        with sessions() as session:
            found = _answer(session=session, registry=registry, query=query, consumer=consumer)
            return found.model_dump_json().encode()

    return Response(await cache.get((query, consumer), answer), media_type="application/json")


def _answer(*, session: Session, registry: PresetRegistry, query: ShapeQuery, consumer: Consumer | None) -> BestPublic:
    groups = measured_groups(session=session, query=query)
    if consumer is not None:
        groups = [with_consumer(group, consumer) for group in groups]
    if groups:
        return BestPublic(measured=True, results=groups, nearest=None, nearest_layers=[])
    _, described, layers = nearest(registry=registry, session=session, query=query)
    return BestPublic(measured=False, results=[], nearest=described, nearest_layers=layers)
