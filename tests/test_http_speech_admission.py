"""HTTP speech does its costly work only once a request is admitted, and never in one block on the event
loop (issue 30, items 6 and 12). `voxgate serve` in its own process, real httpx clients, measuring the
CPU seconds the gateway spent on a refused request and how long /health waited meanwhile."""

from __future__ import annotations

import asyncio

import httpx

from tests.hostile_fixtures import HealthProbe, cpu_seconds, served_gateway

KEY = "sk-http-admission-" + "h" * 12
AUTH = {"Authorization": f"Bearer {KEY}"}
# Dense with sentence-end candidates that the splitter rejects one by one: 100,000 characters of it took
# 12-22 CPU-s of splitting before its key's allowance was checked.
SLOW_TO_SPLIT = "Dr. " * 25_000


async def test_a_key_over_its_character_allowance_is_refused_before_its_input_is_split():
    """Item 6: a key that has spent most of its minute's characters sends 100,000 characters: 429
    rate_limited, at the cost of reading the request, not of splitting it."""
    with served_gateway("--api-key", KEY, "--chars-per-minute", "2000") as gateway:
        async with httpx.AsyncClient(timeout=120) as client:
            spent = await client.post(gateway.url + "/v1/audio/speech", headers=AUTH,
                                      json={"input": "Hello there. " * 100, "voice": "tone-mid", "response_format": "pcm"})
            assert spent.status_code == 200, spent.text
            before = cpu_seconds(gateway.process.pid)
            refused = await client.post(gateway.url + "/v1/audio/speech", headers=AUTH,
                                        json={"input": SLOW_TO_SPLIT, "voice": "tone-mid", "response_format": "pcm"})
            cpu = cpu_seconds(gateway.process.pid) - before
    print(f"a 100,000-character request over its key's allowance: {cpu:.2f} CPU-s")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited", refused.text
    assert "2000 characters per minute" in refused.json()["error"]["message"]
    assert cpu < 0.5, cpu  # before: seconds (the whole split, then the refusal)


# Run-on text (no sentence end, a comma now and then): quick to split, and every character of it is
# looked at to tell its language.
RUN_ON = ("Hello there my friend, how are you " * 60_000)[:2_000_000]


async def test_telling_the_language_of_a_large_request_does_not_stall_the_event_loop():
    """Item 12: the language of each sentence of an HTTP request (to pick the voice that reads it) was
    told in one block on the event loop: 100,000 characters stalled /health 190-319 ms, two million (the
    operator may allow that much) 2.1-2.5 s. It runs in slices now (the worst answer seen here was 0.26 s,
    on a 2-core machine at load 10); the client leaves at the first audio (its synthesis stops then)."""
    flags = ("--max-http-body-bytes", str(4 << 20))
    with served_gateway(*flags, env={"VOXGATE_MAX_HTTP_INPUT_CHARS": str(len(RUN_ON))}) as gateway:
        async with HealthProbe(gateway.url) as health, httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", gateway.url + "/v1/audio/speech",
                                     json={"input": RUN_ON, "response_format": "pcm", "stream": True}) as response:
                assert response.status_code == 200, await response.aread()
                async for first in response.aiter_bytes():
                    assert first
                    break
            await asyncio.sleep(0.2)  # /health asked once more after the request
    print(f"/health's slowest answer while a 2,000,000-character request was prepared: {health.worst * 1000:.0f} ms")
    assert health.worst < 1.0, health.worst
