"""The Twilio Media Streams bridge (clients/telephony) against a real gateway on loopback.

`FakeTwilio` plays Twilio's side of a bidirectional `<Connect><Stream>` exactly as Twilio documents it
(https://www.twilio.com/docs/voice/media-streams/websocket-messages): it sends `connected`, `start`,
20 ms inbound `media` frames, `dtmf` and `stop`; it checks every message the bridge sends (text frames,
`media` with only a base64 payload, `mark`, `clear`, the right streamSid); and it simulates Twilio's
player: a `mark` is echoed when the audio queued before it has finished playing, and `clear` drops the
buffer and echoes every pending mark at once. The gateway runs the synthetic backend (named as such).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import statistics
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

import voxgate_client as vg
import voxgate_telephony as vt
from tests.gateway_server import free_port, running_gateway
from tts_backend.synthetic import SyntheticSynthesizer

VOICE = "tone-mid"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def gateway():
    """The synthetic backend at Twilio's 8 kHz: the mu-law the bridge sends is the backend's samples encoded
    one by one, the same bytes however the gateway batched them. (Resampled from 24 kHz, a sample could
    differ by one step between two sessions whose audio was batched differently - soxr's rounding depends
    on the chunks it is given - as happened on a loaded machine, so the byte comparison below raced.)"""
    with running_gateway(backend=SyntheticSynthesizer(sample_rate=8000)) as server:
        yield server


@pytest.fixture(scope="module")
def paced_gateway():
    """Synthesis at 2x real time after the first chunk: an interrupt lands while audio is being made."""
    with running_gateway(backend=SyntheticSynthesizer(speed=2.0, chunk_ms=40)) as server:
        yield server


@dataclass
class Received:
    at: float
    message: dict


@dataclass
class FakeTwilio:
    url: str
    stream_sid: str = "MZ00000000000000000000000000000001"
    call_sid: str = "CA00000000000000000000000000000001"
    account_sid: str = "AC00000000000000000000000000000001"
    custom_parameters: dict = field(default_factory=lambda: {"caller": "+15550100"})
    headers: dict = field(default_factory=dict)  # e.g. X-Twilio-Signature on the handshake
    received: list[Received] = field(default_factory=list)
    echoed_marks: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sequence = 0
        self.inbound_chunk = 0
        self.buffered_until = 0.0  # when the audio Twilio holds will have finished playing
        self.pending_marks: dict[str, asyncio.TimerHandle] = {}
        self.inbound_payload = bytes([0xFF]) * 160  # mu-law digital silence
        self.media_event = asyncio.Event()
        self.underruns: list[float] = []  # seconds of silence each time Twilio's buffer ran empty
        self.underrun_times: list[float] = []

    async def __aenter__(self) -> "FakeTwilio":
        self.loop = asyncio.get_running_loop()
        self.ws = await ws_connect(self.url, additional_headers=self.headers)
        await self.send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await self.send(
            {
                "event": "start",
                "sequenceNumber": self.next_sequence(),
                "start": {
                    "accountSid": self.account_sid,
                    "streamSid": self.stream_sid,
                    "callSid": self.call_sid,
                    "tracks": ["inbound"],
                    "customParameters": self.custom_parameters,
                    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                },
                "streamSid": self.stream_sid,
            }
        )
        self.reader = asyncio.create_task(self.read_forever())
        self.microphone = asyncio.create_task(self.send_inbound_audio())
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.microphone.cancel()
        for handle in self.pending_marks.values():
            handle.cancel()
        await self.send(
            {
                "event": "stop",
                "sequenceNumber": self.next_sequence(),
                "streamSid": self.stream_sid,
                "stop": {"accountSid": self.account_sid, "callSid": self.call_sid},
            }
        )
        await self.ws.close()
        self.reader.cancel()

    def next_sequence(self) -> str:
        self.sequence += 1
        return str(self.sequence)

    async def send(self, message: dict) -> None:
        await self.ws.send(json.dumps(message))

    async def send_inbound_audio(self) -> None:
        """The caller's microphone: a 20 ms mu-law frame every 20 ms, numbered as Twilio numbers them."""
        start = self.loop.time()
        while True:
            self.inbound_chunk += 1
            await self.send(
                {
                    "event": "media",
                    "sequenceNumber": self.next_sequence(),
                    "media": {
                        "track": "inbound",
                        "chunk": str(self.inbound_chunk),
                        "timestamp": str((self.inbound_chunk - 1) * 20),
                        "payload": base64.b64encode(self.inbound_payload).decode(),
                    },
                    "streamSid": self.stream_sid,
                }
            )
            await asyncio.sleep(max(0.0, start + self.inbound_chunk * 0.02 - self.loop.time()))

    async def read_forever(self) -> None:
        async for frame in self.ws:
            now = self.loop.time()
            if not isinstance(frame, str):
                self.problems.append("binary frame (Twilio warning 31950)")
                continue
            message = json.loads(frame)
            self.received.append(Received(now, message))
            self.check(message)
            event = message.get("event")
            if event == "media":
                if self.buffered_until and now > self.buffered_until:  # the player ran dry: an audible gap
                    self.underruns.append(now - self.buffered_until)
                    self.underrun_times.append(now)
                self.buffered_until = max(now, self.buffered_until) + 0.02
                self.media_event.set()
            elif event == "mark":
                name = message["mark"]["name"]
                self.pending_marks[name] = self.loop.call_at(
                    max(now, self.buffered_until), lambda n=name: asyncio.ensure_future(self.echo_mark(n))
                )
            elif event == "clear":
                self.buffered_until = 0.0  # nothing is playing: the next audio starts afresh
                for name, handle in list(self.pending_marks.items()):
                    handle.cancel()
                    await self.echo_mark(name)

    async def echo_mark(self, name: str) -> None:
        self.pending_marks.pop(name, None)
        self.echoed_marks.append(name)
        await self.send(
            {"event": "mark", "sequenceNumber": self.next_sequence(), "streamSid": self.stream_sid, "mark": {"name": name}}
        )

    def check(self, message: dict) -> None:
        """What Twilio accepts (otherwise warning 31951)."""
        event = message.get("event")
        if message.get("streamSid") != self.stream_sid:
            self.problems.append(f"wrong streamSid in {message}")
        if event == "media":
            if set(message) != {"event", "streamSid", "media"} or set(message["media"]) != {"payload"}:
                self.problems.append(f"unexpected fields in media: {sorted(message)} {sorted(message['media'])}")
        elif event == "mark":
            if set(message) != {"event", "streamSid", "mark"} or not isinstance(message["mark"].get("name"), str):
                self.problems.append(f"malformed mark {message}")
        elif event == "clear":
            if set(message) != {"event", "streamSid"}:
                self.problems.append(f"malformed clear {message}")
        else:
            self.problems.append(f"unknown event to Twilio: {message}")

    def media(self) -> list[Received]:
        return [r for r in self.received if r.message["event"] == "media"]

    def payload(self, received: Received) -> bytes:
        return base64.b64decode(received.message["media"]["payload"], validate=True)


