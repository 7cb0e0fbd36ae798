"""What the gateway adds: the same sentences through the backend in-process and through the WebSocket.

For each prompt the backend is called directly (tts_backend.registry.create_backend, sentence by sentence,
timed from just before the call) and through a running gateway (bench/loadgen.py's client, timed from just
before `input.text`), one request at a time, alternating which goes first. Both are measured with the same
functions (TTFB, first playable, audible TTFA under zero-buffer playback, E2E), and the per-prompt
differences are the gateway's added latency: WebSocket framing, JSON, sentence splitting, scheduling,
loopback transfer and the client's own receive path.

    voxgate serve --port 8000 &                      # Piper on the CPU, the default
    python bench/gateway_overhead.py --backend piper --url ws://127.0.0.1:8000/v1/audio/speech/stream \\
        --count 40 --output bench/results/piper_cpu_overhead.json

With --serve the script starts `voxgate serve` itself on a free port (same backend and options) and stops it
at the end. Direct and gateway runs use separate backend instances with the same settings; with Piper's
default (noise 0) both produce the same bytes, which the report checks (`same_audio`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.loadgen import (  # noqa: E402
    DEFAULT_PROMPTS,
    ClientOptions,
    RequestResult,
    RequestSpec,
    Workload,
    distribution,
    hardware,
    json_safe,
    load_average,
    load_prompts,
    parse_range,
    request_metrics,
    run_request,
)
from bench.ports import free_port  # noqa: E402 - below the kernel's ephemeral ports
from gateway.session.segmenter import SentenceSegmenter  # noqa: E402
from tts_backend.base import SynthesisRequest, Synthesizer  # noqa: E402
from tts_backend.registry import create_backend  # noqa: E402

COMPARED = ("ttfb_s", "first_playable_s", "audible_ttfa_s", "e2e_s")


async def run_direct(backend: Synthesizer, spec: RequestSpec, voice: str) -> RequestResult:
    """The backend called in-process for the request's sentences, split as the gateway splits them."""
    segmenter = SentenceSegmenter("sentence")
    sentences = segmenter.push(spec.text) + segmenter.flush()
    result = RequestResult(index=spec.index, prompt_ids=spec.prompt_ids, chars=len(spec.text), measured=True)
    result.sentences = len(sentences)
    frames: list[tuple[float, int]] = []
    audio: list[bytes] = []  # kept for the onset search
    t0 = time.perf_counter()
    try:
        for sentence in sentences:
            async for chunk in backend.synthesize(SynthesisRequest(text=sentence, voice=voice)):
                frames.append((time.perf_counter() - t0, len(chunk.pcm)))
                audio.append(chunk.pcm)
        result.completed = True
    except Exception as exc:
        result.errors.append(f"{type(exc).__name__}: {exc}"[:200])
    pcm = b"".join(audio)
    samples = np.frombuffer(pcm[: len(pcm) & ~1], dtype="<i2")
    return request_metrics(result, frames, 2, backend.sample_rate, samples, result.completed)


def start_gateway(backend: str, options: list[str], ready_timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """`voxgate serve` in a child process on a free port; returns (process, WebSocket URL) once ready."""
    port = free_port()
    command = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--backend", backend,
               "--log-level", "warning"]
    for option in options:
        command += ["-o", option]
    process = subprocess.Popen(command)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"voxgate serve exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as response:
                if response.status == 200:
                    return process, f"ws://127.0.0.1:{port}/v1/audio/speech/stream"
        except OSError:
            pass
        time.sleep(0.1)
    process.terminate()
    raise SystemExit("voxgate serve did not become ready")


