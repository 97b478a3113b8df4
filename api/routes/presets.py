"""``GET /v1/presets``: the winning configs as a file the user's framework already knows how to load.

``format`` is one of the preset formats (`search_spaces.formats.FORMATS`: nemo, te, bridge, ours) and
``consumer`` who will run it (`search_spaces.consumers`: megatron, bridge, te-layer, te-modules; by default the
format's own, docs/export.md).  The TE formats carry each slot's TE-exact winner as the consumer's switches
make it run, with those switches in the file's header (the te format, a bare ``ub_cfgs`` dict, carries them in
its JSON answer).  When nothing was measured for the shape, the nearest known preset is returned instead and
says so: an ``X-Autotune-Measured: false`` header, a comment at the top of the file, ``measured: false`` in the
JSON.  ``format=ours`` is each slot's overall winner on our runtime; it exists only for measured shapes (404
otherwise).
"""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response, status
from sqlalchemy.orm import Session

from api.deps import RegistryDep, SessionDep, ShapeQueryDep
from api.errors import error
from api.lookup import measured_groups, measured_ours, measured_preset, nearest, nearest_line, one_group, tuned_nearby
from api.schemas import ErrorPublic, NearestPublic
from search_spaces import FORMATS, Consumer, Exported, FormatName, PresetError, PresetFormat, preset_json
from search_spaces.shape_query import ShapeQuery

router = APIRouter(prefix="/v1", tags=["presets"])

_CONTENT = {
    media: {"schema": {"description": " | ".join(f.help for f in FORMATS.values() if f.media_type == media)}}
    for media in {f.media_type for f in FORMATS.values()}
}


@router.get(
    "/presets",
    response_class=Response,
    responses={
        200: {"content": _CONTENT, "description": "The preset file"},
        404: {"model": ErrorPublic, "description": "format=ours for a shape never tuned"},
        422: {"model": ErrorPublic},
    },
)
def get_preset(
    query: ShapeQueryDep,
    session: SessionDep,
    registry: RegistryDep,
    format: Annotated[
        FormatName, Query(description="; ".join(f"{f.name.value}: {f.help}" for f in FORMATS.values()))
    ] = FormatName.NEMO,
    consumer: Annotated[
        Consumer | None,
        Query(description="Who runs the preset (its switches are chosen for it); the format's own by default"),
    ] = None,
    nearest_ok: Annotated[
        bool,
        Query(
            alias="nearest",
            description="For a shape never tuned: the nearest preset, marked (true), or a 404 naming the nearest "
            "shapes tuned here (false)",
        ),
    ] = True,
) -> Response:
    """The preset for a shape: measured winners under the export rule, else the nearest known preset (marked)."""
    fmt = FORMATS[format]
    made_for = consumer or fmt.consumer
    groups = measured_groups(session=session, query=query)
    described: NearestPublic | None = None
    if groups:
        group = one_group(groups)
        exported = Exported(preset=measured_preset(group, consumer=made_for), ours=measured_ours(group))
    elif format == FormatName.OURS:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, detail=[error("format", "ours: nothing was tuned for this shape", "ours")]
        )
    elif not nearest_ok:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=[error("shape", _never_tuned(session, query))])
    else:
        preset, described, _ = nearest(registry=registry, session=session, query=query, consumer=made_for)
        exported = Exported(preset=preset)
    headers = {"X-Autotune-Measured": "false" if described else "true"}
    if described is not None:
        headers["X-Autotune-Nearest"] = nearest_line(described)
    if format == FormatName.TE:
        body = {"measured": described is None, "nearest": described and described.model_dump()}
        body |= preset_json(exported.preset)
        headers["Content-Disposition"] = f'attachment; filename="{_file_name(fmt, exported)}"'
        return Response(json.dumps(body, indent=2) + "\n", media_type=fmt.media_type, headers=headers)
    headers["Content-Disposition"] = f'attachment; filename="{_file_name(fmt, exported)}"'
    return Response(_marked(fmt.write(exported), described), media_type=fmt.media_type, headers=headers)


def _file_name(fmt: PresetFormat, exported: Exported) -> str:
    try:
        return fmt.file_name(exported)
    except PresetError:  # a nearest preset without a shape in its name
        return f"preset{fmt.suffix}"


NEAREST_NAMED = 3
"""Tuned shapes a 404 for a shape never tuned names."""


def _never_tuned(session: Session, query: ShapeQuery) -> str:
    """The rule of a 404 for a shape never tuned: the nearest shapes tuned here, or that none was."""
    tuned = tuned_nearby(session=session, query=query)[:NEAREST_NAMED]
    if not tuned:
        return "was never tuned, and nothing was tuned here yet; ask for the nearest known preset (export --nearest)"
    named = "; ".join(t.text() for t in tuned)
    return f"was never tuned; the nearest tuned here: {named}; ask for the nearest one, marked (export --nearest)"


def _marked(text: str, described: NearestPublic | None) -> str:
    """``text`` (YAML or Python: both comment with #), behind a NOT MEASURED line when it is the nearest preset."""
    if described is None:
        return text
    warning = (
        f"# NOT MEASURED: nothing was tuned for this shape; this is the nearest known preset, {described.source}, "
        f"{described.distance:g} doublings away (shape {described.shape})\n"
        f"# nearest: {nearest_line(described)}\n"
    )
    return warning + text
