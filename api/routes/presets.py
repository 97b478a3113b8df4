"""``GET /v1/presets``: the winning configs as a file TE users already know how to load.

``format=nemo`` (the default) is the NeMo/Megatron userbuffers YAML, named as NVIDIA names its files;
``format=te`` is the ``initialize_ub(ub_cfgs=...)`` dict as JSON; ``format=bridge`` a Python module defining
the preset with Megatron-Bridge's (or NeMo 2's) dataclasses (`search_spaces.bridge`).  All three carry each
slot's TE-exact winner (docs/export.md).  When nothing was measured for the shape, the nearest known preset
is returned instead and says so: an ``X-Autotune-Measured: false`` header, a comment at the top of the YAML,
``measured: false`` in the JSON.  ``format=ours`` is each slot's overall winner on our runtime in our own
YAML (`search_spaces.ours`); it exists only for measured shapes (404 otherwise).
"""

from __future__ import annotations

import enum
import json
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Response, status

from api.deps import RegistryDep, SessionDep, ShapeQueryDep
from api.errors import error
from api.lookup import measured_groups, measured_ours, measured_preset, nearest, one_group
from api.schemas import BestGroup, ErrorPublic, NearestPublic
from search_spaces import (
    Preset,
    bridge_file_name,
    ours_file_name,
    preset_file_name,
    preset_json,
    te_file_name,
    write_bridge,
    write_nemo,
    write_ours,
)

router = APIRouter(prefix="/v1", tags=["presets"])

YAML_MEDIA_TYPE = "application/yaml"
PYTHON_MEDIA_TYPE = "text/x-python"


class Format(enum.StrEnum):
    NEMO = "nemo"
    TE = "te"
    BRIDGE = "bridge"
    OURS = "ours"


_CONTENT = {
    YAML_MEDIA_TYPE: {
        "schema": {
            "description": "NeMo/Megatron ub_cfg YAML (TE slot name -> ub_cfgs entry), or format=ours: our own YAML"
        }
    },
    "application/json": {"schema": {"type": "object"}},
    PYTHON_MEDIA_TYPE: {"schema": {"description": "A Megatron-Bridge / NeMo 2 module defining the preset"}},
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
        Format,
        Query(
            description="nemo: NeMo/Megatron YAML; te: TE ub_cfgs as JSON; bridge: a Megatron-Bridge module; "
            "ours: our runtime's winners"
        ),
    ] = Format.NEMO,
) -> Response:
    """The preset for a shape: measured winners under the export rule, else the nearest known preset (marked)."""
    groups = measured_groups(session=session, query=query)
    if format == Format.OURS:
        return _ours(groups)
    described: NearestPublic | None = None
    if groups:
        preset = measured_preset(one_group(groups))
    else:
        preset, described, _ = nearest(registry=registry, query=query)
    headers = {"X-Autotune-Measured": "false" if described else "true"}
    if format == Format.TE:
        body: dict[str, Any] = {"measured": described is None, "nearest": described and described.model_dump()}
        body |= preset_json(preset)
        name = te_file_name(preset) if preset.shape is not None else "preset.json"
        headers["Content-Disposition"] = f'attachment; filename="{name}"'
        return Response(json.dumps(body, indent=2) + "\n", media_type="application/json", headers=headers)
    if format == Format.BRIDGE:
        text, name, media_type = write_bridge(preset), bridge_file_name(preset), PYTHON_MEDIA_TYPE
    else:
        text, name, media_type = write_nemo(preset), _file_name(preset, described), YAML_MEDIA_TYPE
    headers["Content-Disposition"] = f'attachment; filename="{name}"'
    return Response(_marked(text, described), media_type=media_type, headers=headers)


def _ours(groups: list[BestGroup]) -> Response:
    """Each slot's overall winner in our own format; 404 naming the format when nothing was measured."""
    if not groups:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, detail=[error("format", "ours: nothing was tuned for this shape", "ours")]
        )
    ours = measured_ours(one_group(groups))
    headers = {"X-Autotune-Measured": "true", "Content-Disposition": f'attachment; filename="{ours_file_name(ours)}"'}
    return Response(write_ours(ours), media_type=YAML_MEDIA_TYPE, headers=headers)


def _file_name(preset: Preset, described: NearestPublic | None) -> str:
    return preset_file_name(preset) if described is None else (described.source.rsplit("/", 1)[-1] or "preset.yaml")


def _marked(text: str, described: NearestPublic | None) -> str:
    """``text`` (YAML or Python: both comment with #), behind a NOT MEASURED line when it is the nearest preset."""
    if described is None:
        return text
    warning = (
        f"# NOT MEASURED: nothing was tuned for this shape; this is the nearest known preset, {described.source}, "
        f"{described.distance:g} doublings away (shape {described.shape})\n"
    )
    return warning + text
