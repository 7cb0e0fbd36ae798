"""Nari Labs' live-text WebSocket (`nari.speech.v1` at /v1/audio/speech/ws, gateway/nari_speech.py).

- Nari's benchmark harness itself (nari-labs/benchmarks' `tts_bench`, pinned, unmodified; tests/nari_bench_env.py)
  runs its WebSocket mode against a synthetic gateway: every request completes, and its audio starts before
  the text has ended (token streaming);
- the protocol's edges with a plain WebSocket client: the subprotocol is required, sequence numbers are
  checked, an acknowledgement follows the session's handling, `response.cancel` ends with
  `stop_reason: "cancelled"`, a refused event gets Nari's error shape and a close code.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

import pytest
import websockets

from tests.conftest import IN_CI
from tests.gateway_server import RecordingBackend, running_gateway
from tests.nari_bench_env import HarnessUnavailable, run_harness, source_dir
from tts_backend.synthetic import SyntheticSynthesizer

PROTOCOL = "nari.speech.v1"
PROMPTS = [
    "Hello there, this is a test of the live text protocol. It has two sentences.",
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
]


@pytest.fixture(scope="module")
def server():
    with running_gateway(RecordingBackend(SyntheticSynthesizer())) as running:
        yield running


def nari_url(server) -> str:
    return server.url.replace("http://", "ws://", 1) + "/v1/audio/speech/ws"


def read(frame) -> dict:
    return json.loads(frame) if isinstance(frame, str) else {"binary": len(frame)}


async def until(ws, *types: str) -> list[dict]:
    events = []
    while True:
        event = read(await asyncio.wait_for(ws.recv(), 20))
        events.append(event)
        if event.get("type") in types:
            return events


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the harness's source needs Python 3.11 (asyncio.timeout)")
@pytest.mark.third_party
def test_nari_harness_runs_unchanged_in_websocket_mode(server, tmp_path):
    try:
        source_dir()
    except HarnessUnavailable as exc:
        if IN_CI:
            pytest.fail(f"{exc}; CI must provide it", pytrace=False)
        pytest.skip(str(exc))
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"id": f"p{i}", "text": t}) + "\n" for i, t in enumerate(PROMPTS)))
    before = len(server.gateway.backend.records)
    result = run_harness(
        "run", "--target", "nari", "--transport", "websocket", "--base-url", server.url, "--dataset", str(dataset),
        "--rps", "2", "--warmup", "0s", "--duration", "2s", "--arrival", "constant", "--timeout", "60s",
        "--output", str(tmp_path / "out"), timeout=300, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 4
    failed = [(r.get("error_kind"), r.get("error_message")) for r in records if not r["success"]]
    assert not failed, failed
    assert "audio before input complete: 100.00%" in result.stdout, result.stdout
    # Token streaming: each request's first sentence was opened at its first words, its text streamed in.
    opened = server.gateway.backend.records[before:]
    assert len(opened) >= 4
    assert all(r.request.text_stream is not None and len(r.opened_with) < len(r.text) for r in opened)


async def test_the_subprotocol_is_required(server):
    async with websockets.connect(nari_url(server)) as ws:
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
    assert ws.close_code == 1002 and PROTOCOL in ws.close_reason


async def test_one_request_with_acknowledged_appends(server):
    async with websockets.connect(nari_url(server), subprotocols=[PROTOCOL]) as ws:
        assert ws.subprotocol == PROTOCOL
        created = read(await ws.recv())
        assert created == {"type": "session.created", "protocol": PROTOCOL,
                           "audio": {"encoding": "pcm_s16le", "sample_rate": 24000, "channels": 1}}
        await ws.send(json.dumps({"type": "request.start", "voice": "Ryan", "language": "English",
                                  "temperature": 0.7}))
        configured = read(await ws.recv())
        assert configured["type"] == "request.configured"
        assert {"code": "option_ignored", "field": "temperature"}.items() <= configured["warnings"][-1].items()
        events: list[dict] = []
        words = "Good morning. How are you today?".split(" ")
        for sequence, word in enumerate(words):
            await ws.send(json.dumps({"type": "input_text.append", "sequence": sequence,
                                      "text": word if sequence == 0 else " " + word}))
            events += await until(ws, "input_text.ack")
            assert events[-1] == {"type": "input_text.ack", "event": "input_text.append", "sequence": sequence,
                                  "request_id": configured["request_id"]}
        await ws.send(json.dumps({"type": "input_text.end", "sequence": len(words)}))
        events += await until(ws, "response.done")
        with pytest.raises(websockets.ConnectionClosedOK):
            await ws.recv()
    assert ws.close_code == 1000
    kinds = [e.get("type", "binary") for e in events]
    assert kinds.count("response.started") == 1
    assert kinds.index("response.started") < kinds.index("binary")
    assert {"type": "input_text.ack", "event": "input_text.end", "sequence": len(words),
            "request_id": configured["request_id"]} in events
    chunks = [e for e in events if "binary" in e]
    assert events[-1] == {"type": "response.done", "request_id": configured["request_id"], "stop_reason": "stop",
                          "audio_chunks": len(chunks)}
    assert set(kinds) <= {"input_text.ack", "response.started", "binary", "response.done"}


async def test_a_sequence_out_of_order_is_refused(server):
    async with websockets.connect(nari_url(server), subprotocols=[PROTOCOL]) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "request.start"}))
        await until(ws, "request.configured")
        await ws.send(json.dumps({"type": "input_text.append", "sequence": 1, "text": "Hello"}))
        (error,) = await until(ws, "error")
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
    assert error["error"]["code"] == "invalid_sequence" and "expected sequence 0" in error["error"]["message"]
    assert ws.close_code == 1008


async def test_events_before_request_start_and_unknown_fields_are_refused(server):
    for first in ({"type": "input_text.append", "sequence": 0, "text": "Hi"},
                  {"type": "request.start", "speed": 2},
                  {"type": "session.config"}):
        async with websockets.connect(nari_url(server), subprotocols=[PROTOCOL]) as ws:
            await ws.recv()
            await ws.send(json.dumps(first))
            (error,) = await until(ws, "error")
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
        assert error["type"] == "error" and error["error"]["code"] in ("invalid_request", "unknown_event"), error
        assert ws.close_code == 1008


async def test_response_cancel_ends_the_response(server):
    async with websockets.connect(nari_url(server), subprotocols=[PROTOCOL]) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "request.start"}))
        await until(ws, "request.configured")
        await ws.send(json.dumps({"type": "input_text.append", "sequence": 0,
                                  "text": "A long sentence that is still being written when the client"}))
        events = await until(ws, "input_text.ack")
        await ws.send(json.dumps({"type": "response.cancel"}))
        events += await until(ws, "response.done")
        with pytest.raises(websockets.ConnectionClosedOK):
            await ws.recv()
    assert events[-1]["stop_reason"] == "cancelled"
    assert events[-1]["audio_chunks"] == sum("binary" in e for e in events)


async def test_an_acknowledgement_does_not_wait_for_the_clients_delayed_ack(server):
    """With audio going out, each input_text.ack took 40-50 ms: the gateway's sockets had Nagle on, so the
    ack, written after an audio frame not yet acknowledged, waited for the client's delayed ACK (40 ms).
    The harness sends a word every 10 ms and the next only after its ack, so its input took 4-5 times as long
    as the text's cadence. Now each ack goes out at once."""
    async with websockets.connect(nari_url(server), subprotocols=[PROTOCOL]) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "request.start"}))
        await until(ws, "request.configured")
        waits = []
        words = ("Please call Stella and ask her to bring these things with her from the store today if she can"
                 " manage it").split()
        for sequence, word in enumerate(words):
            sent = time.perf_counter()
            await ws.send(json.dumps({"type": "input_text.append", "sequence": sequence, "text": word + " "}))
            await until(ws, "input_text.ack")
            waits.append(time.perf_counter() - sent)
        await ws.send(json.dumps({"type": "response.cancel"}))
        await until(ws, "response.done")
    assert statistics.median(waits) < 0.025, [round(w * 1000) for w in waits]


async def test_text_over_the_sessions_limit_is_refused_and_never_acknowledged():
    """A session error ends a Nari connection, as Nari's server does: the append it refused gets the error
    and no input_text.ack."""
    with running_gateway("synthetic", max_buffered_chars=40) as small:
        async with websockets.connect(nari_url(small), subprotocols=[PROTOCOL]) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "request.start"}))
            await until(ws, "request.configured")
            await ws.send(json.dumps({"type": "input_text.append", "sequence": 0, "text": "x" * 60}))
            events = []
            with pytest.raises(websockets.ConnectionClosedError):
                while True:
                    events.append(read(await asyncio.wait_for(ws.recv(), 20)))
    assert [e.get("type") for e in events] == ["error"], events
    assert events[0]["error"]["code"] == "text_too_long"
    assert ws.close_code == 1009
