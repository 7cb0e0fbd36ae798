"""The browser demo at `/` and the JavaScript client at `/clients/js/`, served as static files.

Their sources are web_demo/ and clients/js/ at the repository's root, which an editable install serves
directly; a wheel carries copies of them under `gateway/static/` in the same layout (setup.py's build
step). Mounted after every API route, so they never shadow one.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("voxgate")


class _HttpOnly:
    """Static files answer HTTP only; a WebSocket to an unknown path is closed as the router would."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1000, "reason": ""})


PACKAGE_ROOT = Path(__file__).resolve().parent / "static"  # a wheel's copies
CHECKOUT_ROOT = Path(__file__).resolve().parent.parent  # an editable install's repository


def _has_web_demo(root: Path) -> bool:
    return (root / "web_demo" / "index.html").is_file() and (root / "clients" / "js" / "voxgate.js").is_file()


def web_root() -> Path | None:
    """Where the page and the JavaScript client are, or None when this install has neither."""
    return next((root for root in (PACKAGE_ROOT, CHECKOUT_ROOT) if _has_web_demo(root)), None)


def mount_web_demo(app: FastAPI) -> None:
    root = web_root()
    if root is None:
        log.warning("no web demo in this install (neither %s nor %s): / serves nothing", PACKAGE_ROOT, CHECKOUT_ROOT)
        return
    demo, client = root / "web_demo", root / "clients" / "js"
    app.mount("/clients/js", _HttpOnly(StaticFiles(directory=client)), name="js-client")
    app.mount("/", _HttpOnly(StaticFiles(directory=demo, html=True)), name="web-demo")
