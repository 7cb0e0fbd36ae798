"""What a streaming session holds: its resolved config, its utterances, and the items of its send queue
(a sentence to synthesize and send, or an utterance end / session end to announce), in send order.

`Utterance` is the text of one context between its first input.text and its input.done (or input.cancel),
and what becomes of it. `StreamingSession` (gateway/session/connection.py) routes each client message to its
context's utterance and drives it: `take` (input.text), `flush` (input.flush), `finish` (input.done),
`resume` (the text a resume found unreleased) and `end_open_sentence` (a sentence still being written that
failed or waited too long for text). The utterance owns what becomes of its text, in one place: its
segmenter (text -> units, each released once certainly complete), the sentence still being written (text
streaming: synthesizing from its first words, growing as they come, finished by the release of its unit)
and the count of its sentences. A sentence, once made, holds its own audio, words and codes (`SentenceJob`).
An utterance makes and grows sentences through the session's `SentenceSink` (connection.py), which numbers
them and stages them with the client's input: the store records them, and only then are they queued or
their text given to synthesis. It never touches the store, the queue or the socket. The pipeline
(gateway/session/pipeline.py) reads whether it was cancelled and, with word timestamps, keeps the words of
its sentences sent in full for context.cancelled (`keep_sentence`, `heard`).
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from tts_backend.base import TextStream, WordTiming

from ..audio import pcm as audio
from ..language import SentenceVoice
from ..pronunciation.pronouncer import Pronouncer
from ..protocol import ConfigWarning, SessionConfig, SpokenWord
from ..store.base import MarkerRecord, OpenUtterance
from .segmenter import SentenceSegmenter, push_in_slices, spoken_length
from .word_times import count_reached, in_seconds, keep_spoken


# A sentence still being written (text streaming) that holds back another context's audio (which goes out
# only once the sentence is sent) is ended at its words after waiting this long for text: an LLM writes a
# word every tens to hundreds of milliseconds, so a second without one is a wait, not writing.
OPEN_SENTENCE_YIELD_S = 1.0
# In a recorded config (ResolvedConfig.snapshot): the prompt of the session's own clip, base64.
INLINE_PROMPT_KEY = "inline_voice_prompt"
# In a recorded config: the pronunciation rules as resolved (dictionaries named were read once), which a resume
# applies as they are, past the bounds of what a client may send inline.
PRONUNCIATION_RULES_KEY = "pronunciation_rules"


class ClientGone(Exception):
    """The socket is closed; stop quietly."""


class SlowConsumer(Exception):
    """The socket has accepted no data for slow_consumer_timeout_s: the client stopped reading."""


@dataclass
class SessionInfo:
    """What a session's parts all read about it: who this connection is in the store, the session's id there
    (once the handshake made or resumed one), whether its client names contexts, and how many sentences it
    has released. Written by the connection loop only."""

    owner: str  # this connection's lease token in the store
    session_id: str | None = None
    uses_contexts: bool = False  # set once any message names a context_id
    sentences_released: int = 0  # the next sentence's index


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated session.config with the gateway's choices filled in."""

    message: SessionConfig
    voice: str
    response_format: str
    stream_audio: bool
    source_rate: int
    output_rate: int
    warnings: tuple[ConfigWarning, ...] = ()  # told in session.started; not part of the recorded config
    # Word timestamps: None (off, or the backend gives none), "sync" (in audio.done) or "async" (audio.words)
    timestamps: str | None = None
    # A cloned voice's prompt (gateway/voices.py): a registered voice's is found again by its name on a
    # resume, a session's own clip's (ref_audio) is recorded in the snapshot.
    voice_prompt: bytes | None = None
    own_clip: bool = False  # voice_prompt was cloned from the session's ref_audio (recorded in the snapshot)
    # split_granularity "token" on a backend that takes text while it speaks: each sentence's synthesis
    # starts at its first words (a TextStream), and every sentence runs in the model's streaming-text mode.
    text_streaming: bool = False
    # The model's text mode for whole-sentence requests (vLLM-Omni's non_streaming_mode negated), for a
    # backend with "text_mode"; None: the server's default.
    streaming_text: bool | None = None
    # The client left the voice and the language to the server (no voice, language Auto, no clone): each
    # sentence may be spoken by a voice of its own language (gateway/language.py).
    auto_voice: bool = False
    # The session's pronunciation (gateway/pronunciation/): its dictionaries' rules and markup; None: the
    # text goes to the backend as written.
    pronouncer: Pronouncer | None = None

    def shown_text(self, text: str) -> str:
        """A sentence's text as the client's words show it (markup removed)."""
        return self.pronouncer.written(text) if self.pronouncer is not None else text

    def snapshot(self) -> dict[str, Any]:
        """The config as the store records it. The reference clip is not kept (a voice recording is
        biometric data, and megabytes): the prompt computed from it is, so that a resume speaks with the
        same voice, byte for byte, without cloning again. An auto-voice session records no voice: a resume
        resolves it again as it was first (no voice named), so each sentence gets the same voice again."""
        data = self.message.model_dump(exclude_none=True, exclude={"ref_audio"})
        data.update(response_format=self.response_format, sample_rate=self.output_rate)
        if not self.auto_voice:
            data.update(voice=self.voice)
        if self.pronouncer is not None:  # as resolved (names read once): a resume applies the same rules
            data.pop("pronunciations", None)
            data[PRONUNCIATION_RULES_KEY] = self.pronouncer.entries()
        if self.own_clip and self.voice_prompt is not None:
            data[INLINE_PROMPT_KEY] = base64.b64encode(self.voice_prompt).decode("ascii")
        return data


