"""A client that stops reading: the gateway stops pulling audio from the backend once a bounded amount is
queued for it, closes it after the slow-consumer deadline, and keeps its session resumable; a resume
gets every byte, identical to what a reading client gets."""

from __future__ import annotations

import asyncio
import json

import websockets

from tests.gateway_server import RecordingBackend, audio_by_sentence, receive_until, running_gateway
from tests.hostile_fixtures import RawClient
from tts_backend.synthetic import SyntheticSynthesizer

SENTENCE = "This sentence is long enough to be a few seconds of synthetic speech, more or less."
TEXT = " ".join(f"Part {i}. {SENTENCE}" for i in range(12))
CONFIG = {"type": "session.config", "voice": "tone-low", "stream_audio": True, "response_format": "pcm"}
QUEUED_S = 0.5
DEADLINE_S = 3.0


def produced_bytes(backend: RecordingBackend) -> int:
    return sum(r.chunks for r in backend.records) * backend.inner.chunk_samples * 2


async def full_session(url: str) -> tuple[list[str], list[bytes]]:
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps(CONFIG))
        await receive_until(ws, "session.started")
        await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
        await ws.send(json.dumps({"type": "input.done"}))
        messages = await receive_until(ws, "session.done", timeout=60)
    texts = [m["sentence_text"] for m in messages if isinstance(m, dict) and m.get("type") == "audio.start"]
    return texts, list(audio_by_sentence(messages).values())


async def test_a_client_that_stops_reading_pauses_synthesis_and_is_closed_resumably():
    backend = RecordingBackend(SyntheticSynthesizer())  # unpaced: without back-pressure it would race ahead
    with running_gateway(backend, max_queued_audio_s=QUEUED_S, slow_consumer_timeout_s=DEADLINE_S) as server:
        expected_texts, expected_audio = await full_session(server.ws_url)
        total = sum(map(len, expected_audio))
        assert total > 3_000_000  # over a minute of audio: far more than any buffer on the way
        backend.records.clear()

        # A small receive buffer and no reading after session.started.
        client = await RawClient.connect(server.settings.port, rcvbuf=8192)
        await client.send_json(CONFIG)
        session_id = (await client.read_json_until("session.started"))["session_id"]
        await client.send_json({"type": "input.text", "text": TEXT})
        await client.send_json({"type": "input.done"})
        await asyncio.sleep(1.0)
        first = produced_bytes(backend)
        await asyncio.sleep(1.0)
        # Synthesis stopped: no more pulled from the backend, and only a small part of the audio exists.
        assert produced_bytes(backend) == first
        assert first < total / 4, (first, total)
        session = next(iter(server.gateway.sessions))
        bound = QUEUED_S * 2 * backend.sample_rate
        assert session.pipeline.queued_audio <= 2 * bound

        # Past the deadline the session is closed (the connection dropped: its socket takes no close frame).
        for _ in range(int((DEADLINE_S + 3) / 0.05)):
            if not server.gateway.sessions:
                break
            await asyncio.sleep(0.05)
        assert not server.gateway.sessions
        assert await client.eof(timeout=5)
        client.close()
        metrics = (await asyncio.to_thread(__import__("httpx").get, server.url + "/metrics")).text
        assert 'voxgate_errors_total{code="slow_consumer"} 1.0' in metrics

        # Its state is kept: a resume from the start gets all of it, byte for byte.
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.resume", "session_id": session_id,
                                      "sentence_index": 0, "bytes_received": 0}))
            messages = await receive_until(ws, "session.done", timeout=60)
        started_msg = next(m for m in messages if isinstance(m, dict) and m["type"] == "session.started")
        assert started_msg["session_id"] == session_id
        texts = [m["sentence_text"] for m in messages if isinstance(m, dict) and m.get("type") == "audio.start"]
        assert texts == expected_texts
        assert list(audio_by_sentence(messages).values()) == expected_audio


async def test_a_slow_but_reading_client_is_not_cut_off():
    """Back-pressure is not an error: a client that reads slowly (in bursts, with pauses shorter than the
    deadline) gets all its audio."""
    with running_gateway("synthetic", max_queued_audio_s=QUEUED_S, slow_consumer_timeout_s=DEADLINE_S) as server:
        expected_texts, expected_audio = await full_session(server.ws_url)
        async with websockets.connect(server.ws_url, max_size=None, max_queue=1) as ws:
            await ws.send(json.dumps(CONFIG))
            await receive_until(ws, "session.started")
            await ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            await ws.send(json.dumps({"type": "input.done"}))
            messages = []
            while not (messages and isinstance(messages[-1], dict) and messages[-1].get("type") == "session.done"):
                for _ in range(200):
                    frame = await asyncio.wait_for(ws.recv(), 20)
                    messages.append(frame if isinstance(frame, bytes) else json.loads(frame))
                    if isinstance(messages[-1], dict) and messages[-1].get("type") == "session.done":
                        break
                await asyncio.sleep(DEADLINE_S / 3)  # stop reading for a while
        assert [m["sentence_text"] for m in messages if isinstance(m, dict) and m.get("type") == "audio.start"] == expected_texts
        assert list(audio_by_sentence(messages).values()) == expected_audio
