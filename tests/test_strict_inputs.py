"""Issue 12's small ones, over both transports of a real gateway: JSON nested without bound is
`invalid_json` (never `internal` or a 1011 with a traceback), NaN and Infinity are refused and never
echoed back, an HTTP `voice` of the wrong type is a 400, and the API docs are off unless asked for (and
then behind the key when keys are set)."""

from __future__ import annotations

import json

import httpx
import pytest
import websockets

from tests.gateway_server import receive_until, running_gateway

KEY = "sk-strict-inputs"
CONFIG = {"type": "session.config", "voice": "tone-mid"}


@pytest.fixture(scope="module")
def server():
    with running_gateway("synthetic") as running:
        yield running


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# Raw JSON texts the gateway must refuse as invalid_json; each goes where a client value is echoed.
REFUSED_VALUES = {
    "nested 900": nested(900),
    "nested 100k": nested(100_000),
    "NaN": "NaN",
    "Infinity": "Infinity",
    "-Infinity": "-Infinity",
    "overflowing float": "1e400",
}


@pytest.mark.parametrize("value", REFUSED_VALUES.values(), ids=REFUSED_VALUES.keys())
async def test_websocket_refuses_unbounded_json(server, value):
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps(CONFIG))
        await receive_until(ws, "session.started")
        await ws.send('{"type": "ping", "id": ' + value + "}")
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["code"] == "invalid_json", error
        # Not fatal: the session goes on, and a ping with a plain id is answered.
        await ws.send(json.dumps({"type": "ping", "id": 7}))
        pong = json.loads(await ws.recv())
        assert pong["type"] == "pong" and pong["id"] == 7


@pytest.mark.parametrize("value", REFUSED_VALUES.values(), ids=REFUSED_VALUES.keys())
async def test_http_refuses_unbounded_json(server, value):
    async with httpx.AsyncClient() as client:
        for body in ('{"input": "Hello.", "speed": ' + value + "}", '{"input": "Hello.", "voice": {"id": ' + value + "}}"):
            response = await client.post(server.url + "/v1/audio/speech", content=body,
                                         headers={"Content-Type": "application/json"})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "invalid_json"


async def test_modest_nesting_is_still_fine(server):
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps(CONFIG))
        await receive_until(ws, "session.started")
        await ws.send('{"type": "ping", "id": ' + nested(20) + "}")
        assert json.loads(await ws.recv())["id"] == json.loads(nested(20))


@pytest.mark.parametrize("voice", [5, 1.5, True, ["tone-mid"], {"id": 5}, {"id": ["tone-mid"]}, {"id": None}, {}])
async def test_http_voice_of_the_wrong_type_is_a_400(server, voice):
    async with httpx.AsyncClient() as client:
        response = await client.post(server.url + "/v1/audio/speech", json={"input": "Hello.", "voice": voice})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_message"


async def test_http_voice_as_an_object_still_works(server):
    async with httpx.AsyncClient() as client:
        response = await client.post(server.url + "/v1/audio/speech",
                                     json={"input": "Hello.", "voice": {"id": "tone-mid"}, "response_format": "pcm"})
    assert response.status_code == 200 and response.content


DOCS = ("/docs", "/redoc", "/openapi.json")


def test_api_docs_are_off_by_default(server):
    for path in DOCS:
        assert httpx.get(server.url + path).status_code == 404, path


def test_api_docs_when_asked_for_are_behind_the_key():
    with running_gateway("synthetic", api_docs=True, api_keys=[KEY]) as server:
        for path in DOCS:
            assert httpx.get(server.url + path).status_code == 401, path
            assert httpx.get(server.url + path + "?api_key=wrong").status_code == 401, path
        schema = httpx.get(server.url + "/openapi.json", headers={"X-API-Key": KEY})
        assert schema.status_code == 200 and "/v1/audio/speech" in schema.json()["paths"]
        # The page is opened in a browser with ?api_key=, and fetches the schema with it.
        page = httpx.get(server.url + f"/docs?api_key={KEY}")
        assert page.status_code == 200 and f"/openapi.json?api_key={KEY}" in page.text
    with running_gateway("synthetic", api_docs=True) as server:  # no keys: open, as the rest of the API
        assert httpx.get(server.url + "/openapi.json").status_code == 200
        assert httpx.get(server.url + "/redoc").status_code == 200
