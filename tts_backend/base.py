"""The one interface the gateway sees of speech synthesis.

A backend turns text and a voice into a stream of PCM chunks (signed 16-bit little-endian, mono, at the
backend's `sample_rate`). The gateway knows nothing else of synthesis: the CPU Piper voice, the Qwen3-TTS
GPU engine in this process, and a worker process reached over a local socket all look the same.

Cancellation is cooperative and prompt: a backend must stop producing within one chunk when the consumer
stops iterating (``aclose()`` on the iterator, or cancellation of the task that iterates it).

Word timings (issue 16) are opt-in per request: with `SynthesisRequest.word_timestamps` set, a backend
that has "word_timestamps" in `honours` attaches `WordTiming`s to the chunks it yields, as soon as it
knows them: all at once with the first chunk (Piper, the synthetic backend), or in a chunk with no audio
after the sentence's last one (an aligner that needs the whole sentence). Times are sample positions in
the request's own audio (sample 0 is the first sample it yields), at the backend's `sample_rate`; the
gateway maps them to the audio as shipped. Each word of the request's text appears once, in text order,
with start <= end and times that never go back. Without the flag a backend does no timing work at all.
A backend whose timings come after the audio yields a chunk with `audio_ended` set (and nothing else) once
its last audio is out and before it waits for them: from then on only words may come, so the gateway bounds
that wait (issue 32: timings that are late never hold back a sentence's end, its audio.done or the next
sentence) and stops the request at its bound; the words then go untold, with a warning.

Voice cloning (issue 15) is optional too: a backend that can clone has "voice_cloning" in `honours`
(`can_clone`). `clone_voice` turns a `ReferenceAudio` (float32 mono samples at 24 kHz, decoded and
resampled by the gateway, and the reference's transcript when known) into a voice prompt: bytes the
backend computed once (for Qwen3 Base: the x-vector, the reference codes, the tokenized reference text),
opaque to the gateway, which stores them in its voice registry and hands them back with every request
that speaks with that voice (`SynthesisRequest.voice_prompt`). A backend must refuse, with
`InvalidVoicePromptError`, a prompt it cannot read (one made by another model or version), so the bytes
should carry what identifies their maker.

Text streaming (issue 21) is optional: a backend that has "text_streaming" in `honours` takes a request
whose text is still being written (`SynthesisRequest.text_stream`, a `TextStream`). It starts speaking from
the first words, while the caller pushes the rest, and ends the request only after the caller's `finish()`
and the audio of all the text. Why: Qwen3-TTS's streaming-text mode feeds the Talker one text token per
frame, so the model needs only the next token to make the next frame, not the whole sentence; a voice agent
can then speak an LLM's reply as it is written instead of a sentence later. The contract:
- What is said does not change, only when: the audio of a text pushed in pieces, whatever the pieces and
  their timing, equals the audio of the same text given whole in the backend's streaming-text mode (same
  voice, seed and options). The backend, not the caller, holds back a word until the text after it (or
  `finish()`) shows that it is complete, so that its tokens are the whole text's tokens; callers should
  still push whole words (a space-separated tail held back), because a word cut in two waits anyway.
- A stream that has spoken all the text it has waits for more; that silence is the caller's, not an
  underrun of the backend's making (the GPU engine counts it apart, as waiting for text).
- Cancellation is as for any request: the consumer stops iterating. A caller that neither finishes nor
  cancels a text stream leaves the request open; the gateway always does one or the other.
`request.text` is the part known when the request was opened (it may be empty); `text_stream.text` is all
of it so far. A backend without the ability treats `text_stream` as absent: the gateway gives it only whole
sentences.

The model's text mode is a per-request choice too (`SynthesisRequest.streaming_text`, vLLM-Omni's
`non_streaming_mode` negated): True feeds the text one token per frame, False puts it all in the prompt,
None leaves the server's default (`-o streaming_text`). A backend that acts on it has "text_mode" in
`honours`. A text stream always runs in streaming-text mode.

Resume from codes (issue 33) is optional: a backend that has "resume_codes" in `honours` tells its codec
codes with its audio and continues a sentence from them. Why: on a GPU a request's sampled frames depend on
its batch company, so a sentence made again from its text on another worker (failover, a draining worker)
or on another replica (`session.resume`) is another take, and making the delivered part again is most of
the pause. Continuing from the codes keeps the take and costs one prefill. The contract:
- A backend with codes has `codebooks` > 0 (and `frame_rate`, its codec frames a second of audio). Each
  chunk it yields carries in `AudioChunk.codes` the codes of the frames it generated since its previous
  chunk, those whose audio was trimmed or is silent included: little-endian uint16, frame-major (each frame
  its `codebooks` codes in codebook order), whole frames only. A chunk's codes never belong to audio it has
  not yet yielded: the audio of the frames it names is in that chunk or an earlier one.
- `SynthesisRequest.resume_codes` (whole frames, the concatenation of the codes of the chunks delivered so
  far, in order) continues the same request (same text, voice, seed, options) after those frames: the
  backend yields exactly the audio that the uninterrupted request yields after the chunk that carried the
  last of those codes, and its first new sample joins the last delivered one (the codec decodes its left
  context again from the codes, so there is no click). Its chunks carry only the codes of new frames. Where
  numerics do not vary (the CPU, the synthetic backend), the resumed audio equals the uninterrupted run's,
  byte for byte. Word timings keep the uninterrupted request's time base (sample 0 is the sentence's first
  sample, before the resume point); a backend may tell again words it told before, and the caller drops
  those it has.
- A caller that has audio past the last chunk that carried codes (a pool that had part of a chunk) resumes
  from the codes it has and drops the audio it already delivered from the start of the resumed stream.
- `max_code_bytes` bounds a request's codes (what a caller keeps, what a worker may send); a backend refuses,
  with SynthesisError, resume codes that are not whole frames, exceed that bound or do not continue this
  request. A backend without the ability (`codebooks` 0: Piper) yields no codes and refuses resume_codes
  rather than speaking the sentence again from its start.

What a "word" is: `split_words` below, the one definition every backend uses, so that the gateway and
clients can rebuild the text from the words (joined by single spaces).
"""

