"""`voxgate worker` in a real subprocess on a Unix socket, reached through RemoteSynthesizer.

The worker serves the synthetic backend here (named as such: no model needed); the Qwen3 engine behind
the same worker is covered in test_engine_qwen3.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from tts_backend.base import SynthesisRequest, UnknownVoiceError
from tts_backend.remote import RemoteSynthesizer
from tts_backend.synthetic import SyntheticSynthesizer


def start_worker(socket_path: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tts_backend.remote.worker", "--socket", socket_path, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def only_worker(remote: RemoteSynthesizer):
    (member,) = remote.members.values()
    return member


def stop_worker(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def synthetic_worker(tmp_path):
    path = str(tmp_path / "w.sock")
    # speed=4: paced at 4x real time after the first chunk, so a long text streams for a while.
    proc = start_worker(path, "--backend", "synthetic", "--option", "speed=4")
    yield path
    stop_worker(proc)


async def test_remote_streams_what_the_backend_makes(synthetic_worker):
    remote = RemoteSynthesizer(socket=synthetic_worker, connect_timeout_s=30, info_refresh_s=0.1)
    await remote.start()
    try:
        assert remote.ready and remote.sample_rate == 24000
        assert {v.id for v in remote.voices()} == {"tone-low", "tone-mid", "tone-high"}
        assert remote.honours == SyntheticSynthesizer.honours  # so the gateway's warnings are the worker's
        request = SynthesisRequest(text="Hello there, this is a test.", voice="tone-mid", seed=3)
        audio = b"".join([c.pcm async for c in remote.synthesize(request)])
        assert audio == SyntheticSynthesizer().render(request).tobytes()
        with pytest.raises(UnknownVoiceError):
            async for _ in remote.synthesize(SynthesisRequest(text="x", voice="nope")):
                pass
    finally:
        await remote.stop()


async def test_closing_the_stream_cancels_it_in_the_worker(synthetic_worker):
    remote = RemoteSynthesizer(socket=synthetic_worker, connect_timeout_s=30, info_refresh_s=0.05)
    await remote.start()
    try:
        long_text = "word " * 300  # 100 s of audio, ~25 s to stream at 4x
        stream = remote.synthesize(SynthesisRequest(text=long_text, voice="tone-low"))
        await stream.__anext__()
        await asyncio.sleep(0.2)
        assert (await only_worker(remote).query("info"))["streams"] == 1
        started = time.monotonic()
        await stream.aclose()
        while (await only_worker(remote).query("info"))["streams"] != 0:
            assert time.monotonic() - started < 2.0, "worker kept streaming after the client left"
            await asyncio.sleep(0.02)
        # The worker still serves.
        audio = b"".join([c.pcm async for c in remote.synthesize(SynthesisRequest(text="ok", voice="tone-high"))])
        assert len(audio) > 0
    finally:
        await remote.stop()


async def test_remote_start_fails_clearly_without_a_worker(tmp_path):
    remote = RemoteSynthesizer(socket=str(tmp_path / "none.sock"), connect_timeout_s=0.3)
    with pytest.raises(Exception, match="no ready worker"):
        await remote.start()
