"""Who may use the gateway: the auth hook checked at WebSocket upgrade and on every HTTP API route.

An authenticator is any `async (connection) -> Principal` that raises `AuthError` to refuse. The default
(`api_key_authenticator`) accepts everyone when no API keys are configured (the CLI allows that only on
loopback, or with --insecure-no-auth); with `api_keys` set it wants a credential as
`Authorization: Bearer <credential>`, `Authorization: Api-Key <credential>` (Baseten's scheme, which
LiveKit's Baseten plugin sends), `X-API-Key: <credential>`, or, for browsers (which cannot set
WebSocket headers), the query parameter `api_key` (alias `token`). A credential is either an API key or a
short-lived token minted by `POST /v1/tokens` (`TokenSigner`): an HMAC-signed expiry and key fingerprint,
so a backend can hand a browser something that stops working on its own and never reveals the key. A
token counts against the limits of the key that minted it. With `allowed_origins` set, a browser's
`Origin` must be one of them. Without keys and without that list (the default loopback mode), only pages
served from loopback may connect: any web site could otherwise use a gateway on the visitor's machine.

Keys are compared in constant time and never logged: a principal carries only a fingerprint of its key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection

from .settings import GatewaySettings

TOKEN_PREFIX = "vxt1."


class AuthError(Exception):
    """Refused. `message` is safe to show to the client."""


@dataclass(frozen=True)
class Principal:
    key_id: str | None = None  # fingerprint of the API key (None: anonymous); limits are counted per key_id
    via_token: bool = False  # authenticated with a minted token rather than the key itself


Authenticator = Callable[[HTTPConnection], Awaitable[Principal]]
# Where an HTTP request's principal is kept once gateway.http.guard has authenticated it (before its
# body), so that the route's dependency does not run the hook a second time.
PRINCIPAL_SCOPE_KEY = "voxgate.principal"


def key_fingerprint(key: str) -> str:
    """A stable, non-reversible id for an API key: the same on every replica, safe to log and to use in
    Redis key names."""
    return hashlib.sha256(b"voxgate-key\0" + key.encode()).hexdigest()[:16]


AUTH_SCHEMES = ("bearer", "api-key")


def authorization_scheme(connection: HTTPConnection) -> str | None:
    """The scheme of the Authorization header, lower-cased ("bearer", "api-key", ...), or None."""
    scheme, _, _ = connection.headers.get("authorization", "").strip().partition(" ")
    return scheme.lower() or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_loopback_origin(origin: str) -> bool:
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        return False
    return is_loopback(host) or host.endswith(".localhost")  # browsers resolve *.localhost to loopback


def presented_credential(connection: HTTPConnection) -> str | None:
    if authorization_scheme(connection) in AUTH_SCHEMES:
        return connection.headers["authorization"].strip().partition(" ")[2].strip() or None
    query = connection.query_params
    return connection.headers.get("x-api-key") or query.get("api_key") or query.get("token")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TokenSigner:
    """Mints and checks `vxt1.<payload>.<signature>` tokens: payload = {"k": key fingerprint,
    "exp": unix seconds, "n": nonce}, signature = HMAC-SHA256 over the payload.

    The secret is `token_secret` when set (share it between replicas), else derived from the configured
    API keys, so replicas with the same keys accept each other's tokens without more configuration and
    removing a key revokes its tokens too."""

    def __init__(self, secret: bytes, known_key_ids: set[str], max_ttl_s: float) -> None:
        self._secret = secret
        self._known = known_key_ids
        self.max_ttl_s = max_ttl_s

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> "TokenSigner":
        if settings.token_secret:
            secret = hashlib.sha256(b"voxgate-token-secret\0" + settings.token_secret.encode()).digest()
        else:
            secret = hashlib.sha256(b"voxgate-token-keys\0" + "\0".join(sorted(settings.api_keys)).encode()).digest()
        return cls(secret, {key_fingerprint(k) for k in settings.api_keys}, settings.max_token_ttl_s)

    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self._secret, payload.encode("ascii"), hashlib.sha256).digest())

    def mint(self, key_id: str, ttl_s: float, now: float | None = None) -> tuple[str, int]:
        """A token for `key_id` valid for `ttl_s` (capped at max_ttl_s); returns (token, expires_at)."""
        expires_at = int((now or time.time()) + min(ttl_s, self.max_ttl_s))
        payload = _b64(json.dumps({"k": key_id, "exp": expires_at, "n": secrets.token_hex(8)}).encode())
        return f"{TOKEN_PREFIX}{payload}.{self._sign(payload)}", expires_at

    def verify(self, token: str, now: float | None = None) -> str:
        """The key fingerprint a valid token was minted for. Raises AuthError."""
        try:
            payload, signature = token[len(TOKEN_PREFIX):].split(".")
        except ValueError:
            raise AuthError("malformed token") from None
        if not hmac.compare_digest(signature.encode(), self._sign(payload).encode()):
            raise AuthError("invalid token")
        try:
            claims = json.loads(_unb64(payload))
            key_id, expires_at = str(claims["k"]), float(claims["exp"])
        except (ValueError, KeyError, TypeError):
            raise AuthError("malformed token") from None
        if (now or time.time()) >= expires_at:
            raise AuthError("the token has expired; mint a new one with POST /v1/tokens")
        if key_id not in self._known:
            raise AuthError("the key that minted this token is no longer accepted")
        return key_id


@dataclass(frozen=True)
class OriginPolicy:
    """Which browser pages (by their `Origin`) may use the gateway: those of `allowed_origins` when it is set;
    else, without API keys (the default loopback mode), pages served from loopback; else any (a key is
    needed anyway). The WebSocket's authentication and the HTTP routes' CORS answers follow the same policy."""

    allowed: frozenset[str]
    loopback_only: bool

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> "OriginPolicy":
        allowed = frozenset(settings.allowed_origins)
        return cls(allowed, loopback_only=not settings.api_keys and not allowed and not settings.insecure_no_auth)

    def refusal(self, origin: str) -> str | None:
        """Why a page of `origin` may not use the gateway; None when it may."""
        if self.allowed and origin not in self.allowed:
            return f"origin {origin!r} is not allowed (allow it with --allowed-origin)"
        if self.loopback_only and not is_loopback_origin(origin):
            return (f"origin {origin!r} is not allowed: without API keys only loopback pages may connect"
                    " (allow a site with --allowed-origin)")
        return None


def api_key_authenticator(settings: GatewaySettings) -> Authenticator:
    """The default hook: API keys or minted tokens, plus the origin policy."""
    keys = [(k.encode(), key_fingerprint(k)) for k in settings.api_keys]
    origins = OriginPolicy.from_settings(settings)
    signer = TokenSigner.from_settings(settings)

    async def authenticate(connection: HTTPConnection) -> Principal:
        origin = connection.headers.get("origin")
        refusal = origins.refusal(origin) if origin is not None else None
        if refusal is not None:
            raise AuthError(refusal)
        if not keys:
            return Principal()
        credential = presented_credential(connection)
        if not credential:
            raise AuthError(
                "a valid API key or token is required (Authorization: Bearer <key> or Api-Key <key>, X-API-Key,"
                " or ?api_key=)"
            )
        if credential.startswith(TOKEN_PREFIX):
            return Principal(key_id=signer.verify(credential), via_token=True)
        presented = credential.encode()
        match: str | None = None
        for known, fingerprint in keys:  # every key is compared, so timing says nothing about which matched
            if hmac.compare_digest(presented, known):
                match = fingerprint
        if match is None:
            raise AuthError("invalid API key")
        return Principal(key_id=match)

    return authenticate
