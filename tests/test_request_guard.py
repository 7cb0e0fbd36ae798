"""gateway/http/guard.py authenticates an API request from its headers before its body is read; the
route then uses that principal instead of asking the auth hook again (a hook may be costly: a lookup in
another service, a rate count of its own)."""

from __future__ import annotations

import httpx

from gateway.auth import AuthError, Principal
from tests.gateway_server import running_gateway


def test_each_api_request_runs_the_auth_hook_once():
    calls: list[str] = []

    async def counting_hook(connection) -> Principal:
        calls.append(connection.url.path)
        if connection.headers.get("x-team") != "a":
            raise AuthError("team a only")
        return Principal(key_id="team-a")

    team_a = {"X-Team": "a"}
    with running_gateway("synthetic", authenticate=counting_hook) as server, httpx.Client(base_url=server.url) as http:
        speech = http.post("/v1/audio/speech", headers=team_a, timeout=30,
                           json={"input": "Counted once.", "voice": "tone-mid", "response_format": "pcm"})
        assert speech.status_code == 200 and speech.content
        assert http.get("/v1/models", headers=team_a).status_code == 200
        assert http.get("/v1/audio/voices", headers=team_a).status_code == 200
        assert http.post("/v1/audio/speech", json={"input": "Refused."}).status_code == 401
    # Before: twice each (the middleware, then the route's dependency), the refusal once.
    assert calls == ["/v1/audio/speech", "/v1/models", "/v1/audio/voices", "/v1/audio/speech"]
