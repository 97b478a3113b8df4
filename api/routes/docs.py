"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) from assets the controller serves itself (``/static/docs``).

FastAPI's default pages load their scripts from a CDN, so on a cluster with no internet access they were
blank.  The npm packages' bundles ship in ``api/static/docs`` (its README says which versions and files).
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/static/docs"

router = APIRouter(include_in_schema=False)


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url=request.app.openapi_url,
        title=f"{request.app.title}: Swagger UI",
        oauth2_redirect_url="/docs/oauth2-redirect",
        swagger_js_url=f"{ASSETS}/swagger-ui/swagger-ui-bundle.js",
        swagger_css_url=f"{ASSETS}/swagger-ui/swagger-ui.css",
        swagger_favicon_url=f"{ASSETS}/swagger-ui/favicon-32x32.png",
    )


@router.get("/docs/oauth2-redirect")
def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc")
def redoc(request: Request) -> HTMLResponse:
    return get_redoc_html(
        openapi_url=request.app.openapi_url,
        title=f"{request.app.title}: ReDoc",
        redoc_js_url=f"{ASSETS}/redoc/redoc.standalone.js",
        redoc_favicon_url=f"{ASSETS}/swagger-ui/favicon-32x32.png",
        with_google_fonts=False,
    )


def mount_assets(app: FastAPI) -> None:
    """Serve ``api/static/docs`` under `ASSETS`."""
    folder = resources.files("api").joinpath("static", "docs")
    app.mount(ASSETS, StaticFiles(directory=str(folder)), name="docs-assets")