@contextlib.asynccontextmanager
async def serving_bridge(gateway_url: str, serve_options=None, **options) -> AsyncIterator[tuple[vt.TwilioBridge, str]]:
    """A TwilioBridge serving on a free loopback port, and its WebSocket URL; stopped on exit."""
    bridge = vt.TwilioBridge(gateway_url, config=vg.SessionConfig(voice=VOICE), **options)
    port = free_port()
    server = await bridge.serve("127.0.0.1", port, **(serve_options or {}))
    try:
        yield bridge, f"ws://127.0.0.1:{port}/twilio"
    finally:
        server.close()
        await server.wait_closed()


async def gateway_mulaw(gateway_url: str, context_text: str) -> list[bytes]:
    """The gateway's own mu-law 8 kHz audio for a text, per sentence, fetched with the Python client."""
    async with vg.connect(gateway_url, vg.SessionConfig(voice=VOICE, response_format="mulaw", sample_rate=8000)) as s:
        await s.send_text(context_text)
        await s.done()
        per_sentence: dict[int, bytearray] = {}
        async for event in s.events():
            if isinstance(event, vg.AudioChunk):
                per_sentence.setdefault(event.sentence_index, bytearray()).extend(event.data)
    return [bytes(per_sentence[i]) for i in sorted(per_sentence)]