from __future__ import annotations

import abc
import asyncio
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field


class SynthesisError(RuntimeError):
    """A request failed inside the backend; the message is safe to show to the client."""


class UnknownVoiceError(SynthesisError):
    pass


class BackendOverloadedError(SynthesisError):
    """The backend cannot accept more work now; the same request may succeed later."""


class VoiceCloningUnsupportedError(SynthesisError):
    """This backend (or its checkpoint) cannot clone a voice from reference audio."""


class InvalidReferenceAudioError(SynthesisError):
    """The reference audio (or its transcript) cannot make a voice: too short, silent, no ref_text where
    the in-context prompt needs one. The message says which."""


class InvalidVoicePromptError(SynthesisError):
    """A SynthesisRequest's voice_prompt was not made by this backend (another model, another version)."""


# The one rate reference audio reaches a backend at: the Qwen3 speaker encoder's and tokenizer's.
REFERENCE_SAMPLE_RATE = 24000


@dataclass(frozen=True)
class ReferenceAudio:
    """A clip to clone a voice from: float32 little-endian mono samples in [-1, 1] at
    REFERENCE_SAMPLE_RATE (bytes, so that it crosses the worker socket as it is), and what is said in it."""

    samples: bytes
    ref_text: str | None = None

    @property
    def num_samples(self) -> int:
        return len(self.samples) // 4

    @property
    def duration_s(self) -> float:
        return self.num_samples / REFERENCE_SAMPLE_RATE


@dataclass(frozen=True)
class Voice:
    id: str
    name: str
    language: str = "en"
    description: str = ""


