"""The dashboard at ``/``: one static page that reads the public JSON endpoints and follows a job's events."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["dashboard"])


@router.get("/", response_class=HTMLResponse)
def dashboard() -> HTMLResponse:
    """Jobs with live progress and per-slot best configs, and the workers with their GPUs."""
    return HTMLResponse(resources.files("api").joinpath("dashboard.html").read_text(encoding="utf-8"))