async def test_say_sends_paced_20ms_frames_and_marks(gateway):
    text = "Hello there. How are you today?"
    async with serving_bridge(gateway.url, lead_ms=40) as (bridge, url):
        async with FakeTwilio(url) as twilio:
            call = await bridge.wait_for_call(twilio.call_sid, timeout_s=5)
            assert (call.stream_sid, call.custom_parameters) == (twilio.stream_sid, {"caller": "+15550100"})
            speech = await call.say(text)
            assert await speech.played(timeout_s=10) is True
            messages = list(twilio.received)
            assert call.inbound_frames > 0
        assert twilio.problems == []

        # Frames: exactly 160 bytes each, and together exactly the gateway's mu-law audio per sentence,
        # each sentence padded to a whole frame with mu-law silence (0xFF), a mark right after each.
        expected = await gateway_mulaw(gateway.url, text)
        events = [m.message["event"] for m in messages]
        mark_positions = [i for i, e in enumerate(events) if e == "mark"]
        assert len(mark_positions) == 2 and mark_positions[-1] == len(events) - 1
        media = [m for m in messages if m.message["event"] == "media"]
        payloads = [twilio.payload(m) for m in media]
        assert all(len(p) == 160 for p in payloads)
        first_sentence_frames = mark_positions[0]
        got = [b"".join(payloads[:first_sentence_frames]), b"".join(payloads[first_sentence_frames:])]
        for audio, sentence in zip(got, expected):
            padded = sentence + b"\xff" * (-len(sentence) % 160)
            assert audio == padded

        # Marks: named per sentence, echoed by Twilio after the audio before them played, seen by the bridge.
        names = [messages[i].message["mark"]["name"] for i in mark_positions]
        assert names == [f"{speech.context_id}:0", f"{speech.context_id}:1"]
        assert call.marks_received == names == twilio.echoed_marks
        assert speech.marks_played == names and speech.sentences == ["Hello there.", "How are you today?"]

        # Pacing: one frame per 20 ms in real time after a 40 ms lead; never ahead of that schedule.
        times = [m.at for m in media]
        t0 = times[0]
        lead_frames = 2
        for i, at in enumerate(times):  # 12 ms of slack for scheduling jitter on a loaded 2-core machine
            assert at - t0 >= (i - lead_frames) * 0.020 - 0.012, f"frame {i} sent early (flooding)"
        steady = [b - a for a, b in zip(times[lead_frames:], times[lead_frames + 1 :])]
        assert 0.017 <= statistics.median(steady) <= 0.023
        expected_span = (len(times) - 1 - lead_frames) * 0.020
        assert expected_span - 0.005 <= times[-1] - t0
        # No slack piles up within a sentence. Across the two, the bridge waits for the second sentence's audio,
        # which the gateway makes while the first plays: on a loaded machine it came 0.6 s late, which is the
        # backend's time, not the pacing's.
        for start, end in ((0, first_sentence_frames), (first_sentence_frames, len(times))):
            span = (end - 1 - start) * 0.020
            assert times[end - 1] - times[start] <= span * 1.15 + 0.03 + lead_frames * 0.020


async def test_interrupt_sends_clear_and_input_cancel(paced_gateway):
    text = "This is a rather long answer that the caller will not wait for. It goes on. And on and on."
    async with serving_bridge(paced_gateway.url, lead_ms=40) as (bridge, url):
        async with FakeTwilio(url) as twilio:
            call = await bridge.wait_for_call(timeout_s=5)
            speech = await call.say(text)
            while len(twilio.media()) < 10:  # 200 ms of audio has gone out
                await asyncio.sleep(0.005)
            stopped = await call.interrupt()
            assert stopped == [speech]
            assert await speech.played(timeout_s=1) is False and speech.interrupted
            await asyncio.sleep(0.3)
            events = [r.message["event"] for r in twilio.received]
            assert events.count("clear") == 1
            assert "media" not in events[events.index("clear") :], "audio after clear"
            assert speech.cancel_confirmed, "the gateway did not confirm input.cancel with context.cancelled"
            sent_frames = events.count("media")
            assert sent_frames < 30  # far less than the ~6 s the text would take

            # The call goes on: the next utterance plays normally after the clear.
            reply = await call.say("Yes?")
            assert await reply.played(timeout_s=5) is True
            after_clear = [r for r in twilio.received[events.index("clear") :] if r.message["event"] == "media"]
            assert after_clear and all(len(twilio.payload(r)) == 160 for r in after_clear)
            # sentence indices count across the session: the reply's one sentence follows the cancelled ones
            assert call.marks_received[-1] == reply.marks_played[-1] == f"{reply.context_id}:{reply.marks_queued[0][-1]}"
            assert len(reply.marks_queued) == 1
        assert twilio.problems == []