def _option_pair(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    try:
        return key.replace("-", "_"), json.loads(value)
    except ValueError:
        return key.replace("-", "_"), value


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    backend = create_backend(args.backend, **dict(_option_pair(o) for o in args.option))
    await backend.start()
    voice = args.voice or backend.default_voice
    options = ClientOptions(url=url, voice=args.voice, timeout_s=args.timeout)
    workload = Workload(load_prompts(args.prompts), args.seed, args.sentences)
    pairs = []
    try:
        for index in range(args.warmup + args.count):
            spec = workload.request(index)
            direct_first = index % 2 == 0
            if direct_first:
                direct = await run_direct(backend, spec, voice)
            ws = await run_request(spec, options, measured=True, run_start=time.perf_counter())
            if not direct_first:
                direct = await run_direct(backend, spec, voice)
            if index >= args.warmup:
                pairs.append((spec, direct, ws))
    finally:
        await backend.stop()
    return summarize_pairs(pairs)


def summarize_pairs(pairs: list[tuple[RequestSpec, RequestResult, RequestResult]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"direct": {}, "websocket": {}, "added": {}}
    for name in COMPARED:
        direct = [getattr(d, name) for _, d, _ in pairs]
        ws = [getattr(w, name) for _, _, w in pairs]
        added = [w - d for d, w in zip(direct, ws) if d is not None and w is not None]
        summary["direct"][name] = distribution(direct)
        summary["websocket"][name] = distribution(ws)
        summary["added"][name] = distribution(added)
    summary["pairs"] = len(pairs)
    summary["failed"] = sum(not (d.ok and w.ok) for _, d, w in pairs)
    summary["same_audio_bytes"] = sum(d.bytes == w.bytes for _, d, w in pairs)
    summary["errors"] = sorted({e for _, d, w in pairs for e in d.errors + w.errors})
    summary["requests"] = [
        {"prompt_ids": spec.prompt_ids, "chars": d.chars, "audio_s": d.audio_s,
         **{f"direct_{n}": getattr(d, n) for n in COMPARED}, **{f"ws_{n}": getattr(w, n) for n in COMPARED}}
        for spec, d, w in pairs
    ]
    return summary


def markdown(summary: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None or value != value else f"{value * 1000:.1f}"

    lines = ["| metric | direct p50 | WebSocket p50 | added p50 | direct p95 | WebSocket p95 | added p95 |",
             "|---|---|---|---|---|---|---|"]
    labels = {"ttfb_s": "TTFB (ms)", "first_playable_s": "first playable (ms)",
              "audible_ttfa_s": "audible TTFA (ms)", "e2e_s": "E2E (ms)"}
    for name in COMPARED:
        d, w, a = summary["direct"][name], summary["websocket"][name], summary["added"][name]
        lines.append(f"| {labels[name]} | {ms(d['p50'])} | {ms(w['p50'])} | {ms(a['p50'])} | {ms(d['p95'])} | "
                     f"{ms(w['p95'])} | {ms(a['p95'])} |")
    lines.append(f"\n{summary['pairs']} prompts, {summary['failed']} failed, "
                 f"{summary['same_audio_bytes']} with the same byte count both ways")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="WebSocket URL of a gateway running the same backend")
    target.add_argument("--serve", action="store_true", help="start `voxgate serve` on a free port")
    parser.add_argument("--backend", default="piper", help="backend name (default piper)")
    parser.add_argument("--option", "-o", action="append", default=[], metavar="KEY=VALUE",
                        help="backend option, as for voxgate serve -o; repeatable")
    parser.add_argument("--voice")
    parser.add_argument("--count", type=int, default=30, help="measured prompts (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured prompts first (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sentences", type=parse_range, default=(1, 1), metavar="N|LOW-HIGH")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--output", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    process = None
    url = args.url
    load_before = load_average()
    if args.serve:
        process, url = start_gateway(args.backend, args.option)
    try:
        summary = asyncio.run(measure(args, url))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
    report = {
        "tool": "bench/gateway_overhead.py",
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "hardware": hardware() | {"load_average_1m_before": load_before},
        "backend": args.backend,
        "backend_options": args.option,
        "sentences": list(args.sentences),
        "summary": summary,
    }
    print(markdown(summary))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(json_safe(report), indent=2, allow_nan=False) + "\n")
        print(f"wrote {args.output}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
