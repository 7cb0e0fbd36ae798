"""CPU cost of the output formats: seconds of CPU per second of audio, per format, for one stream.

A speech-like test signal (a gliding tone with syllable-rate loudness changes) is fed to
`gateway.audio.encoders.AudioFileEncoder` in chunks of --chunk-ms, as a session's sender does, one file per
--sentence-s of audio, all on this thread. Reported per format: CPU time per second of audio, the median
and longest CPU time of one `encode` call (what a call would hold the event loop for, were it run there),
and the bit rate produced.

    python bench/encode_cost.py --source-rate 22050 --rate 24000 --seconds 60
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from gateway.audio.encoders import AudioFileEncoder

FORMATS = ("pcm", "wav", "mulaw", "alaw", "flac", "mp3", "aac", "opus")


def speech_like(rate: int, seconds: float) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    pitch = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t) ** 2
    signal = 0.25 * voice * envelope + 0.01 * np.random.default_rng(0).standard_normal(len(t))
    return np.round(np.clip(signal, -1, 1) * 32767).astype("<i2").tobytes()


def measure(fmt: str, pcm: bytes, source_rate: int, rate: int, chunk_ms: int, sentence_s: float) -> dict:
    chunk = source_rate * chunk_ms // 1000 * 2
    sentence = int(source_rate * sentence_s) * 2
    out_bytes, calls = 0, []
    started = time.thread_time()
    for start in range(0, len(pcm), sentence):
        encoder = AudioFileEncoder(fmt, source_rate, rate, serial=start)
        piece = pcm[start : start + sentence]
        for offset in range(0, len(piece), chunk):
            t0 = time.thread_time()
            out_bytes += len(encoder.encode_now(piece[offset : offset + chunk]))
            calls.append(time.thread_time() - t0)
        out_bytes += len(encoder.finish_now())
    cpu = time.thread_time() - started
    audio_s = len(pcm) / 2 / source_rate
    return {"format": fmt, "cpu_ms_per_audio_s": round(1000 * cpu / audio_s, 2),
            "call_median_ms": round(1000 * float(np.median(calls)), 3), "call_max_ms": round(1000 * max(calls), 3),
            "kbit_per_s": round(out_bytes * 8 / audio_s / 1000, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source-rate", type=int, default=22050, help="the backend's rate (Piper: 22050)")
    parser.add_argument("--rate", type=int, default=24000, help="the requested output rate")
    parser.add_argument("--seconds", type=float, default=60.0, help="audio per format")
    parser.add_argument("--chunk-ms", type=int, default=100, help="PCM per encode call")
    parser.add_argument("--sentence-s", type=float, default=4.0, help="audio per file (a sentence)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    pcm = speech_like(args.source_rate, args.seconds)
    for fmt in args.formats.split(","):
        print(json.dumps(measure(fmt, pcm, args.source_rate, args.rate, args.chunk_ms, args.sentence_s)))


if __name__ == "__main__":
    main()