def loud_tone_mulaw(frames: int) -> bytes:
    samples = array("h", (int(16000 * math.sin(2 * math.pi * 440 * n / 8000)) for n in range(160 * frames)))
    return vg.pcm16_to_mulaw(samples.tobytes())


async def test_caller_speech_barges_in_and_callbacks_fire(paced_gateway):
    inbound: list[int] = []
    digits: list[str] = []
    assert vt.frame_dbfs(bytes([0xFF]) * 160) == float("-inf")
    assert vt.frame_dbfs(loud_tone_mulaw(1)) > -10
    async with serving_bridge(
        paced_gateway.url,
        barge_in_factory=lambda: vt.EnergyBargeIn(threshold_dbfs=-30, min_speech_ms=60),
        on_inbound_audio=lambda call, data: inbound.append(len(data)),
        on_dtmf=lambda call, digit: digits.append(digit),
    ) as (bridge, url):
        async with FakeTwilio(url) as twilio:
            call = await bridge.wait_for_call(timeout_s=5)
            await asyncio.sleep(0.1)
            assert not call.speaking and twilio.received == []  # silence from the caller: nothing to do
            speech = await call.say("Let me tell you all about our wonderful products and services today.")
            while len(twilio.media()) < 5:
                await asyncio.sleep(0.005)
            loud_at = asyncio.get_running_loop().time()
            twilio.inbound_payload = loud_tone_mulaw(1)  # the caller starts talking
            assert await speech.played(timeout_s=2) is False
            clear = next(r for r in twilio.received if r.message["event"] == "clear")
            assert 0.035 <= clear.at - loud_at <= 0.5  # after 60 ms of speech, promptly
            await twilio.send(
                {"event": "dtmf", "streamSid": twilio.stream_sid, "sequenceNumber": twilio.next_sequence(),
                 "dtmf": {"track": "inbound_track", "digit": "7"}}
            )
            await asyncio.sleep(0.05)
        assert digits == ["7"]
        assert inbound and set(inbound) == {160}
        assert twilio.problems == []


async def test_streamed_tokens_start_playing_before_the_text_ends(gateway):
    words = "The first sentence is quick. The second takes its time.".split(" ")

    async def llm():
        for word in words:
            yield word + " "
            await asyncio.sleep(0.03)

    async with serving_bridge(gateway.url) as (bridge, url):
        async with FakeTwilio(url) as twilio:
            call = await bridge.wait_for_call(timeout_s=5)
            speech = await call.stream(llm())
            await twilio.media_event.wait()
            assert not speech.feeder.done(), "first audio should play while the LLM is still writing"
            assert await speech.played(timeout_s=10) is True
            assert speech.sentences == [
                "The first sentence is quick.",
                "The second takes its time.",
            ]

            async def failing_llm():
                yield "Partial answer. And then"
                raise ConnectionError("the LLM stream broke")

            broken = await call.stream(failing_llm())
            assert await broken.played(timeout_s=10) is True  # what arrived is spoken, the utterance ends
            assert broken.sentences == ["Partial answer.", "And then"]
            assert isinstance(broken.feeder.exception(), ConnectionError)
        assert twilio.problems == []


async def test_stop_ends_the_call_and_twiml_endpoint(gateway):
    async with serving_bridge(gateway.url) as (bridge, url):
        http_base = url.replace("ws://", "http://").rsplit("/", 1)[0]
        async with httpx.AsyncClient() as http:
            twiml = await http.get(f"{http_base}/twiml")
            assert twiml.status_code == 200 and twiml.headers["content-type"] == "text/xml"
            assert f'<Connect><Stream url="wss://{http_base[7:]}/twilio">' in twiml.text
            assert (await http.get(f"{http_base}/elsewhere")).status_code == 404
        async with FakeTwilio(url) as twilio:
            call = await bridge.wait_for_call(twilio.call_sid, timeout_s=5)
            session = call.session
        for _ in range(100):
            if not bridge.calls:
                break
            await asyncio.sleep(0.01)
        assert bridge.calls == {} and call.ended.is_set() and session.closed
        with pytest.raises(RuntimeError):
            await call.say("Too late.")


