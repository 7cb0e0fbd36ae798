"""Issue 12, the transport: no client, with or without a valid key, makes the gateway buffer without
bound or hold a connection forever. Each attack runs against `voxgate serve` in its own process, whose
peak RSS is measured, while /health is asked over and over (the event loop must keep answering).

Sizes are what a CI machine handles: 50 MB poured where the attack would pour gigabytes; the bound shows
as the refusal arriving long before the body is sent and the peak RSS rising by little."""

from __future__ import annotations

import asyncio
import json
import struct
import time

import pytest

from tests.gateway_server import running_gateway
from tests.hostile_fixtures import (
    OP_PING,
    OP_PONG,
    HealthProbe,
    MemoryWatch,
    RawClient,
    RawHttp,
    frame,
    served_gateway,
)

KEY = "sk-transport-test-key"
POURED = 50 * 1024 * 1024  # what each attack tries to send
MAX_GROWTH = 20 * 1024 * 1024  # the gateway's peak RSS may rise this much at most
MAX_STALL_S = 2.0  # slowest /health answer allowed while an attack runs (the attacker shares the 2 cores)
BODY_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def gateway():
    with served_gateway("--api-key", KEY, env={"VOXGATE_HTTP_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)}) as running:
        yield running


def speech_head(length: int | None = None, key: str | None = None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    headers.update({"Content-Length": str(length)} if length is not None else {"Transfer-Encoding": "chunked"})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return headers


async def refused_while_pouring(gateway, headers: dict[str, str], chunked: bool) -> tuple[int, dict, int, int]:
    """POST /v1/audio/speech, pouring a POURED-byte body while waiting for the answer: (status, error,
    bytes poured when the answer came, peak RSS growth)."""
    memory = MemoryWatch(gateway.process.pid)
    memory.start()
    async with HealthProbe(gateway.url) as health:
        request = await RawHttp.send_head(gateway.port, "POST", "/v1/audio/speech", headers)
        pouring = asyncio.create_task(request.pour(POURED, chunked=chunked))
        status, _, body = await request.response(timeout=30)
        poured_then = request.poured
        assert await request.closed_by_server()  # the rest of the body is never read
        await pouring
        request.close()
    assert health.worst < MAX_STALL_S, health.worst
    return status, json.loads(body)["error"], poured_then, memory.growth


async def test_a_keyless_body_is_refused_before_it_is_read(gateway):
    # Before: the whole body was read, then 401 (300 MB took RSS to 851 MB).
    status, error, poured, growth = await refused_while_pouring(gateway, speech_head(POURED), chunked=False)
    assert status == 401 and error["code"] == "unauthorized"
    assert poured < POURED / 2, poured
    assert growth < MAX_GROWTH, growth


async def test_a_keyless_endless_chunked_body_is_refused_before_it_is_read(gateway):
    status, error, poured, growth = await refused_while_pouring(gateway, speech_head(), chunked=True)
    assert status == 401 and error["code"] == "unauthorized"
    assert poured < POURED / 2, poured
    assert growth < MAX_GROWTH, growth


async def test_an_endless_chunked_body_with_a_key_stops_at_the_limit(gateway):
    # Before: an endless chunked body was read for as long as it came (1.28 GB).
    status, error, poured, growth = await refused_while_pouring(gateway, speech_head(key=KEY), chunked=True)
    assert status == 413 and error["code"] == "message_too_large"
    assert poured < POURED / 2, poured
    assert growth < MAX_GROWTH, growth


async def test_a_declared_length_over_the_limit_is_refused_at_once(gateway):
    status, error, poured, growth = await refused_while_pouring(gateway, speech_head(POURED, KEY), chunked=False)
    assert status == 413 and error["code"] == "message_too_large"
    assert poured < POURED / 2, poured
    assert growth < MAX_GROWTH, growth


async def test_a_body_sent_one_byte_at_a_time_gets_408(gateway):
    """Slowloris on the body: one byte every 0.3 s would hold the connection for ever; the whole body
    must arrive within the body deadline."""
    request = await RawHttp.send_head(gateway.port, "POST", "/v1/audio/speech", speech_head(200, KEY))
    started = time.monotonic()

    async def trickle() -> None:
        try:
            for _ in range(200):
                request.writer.write(b" ")
                await request.writer.drain()
                await asyncio.sleep(0.3)
        except (ConnectionError, OSError):
            pass

    trickling = asyncio.create_task(trickle())
    try:
        status, headers, _ = await request.response(timeout=BODY_TIMEOUT_S + 5)
        elapsed = time.monotonic() - started
        assert status == 408 and headers.get("connection") == "close"
        assert BODY_TIMEOUT_S - 0.1 <= elapsed < BODY_TIMEOUT_S + 3, elapsed
        assert await request.closed_by_server(timeout=5)
    finally:
        trickling.cancel()
        request.close()


async def test_a_ping_flood_that_reads_no_pong_is_dropped(gateway):
    """Without a valid key: refused, but pings are answered at the WebSocket layer whatever the app
    does, and the pongs queue for a client that reads nothing (before: +300 MB)."""
    ping = bytes([0x80 | OP_PING, 0x80 | 125]) + b"\0" * 4 + b"p" * 125  # zero mask: the payload as is
    burst = ping * (1024 * 1024 // len(ping))
    memory = MemoryWatch(gateway.process.pid)
    memory.start()
    async with HealthProbe(gateway.url) as health:
        client = await RawClient.connect(gateway.port, "/v1/audio/speech/stream?api_key=wrong")
        sent = 0
        try:
            while sent < POURED:
                await client.send(burst)
                sent += len(burst)
                await asyncio.sleep(0)  # let the /health probe of this process run
        except (ConnectionError, OSError):
            pass
        assert sent < POURED / 2, sent  # dropped: the rest could not be sent
        client.close()
    assert health.worst < MAX_STALL_S, health.worst
    assert memory.growth < MAX_GROWTH, memory.growth


# ---------------------------------------------------------------- every session ends (item 4)


def websocket_connections(server) -> int:
    return sum(1 for c in server.server.server_state.connections if "WebSocket" in type(c).__name__)


async def wait_for(condition, timeout: float) -> float:
    """Seconds until `condition()` held; raises TimeoutError after `timeout`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"still not true after {timeout} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


CLOSE_TIMEOUT_S = 1.0


async def test_a_fatal_error_for_a_client_that_reads_nothing_still_ends_the_session():
    """The client fills its receive window and stops reading; then a fatal protocol error
    (message_too_large, close 1009) ends the session: the connection is dropped and the session's slot
    (--max-sessions 1) is free within the close deadline. Before: both stayed for ever."""
    config = {"type": "session.config", "voice": "tone-low", "stream_audio": True, "response_format": "pcm"}
    with running_gateway(
        "synthetic", max_sessions=1, max_config_bytes=64 * 1024, close_timeout_s=CLOSE_TIMEOUT_S,
        slow_consumer_timeout_s=120, max_queued_audio_s=30,
    ) as server:
        client = await RawClient.connect(server.settings.port, rcvbuf=4096)
        await client.send_json(config)
        await client.read_json_until("session.started")
        await client.send_json({"type": "input.text", "text": "A sentence of speech that goes on. " * 40})
        await client.send_json({"type": "input.flush"})
        # The gateway's writes now wait for a socket that takes nothing.
        await wait_for(lambda: any((s.writer.blocked_for() or 0) > 1.0
                                   for s in server.gateway.sessions), 20)
        assert server.gateway.admission.open_sessions == 1

        await client.send_json({"type": "input.text", "text": "x" * (100 * 1024)})  # over max_config_bytes: fatal
        gone = await wait_for(
            lambda: server.gateway.admission.open_sessions == 0 and websocket_connections(server) == 0,
            CLOSE_TIMEOUT_S + 10,
        )
        assert gone < CLOSE_TIMEOUT_S + 2, gone
        client.close()

        # The slot is free: a new session is admitted.
        second = await RawClient.connect(server.settings.port)
        await second.send_json(config)
        await second.read_json_until("session.started")
        second.close()


# ---------------------------------------------------------------- the pong bound spares real clients


async def test_a_client_that_pings_while_a_large_sentence_is_on_its_way_keeps_its_session():
    """A sentence sent whole (stream_audio false) is 1.9 MB of 48 kHz wav for 20 s, sent in frames of at most
    1,000,000 bytes (under websockets' default 1 MiB limit), most of it waiting in the server's buffer while
    a slow link delivers it. A client that sends a keepalive ping meanwhile is not a ping flood: it gets the
    whole sentence, its pong and audio.done. Before, the unsent-bytes bound (1 MiB) counted the gateway's own
    audio and dropped the connection."""
    from gateway.session.pipeline import MAX_WHOLE_FRAME_BYTES

    sentence = "This sentence runs on for a long while without a single stop " * 4 + "and then it ends here."
    assert len(sentence) < 300  # one synthesis unit (the default max_synthesis_chars)
    with running_gateway("synthetic") as server:
        client = await RawClient.connect(server.settings.port, rcvbuf=64 * 1024)
        try:
            await client.send_json({"type": "session.config", "voice": "tone-mid", "response_format": "wav",
                                    "sample_rate": 48000})
            await client.read_json_until("session.started")
            await client.send_json({"type": "input.text", "text": sentence})
            await client.send_json({"type": "input.done"})
            await client.read_json_until("audio.start")
            # The sentence's first frame has been written: its first bytes are here, most of it is unsent.
            head = await asyncio.wait_for(client.reader.readexactly(2), 20)
            assert head[0] & 0x0F == 0x2 and head[1] & 0x7F == 127, head  # binary, 64-bit length
            (length,) = struct.unpack("!Q", await client.reader.readexactly(8))
            assert 512 * 1024 < length <= MAX_WHOLE_FRAME_BYTES
            await client.send(frame(OP_PING, b"keepalive"))
            audio = await asyncio.wait_for(client.reader.readexactly(length), 30)
            await client.read_json_until("session.done", timeout=30)
        finally:
            client.close()
    rest = [f.payload for f in client.received if f.opcode == 0x2]
    audio += b"".join(rest)
    assert audio[:4] == b"RIFF" and len(audio) > 1024 * 1024
    assert all(len(part) <= MAX_WHOLE_FRAME_BYTES for part in rest)
    assert [(f.opcode, f.payload) for f in client.received if f.opcode == OP_PONG] == [(OP_PONG, b"keepalive")]
    done = [f.json for f in client.received if f.opcode == 0x1 and f.json["type"] == "audio.done"]
    assert [d["total_bytes"] for d in done] == [len(audio)]
