"""Hostile clients over raw sockets (hand-built WebSocket frames): the gateway refuses what is wrong with
the right close code or protocol error, keeps serving, and a well-behaved session running at the same
time gets exactly the audio it gets alone, byte for byte."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.gateway_server import running_gateway
from tests.hostile_fixtures import (
    GOOD_CONFIG,
    OP_BINARY,
    OP_CONT,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    RawClient,
    frame,
    good_session,
    text,
)

HEADER_TIMEOUT_S = 1.5
CONFIG_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def server():
    # Paced synthesis (4x real time), so the reference session is still running while the hostile ones act.
    with running_gateway(
        "synthetic", backend_options={"speed": 4.0}, header_timeout_s=HEADER_TIMEOUT_S,
        config_timeout_s=CONFIG_TIMEOUT_S, max_open_contexts=256,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def reference(server):
    """The reference session's audio with nothing else going on."""
    return asyncio.run(good_session(server.ws_url, rounds=2))


async def alongside(server, reference, hostile) -> None:
    """Run `hostile` while a well-behaved session runs; its audio must equal the reference."""
    good = asyncio.create_task(good_session(server.ws_url, rounds=2))
    await asyncio.sleep(0.05)
    await hostile
    assert await asyncio.wait_for(good, 60) == reference
    async with httpx.AsyncClient() as client:
        assert (await client.get(server.url + "/health")).status_code == 200


async def configured(server) -> RawClient:
    client = await RawClient.connect(server.settings.port)
    await client.send_json(GOOD_CONFIG)
    await client.read_json_until("session.started")
    return client


def port(server) -> int:
    return server.settings.port


async def test_oversized_frames(server, reference):
    async def hostile():
        # A frame announcing 64 MiB: refused from its header (1009), nothing buffered.
        big = await configured(server)
        await big.send(frame(OP_TEXT, b'{"type": "input.text", "text": "', length=64 << 20))
        assert await big.read_close() == 1009
        big.close()
        # A message within the transport's limit but over the protocol's 128 KiB: an error, the session lives.
        large = await configured(server)
        await large.send_json({"type": "input.text", "text": "a" * (200 * 1024)})
        error = await large.read_json_until("error")
        assert error["code"] == "message_too_large"
        await large.send_json({"type": "ping", "id": 7})
        assert (await large.read_json_until("pong"))["id"] == 7
        large.close()

    await alongside(server, reference, hostile())


async def test_binary_frames_from_the_client(server, reference):
    async def hostile():
        client = await configured(server)
        await client.send(frame(OP_BINARY, b"\x00\x01" * 5000))
        error = await client.read_json_until("error")
        assert error["code"] == "invalid_message" and "binary" in error["message"]
        await client.send_json({"type": "input.text", "text": "Still here."})
        await client.send_json({"type": "input.done"})
        start = await client.read_json_until("audio.start")
        assert start["sentence_text"] == "Still here."
        await client.read_json_until("session.done")
        client.close()

    await alongside(server, reference, hostile())


async def test_fragmented_frames(server, reference):
    async def hostile():
        # Legal: one text message in three fragments, with a ping control frame between them.
        client = await configured(server)
        body = json.dumps({"type": "input.text", "text": "Fragments make one message."}).encode()
        await client.send(frame(OP_TEXT, body[:10], fin=False))
        await client.send(frame(OP_CONT, body[10:20], fin=False))
        await client.send(frame(OP_PING, b"between"))
        await client.send(frame(OP_CONT, body[20:], fin=True))
        await client.send_json({"type": "input.done"})
        pong = await client.read_until(lambda f: f.opcode == OP_PONG)
        assert pong.payload == b"between"
        start = await client.read_json_until("audio.start")
        assert start["sentence_text"] == "Fragments make one message."
        await client.read_json_until("session.done")
        client.close()

        # Illegal: a continuation with nothing to continue; a new message inside a fragmented one; a
        # fragmented control frame. Each is a protocol error: close 1002.
        for frames in (
            [frame(OP_CONT, b"orphan", fin=True)],
            [frame(OP_TEXT, b'{"type": ', fin=False), frame(OP_TEXT, b'"ping"}', fin=True)],
            [frame(OP_PING, b"split", fin=False)],
        ):
            bad = await configured(server)
            for piece in frames:
                await bad.send(piece)
            assert await bad.read_close() == 1002
            bad.close()

    await alongside(server, reference, hostile())


async def test_invalid_utf8_in_a_text_frame(server, reference):
    async def hostile():
        client = await configured(server)
        await client.send(frame(OP_TEXT, b'{"type": "input.text", "text": "\xff\xfe\xc3\x28"}'))
        assert await client.read_close() == 1007
        client.close()

    await alongside(server, reference, hostile())