def test_parses_twilio_messages_as_documented():
    start = vt.parse_twilio_message(
        json.dumps(
            {
                "event": "start",
                "sequenceNumber": "1",
                "start": {
                    "accountSid": "AC1",
                    "streamSid": "MZ1",
                    "callSid": "CA1",
                    "tracks": ["inbound"],
                    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                    "customParameters": {"voice": "tone-low"},
                },
                "streamSid": "MZ1",
            }
        )
    )
    assert start == vt.Start("MZ1", "CA1", "AC1", ["inbound"], {"voice": "tone-low"}, vt.MediaFormat(), 1)
    media = vt.parse_twilio_message(
        '{"event":"media","sequenceNumber":"3","media":{"track":"inbound","chunk":"1","timestamp":"5",'
        '"payload":"' + base64.b64encode(b"\xff" * 160).decode() + '"},"streamSid":"MZ1"}'
    )
    assert media.payload == b"\xff" * 160 and (media.chunk, media.timestamp_ms) == (1, 5)
    assert vt.parse_twilio_message('{"event":"mark","sequenceNumber":"4","streamSid":"MZ1","mark":{"name":"a"}}') \
        == vt.Mark("MZ1", "a", 4)
    for bad in ("not json", "[]", '{"event":"media","media":{}}', '{"event":"media","media":{"payload":"%%"}}'):
        with pytest.raises(vt.TwilioProtocolError):
            vt.parse_twilio_message(bad)
    assert json.loads(vt.media_message("MZ1", b"\x00\x01")) == {
        "event": "media", "streamSid": "MZ1", "media": {"payload": "AAE="}
    }
    assert json.loads(vt.clear_message("MZ1")) == {"event": "clear", "streamSid": "MZ1"}


def test_signature_matches_twilios_documented_example():
    # The worked example of https://www.twilio.com/docs/usage/security#validating-requests
    params = {"CallSid": "CA1234567890ABCDE", "Caller": "+12349013030", "Digits": "1234", "From": "+12349013030",
              "To": "+18005551212"}
    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    assert vt.twilio_signature("12345", url, params) == "0/KCTR6DLpKmkAf8muzZqo1nDgQ="
    assert vt.signature_is_valid("12345", "wss://x/twilio", vt.twilio_signature("12345", "wss://x/twilio"))
    assert not vt.signature_is_valid("12345", "wss://x/twilio", vt.twilio_signature("54321", "wss://x/twilio"))
    assert not vt.signature_is_valid("12345", "wss://x/twilio", None)


async def test_with_an_auth_token_only_signed_requests_are_served(gateway):
    from websockets.exceptions import InvalidStatus

    token, public = "twilio-auth-token", "wss://bridge.example"
    async with serving_bridge(gateway.url, {"public_url": public, "auth_token": token}) as (bridge, url):
        http_base = url.replace("ws://", "http://").rsplit("/", 1)[0]
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{http_base}/twiml")).status_code == 403
            signed = {"X-Twilio-Signature": vt.twilio_signature(token, "https://bridge.example/twiml?From=%2B1555")}
            twiml = await http.get(f"{http_base}/twiml?From=%2B1555", headers=signed)
            assert twiml.status_code == 200 and '<Stream url="wss://bridge.example/twilio">' in twiml.text
        for headers in ({}, {"X-Twilio-Signature": vt.twilio_signature("another-token", public + "/twilio")}):
            with pytest.raises(InvalidStatus) as refused:
                async with FakeTwilio(url, headers=headers):
                    pass
            assert refused.value.response.status_code == 403
        assert bridge.calls == {}
        async with FakeTwilio(url, headers={"X-Twilio-Signature": vt.twilio_signature(token, public + "/twilio")}) as t:
            call = await bridge.wait_for_call(t.call_sid, timeout_s=5)
            assert await (await call.say("Signed.")).played(timeout_s=5)
