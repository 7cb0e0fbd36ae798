"""Bounded session state (issue 12, item 8): sentence records of finished or cancelled sentences are
pruned, a resume still replays byte-exactly what the replay log covers, a resume reads only the part of
the log it replays, and `context_id` has a length limit."""

from __future__ import annotations

import contextlib
import json
import socket
import threading

import pytest
import redis
import websockets

from tests.gateway_server import running_gateway
from tests.redis_fixtures import REDIS_URL, redis_prefix  # noqa: F401 (fixture)
from tests.resume_fixtures import Listener, config_message, start_session, uninterrupted_pcm

# ~99 KB of short sentences: one input.text releases about 9,000 sentences.
FLOOD_TEXT = "Go on now. " * 9000


def sentence_records(server, session_id: str) -> tuple[int, int | None]:
    """(sentence records, bytes of the session's text/state/bytes hashes in Redis; None in memory)."""
    store = server.gateway.store
    if server.settings.store == "memory":
        return len(server.call(store.get, session_id).sentences), None
    keys = store.keys(session_id)
    client = redis.Redis.from_url(REDIS_URL)
    records = client.hlen(keys[2])
    memory = sum(client.memory_usage(key, samples=0) or 0 for key in keys[2:5])
    return records, memory


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_text_and_cancel_flood_leaves_few_sentence_records(store, redis_prefix):  # noqa: F811
    with running_gateway(backend="synthetic", store=store, redis_key_prefix=redis_prefix) as server:
        listener = Listener()
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.send(config_message())
            await listener.receive(ws, "session.started")
            for _ in range(8):
                await ws.send(json.dumps({"type": "input.text", "text": FLOOD_TEXT, "context_id": "c"}))
                await ws.send(json.dumps({"type": "input.cancel", "context_id": "c"}))
                await listener.receive(ws, "context.cancelled")
            records, memory = sentence_records(server, listener.session_id)
            # Sentence indices go on from the count of sentences released, pruned or not.
            await ws.send(json.dumps({"type": "input.text", "text": "The end.", "context_id": "d"}))
            await ws.send(json.dumps({"type": "input.done", "context_id": "d"}))
            end = await listener.receive(ws, "audio.start")
            await listener.receive(ws, "utterance.done")
    print(f"{store}: after 8 x (99 KB input.text + input.cancel): {end['sentence_index']} sentences released,"
          f" {records} records, {memory} bytes in the sentence hashes")
    assert end["sentence_index"] == 8 * 8999  # the flood happened (the last "Go on now." of each stays open)
    # Only sentences whose audio the replay log still holds are kept (here the cancels come before any
    # audio); without pruning every released sentence stays (before: 71,992 records, 16.8 MB).
    assert records < 200 and (memory is None or memory < 64 * 1024)


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_pruned_session_resumes_byte_exact_where_its_log_reaches(store, redis_prefix):  # noqa: F811
    """A replay log of 40 KB (under 1 s of audio) over 12 sentences of 150 KB each: the records of the
    early sentences are pruned, the session still resumes byte-exactly from a position the log holds, a
    position before it is resume_out_of_range, and the next sentence index is still right."""
    text = " ".join(f"Sentence number {n} is spoken a little while here." for n in range(12))
    options = dict(store=store, redis_key_prefix=redis_prefix, replay_log_bytes=40_000)
    with running_gateway(backend="synthetic", **options) as server:
        reference = await uninterrupted_pcm(server.ws_url, text)
        listener = Listener()
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await start_session(ws, listener, text, done=False)
            await ws.send(json.dumps({"type": "input.flush"}))
            while listener.last_done < 11:
                await listener.receive(ws, "audio.done")
        record = server.call(server.gateway.store.get, listener.session_id)
        assert len(record.sentences) <= 2  # only what the log holds
        # The client lost the last 30,000 bytes: replayed from the log, byte for byte.
        last = listener.audio[11]
        kept = len(last) - 30_000
        listener.audio[11] = last[:kept]
        listener.open_sentence, listener.last_done = 11, 10
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.send(listener.resume_message())
            started = await listener.receive(ws, ("session.started", "error"))
            assert started["type"] == "session.started", started
            await ws.send(json.dumps({"type": "input.done"}))
            done = await listener.receive(ws, ("session.done", "error"))
        assert done == {"type": "session.done", "total_sentences": 12}
        assert listener.pcm() == reference
        for index, received in [(0, 0), (9, 0), (10, 0)]:  # pruned, or older than the log
            async with websockets.connect(server.ws_url, max_size=None) as ws:
                await ws.send(json.dumps({"type": "session.resume", "session_id": listener.session_id,
                                          "sentence_index": index, "bytes_received": received}))
                error = json.loads(await ws.recv())
                assert error["code"] == "resume_out_of_range", error


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_cancelled_utterance_ends_leave_no_record(store, redis_prefix):  # noqa: F811
    """An input.done cancelled before its end went out is never sent: its record goes at once."""
    with running_gateway(backend="synthetic", store=store, redis_key_prefix=redis_prefix) as server:
        listener = Listener()
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.send(config_message())
            await listener.receive(ws, "session.started")
            for _ in range(20):
                await ws.send(json.dumps({"type": "input.text", "text": "Go on now. " * 50, "context_id": "c"}))
                await ws.send(json.dumps({"type": "input.done", "context_id": "c"}))
                await ws.send(json.dumps({"type": "input.cancel", "context_id": "c"}))
                await listener.receive(ws, "context.cancelled")
            records, _ = marker_records(server, listener.session_id)
            await ws.send(json.dumps({"type": "input.text", "text": "The end.", "context_id": "d"}))
            await ws.send(json.dumps({"type": "input.done", "context_id": "d"}))
            done = await listener.receive(ws, "utterance.done")
    assert not any(m["type"] == "utterance.done" and m["context_id"] == "c" for m in listener.messages)
    assert records == 0  # before: 20 records of ends that were never sent
    assert done == {"type": "utterance.done", "context_id": "d", "total_sentences": 1}


