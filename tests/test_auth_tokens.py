"""Authentication: API keys in every accepted place, tokens minted by POST /v1/tokens (expiry, tamper,
revocation, scope), allowed origins, and the rule that a non-loopback gateway needs keys."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from gateway.auth import TOKEN_PREFIX, TokenSigner, key_fingerprint
from gateway.cli import InsecureBinding, check_binding, is_loopback
from gateway.settings import GatewaySettings
from tests.gateway_server import open_session, receive_until, running_gateway

KEY = "k-live-0123456789"
OTHER = "k-other-abcdef"
CONFIG = {"type": "session.config", "voice": "tone-mid", "stream_audio": True}


@pytest.fixture(scope="module")
def server():
    with running_gateway("synthetic", api_keys=[KEY, OTHER], allowed_origins=["https://app.example"],
                         max_token_ttl_s=600) as running:
        yield running


async def speaks(url: str, **connect) -> bool:
    """Opens a session and gets audio (True), or is refused with `unauthorized` and close 1008 (False)."""
    ws, first, code = await open_session(url, CONFIG, **connect)
    if ws is None:
        assert first["code"] == "unauthorized" and first["retryable"] is False and code == 1008
        return False
    async with ws:
        await ws.send(json.dumps({"type": "input.text", "text": "Authorized."}))
        await ws.send(json.dumps({"type": "input.done"}))
        messages = await receive_until(ws, "session.done")
        return any(isinstance(m, bytes) for m in messages)


def mint(server, credential: str, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/tokens", json=body or None, headers={"Authorization": f"Bearer {credential}"})


async def test_keys_in_every_accepted_place(server):
    url = server.ws_url
    assert await speaks(url, additional_headers={"Authorization": f"Bearer {KEY}"})
    assert await speaks(url, additional_headers={"X-API-Key": OTHER})
    assert await speaks(url + f"?api_key={KEY}")
    assert not await speaks(url)
    assert not await speaks(url + "?api_key=k-live-012345678")  # a prefix of a key
    assert not await speaks(url, additional_headers={"Authorization": f"Bearer {KEY}x"})
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers={"X-API-Key": KEY}).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


async def test_minted_tokens_work_for_browsers_and_expire(server):
    response = mint(server, KEY, ttl_s=60)
    assert response.status_code == 200
    body = response.json()
    token = body["token"]
    assert token.startswith(TOKEN_PREFIX) and KEY not in token
    assert 55 <= body["expires_in"] <= 60 and body["expires_at"] > time.time()
    # As a query parameter (what a browser can do), and as a bearer credential on HTTP.
    assert await speaks(server.ws_url + f"?token={token}")
    assert await speaks(server.ws_url + f"?api_key={token}")
    assert httpx.get(server.url + "/v1/audio/voices", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    # A token cannot mint another; a lifetime is capped at max_token_ttl_s.
    assert mint(server, token).status_code == 401
    assert mint(server, KEY, ttl_s=10_000).json()["expires_in"] <= 600
    assert mint(server, "wrong").status_code == 401

    signer = TokenSigner.from_settings(server.settings)
    expired, _ = signer.mint(key_fingerprint(KEY), 60, now=time.time() - 120)
    assert not await speaks(server.ws_url + f"?token={expired}")
    # Tampering with the payload (another key's fingerprint) breaks the signature.
    payload, signature = token[len(TOKEN_PREFIX):].split(".")
    forged_payload, _ = signer.mint(key_fingerprint(OTHER), 60)
    forged = TOKEN_PREFIX + forged_payload[len(TOKEN_PREFIX):].split(".")[0] + "." + signature
    assert not await speaks(server.ws_url + f"?token={forged}")
    assert not await speaks(server.ws_url + "?token=" + TOKEN_PREFIX + "garbage")


def test_tokens_are_revoked_with_their_key_and_shared_by_replicas():
    replica_a = TokenSigner.from_settings(GatewaySettings(api_keys=[KEY, OTHER]))
    replica_b = TokenSigner.from_settings(GatewaySettings(api_keys=[OTHER, KEY]))  # same keys, any order
    token, _ = replica_a.mint(key_fingerprint(KEY), 60)
    assert replica_b.verify(token) == key_fingerprint(KEY)
    without_key = TokenSigner.from_settings(GatewaySettings(api_keys=[OTHER], token_secret="shared"))
    with_secret = TokenSigner.from_settings(GatewaySettings(api_keys=[KEY, OTHER], token_secret="shared"))
    token, _ = with_secret.mint(key_fingerprint(KEY), 60)
    with pytest.raises(Exception, match="no longer accepted"):
        without_key.verify(token)


async def test_allowed_origins(server):
    assert await speaks(server.ws_url, origin="https://app.example", additional_headers={"X-API-Key": KEY})
    assert not await speaks(server.ws_url, origin="https://evil.example", additional_headers={"X-API-Key": KEY})
    response = httpx.get(server.url + "/v1/models", headers={"X-API-Key": KEY, "Origin": "https://evil.example"})
    assert response.status_code == 401


def test_no_keys_means_open_only_on_loopback():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.5"):
        assert is_loopback(host)
        check_binding(GatewaySettings(host=host))
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        assert not is_loopback(host)
        with pytest.raises(InsecureBinding, match="--insecure-no-auth"):
            check_binding(GatewaySettings(host=host))
        check_binding(GatewaySettings(host=host, api_keys=["k"]))
        check_binding(GatewaySettings(host=host, insecure_no_auth=True))


def test_voxgate_serve_refuses_a_public_host_without_keys():
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--host", "0.0.0.0", "--backend", "synthetic", "--port", "1"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "refusing to serve 0.0.0.0 without authentication" in result.stderr
    assert "--insecure-no-auth" in result.stderr


async def test_without_keys_only_loopback_pages_may_connect():
    """The default loopback mode (no keys): any web page the user visits could otherwise open the local
    gateway from the browser. Loopback pages (the gateway's own web demo) still connect."""
    with running_gateway("synthetic") as server:
        for origin in ("https://evil.example", "http://192.168.1.5:8000", "null", "http://127.0.0.1.evil.example"):
            assert not await speaks(server.ws_url, origin=origin), origin
            response = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hi.", "voice": "tone-mid"},
                                  headers={"Origin": origin})
            assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized", origin
        port = server.settings.port
        for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://[::1]:{port}", "http://demo.localhost"):
            assert await speaks(server.ws_url, origin=origin), origin
        assert await speaks(server.ws_url)  # no Origin: not a browser
        assert httpx.get(server.url + "/", headers={"Origin": "https://evil.example"}).status_code == 200  # the page itself


async def test_without_keys_allowed_origins_decide():
    with running_gateway("synthetic", allowed_origins=["https://app.example"]) as server:
        assert await speaks(server.ws_url, origin="https://app.example")
        assert not await speaks(server.ws_url, origin="https://evil.example")
        assert not await speaks(server.ws_url, origin=f"http://127.0.0.1:{server.settings.port}")  # not listed