class SentenceSink(Protocol):
    """Where an utterance's sentences go (connection.py): numbered, staged with the client's input, recorded
    in the store and only then queued (or given their text)."""

    @property
    def text_streaming(self) -> bool:
        """Each sentence synthesizes from its first words (split_granularity "token" on a backend with
        "text_streaming")."""

    def new_sentence(self, utterance: "Utterance", text: str, *, first: bool, trim_tail: bool,
                     open_text: bool) -> SentenceJob:
        """A sentence of `utterance`, numbered, recorded and queued with the input. `open_text`: still being
        written, its synthesis takes the rest as it comes."""

    def grew(self, job: SentenceJob, added: str, *, finish: bool) -> None:
        """An open sentence's text grew by `added` (recorded), and, with `finish`, it ends there: given to
        its synthesis once recorded."""

    def count_text(self, job: SentenceJob, chars: int) -> None:
        """`chars` more of the session's accepted text are `job`'s to speak."""

    def record_open_text(self, utterance: "Utterance") -> None:
        """The utterance's text not yet released, recorded so that a resume elsewhere still speaks it."""


@dataclass(eq=False)
class Utterance:
    """The text of one context between its first input.text and its input.done (or cancel)."""

    context_id: str | None
    number: int  # per session, for SynthesisRequest.utterance_key
    segmenter: SentenceSegmenter
    sentences: int = 0
    cancelled: bool = False
    spoken: list[SpokenWord] = field(default_factory=list)  # words of its sentences fully sent (timestamps on)
    # Where the client's playback position (input.cancel's played_ms) falls in these words: the seconds of
    # audio of its sentences sent whole, end to end, and where each sentence with words in `spoken` began.
    audio_s: float = 0.0
    sentence_starts: dict[int, float] = field(default_factory=dict)
    # Text streaming: the sentence still being written, synthesizing from the words it has so far; the
    # segmenter's release of its unit finishes it.
    open_job: SentenceJob | None = None
    # Where its sentences go; None for an utterance that takes no text (the pipeline's tests, an empty one).
    sink: SentenceSink | None = field(default=None, repr=False)

    # ---- its text ------------------------------------------------------------------------------------
    @property
    def buffered_chars(self) -> int:
        """Text accepted and not yet released as a sentence."""
        return self.segmenter.buffered_chars

    async def take(self, text: str) -> None:
        """input.text: the units it completes become sentences, the words after them grow the open
        sentence (text streaming), and the rest waits, recorded. In slices: splitting a large input can take
        seconds, and other sessions share the loop (this session's next message waits, so texts stay in
        order)."""
        self._release(await push_in_slices(self.segmenter, text))
        self._grow_open_sentence()
        self.sink.record_open_text(self)

    def flush(self) -> None:
        """input.flush: all its text is released, the utterance goes on."""
        self._release(self.segmenter.flush())
        self.sink.record_open_text(self)  # flushed whole: no open sentence is left

    def finish(self) -> None:
        """input.done: all its text is released; it takes no more (the caller records that)."""
        self._release(self.segmenter.flush())

    async def resume(self, text: str, max_unit_chars: int) -> None:
        """A resume found `text` not yet released (after its open sentence's, if any): split again."""
        job = self.open_job
        self.segmenter.append(text)
        if job is not None and spoken_length(job.text) >= max_unit_chars:
            # Written under a larger max_synthesis_chars (a rolling change of it): this replica's segmenter
            # would cut the unit inside the words already spoken, so the sentence ends at them.
            await self.end_open_sentence()
        else:
            await self.take("")

    # ---- the sentence still being written (text streaming) ------------------------------------------
    def waits_for_text(self, pipeline, idle_timeout_s: float) -> tuple[float, bool] | None:
        """While its open sentence's synthesis runs, holding a backend slot, and waits for the client's text:
        (when it is ended at the words it has, whether another context waits behind it). The wait is the idle
        timeout, shortened to OPEN_SENTENCE_YIELD_S while another context's audio waits. None otherwise."""
        job = self.open_job
        if job is None or job.task is None or job.task.done() or job.synthesis_failed or not job.waits_for_text:
            return None
        blocking = pipeline.others_wait_behind(job)
        return job.progress_at + (min(idle_timeout_s, OPEN_SENTENCE_YIELD_S) if blocking else idle_timeout_s), blocking

    async def end_open_sentence(self, *, warning: str | None = None) -> None:
        """End the sentence still being written at the words it has (its synthesis finishes them); the text
        after them goes on as the next unit. `warning`: why, told in the sentence's audio.done."""
        job = self.open_job
        if warning is not None:
            job.warnings.append(ConfigWarning(code="sentence_finished_early", message=warning,
                                              field="split_granularity"))
        unit = self.segmenter.end_unit_at(len(job.text))
        self._release([unit, *await push_in_slices(self.segmenter, "")])
        self._grow_open_sentence()
        self.sink.record_open_text(self)

    def _release(self, units: list[str]) -> None:
        """Released units become sentences. With text streaming, the first unit released is the end of the
        open sentence, whose synthesis is running."""
        for text in units:
            if not text.strip():
                continue
            job, rest = self.open_job, ""
            if job is not None:
                self.open_job = None
                if job.synthesis_failed:  # it takes no more text: its error names the words it has
                    text, rest = text[: len(job.text)], text[len(job.text):].strip()
                self._grow(job, text, finish=True)
            else:
                job = self._new_sentence(text)
            if not job.finished:  # (a sentence that failed while open owes nothing more)
                self.sink.count_text(job, len(text))
            if rest:  # the text after a failed sentence: a sentence of its own, spoken or named in an error
                self.sink.count_text(self._new_sentence(rest), len(rest))

    def _new_sentence(self, text: str, *, open_text: bool = False) -> SentenceJob:
        first = self.sentences == 0
        job = self.sink.new_sentence(self, text, first=first, trim_tail=first and self.segmenter.first_unit_in_sentence,
                                     open_text=open_text)
        self.sentences += 1
        return job

    def _grow_open_sentence(self) -> None:
        """Text streaming: give the unreleased text, up to its last whole word, to synthesis: it opens a
        sentence from the first words, or continues the open one. What lies beyond the last whole word
        waits, so the backend is given the whole text's words."""
        if not self.sink.text_streaming:
            return
        text = self.segmenter.buffered_text[: self.segmenter.stable_chars]
        if not text:
            return
        if self.open_job is None:
            self.open_job = self._new_sentence(text, open_text=True)
        elif self.open_job.synthesis_failed:
            return  # it takes no more text: the session ends it at its words (end_open_sentence)
        elif len(text) > len(self.open_job.text):
            self._grow(self.open_job, text)

    def _grow(self, job: SentenceJob, text: str, *, finish: bool = False) -> None:
        """The open sentence's text is now `text` (which starts with what it had), and ends there with
        `finish`."""
        if not text.startswith(job.text):  # the segmenter keeps a unit's start (gateway/session/segmenter.py)
            raise RuntimeError(f"sentence {job.index}: {text!r} does not continue {job.text!r}")
        added, job.text = text[len(job.text):], text
        if added:
            job.progress_at = time.monotonic()
        if added or finish:
            self.sink.grew(job, added, finish=finish)

    def open_text(self) -> OpenUtterance:
        """What the store keeps of it while it takes text: its unreleased text and open sentence."""
        return OpenUtterance(self.context_id, self.number, self.segmenter.buffered_text, self.sentences,
                             open_sentence=self.open_job.index if self.open_job is not None else None)

    # ---- what the client heard of it (word timestamps) -----------------------------------------------
    def keep_sentence(self, index: int, words: list[SpokenWord], duration_s: float) -> None:
        """A sentence of it went out (whole, or as far as a failure let it): keep its words for
        context.cancelled, placed in the utterance's audio."""
        self.sentence_starts[index] = self.audio_s
        self.audio_s += duration_s
        keep_spoken(self.spoken, [w.model_copy(update={"sentence_index": index}) for w in words])
        first = self.spoken[0].sentence_index if self.spoken else index
        for old in [i for i in self.sentence_starts if i < first]:  # their words were let go
            del self.sentence_starts[old]

    def heard(self, words: list[SpokenWord], played_s: float | None, cut: SentenceJob | None = None) -> list[SpokenWord]:
        """Of `words` (its spoken words, then those of `cut`, the sentence being sent when it was cut), those
        whose end the client's playback position `played_s` (seconds into this utterance's audio) reached;
        all of them when the client did not say."""
        if played_s is None:
            return words
        # A millisecond of slack: the client adds up its sentences' lengths in floating point.
        reach = played_s + 0.001
        return [w for w in words
                if (self.audio_s if cut is not None and w.sentence_index == cut.index
                    else self.sentence_starts.get(w.sentence_index, 0.0)) + w.end <= reach]