async def test_slowloris_handshakes_are_cut_off(server, reference):
    async def trickle(n: int) -> float:
        """Send an upgrade request one header line every 0.4 s; returns when the server hung up."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port(server))
        started = asyncio.get_running_loop().time()
        lines = [b"GET /v1/audio/speech/stream HTTP/1.1\r\n", b"Host: x\r\n", b"Upgrade: websocket\r\n"]
        lines += [f"X-Slow-{i}: {'z' * 20}\r\n".encode() for i in range(40)]
        try:
            for line in lines:
                writer.write(line)
                await writer.drain()
                await asyncio.sleep(0.4)
                if reader.at_eof():
                    break
            data = await asyncio.wait_for(reader.read(), 10)
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        writer.close()
        assert b"101" not in data
        return asyncio.get_running_loop().time() - started

    async def silent_after_upgrade() -> int | None:
        client = await RawClient.connect(port(server))  # upgraded, then never sends session.config
        code = await client.read_close(timeout=CONFIG_TIMEOUT_S + 5)
        client.close()
        return code

    async def hostile():
        results = await asyncio.gather(*(trickle(i) for i in range(30)), silent_after_upgrade())
        durations, close_code = results[:-1], results[-1]
        # Each slow handshake is dropped at the header deadline, long before its 40 lines could finish.
        assert all(HEADER_TIMEOUT_S - 0.1 <= d < HEADER_TIMEOUT_S + 2.0 for d in durations), durations
        assert close_code == 1008  # config_required

    await alongside(server, reference, hostile())


async def test_ping_floods(server, reference):
    async def hostile():
        client = await configured(server)
        count = 3000
        # WebSocket ping control frames, all at once; every one is answered with its payload.
        await client.send(b"".join(frame(OP_PING, str(i).encode()) for i in range(count)))
        pongs = []
        while len(pongs) < count:
            got = await client.read_frame()
            if got.opcode == OP_PONG:
                pongs.append(int(got.payload))
        assert pongs == list(range(count))
        # Protocol pings: answered in order with their ids.
        await client.send(b"".join(text({"type": "ping", "id": i}) for i in range(count)))
        ids = []
        while len(ids) < count:
            got = await client.read_frame()
            if got.opcode == OP_TEXT:
                message = got.json
                assert message["type"] == "pong"
                ids.append(message["id"])
        assert ids == list(range(count))
        client.close()

    await alongside(server, reference, hostile())


async def test_thousands_of_contexts(server, reference):
    async def hostile():
        client = await configured(server)
        contexts = 3000
        # Thousands of contexts opened at once: the first max_open_contexts take text, the rest are
        # refused with an error naming the context (reported, not silently dropped).
        await client.send(b"".join(
            text({"type": "input.text", "text": f"Context {i} says hi.", "context_id": f"c{i}"}) for i in range(contexts)
        ))
        refused = set()
        while len(refused) < contexts - 256:
            got = await client.read_frame()
            assert got.opcode == OP_TEXT
            message = got.json
            assert message["type"] == "error" and message["code"] == "invalid_message", message
            refused.add(message["context_id"])
        assert refused == {f"c{i}" for i in range(256, contexts)}
        # All of them cancelled: every one is answered, none makes audio.
        await client.send(b"".join(text({"type": "input.cancel", "context_id": f"c{i}"}) for i in range(contexts)))
        cancelled = []
        while len(cancelled) < contexts:
            got = await client.read_frame()
            assert got.opcode == OP_TEXT and got.json["type"] == "context.cancelled", got
            cancelled.append(got.json["context_id"])
        assert sorted(cancelled) == sorted(f"c{i}" for i in range(contexts))
        # The session still works, and a thousand short utterances one after another are all answered:
        # ended, or, past max_pending_ends waiting at once, refused with rate_limited.
        count = 1000
        await client.send(b"".join(
            text({"type": "input.done", "context_id": f"d{i}"}) for i in range(count)
        ))
        done = refused = 0
        while done + refused < count:
            got = await client.read_frame()
            if got.opcode == OP_TEXT and got.json["type"] == "utterance.done":
                done += 1
            elif got.opcode == OP_TEXT and got.json["type"] == "error":
                assert got.json["code"] == "rate_limited", got.json
                refused += 1
        assert done >= server.settings.max_pending_ends
        await client.send_json({"type": "input.text", "text": "Last words.", "context_id": "last"})
        await client.send_json({"type": "input.done", "context_id": "last"})
        start = await client.read_json_until("audio.start")
        assert start["sentence_text"] == "Last words." and start["context_id"] == "last"
        await client.read_json_until("utterance.done")
        client.close()

    await alongside(server, reference, hostile())
