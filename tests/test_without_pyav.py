"""A gateway whose install has no PyAV (the GPU bench's stripped one: bench/h200.sh setup without
.carry/optwhl) starts and serves pcm and wav; a compressed format or a reference clip then fails saying that
PyAV is missing. Run in a child interpreter in which `import av` fails, against a real gateway (synthetic
backend) over HTTP."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import sys
    sys.modules["av"] = None  # `import av` now raises ImportError, as where PyAV is not installed

    import httpx
    import numpy as np

    from gateway.audio.pyav import PyAVMissing
    from gateway.audio.reference import decode_clip
    from tests.gateway_server import running_gateway

    with running_gateway("synthetic") as server:
        for fmt in ("pcm", "wav"):
            response = httpx.post(server.url + "/v1/audio/speech", timeout=60,
                                  json={"input": "Hello there, no PyAV here.", "response_format": fmt})
            assert response.status_code == 200, (fmt, response.status_code, response.text)
            body = response.content
            if fmt == "wav":
                assert body[:4] == b"RIFF", body[:16]
                body = body[44:]
            samples = np.frombuffer(body, dtype="<i2")
            assert len(samples) > 2400 and np.abs(samples).max() > 0, len(samples)
            print(fmt, "ok", len(samples))
        try:
            response = httpx.post(server.url + "/v1/audio/speech", timeout=60,
                                  json={"input": "Hello there.", "response_format": "mp3"})
            print("mp3 status", response.status_code, response.text[:300])
        except httpx.HTTPError as exc:
            print("mp3 transport error", type(exc).__name__)
    try:
        decode_clip(b"RIFF....WAVE", 1.0, 30.0, 24000)
    except PyAVMissing as exc:
        print("clip:", exc)
    print("av imported:", sys.modules.get("av") is not None)
""")


def test_pcm_and_wav_without_pyav_and_a_clear_error_for_what_needs_it():
    result = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "pcm ok" in out and "wav ok" in out, out[-4000:]
    assert "clip: decoding reference audio needs PyAV, which is not installed here (pip install av)" in out, out[-4000:]
    assert "av imported: False" in out, out[-4000:]
    # mp3 fails (500: a stripped install is the operator's doing, not the client's), and the log says why.
    assert "mp3 status 500" in out, out[-4000:]
    assert "compressed output (mp3, opus, aac, flac) needs PyAV" in out, out[-4000:]
