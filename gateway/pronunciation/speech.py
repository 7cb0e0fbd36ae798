"""One sentence's synthesis through its rewrite: the backend is given the spoken text, never the written.

The sentence's written text (a request's `text`, or its `text_stream` while the sentence is still being
written) is rewritten as it comes (gateway/pronunciation/rewrite.py). The spoken text is cut into parts
at each pause (`<break>`) and at each expression a backend honours as instructions: each text part is one
backend request (a TextStream of its own when the sentence streams, pushed as the rewrite decides it), and
a pause is that many samples of silence made here, between the parts. The chunks come out in order on one
timeline: each part's word timings are moved after the audio before it and mapped back to the client's
written words (`WordMap`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tts_backend.base import AudioChunk, SynthesisRequest, Synthesizer, TextStream, WordTiming, split_words

from ..session.word_times import WordsWait
from .rewrite import Expression, Pause, Piece, Rewriter, WordMap

SILENCE_CHUNK_S = 0.1  # a pause is yielded in chunks of at most this much audio


@dataclass(eq=False)
class _TextPart:
    stream: TextStream  # its spoken text, growing while the sentence is written
    spoken_offset: int  # where it starts among the WordMap's spoken characters
    instructions: str | None
    words_seen: int = 0  # the backend's words of it mapped so far


class _Parts:
    """The sentence's parts as its rewrite decides them."""

    def __init__(self, rewriter: Rewriter, instructions: str | None, honours_instructions: bool) -> None:
        self.rewriter = rewriter
        self.words = WordMap()
        self.parts: list[_TextPart | Pause] = []
        self.final = False
        self.changed = asyncio.Event()
        self._open: _TextPart | None = None
        self._instructions = instructions
        self._honours_instructions = honours_instructions

    def update(self, text: str, final: bool) -> None:
        if self.final:
            return
        for piece in self.rewriter.feed(text, final=final):
            if isinstance(piece, Piece):
                part = self._text_part()
                self.words.add(piece)
                part.stream.push(piece.spoken)
            elif isinstance(piece, Pause):
                self._close()
                self.parts.append(piece)
            elif isinstance(piece, Expression) and self._honours_instructions:
                self._close()
                self._instructions = piece.value
        if final:
            self._close()
            self.final = True
        self.changed.set()

    def _text_part(self) -> _TextPart:
        if self._open is None:
            self._open = _TextPart(TextStream(), self.words.spoken_chars, self._instructions)
            self.parts.append(self._open)
        return self._open

    def _close(self) -> None:
        if self._open is not None:
            self._open.stream.finish()
            self._open = None

    def written_words(self, part: _TextPart, words: tuple[WordTiming, ...], offset: int) -> list[WordTiming]:
        """A part's word timings from the backend (in its own samples) as written words on the sentence's
        timeline (`offset`: samples before the part)."""
        spans = split_words(part.stream.text)
        placed = []
        for timing in words:
            if part.words_seen < len(spans):
                _, a, b = spans[part.words_seen]
                placed.append((part.spoken_offset + a, part.spoken_offset + b,
                               WordTiming(timing.word, timing.start + offset, timing.end + offset)))
            part.words_seen += 1
        return self.words.map(placed)


async def speak(backend: Synthesizer, request: SynthesisRequest, rewriter: Rewriter,
                words_wait: WordsWait | None = None) -> AsyncIterator[AudioChunk]:
    """The sentence's audio (see the module doc): `request` as the client's text gives it, through
    `rewriter`. `words_wait` bounds each part's wait for its word timings: a part whose words are late
    goes on without them (the written words they would have timed are left out) and the next part follows."""
    source = request.text_stream
    parts = _Parts(rewriter, request.instructions, "instructions" in backend.honours)
    unsubscribe = None
    if source is None:
        parts.update(request.text, True)
    else:
        unsubscribe = source.subscribe(lambda: parts.update(source.text, source.finished))
        parts.update(source.text, source.finished)
    made = 0  # samples of the sentence so far
    try:
        index = 0
        while True:
            while index >= len(parts.parts) and not parts.final:
                parts.changed.clear()
                await parts.changed.wait()
            if index >= len(parts.parts):
                break
            part = parts.parts[index]
            index += 1
            if isinstance(part, Pause):
                samples = part.ms * backend.sample_rate // 1000
                step = max(1, int(backend.sample_rate * SILENCE_CHUNK_S))
                for start in range(0, samples, step):
                    await asyncio.sleep(0)  # a cancellation point between chunks, as a backend has
                    yield AudioChunk(bytes(2 * min(step, samples - start)))
                made += samples
                continue
            stream = part.stream
            while not stream.text.strip() and not stream.finished:
                await stream.wait_beyond(len(stream.text))
            if not stream.text.strip():
                continue
            part_request = dataclasses.replace(request, text=stream.text, instructions=part.instructions,
                                               text_stream=stream if source is not None else None)
            start = made
            part_chunks = backend.synthesize(part_request)
            if words_wait is not None:
                part_chunks = words_wait.bound(part_chunks)
            async with contextlib.aclosing(part_chunks) as chunks:
                async for chunk in chunks:
                    words = parts.written_words(part, chunk.words, start) if chunk.words else []
                    made += len(chunk.pcm) // 2
                    if chunk.pcm or words:
                        yield AudioChunk(chunk.pcm, tuple(words))
        if request.word_timestamps:
            last = parts.words.finish()
            if last:
                yield AudioChunk(b"", tuple(last))
    finally:
        if unsubscribe is not None:
            unsubscribe()
