"""The tenant dashboard: a static page (`index.html`, `app.js`, `style.css` next to
this module, shipped as package data) that signs in with an API key and then reads the
same `/v1` API a client would. Nothing here touches tenant data: the page is public,
and every figure it shows comes from an authenticated API call made by the browser.

The page loads nothing from outside the service (charts are drawn as inline SVG), which
the Content-Security-Policy below enforces.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from marlaas.service.errors import NotFound

WEB_DIR = Path(__file__).resolve().parent

#: The files `/dashboard/{name}` serves, with their media types; nothing else is served.
ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}

_HEADERS = {
    # Revalidate on every load so that an upgraded server never runs a stale script.
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_PAGE_HEADERS = {
    **_HEADERS,
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data: blob:; connect-src 'self'; object-src 'none'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
}

router = APIRouter(include_in_schema=False)


@router.get("/")
def index() -> FileResponse:
    """The dashboard page."""
    return FileResponse(
        WEB_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS
    )


@router.get("/dashboard/{name}")
def asset(name: str) -> FileResponse:
    """The page's script and style sheet."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"no dashboard file {name!r}")
    return FileResponse(WEB_DIR / name, media_type=media_type, headers=_HEADERS)
