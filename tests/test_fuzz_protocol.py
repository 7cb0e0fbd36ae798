"""Property-based tests (hypothesis) of the message parser and the sentence splitter, and of whole
sessions on a live gateway (synthetic backend): nothing crashes or hangs, every reply is a valid protocol
message, and every accepted character is spoken or reported."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import protocol
from gateway.protocol import CLIENT_TYPES, ErrorCode, ProtocolError, parse_client_message
from gateway.session.segmenter import SentenceSegmenter
from tests.gateway_server import running_gateway

FIELDS = ["text", "context_id", "voice", "speaker", "response_format", "stream_audio", "speed", "sample_rate",
          "chunk_schedule", "session_id", "sentence_index", "bytes_received", "id", "language",
          "split_granularity", "max_new_tokens", "seed", "instructions", "model", "unknown_field"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8,
)
messages = st.fixed_dictionaries(
    {"type": st.sampled_from([*CLIENT_TYPES, "bogus", ""]) | json_values},
    optional={name: json_values for name in FIELDS},
)
SERVER_MODELS = {
    "session.started": protocol.SessionStarted, "audio.start": protocol.AudioStart,
    "audio.done": protocol.AudioDone, "utterance.done": protocol.UtteranceDone,
    "context.cancelled": protocol.ContextCancelled, "session.done": protocol.SessionDone,
    "error": protocol.ErrorMessage, "pong": protocol.Pong,
}


def check_parse(raw: str) -> None:
    """A parsed message, or a non-fatal ProtocolError whose reply encodes to a valid error message."""
    try:
        message = parse_client_message(raw)
    except ProtocolError as error:
        assert error.code in ErrorCode and error.close is None
        reply = json.loads(error.to_message().encode())
        assert protocol.ErrorMessage.model_validate(reply).code == error.code.value
        return
    assert message.type in CLIENT_TYPES
    # Whatever was accepted can be echoed back (sentence_text, context_id) without failing to encode.
    json.dumps(message.model_dump(), ensure_ascii=False).encode("utf-8")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
def test_parser_on_generated_messages(message: dict[str, Any]):
    check_parse(json.dumps(message))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_parser_on_arbitrary_text(raw: str):
    check_parse(raw)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30), st.integers(0xD800, 0xDFFF))
def test_parser_refuses_unpaired_surrogate_escapes(text: str, surrogate: int):
    raw = json.dumps({"type": "input.text", "text": text}).replace('"text": "', f'"text": "\\u{surrogate:04x}', 1)
    check_parse(raw)
    try:
        parse_client_message(raw)
        raise AssertionError("an unpaired surrogate was accepted")
    except ProtocolError as error:
        assert error.code == ErrorCode.invalid_message


def visible(text: str) -> str:
    return "".join(ch for ch in text if not ch.isspace())


@settings(max_examples=300, deadline=2000)  # a hang or a quadratic blow-up fails the deadline
@given(
    st.lists(st.text(max_size=60) | st.sampled_from([". ", "! ", "? ", "。", "Dr. ", "3.5", "\n\n", ", "]), max_size=40),
    st.sampled_from(["sentence", "clause", "none"]),
    st.sampled_from(["en", "zh", "ja", "de", "Auto", "xx"]),
    st.lists(st.booleans(), max_size=40),
)
def test_segmenter_loses_nothing(pieces: list[str], granularity: str, language: str, flushes: list[bool]):
    segmenter = SentenceSegmenter(granularity, language=language)
    units: list[str] = []
    for i, piece in enumerate(pieces):
        units += segmenter.push(piece)
        if i < len(flushes) and flushes[i]:
            units += segmenter.flush()
        assert segmenter.buffered_chars == len(segmenter.buffered_text)
    units += segmenter.flush()
    assert segmenter.buffered_chars == 0
    assert all(unit.strip() for unit in units)
    assert visible("".join(units)) == visible("".join(pieces))


# ------------------------------------------------------------------------------------ live sessions

contexts = st.sampled_from([None, "a", "b"])
operations = st.lists(
    st.one_of(
        st.tuples(st.just("text"), contexts, st.text(max_size=40)),
        st.tuples(st.just("text"), contexts, st.sampled_from(["Hello there. ", "Yes! ", "Dr. Who? ", "好的。"])),
        st.tuples(st.just("flush"), contexts),
        st.tuples(st.just("done"), contexts),
        st.tuples(st.just("cancel"), contexts),
        st.tuples(st.just("ping"), st.integers(-5, 5)),
        st.tuples(st.just("garbage"), st.text(max_size=20)),
        st.tuples(st.just("surrogate"), contexts),
        st.tuples(st.just("config"), st.sampled_from(["tone-low", "nobody"])),
    ),
    max_size=20,
)


def to_message(op: tuple) -> str:
    kind = op[0]
    if kind == "garbage":
        return "#" + op[1]  # never valid JSON
    if kind == "surrogate":  # refused as a whole (invalid_message): not accepted text
        return '{"type": "input.text", "text": "Half a pair: \\ud83d. "' + (f', "context_id": "{op[1]}"' if op[1] else "") + "}"
    if kind == "ping":
        return json.dumps({"type": "ping", "id": op[1]})
    if kind == "config":
        return json.dumps({"type": "session.config", "voice": op[1], "stream_audio": True})
    message: dict[str, Any] = {"type": f"input.{kind}"}
    if kind == "text":
        message["text"] = op[2]
    if op[1] is not None:
        message["context_id"] = op[1]
    return json.dumps(message)


async def run_script(url: str, ops: list[tuple]) -> None:
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.config", "voice": "tone-mid", "stream_audio": True}))
        sent_text: dict[str | None, str] = {}
        cancels: dict[str | None, int] = {}
        for op in ops:
            if op[0] == "text":
                sent_text[op[1]] = sent_text.get(op[1], "") + op[2]
            elif op[0] == "cancel":
                cancels[op[1]] = cancels.get(op[1], 0) + 1
            await ws.send(to_message(op))
        await ws.send(json.dumps({"type": "session.close"}))

        spoken: dict[str | None, str] = {}
        cancelled: dict[str | None, int] = {}
        current: dict | None = None
        current_bytes = 0
        last_index = -1
        errors: list[dict] = []
        while True:
            try:
                frame = await asyncio.wait_for(ws.recv(), 30)
            except websockets.ConnectionClosedOK:
                break
            if isinstance(frame, bytes):
                assert current is not None, "audio outside a sentence"
                assert len(frame) % 2 == 0
                current_bytes += len(frame)
                continue
            message = json.loads(frame)
            kind = message["type"]
            SERVER_MODELS[kind].model_validate(message)  # every reply is a valid protocol message
            if kind == "audio.start":
                assert current is None and message["sentence_index"] > last_index
                current, current_bytes, last_index = message, 0, message["sentence_index"]
                context = message.get("context_id")
                spoken[context] = spoken.get(context, "") + message["sentence_text"]
            elif kind == "audio.done":
                assert current is not None and message["sentence_index"] == current["sentence_index"]
                assert message["total_bytes"] == current_bytes
                assert not message["error"], message
                current = None
            elif kind == "context.cancelled":
                context = message.get("context_id")
                cancelled[context] = cancelled.get(context, 0) + 1
                if current is not None and current.get("context_id") == context:
                    current = None
            elif kind == "error":
                assert message["code"] in ErrorCode.__members__, message
                errors.append(message)
            elif kind == "session.done":
                pass
        assert current is None
        assert cancelled == cancels
        # Text is refused only by a message-level error (never here: every input.text is valid and small),
        # so every character sent on a context that was never cancelled is spoken, in order.
        assert not [e for e in errors if e["code"] in ("text_too_long", "message_too_large", "rate_limited")]
        for context, text in sent_text.items():
            if context not in cancels:
                assert visible(spoken.get(context, "")) == visible(text), (context, text, spoken.get(context))
            else:  # cancelled: some of it may never be spoken, but nothing beyond what was sent
                assert len(visible(spoken.get(context, ""))) <= len(visible(text))


def test_live_sessions_on_generated_scripts():
    with running_gateway("synthetic") as server:

        @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(operations)
        def check(ops: list[tuple]) -> None:
            asyncio.run(asyncio.wait_for(run_script(server.ws_url, ops), 60))

        check()
