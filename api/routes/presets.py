"""``GET /v1/presets``: the winning configs as a file TE users already know how to load.

``format=nemo`` (the default) is the NeMo/Megatron userbuffers YAML, named as NVIDIA names its files;
``format=te`` is the ``initialize_ub(ub_cfgs=...)`` dict as JSON.  When nothing was measured for the shape,
the nearest known preset is returned instead and says so: an ``X-Autotune-Measured: false`` header, a
comment at the top of the YAML, ``measured: false`` in the JSON.
"""

from __future__ import annotations

import enum
import json
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response

from api.deps import RegistryDep, SessionDep
from api.lookup import ShapeQueryDep, measured_groups, measured_preset, nearest, one_group
from api.schemas import ErrorPublic, NearestPublic
from search_spaces import Preset, preset_file_name, preset_json, te_file_name, write_nemo

router = APIRouter(prefix="/v1", tags=["presets"])

YAML_MEDIA_TYPE = "application/yaml"


class Format(enum.StrEnum):
    NEMO = "nemo"
    TE = "te"


_CONTENT = {
    YAML_MEDIA_TYPE: {"schema": {"description": "NeMo/Megatron ub_cfg YAML: TE slot name -> ub_cfgs entry"}},
    "application/json": {"schema": {"type": "object"}},
}


@router.get(
    "/presets",
    response_class=Response,
    responses={200: {"content": _CONTENT, "description": "The preset file"}, 422: {"model": ErrorPublic}},
)
def get_preset(
    query: ShapeQueryDep,
    session: SessionDep,
    registry: RegistryDep,
    format: Annotated[Format, Query(description="nemo: NeMo/Megatron YAML; te: TE ub_cfgs as JSON")] = Format.NEMO,
) -> Response:
    """The preset for a shape: measured winners under the export rule, else the nearest known preset (marked)."""
    groups = measured_groups(session=session, query=query)
    described: NearestPublic | None = None
    if groups:
        preset = measured_preset(one_group(groups))
    else:
        preset, described, _ = nearest(registry=registry, query=query)
    name = _file_name(preset, described)
    headers = {"X-Autotune-Measured": "false" if described else "true"}
    headers["Content-Disposition"] = f'attachment; filename="{name if format == Format.NEMO else te_file_name(name)}"'
    if format == Format.TE:
        body: dict[str, Any] = {"measured": described is None, "nearest": described and described.model_dump()}
        body |= preset_json(preset)
        return Response(json.dumps(body, indent=2) + "\n", media_type="application/json", headers=headers)
    return Response(_yaml(preset, described), media_type=YAML_MEDIA_TYPE, headers=headers)


def _file_name(preset: Preset, described: NearestPublic | None) -> str:
    return preset_file_name(preset) if described is None else (described.source.rsplit("/", 1)[-1] or "preset.yaml")


def _yaml(preset: Preset, described: NearestPublic | None) -> str:
    text = write_nemo(preset)
    if described is None:
        return text
    warning = (
        f"# NOT MEASURED: nothing was tuned for this shape; this is the nearest known preset, {described.source}, "
        f"{described.distance:g} doublings away (shape {described.shape})\n"
    )
    return warning + text
