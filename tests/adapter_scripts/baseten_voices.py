"""LiveKit Agents' Baseten Qwen3-TTS client (livekit-plugins-baseten 1.8.9) registering and using a cloned
voice on a live gateway; run in the livekit venv (tests/adapter_env.py).

    python baseten_voices.py WS_URL KEY CLIP_PATH REF_TEXT

The plugin's own `register_voice()` (voice.add) and `list_voices()` (voice.list), then
`baseten.TTS(model="qwen3-tts", voice=<the clone>)` streams a reply with it, used unchanged. Prints one
line: RESULTS <json> with what they returned and the reply's audio (base64 s16le).
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys

from livekit.agents import utils
from livekit.plugins import baseten

NAME = "livekit-clone"


async def main(url: str, key: str, clip: str, ref_text: str) -> dict:
    out: dict = {}
    out["registered"] = await baseten.register_voice(model_endpoint=url, name=NAME, ref_audio_path=clip,
                                                     ref_text=ref_text, api_key=key)
    out["listed"] = await baseten.list_voices(model_endpoint=url, api_key=key)
    async with utils.http_context.open():
        tts = baseten.TTS(model="qwen3-tts", model_endpoint=url, api_key=key, voice=NAME, task_type="Base")
        try:
            frames = []
            async with tts.stream() as stream:
                stream.push_text("Hello from the cloned voice. ")
                stream.end_input()
                async for event in stream:
                    frames.append(event.frame)
        finally:
            await tts.aclose()
    out["sample_rates"] = sorted({f.sample_rate for f in frames})
    out["audio"] = base64.b64encode(b"".join(f.data.tobytes() for f in frames)).decode()
    return out


if __name__ == "__main__":
    print("RESULTS " + json.dumps(asyncio.run(main(*sys.argv[1:5]))), flush=True)