class CountingProxy:
    """A TCP proxy in front of Redis, in threads of its own (the gateway under test starts while the test's
    loop waits), that counts the bytes Redis sends back."""

    def __init__(self) -> None:
        self.from_redis = 0
        host, port = REDIS_URL.split("//")[1].split("/")[0].split(":")
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.upstream)
                self.sockets += [client, upstream]
                threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
                threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, count: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if count:
                    self.from_redis += len(data)
                target.sendall(data)
        with contextlib.suppress(OSError):
            target.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


async def test_a_resume_reads_only_the_part_of_the_log_it_replays(redis_prefix):  # noqa: F811
    """3 MB of audio in the replay log; a client that lacks only the last 20,000 bytes resumes. Redis
    sends the gateway little more than those bytes (before: the whole log, every resume)."""
    text = " ".join(f"Sentence number {n} is spoken for a while, and then some more." for n in range(20))
    proxy = CountingProxy()
    url = f"redis://127.0.0.1:{proxy.port}/0"
    try:
        with running_gateway(backend="synthetic", store="redis", redis_url=url, redis_key_prefix=redis_prefix,
                             session_lease_s=60) as server:
            listener = Listener()
            async with websockets.connect(server.ws_url, max_size=None) as ws:
                await start_session(ws, listener, text)
                await listener.receive(ws, "session.done")
            logged = sum(map(len, listener.audio.values()))
            assert logged > 3_000_000
            last = max(listener.audio)
            complete = bytes(listener.audio[last])
            listener.audio[last] = listener.audio[last][:-20_000]
            listener.open_sentence, listener.last_done = last, last - 1
            async with websockets.connect(server.ws_url, max_size=None) as ws:
                before = proxy.from_redis
                await ws.send(listener.resume_message())
                await listener.receive(ws, "audio.done")
                read = proxy.from_redis - before
    finally:
        proxy.close()
    assert bytes(listener.audio[last]) == complete
    print(f"one resume read {read} bytes from Redis ({logged} bytes in the replay log)")
    assert read < 20_000 + 100_000


async def test_context_id_has_a_length_limit():
    with running_gateway(backend="synthetic") as server:
        listener = Listener()
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.send(config_message())
            await listener.receive(ws, "session.started")
            for kind in ("input.text", "input.flush", "input.done", "input.cancel"):
                message = {"type": kind, "context_id": "c" * 129}
                if kind == "input.text":
                    message["text"] = "Never spoken."
                await ws.send(json.dumps(message))
                error = await listener.receive(ws, "error")
                assert error["code"] == "invalid_message" and "128" in error["message"], error
                assert "c" * 129 not in json.dumps(error)  # the over-long id is not echoed
            # Non-fatal: the session goes on, and an id of 128 characters is fine.
            await ws.send(json.dumps({"type": "input.text", "text": "Spoken.", "context_id": "c" * 128}))
            await ws.send(json.dumps({"type": "input.done", "context_id": "c" * 128}))
            done = await listener.receive(ws, "utterance.done")
        assert done["context_id"] == "c" * 128 and done["total_sentences"] == 1
        assert [m["sentence_text"] for m in listener.messages if m["type"] == "audio.start"] == ["Spoken."]
