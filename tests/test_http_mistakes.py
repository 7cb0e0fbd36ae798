"""The mistakes a newcomer makes over HTTP get errors that say what is wrong: a body sent without
`Content-Type: application/json` (curl's -d), a path without /v1 (the OpenAI SDK given the gateway's bare
address), a wrong method, and in the Python client an http://.../v1 URL, a wrong path or a wrong port."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest

import voxgate_client
from tests.gateway_server import running_gateway


@pytest.fixture(scope="module")
def gateway():
    with running_gateway("synthetic") as server:
        yield server


def test_a_body_without_the_json_content_type_is_named(gateway):
    body = b'{"input": "Hello.", "voice": "tone-mid"}'
    # What `curl -d '...' URL` sends: form data, by its Content-Type.
    answer = httpx.post(gateway.url + "/v1/audio/speech", content=body,
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "invalid_message"
    assert "Content-Type: application/json" in error["message"]
    assert "application/x-www-form-urlencoded" in error["message"]
    assert httpx.post(gateway.url + "/v1/audio/speech", json={"input": "Hello.", "voice": "tone-mid"}).status_code == 200


def test_the_openai_sdk_without_v1_is_told_where_the_api_is(gateway):
    client = openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        client.audio.speech.create(model="voxgate", voice="alloy", input="Hello!")
    error = raised.value.body
    assert error["code"] == "not_found", error
    assert "/v1/audio/speech" in error["message"] and "base_url" in error["message"], error
    # The same client with /v1 works.
    fixed = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    assert len(fixed.audio.speech.create(model="voxgate", voice="alloy", input="Hello!", response_format="wav").content) > 44


@pytest.mark.parametrize("method,path,status,code,says", [
    ("GET", "/v1/audio/speech", 405, "method_not_allowed", "takes POST"),
    ("GET", "/models", 404, "not_found", "GET /v1/models"),
    ("POST", "/nothing/here", 404, "not_found", "the API is under /v1"),
])
def test_unknown_paths_and_methods_answer_in_the_openai_shape(gateway, method, path, status, code, says):
    answer = httpx.request(method, gateway.url + path)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert error["code"] == code and says in error["message"], error
    assert error["type"] == "invalid_request_error"


async def test_the_python_client_takes_an_openai_base_url_and_explains_a_wrong_path(gateway):
    config = voxgate_client.SessionConfig(voice="tone-mid")
    async with voxgate_client.connect(gateway.url + "/v1", config) as session:
        assert session.started is not None
    with pytest.raises(voxgate_client.VoxgateError) as raised:
        await voxgate_client.connect(gateway.url + "/v2/speech", config)
    assert raised.value.code == "http_404"
    assert "/v1/audio/speech/stream" in raised.value.message and "ws://HOST:PORT" in raised.value.message


async def test_the_python_client_says_when_nothing_answers():
    with socket.socket() as closed:  # bound, never listening: a connection to it is refused
        closed.bind(("127.0.0.1", 0))
        url = f"ws://127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(voxgate_client.GatewayUnreachable) as raised:
            await voxgate_client.connect(url, voxgate_client.SessionConfig(voice="tone-mid"), api_key="secret-key")
    message = str(raised.value)
    assert url + "/v1/audio/speech/stream" in message and "refused" in message.lower()
    assert "voxgate serve" in message and "secret-key" not in message
    assert raised.value.code == "connection_failed" and raised.value.retryable
    assert isinstance(raised.value, OSError)  # callers that caught the socket's error still do