class TextStream:
    """The text of one request, growing while the backend speaks it (see the module doc).

    The caller `push`es pieces (they are concatenated as given, spaces included) and calls `finish()` once no
    more will come; a backend reads `text` and waits for more with `wait_beyond` (or iterates `pieces`).
    One event loop owns it: push, finish and the waits run on that loop, so no lock is needed. It is plain
    data with no tie to a backend, so a worker pool forwards what is pushed as frames and the worker feeds
    a TextStream of its own. A listener (`subscribe`) is called on the loop after every push and finish:
    that is how a backend whose work runs on another thread (the GPU engine) learns of new text without
    polling.
    """

    def __init__(self, text: str = "") -> None:
        self._text = text
        self._finished = False
        self._waiters: list[asyncio.Future] = []
        self._listeners: list[Callable[[], None]] = []

    @property
    def text(self) -> str:
        """All the text so far, the part known at the start included."""
        return self._text

    @property
    def finished(self) -> bool:
        return self._finished

    def push(self, text: str) -> None:
        if self._finished:
            raise RuntimeError("text pushed after finish()")
        if not text:
            return
        self._text += text
        self._changed()

    def finish(self) -> None:
        """No more text. Idempotent."""
        if not self._finished:
            self._finished = True
            self._changed()

    def _changed(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        for listener in list(self._listeners):
            listener()

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener()` after every push and finish from now on; returns the function that stops it."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    async def wait_beyond(self, n_chars: int) -> bool:
        """Wait until the text is longer than `n_chars` characters (True) or finished at or below it (False)."""
        while len(self._text) <= n_chars and not self._finished:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        return len(self._text) > n_chars

    async def pieces(self, start: int = 0) -> AsyncIterator[str]:
        """The text after character `start`, as it comes (several pushes may arrive as one piece), until
        finished."""
        sent = start
        while await self.wait_beyond(sent):
            piece = self._text[sent:]
            sent = len(self._text)
            yield piece


@dataclass(frozen=True)
class SynthesisRequest:
    text: str
    voice: str
    language: str = "Auto"
    instructions: str | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    # Codec frames per chunk for backends that stream in frames (Qwen3: 80 ms each), e.g. (2, 4, 8, 12).
    chunk_schedule: tuple[int, ...] | None = None
    # Sentences of one utterance share this key, so a backend may keep generation context across them.
    utterance_key: str | None = None
    # Requests of one client session share this key, so a pool of workers keeps a session on one worker.
    session_key: str | None = None
    # A caller-chosen id for logs and tracing; never affects the audio.
    request_id: str = ""
    extra: dict = field(default_factory=dict)
    # Attach WordTimings to the chunks (backends with "word_timestamps" in `honours`; others ignore it).
    word_timestamps: bool = False
    # A cloned voice: what this backend's clone_voice returned. When set, it speaks instead of `voice`
    # (which then only names the voice, for logs); a backend that cannot clone raises
    # VoiceCloningUnsupportedError.
    voice_prompt: bytes | None = None
    # Text still being written (backends with "text_streaming" in `honours`, see the module doc): the text
    # is then `text_stream.text`, of which `text` is the part known when the request was opened.
    text_stream: TextStream | None = None
    # The model's text mode (backends with "text_mode"): True one token per frame, False all in the
    # prompt (vLLM-Omni's non_streaming_mode), None the server's default.
    streaming_text: bool | None = None
    # Continue after these frames (backends with "resume_codes", see the module doc): the codes the chunks
    # delivered so far carried, whole frames; empty: from the start.
    resume_codes: bytes = b""

    @property
    def full_text(self) -> str:
        """The request's text so far: the stream's when it has one."""
        return self.text_stream.text if self.text_stream is not None else self.text


@dataclass(frozen=True)
class BackendMetric:
    """One metric family a backend reports for the gateway's /metrics (exposed as voxgate_<name>). Plain
    data, so a worker process can send it over its socket; values are cumulative for counters."""

    name: str  # e.g. "engine_batches" (a counter is exposed with the _total suffix)
    kind: str  # "counter" or "gauge"
    help: str
    labels: tuple[str, ...] = ()
    samples: tuple[tuple[tuple[str, ...], float], ...] = ()  # (label values, value)

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "help": self.help, "labels": list(self.labels),
                "samples": [[list(values), value] for values, value in self.samples]}

    @classmethod
    def from_json(cls, data: dict) -> "BackendMetric":
        if data["kind"] not in ("counter", "gauge"):
            raise ValueError(f"unknown metric kind {data['kind']!r}")
        labels = tuple(str(label) for label in data.get("labels", ()))
        samples = tuple((tuple(str(v) for v in values), float(value)) for values, value in data.get("samples", ()))
        if any(len(values) != len(labels) for values, _ in samples):
            raise ValueError(f"metric {data['name']!r}: a sample's label values do not match its labels")
        return cls(str(data["name"]), data["kind"], str(data.get("help", "")), labels, samples)


@dataclass(frozen=True)
class WordTiming:
    """One word of a request's text and where it is spoken, in samples of the request's audio at the
    backend's rate: [start, end)."""

    word: str
    start: int
    end: int

    def to_json(self) -> list:
        return [self.word, self.start, self.end]

    @classmethod
    def from_json(cls, data: list) -> "WordTiming":
        word, start, end = data
        if not isinstance(word, str) or not 0 <= int(start) <= int(end):
            raise ValueError(f"bad word timing {data!r}")
        return cls(word, int(start), int(end))


_TOKEN = re.compile(r"\S+")
_SPOKEN = re.compile(r"\w", re.UNICODE)


def split_words(text: str) -> list[tuple[str, int, int]]:
    """The words of a text as (word, start, end) character spans: whitespace-separated tokens as written,
    punctuation and all ("$3.50", "Hello,"). A token with no letter or digit ("-", "...") is not spoken on
    its own, so it joins the word before it ("Hello -"), or the one after it at the start of the text."""
    words: list[list] = []
    leading: tuple[int, int] | None = None  # unspoken tokens before the first word
    for match in _TOKEN.finditer(text):
        start, end = match.span()
        if _SPOKEN.search(match.group()) is None:
            if words:
                words[-1][2] = end
            elif leading is None:
                leading = (start, end)
            else:
                leading = (leading[0], end)
            continue
        words.append([None, leading[0] if leading and not words else start, end])
    spans = [(text[a:b], a, b) for _, a, b in words]
    if not spans and leading is not None:  # nothing but punctuation: one silent "word"
        spans = [(text[leading[0]:leading[1]], *leading)]
    return spans


@dataclass(frozen=True)
class AudioChunk:
    pcm: bytes  # s16le mono at the backend's sample_rate; always a whole number of samples; may be empty
    # Word timings that became known with this chunk (only when the request asked for them); they may
    # concern audio of earlier chunks or of chunks still to come.
    words: tuple[WordTiming, ...] = ()
    # No audio follows in this request: only its word timings may (see the module doc).
    audio_ended: bool = False
    # The codec codes of the frames generated since the previous chunk (backends with "resume_codes", see
    # the module doc): little-endian uint16, frame-major, whole frames.
    codes: bytes = b""

    @property
    def num_samples(self) -> int:
        return len(self.pcm) // 2


# What a request's audio may last, at most: MIN_SENTENCE_S for any text (a short "Hmm." with a pause
# around it) and MAX_SECONDS_PER_CHAR a character (natural speech is ~0.07 s). A pool bounds a worker's audio
# by it, and a request's codes follow from it.
MAX_SECONDS_PER_CHAR = 0.5
MIN_SENTENCE_S = 10.0
MAX_CODEBOOKS = 64
MAX_FRAME_RATE = 100.0


def max_code_bytes(codebooks: int, frame_rate: float, text_chars: int) -> int:
    """The most code bytes a request of `text_chars` characters may produce: frames for as long as its audio
    may last, plus one a character (a text stream's chunks cut short while it waits for text), each
    `codebooks` uint16s. 0 for a backend without codes."""
    if codebooks <= 0:
        return 0
    seconds = MIN_SENTENCE_S + MAX_SECONDS_PER_CHAR * text_chars
    frames = int(seconds * frame_rate) + 1 + text_chars
    return frames * codebooks * 2


def check_codes(codes: bytes, codebooks: int, bound: int, what: str = "codes") -> None:
    """Raise SynthesisError unless `codes` are whole frames of `codebooks` codes within `bound` bytes."""
    if codes and codebooks <= 0:
        raise SynthesisError(f"{what}: this backend has no codes")
    if codebooks > 0 and len(codes) % (2 * codebooks):
        raise SynthesisError(f"{what}: {len(codes)} bytes are not whole frames of {codebooks} uint16 codes")
    if len(codes) > bound:
        raise SynthesisError(f"{what}: {len(codes)} bytes, more than the text can produce ({bound})")


class Synthesizer(abc.ABC):
    """A speech backend. One instance serves every session of a gateway process."""

    name: str = "backend"
    sample_rate: int = 24000
    # The optional parts of a SynthesisRequest this backend acts on, of: "language", "instructions",
    # "max_new_tokens", "chunk_schedule", "seed", "speed", "voice_design" (a voice made from the
    # instructions), "voice_cloning" (a voice from reference audio), "word_timestamps" (WordTimings when
    # the request asks, see the module doc), "text_streaming" (text pushed while it speaks, `text_stream`),
    # "text_mode" (the per-request `streaming_text`), "resume_codes" (codes with the audio, and
    # `resume_codes` continued from, see the module doc). The gateway tells a client which of
    # its options take no effect here, instead of ignoring them silently.
    honours: frozenset[str] = frozenset()
    # Speaks only with a voice_prompt (a Qwen3 Base checkpoint): its voices() are placeholders, so the gateway
    # answers a name that is no cloned voice with voice_not_found instead of falling back to one of them.
    speaks_only_clones: bool = False
    # Codes per codec frame (Qwen3 12 Hz: 16) and codec frames per second of audio (12.5), for a backend with
    # "resume_codes"; 0 for one without codes.
    codebooks: int = 0
    frame_rate: float = 0.0

    async def start(self) -> None:
        """Load models, warm up. `ready` is true once this returns."""

    async def stop(self) -> None:
        """Release resources; pending streams end."""

    @property
    def ready(self) -> bool:
        return True

    @abc.abstractmethod
    def voices(self) -> list[Voice]: ...

    @property
    def default_voice(self) -> str:
        return self.voices()[0].id

    def has_voice(self, voice: str) -> bool:
        return any(v.id == voice for v in self.voices())

    def voice_id(self, name: str) -> str | None:
        """The id of the voice `name` names (its id in any case, or another name the backend accepts for
        it), or None when it names none: what the gateway reports as the voice it resolved."""
        for known in self.voices():
            if known.id == name or known.id.lower() == name.lower():
                return known.id
        return name if self.has_voice(name) else None

    def load(self) -> float:
        """Fraction of real-time capacity in use (0 idle, 1 saturated); used to refuse sessions early."""
        return 0.0

    def capacity(self) -> int | None:
        """How many streams this backend serves at once at full speed (the engine's KV slots), or None when
        it does not know. A worker reports it, and a pool of workers routes sessions by what is left of it."""
        return None

    def queued(self) -> int:
        """Requests accepted but waiting for a place among the `capacity` (an engine's queue for a KV slot):
        work that has no audio yet and delays every stream that comes after it."""
        return 0

    @property
    def can_clone(self) -> bool:
        return "voice_cloning" in self.honours

    async def clone_voice(self, reference: ReferenceAudio, x_vector_only: bool = False) -> bytes:
        """The voice prompt for `reference` (see the module doc), computed once; later requests carry it
        as `voice_prompt`. x_vector_only: a prompt from the speaker embedding alone (no reference codes,
        no ref_text needed; a weaker likeness). Runs the model off the event loop. Raises
        VoiceCloningUnsupportedError (the default), InvalidReferenceAudioError, BackendOverloadedError."""
        raise VoiceCloningUnsupportedError(f"the {self.name} backend cannot clone a voice from reference audio")

    def refuse_voice_prompt(self, request: SynthesisRequest) -> None:
        """For backends that cannot clone: a request with a voice prompt fails rather than speaking
        with another voice."""
        if request.voice_prompt is not None and not self.can_clone:
            raise VoiceCloningUnsupportedError(f"the {self.name} backend cannot speak with a cloned voice")

    def refuse_resume_codes(self, request: SynthesisRequest) -> None:
        """For backends without "resume_codes": a request that continues from codes fails rather than
        speaking the delivered part again."""
        if request.resume_codes and "resume_codes" not in self.honours:
            raise SynthesisError(f"the {self.name} backend cannot continue a sentence from codes")

    def max_code_bytes(self, text_chars: int) -> int:
        """The most code bytes a request of `text_chars` characters may produce (module doc); 0 without codes."""
        return max_code_bytes(self.codebooks, self.frame_rate, text_chars)

    def refuse_text_stream(self, request: SynthesisRequest) -> None:
        """For backends without "text_streaming": a request whose text is still coming fails rather than
        speaking only the part known when it was opened (text accepted is never dropped silently)."""
        if request.text_stream is not None and "text_streaming" not in self.honours:
            raise SynthesisError(f"the {self.name} backend cannot take text while it speaks; send whole sentences")

    async def metrics(self) -> list[BackendMetric]:
        """The backend's own metrics for the gateway's /metrics (the GPU engine's batches and time shares,
        say); none by default."""
        return []

    @abc.abstractmethod
    def synthesize(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """Stream the audio for one piece of text. Raises UnknownVoiceError / SynthesisError."""