@dataclass(eq=False)
class SentenceJob:
    index: int
    text: str
    utterance: Utterance
    config: ResolvedConfig
    released_at: float
    first_of_utterance: bool
    # The utterance's first unit, cut early inside its sentence (segmenter.first_unit_in_sentence): its
    # trailing silence is dropped, so that the sentence's two units join as spoken whole (audio/silence.py).
    # A resume makes it again whole: the same bytes, with the silence after them.
    trim_tail: bool = False
    # Resumed sentences: logged bytes to replay first, and how many bytes of freshly synthesized audio to
    # drop because the client already has them or they were replayed. No synthesis if fully recorded.
    replay: list[bytes] = field(default_factory=list)
    skip_bytes: int = 0
    needs_synthesis: bool = True
    # Codes (issue 33; the backend has "resume_codes" and the audio goes out as made, see
    # SpeechPipeline.keeps_codes): a resumed sentence's recorded codes and the byte of its audio they resume
    # at; its synthesis goes on from them, and only the bytes past that byte are dropped.
    resume_codes: bytes = b""
    resume_at: int = 0
    codes_recorded: int = 0  # bytes of codes the store holds for it; -1: past the bound, no more are kept
    made_bytes: int = 0  # encoded bytes of it made so far, from its start (those dropped included)
    # Text streaming: the text given to synthesis so far (`text` is the same), finished once the sentence
    # has ended; None for a sentence whose text was whole from the start.
    text_stream: TextStream | None = None
    # Text streaming: when the sentence last grew, had its synthesis started or sent audio. A sentence still
    # being written waits for the client's text from then on, holding its backend slot (StreamingSession
    # bounds that wait).
    progress_at: float = 0.0
    synthesis_failed: bool = False  # its synthesis ended with an error: it takes no more text
    warnings: list[ConfigWarning] = field(default_factory=list)  # told in its audio.done
    chars_pending: int = 0  # what this sentence adds to the session's count of text not yet spoken
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    started_sending: bool = False
    finished: bool = False
    bytes_sent: int = 0
    source_samples: int | None = 0  # backend samples received, for duration_ms; None: unknown
    queued_bytes: int = 0  # PCM made but not yet taken by the sender (back-pressure)
    spoken_by: SentenceVoice | None = None  # its voice, chosen once for its text (SpeechPipeline._voice_of)
    markup_told: bool = False  # its markup warnings went out (in audio.start, or audio.done once its text ended)
    # Word timestamps (config.timestamps set): the backend's timings so far, how many were told in
    # audio.words, and for compressed formats the audio (output samples) the bytes sent so far decode to.
    words: list[WordTiming] = field(default_factory=list)
    words_told: int = 0
    words_late: bool = False  # its timings did not come within word_timestamps_wait_s: its words go untold
    coded_samples_sent: int = 0
    time_offset_samples: int = 0  # output samples a decoder plays before the audio (mp3/aac priming)

    def heard_duration_s(self) -> float:
        """Its audio as a client plays it: the decoder's priming (mp3, aac), then the samples made; from the
        words when a replayed sentence's length is unknown."""
        if self.source_samples is None:
            return max((w.end for w in self.words), default=0) / self.config.source_rate
        return self.time_offset_samples / self.config.output_rate + self.source_samples / self.config.source_rate

    def spoken_words(self, everything: bool = False) -> list[SpokenWord]:
        """Its words whose audio went out in full (`everything`: all of them, the sentence is sent). A word
        is out once the output samples sent reach its end: end * output_rate <= sent * source_rate."""
        config = self.config
        if everything:
            count = len(self.words)
        else:
            if config.response_format in audio.FORMATS:  # raw: bytes are samples (after a wav header)
                header = len(audio.wav_header(config.output_rate)) if config.response_format == "wav" else 0
                width = 1 if config.response_format in ("mulaw", "alaw") else 2
                sent = max(0, self.bytes_sent - header) // width
            else:
                sent = self.coded_samples_sent
            count = count_reached(self.words, sent, config.source_rate, config.output_rate)
        return in_seconds(self.words[:count], config.source_rate, self.time_offset_samples / config.output_rate)

    @property
    def cancelled(self) -> bool:
        return self.utterance.cancelled

    @property
    def waits_for_text(self) -> bool:
        """A sentence still being written, not stopped: its synthesis speaks what it has, then waits for more."""
        return self.text_stream is not None and not self.text_stream.finished and not self.finished


