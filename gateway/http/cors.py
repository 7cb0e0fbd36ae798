"""CORS for the parts a page on another origin uses: the HTTP API (`/v1/...`) and the JavaScript client
(`/clients/js/...`, which a page imports as a module, and the player's worklet).

A browser reads a cross-origin response only if it carries `Access-Control-Allow-Origin`, and sends a
POST with a JSON body (or an `Authorization` header) only after an `OPTIONS` preflight says it may. The
origins are those the WebSocket admits (`auth.OriginPolicy`: `--allowed-origin`, else loopback pages
without API keys, else any); the answer names the page's own origin, never `*`. A preflight is answered
here, before the key is checked (a browser sends none with it); the request that follows is checked as
any other. Other paths (the demo page, /health, /metrics) send no CORS headers.
"""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from ..auth import OriginPolicy
from ..settings import GatewaySettings

CORS_PATHS = ("/v1/", "/clients/js/")
EXPOSED_HEADERS = ("Retry-After", "X-Sample-Rate", "X-Word-Timestamps", "X-Voxgate-Warnings")


class _PolicyCors(CORSMiddleware):
    """Starlette's CORS answers, with the gateway's origin policy deciding which origins are allowed."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy) -> None:
        super().__init__(app, allow_methods=("GET", "POST", "DELETE"), allow_headers=("*",),
                         expose_headers=EXPOSED_HEADERS, allow_private_network=True)
        self._policy = policy

    def is_allowed_origin(self, origin: str) -> bool:
        return self._policy.refusal(origin) is None


class Cors:
    """The ASGI middleware: CORS on CORS_PATHS, everything else passed through untouched."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings) -> None:
        self.app = app
        self._cors = _PolicyCors(app, OriginPolicy.from_settings(settings))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(CORS_PATHS):
            await self._cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)
