"""`voxgate-say`: speak a text file (or stdin) through a Voxgate gateway to a WAV file or the sound card.

    voxgate-say --url ws://127.0.0.1:8000 --voice tone-mid -o out.wav story.txt
    echo "Hello there." | voxgate-say --play
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from .audio import SoundCardPlayer, to_pcm16, write_wav
from .config import SAMPLE_RATES, SessionConfig
from .events import AudioChunk, AudioStart, Error, SessionDone
from .session import VoxgateError, connect


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voxgate-say", description=__doc__.split("\n")[0])
    parser.add_argument("text_file", nargs="?", default="-", help="text to speak; '-' or nothing reads stdin")
    parser.add_argument("--url", default=os.environ.get("VOXGATE_URL", "ws://127.0.0.1:8000"), help="gateway URL")
    parser.add_argument("-o", "--output", help="write a WAV file here")
    parser.add_argument("--play", action="store_true", help="play on the sound card (needs sounddevice)")
    parser.add_argument("--voice")
    parser.add_argument("--language")
    parser.add_argument("--instructions")
    parser.add_argument("--sample-rate", type=int, choices=SAMPLE_RATES)
    parser.add_argument("--format", default="pcm", choices=("pcm", "mulaw", "alaw"), help="wire format")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--split", choices=("token", "sentence", "clause", "none"), default="token",
                        help="split granularity (default token: synthesis starts at each sentence's first words "
                             "where the backend can)")
    parser.add_argument("--say", action="append", default=[], metavar="WRITTEN=SPOKEN",
                        help="say WRITTEN as SPOKEN (a pronunciation entry; repeatable), e.g. --say Voxgate='vox gate'")
    parser.add_argument("--dictionary", action="append", default=[], metavar="NAME",
                        help="a pronunciation dictionary registered with the key (repeatable)")
    parser.add_argument("--ssml", action="store_true", help="read the text as markup: <spell>, <say-as>, <sub>, <break>")
    parser.add_argument("--api-key", default=os.environ.get("VOXGATE_API_KEY"), help="or VOXGATE_API_KEY")
    parser.add_argument("-q", "--quiet", action="store_true", help="no per-sentence progress on stderr")
    return parser


async def say(args: argparse.Namespace, text: str) -> int:
    config = SessionConfig(
        voice=args.voice,
        response_format=args.format,
        sample_rate=args.sample_rate,
        language=args.language,
        instructions=args.instructions,
        seed=args.seed,
        split_granularity=args.split,
        pronunciations=_pronunciations(args) or None,
        text_markup="ssml" if args.ssml else None,
    )
    play = args.play or not args.output
    if play and not SoundCardPlayer.available():
        if not args.output:
            print("voxgate-say: no sound card (or sounddevice not installed); use -o FILE.wav", file=sys.stderr)
            return 2
        play = False
    pcm = bytearray()
    player: SoundCardPlayer | None = None
    started = time.monotonic()
    status = 0
    async with connect(args.url, config, api_key=args.api_key) as session:
        _print_warnings(session.started.warnings if session.started else [])
        sample_rate = session.sample_rate or args.sample_rate or 24000
        if play:
            player = SoundCardPlayer(sample_rate)
        try:
            await session.send_text(text)
            await session.done()
            async for event in session.events():
                if isinstance(event, AudioChunk):
                    samples = to_pcm16(event.data, session.format or args.format)
                    pcm += samples
                    if player is not None:
                        await player.play(samples)
                elif isinstance(event, AudioStart):
                    if not args.quiet:
                        elapsed = time.monotonic() - started
                        voice = f" (voice {event.voice})" if event.voice else ""
                        print(f"[{elapsed:6.2f}s] sentence {event.sentence_index}{voice}: {event.sentence_text}",
                              file=sys.stderr)
                    _print_warnings(event.warnings, f"sentence {event.sentence_index}: ")
                elif isinstance(event, Error):
                    print(f"voxgate-say: {event.code}: {event.message}", file=sys.stderr)
                    status = 1
                elif isinstance(event, SessionDone):
                    break
        finally:
            if player is not None:
                player.close()
    if args.output:
        write_wav(args.output, bytes(pcm), sample_rate)
    if not args.quiet:
        seconds = len(pcm) / 2 / sample_rate
        print(f"{seconds:.2f} s of audio at {sample_rate} Hz" + (f" -> {args.output}" if args.output else ""),
              file=sys.stderr)
    return status


def _print_warnings(warnings: list[dict], where: str = "") -> None:
    """What the gateway does differently than asked (a voice fallback, a language the voice does not speak):
    always shown, even with --quiet."""
    for warning in warnings:
        print(f"voxgate-say: warning: {where}{warning.get('code')}: {warning.get('message')}", file=sys.stderr)


def _pronunciations(args: argparse.Namespace) -> list:
    entries: list = []
    for rule in args.say:
        written, sep, spoken = rule.partition("=")
        if not sep or not written.strip() or not spoken.strip():
            raise SystemExit(f"voxgate-say: --say takes WRITTEN=SPOKEN, not {rule!r}")
        entries.append({"text": written, "say": spoken})
    return entries + list(args.dictionary)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.text_file == "-":
        text = sys.stdin.read()
    else:
        with open(args.text_file, encoding="utf-8") as handle:
            text = handle.read()
    if not text.strip():
        print("voxgate-say: no text to speak", file=sys.stderr)
        return 2
    try:
        return asyncio.run(say(args, text))
    except VoxgateError as exc:
        print(f"voxgate-say: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"voxgate-say: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
