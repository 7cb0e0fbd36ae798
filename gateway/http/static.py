"""The browser demo at `/` and the JavaScript client at `/clients/js/`, served as static files.

Their sources are web_demo/ and clients/js/ at the repository's root, which an editable install serves
directly; a wheel carries copies of them under `gateway/static/` in the same layout (setup.py's build
step). Mounted after every API route, so they never shadow one.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI
from starlette.responses import JSONResponse
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("voxgate")


async def websocket_not_found(scope: Scope, receive: Receive, send: Send) -> None:
    """A WebSocket handshake to a path nothing serves gets an HTTP 404, as a plain request would. (Closing
    it unaccepted, starlette's default, reaches the client as a 403, which reads as an auth failure.)"""
    websocket = WebSocket(scope, receive, send)
    if "websocket.http.response" in scope.get("extensions", {}):
        await websocket.send_denial_response(JSONResponse({"detail": "Not Found"}, status_code=404))
    else:  # a server without the denial-response extension can only refuse
        await websocket.close()


class _HttpOnly:
    """Static files answer HTTP only; a WebSocket to a path under them is a path nothing serves."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await websocket_not_found(scope, receive, send)


PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "static"  # a wheel's copies: gateway/static/
CHECKOUT_ROOT = Path(__file__).resolve().parents[2]  # an editable install's repository


def _has_web_demo(root: Path) -> bool:
    return (root / "web_demo" / "index.html").is_file() and (root / "clients" / "js" / "voxgate.js").is_file()


def web_root() -> Path | None:
    """Where the page and the JavaScript client are, or None when this install has neither."""
    return next((root for root in (PACKAGE_ROOT, CHECKOUT_ROOT) if _has_web_demo(root)), None)


def _not_found(http_default: ASGIApp) -> ASGIApp:
    async def not_found(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await websocket_not_found(scope, receive, send)
        else:
            await http_default(scope, receive, send)

    return not_found


def mount_web_demo(app: FastAPI) -> None:
    app.router.default = _not_found(app.router.default)  # without the page's catch-all too
    root = web_root()
    if root is None:
        log.warning("no web demo in this install (neither %s nor %s): / serves nothing", PACKAGE_ROOT, CHECKOUT_ROOT)
        return
    demo, client = root / "web_demo", root / "clients" / "js"
    app.mount("/clients/js", _HttpOnly(StaticFiles(directory=client)), name="js-client")
    app.mount("/", _HttpOnly(StaticFiles(directory=demo, html=True)), name="web-demo")
