"""The browser demo at `/` and the JavaScript client at `/clients/js/`, served as static files.

Both live in the repository (web_demo/, clients/js/), beside the `gateway` package of an editable install.
`VOXGATE_WEB_ROOT` points at another checkout; when the folders are absent (a wheel without them) the
gateway runs without the page. Mounted after every API route, so they never shadow one.
"""

from __future__ import annotations

import logging
import os
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


def web_root() -> Path:
    return Path(os.environ.get("VOXGATE_WEB_ROOT") or Path(__file__).resolve().parent.parent)


def mount_web_demo(app: FastAPI) -> None:
    root = web_root()
    demo, client = root / "web_demo", root / "clients" / "js"
    if not (demo / "index.html").is_file() or not (client / "voxgate.js").is_file():
        log.info("no web demo under %s: / serves nothing", root)
        return
    app.mount("/clients/js", _HttpOnly(StaticFiles(directory=client)), name="js-client")
    app.mount("/", _HttpOnly(StaticFiles(directory=demo, html=True)), name="web-demo")