@dataclass(eq=False)
class TextPush:
    """Text for an open sentence's synthesis (and, with `finish`, the end of it), given to its text stream
    only once the store has recorded it, as a sentence is queued only once recorded."""

    job: SentenceJob
    text: str
    finish: bool = False

    def apply(self) -> None:
        stream = self.job.text_stream
        if stream is None or stream.finished:
            return
        stream.push(self.text)
        if self.finish:
            stream.finish()


@dataclass(eq=False)
class UtteranceEnd:
    """Marks the end of an utterance in the send queue."""

    utterance: Utterance
    by_close: bool = False  # ended by session.close, whose own session.done follows
    number: int = 0  # the store's marker number
    after: int = 0  # sentences released before it
    sent: bool = False  # its message went out (set under the send lock)


@dataclass(eq=False)
class SessionEnd:
    """session.close: after everything before it, send session.done and close."""

    number: int = 0  # the store's marker number
    after: int = 0  # sentences released before it


def sent_marker(marker: UtteranceEnd, *, cancelled: bool = False) -> MarkerRecord:
    """The store's record of an utterance end that went out (or, cancelled, is owed no more at all)."""
    return MarkerRecord(
        number=marker.number,
        after=-1 if cancelled else marker.after,
        context_id=marker.utterance.context_id,
        utterance=marker.utterance.number,
        total_sentences=marker.utterance.sentences,
        by_close=marker.by_close,
        sent=True,
    )
