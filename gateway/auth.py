"""Who may use the gateway: the auth hook checked at WebSocket upgrade and on every HTTP route.

An authenticator is any `async (connection) -> Principal` that raises `AuthError` to refuse. The default
accepts everyone when no API keys are configured; with `api_keys` set it wants one of them as
`Authorization: Bearer <key>`, `X-API-Key: <key>`, or (for browsers, which cannot set WebSocket headers)
the query parameter `api_key`. With `allowed_origins` set, a browser's `Origin` must be one of them.
Issue 7 extends this (tokens, per-key limits); the hook's shape stays.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import HTTPConnection

from .settings import GatewaySettings


class AuthError(Exception):
    """Refused. `message` is safe to show to the client."""


@dataclass(frozen=True)
class Principal:
    key_id: str | None = None  # which API key (None: anonymous); limits are counted per key_id


Authenticator = Callable[[HTTPConnection], Awaitable[Principal]]


def presented_key(connection: HTTPConnection) -> str | None:
    header = connection.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return connection.headers.get("x-api-key") or connection.query_params.get("api_key")


def api_key_authenticator(settings: GatewaySettings) -> Authenticator:
    keys = list(settings.api_keys)
    origins = set(settings.allowed_origins)

    async def authenticate(connection: HTTPConnection) -> Principal:
        origin = connection.headers.get("origin")
        if origins and origin is not None and origin not in origins:
            raise AuthError(f"origin {origin!r} is not allowed")
        if not keys:
            return Principal()
        key = presented_key(connection)
        if key:
            for index, known in enumerate(keys):
                if hmac.compare_digest(key.encode(), known.encode()):
                    return Principal(key_id=f"key{index}")
        raise AuthError("a valid API key is required (Authorization: Bearer <key>, X-API-Key, or ?api_key=)")

    return authenticate
