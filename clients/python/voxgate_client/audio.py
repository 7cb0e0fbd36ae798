"""Audio helpers with no dependencies: G.711 mu-law/A-law codecs, WAV files, optional sound-card playback.

The stdlib `audioop` module is gone from Python 3.13, so the G.711 codecs are implemented here from the
ITU-T G.711 definition (segment/mantissa encoding, bias 0x84 for mu-law).
"""

from __future__ import annotations

import asyncio
import sys
import wave
from array import array
from pathlib import Path
from typing import BinaryIO

_MULAW_BIAS = 0x84
_MULAW_CLIP = 32635


def _mulaw_decode_byte(value: int) -> int:
    value = ~value & 0xFF
    sign = value & 0x80
    exponent = (value >> 4) & 0x07
    mantissa = value & 0x0F
    sample = (((mantissa << 3) + _MULAW_BIAS) << exponent) - _MULAW_BIAS
    return -sample if sign else sample


def _alaw_decode_byte(value: int) -> int:
    value ^= 0x55
    sign = value & 0x80
    exponent = (value >> 4) & 0x07
    mantissa = value & 0x0F
    if exponent == 0:
        sample = (mantissa << 4) + 8
    else:
        sample = ((mantissa << 4) + 0x108) << (exponent - 1)
    return sample if sign else -sample


def _mulaw_encode_sample(sample: int) -> int:
    sign = 0x80 if sample < 0 else 0
    magnitude = min(-sample if sign else sample, _MULAW_CLIP) + _MULAW_BIAS
    exponent = max(0, magnitude.bit_length() - 8)  # position of the highest set bit above bit 7
    exponent = min(exponent, 7)
    mantissa = (magnitude >> (exponent + 3)) & 0x0F
    return ~(sign | (exponent << 4) | mantissa) & 0xFF


_MULAW_TO_PCM = array("h", [_mulaw_decode_byte(b) for b in range(256)])
_ALAW_TO_PCM = array("h", [_alaw_decode_byte(b) for b in range(256)])

MULAW_SILENCE = 0xFF  # encodes sample 0


def mulaw_to_pcm16(data: bytes) -> bytes:
    """G.711 mu-law bytes to s16le samples."""
    out = array("h", (_MULAW_TO_PCM[b] for b in data))
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def alaw_to_pcm16(data: bytes) -> bytes:
    """G.711 A-law bytes to s16le samples."""
    out = array("h", (_ALAW_TO_PCM[b] for b in data))
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def pcm16_to_mulaw(data: bytes) -> bytes:
    """s16le samples to G.711 mu-law bytes."""
    samples = array("h")
    samples.frombytes(data[: len(data) - len(data) % 2])
    if sys.byteorder != "little":
        samples.byteswap()
    return bytes(_mulaw_encode_sample(s) for s in samples)


def to_pcm16(data: bytes, audio_format: str) -> bytes:
    """Audio in a streaming format (pcm, mulaw, alaw) as s16le samples."""
    if audio_format == "pcm":
        return data
    if audio_format == "mulaw":
        return mulaw_to_pcm16(data)
    if audio_format == "alaw":
        return alaw_to_pcm16(data)
    raise ValueError(f"cannot decode {audio_format!r}; expected pcm, mulaw or alaw")


def write_wav(target: str | Path | BinaryIO, pcm16: bytes, sample_rate: int, channels: int = 1) -> None:
    """Write s16le samples as a 16-bit PCM WAV file."""
    with wave.open(target if not isinstance(target, Path) else str(target), "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm16)


class SoundCardPlayer:
    """Plays s16le mono through `sounddevice` (optional dependency) as chunks arrive."""

    def __init__(self, sample_rate: int, device: int | str | None = None) -> None:
        import sounddevice  # optional: pip install 'voxgate-client[playback]'

        self._stream = sounddevice.RawOutputStream(samplerate=sample_rate, channels=1, dtype="int16", device=device)
        self._stream.start()

    @staticmethod
    def available() -> bool:
        """True when sounddevice is installed and an output device exists."""
        try:
            import sounddevice
        except (ImportError, OSError):  # OSError: the PortAudio library itself is missing
            return False
        try:
            sounddevice.query_devices(kind="output")
        except Exception:  # sounddevice raises PortAudioError / ValueError when there is no device
            return False
        return True

    async def play(self, pcm16: bytes) -> None:
        # RawOutputStream.write blocks until the device accepts the data: keep it off the event loop.
        await asyncio.get_running_loop().run_in_executor(None, self._stream.write, pcm16)

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()
