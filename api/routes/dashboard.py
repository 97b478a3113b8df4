"""The dashboard at ``/``: a static page (``api/static``) that reads the public JSON endpoints and follows a job's
events; its script, styles and the vendored chart library (uPlot, with its license) are served under ``/static``,
so it works on a cluster with no way out to a CDN."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(str(resources.files("api").joinpath("static")))

router = APIRouter(tags=["dashboard"])


@router.get("/", response_class=FileResponse)
def dashboard() -> FileResponse:
    """Jobs with live progress; per slot the search history, the winner beside its baselines and the preset; workers."""
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/favicon.ico", response_class=FileResponse, include_in_schema=False)
def favicon() -> FileResponse:
    """The tab's icon, where browsers ask for it (an SVG: every browser the dashboard runs in draws one)."""
    return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")


def static_files() -> StaticFiles:
    """What ``/static`` serves: the dashboard's script and styles, and ``vendor/`` (uPlot and its license)."""
    return StaticFiles(directory=STATIC)
