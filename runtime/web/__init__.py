"""Pages for people, served by the same FastAPI app as the API: the chat page at ``/``.

The page is three static files shipped in this package (no build step, no CDN): ``index.html``,
``chat.js`` and ``chat.css``. Every page response carries ``CONTENT_SECURITY_POLICY``: scripts and
styles from this origin only, no inline script, requests to this origin only. The page renders
model output as text nodes, never as HTML (``chat.js``: ``renderMarkdown``).

The page paths hold no data, so ``http_guard`` lets them through without the API key; the page asks
for the key on its first 401 and keeps it in the tab's ``sessionStorage`` only.
"""
from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, HTTPException
from fastapi.responses import Response

CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
#: Where the page's own files are served (``/`` is index.html).
ASSET_PREFIX = "/ui/"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8"}
CHAT_ASSETS = ("chat.js", "chat.css")


def is_page_path(path: str) -> bool:
    """A path of the pages (no API key needed: static files only)."""
    return path == "/" or path.startswith(ASSET_PREFIX)


def page_headers() -> dict[str, str]:
    return {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def page_file(name: str) -> str:
    """The text of one of this package's page files."""
    return (files(__package__) / name).read_text(encoding="utf-8")


def page_response(name: str, text: str | None = None) -> Response:
    """``name`` (one of this package's files, or ``text`` under that name) with the page headers."""
    suffix = name[name.rfind("."):]
    return Response(page_file(name) if text is None else text, media_type=MEDIA_TYPES[suffix],
                    headers=page_headers())


def mount_chat_page(app: FastAPI) -> None:
    """Add the chat page (``GET /``) and its files (``GET /ui/NAME``) to ``app``."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return page_response("index.html")

    @app.get(ASSET_PREFIX + "{name}", include_in_schema=False)
    async def chat_asset(name: str) -> Response:
        if name not in CHAT_ASSETS:
            raise HTTPException(404)
        return page_response(name)
