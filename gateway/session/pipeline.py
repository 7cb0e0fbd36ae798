"""The speech pipeline of a streaming session: synthesis of queued sentences with back-pressure, and the
sender that puts them on the socket in order.

`SpeechPipeline` is an object `StreamingSession` (gateway/session/connection.py) holds. It owns the send
queue and the sentence being sent, the synthesis tasks and the back-pressure counts; it is given what it
needs and nothing more: a `SocketWriter` (every socket write, under one lock), the store (each frame is
recorded before it goes out), the session's `SessionInfo`, the backend, settings and metrics.

- One synthesis task per sentence (`_synthesize`) fills that sentence's chunk queue. The first
  1 + `lookahead_sentences` sentences of the send queue are synthesizing at any time: sentence N+1 is
  being made while N is sent, so there is no gap, and memory stays bounded (`max_queued_audio_s`).
- The sender (`send_loop`) walks the send queue in order: for each sentence `audio.start`, the binary
  frames (each recorded in the store before it goes out), `audio.done`; for an utterance end
  `utterance.done`/`session.done`. Only one sentence is ever being sent, so two sentences' frames never
  interleave. Resumed sentences replay logged bytes first and drop re-synthesized bytes already delivered.
- Codes (issue 33): where the backend tells codes and the audio goes out as it is made (`keeps_codes`),
  each chunk's codes follow its audio through the sentence's queue, and the sender records them in the
  store once that audio is recorded, with the byte they resume at. A resume elsewhere then continues the
  sentence from them (the same take on a GPU, where a sentence made again is another) and drops only the
  bytes past that byte.
- Word timestamps (session.config `timestamp_type`): the backend's timings are kept on the sentence as
  they arrive; a word is told (`audio.words`, "async") once the bytes sent of its sentence decode past its
  end, and all of a sentence's words go in its `audio.done` ("sync"). Timings that come after the audio
  are waited for at most `word_timestamps_wait_s` (word_times.WordsWait): past it the sentence ends
  without them, `timestamps_late` in its `audio.done`. Each utterance keeps the words sent in full, which
  `context.cancelled` reports as `spoken_text`/`spoken_words`.
- `cut` takes a cancelled context out of the queue (input.cancel), under the writer's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace

from tts_backend.base import SynthesisRequest, Synthesizer, TextStream

from ..audio import encoders
from ..audio import pcm as audio
from ..audio.silence import TrailingSilence
from ..language import SentenceVoice, voice_for_sentence
from ..limits import AdmissionClaim, SynthesisMonitor
from ..metrics import GatewayMetrics
from ..protocol import (
    AudioDone,
    AudioStart,
    AudioWords,
    CloseCode,
    ConfigWarning,
    ErrorCode,
    ProtocolError,
    SessionDone,
    TimestampInfo,
    UtteranceDone,
    WordAlignment,
    backend_error_code,
)
from ..settings import GatewaySettings
from ..store.base import SessionStore
from .data import SentenceJob, SessionEnd, SessionInfo, Utterance, UtteranceEnd, sent_marker
from .word_times import WordsWait, append_monotonic
from .writer import SocketWriter

log = logging.getLogger("voxgate.session")

# The largest binary frame of a sentence sent whole (stream_audio false): under websockets' default
# max_size of 1 MiB, which vLLM-Omni's client keeps; a whole number of samples for every raw format.
MAX_WHOLE_FRAME_BYTES = 1_000_000
END = object()  # a sentence's synthesis finished


@dataclass(frozen=True)
class Codes:
    """A chunk's codes, in a sentence's queue after the chunk's audio."""

    codes: bytes


CANCELLED = object()  # a sentence was cancelled; wakes a sender waiting on its chunks
FINISHED_KEPT = 64  # contexts whose latest finished utterance is kept for a late barge-in (Cut.finished)


@dataclass
class Cut:
    """What `SpeechPipeline.cut` took out of the queue for one context."""

    utterances: dict[int, Utterance]  # by number: the context's utterances that were queued or being sent
    stopped: list[SentenceJob]  # its sentences not yet sent in full, in send order
    dropped_ends: list[UtteranceEnd]  # its utterance ends not sent, owed no more
    interrupted: SentenceJob | None  # the sentence being sent when it was cut, if its audio.start went out
    finished: Utterance | None = None  # the context's latest utterance whose end already went out


class SpeechPipeline:
    """A session's send queue, its synthesis and its sender (see the module docstring).

    The connection loop hands it work (`enqueue`), cuts a context out of it (`cut`, for input.cancel)
    and stops it (`stop`, `close`); the sender task runs `send_loop`."""

    def __init__(
        self,
        writer: SocketWriter,
        store: SessionStore,
        info: SessionInfo,
        *,
        backend: Synthesizer,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        monitor: SynthesisMonitor | None = None,
        admission_claim: AdmissionClaim | None = None,
    ) -> None:
        self.writer = writer
        self.store = store
        self.info = info
        self.backend = backend
        self.settings = settings
        self.metrics = metrics
        self.monitor = monitor
        self.admission_claim = admission_claim  # released when the session's first synthesis starts
        self._queue: deque[SentenceJob | UtteranceEnd | SessionEnd] = deque()
        self._queue_changed = asyncio.Event()
        self._current: SentenceJob | UtteranceEnd | SessionEnd | None = None  # being sent now
        # The UtteranceEnds in the queue, kept as items enter and leave it (`enqueue`, the sender, `cut`), so
        # that max_pending_ends is checked per input.done without a scan.
        self.ends_queued = 0
        self.pending_chars = 0  # text released and not yet fully sent (count_text)
        self._synthesis: set[asyncio.Task] = set()  # running synthesis tasks, owned here
        # The voice of the latest sentence given one, in send order: a sentence of unclear language keeps it.
        self._previous_voice: str | None = None
        self._stopping = False
        # Back-pressure: PCM made and not yet taken by the sender, in all jobs; synthesis waits beyond
        # max_queued_audio_s.
        self.queued_audio = 0
        self._audio_taken = asyncio.Event()
        self.last_sent_at = time.monotonic()  # when the sender last sent a frame or finished an item (idle timeout)
        # Per context, its latest utterance whose end went out: the client may still be playing it (a CPU
        # voice sends a sentence far faster than real time), and a barge-in with the playback position must
        # still be answered with what was heard. One per context, at most FINISHED_KEPT contexts.
        self._finished: OrderedDict[str | None, Utterance] = OrderedDict()

    @property
    def busy(self) -> bool:
        """Audio is being made or sent, or waits to be. A sentence still being written does not count: once its
        audio so far has gone out (`last_sent_at`), it waits for the client's text, and the session is idle."""
        return any(item is not None and not (isinstance(item, SentenceJob) and item.waits_for_text)
                   for item in [self._current, *self._queue])

    def others_wait_behind(self, job: SentenceJob) -> bool:
        """Items of another context are queued after `job`: they go out only once it has been sent."""
        context_id, behind = job.utterance.context_id, False
        for item in [self._current, *self._queue]:
            if item is job:
                behind = True
            elif behind and isinstance(item, (SentenceJob, UtteranceEnd)) and item.utterance.context_id != context_id:
                return True
        return False

    def enqueue(self, *items: SentenceJob | UtteranceEnd | SessionEnd) -> None:
        """Queue items to be sent after everything queued already, and start what synthesis they allow."""
        for item in items:
            self._queue.append(item)
            if isinstance(item, UtteranceEnd):
                self.ends_queued += 1
        self.refill()

    def count_text(self, job: SentenceJob, chars: int) -> None:
        """`chars` more of the session's accepted text are `job`'s to speak: counted in `pending_chars` (the
        session's limit on text not yet spoken) until the sentence is sent in full or stopped."""
        job.chars_pending += chars
        self.pending_chars += chars

    def refill(self) -> None:
        """Start what synthesis the queue allows now, and wake the sender."""
        self._fill_pipeline()
        self._queue_changed.set()

    def stop(self) -> None:
        """No new synthesis from now on (the session ends, or was handed over)."""
        self._stopping = True

    async def close(self) -> None:
        """Stop, and end the synthesis tasks still running."""
        self.stop()
        tasks = [task for task in self._synthesis if not task.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    def cut(self, context_id: str | None) -> Cut:
        """input.cancel: mark every utterance of `context_id` in the queue (and the one being sent)
        cancelled, stop its sentences, and drop them and its utterance ends from the queue. The caller
        holds the writer's lock: the sender is between frames, and from here on it sees the flag."""
        items = [self._current, *self._queue]
        utterances: dict[int, Utterance] = {}
        for item in items:
            if isinstance(item, (SentenceJob, UtteranceEnd)) and item.utterance.context_id == context_id:
                item.utterance.cancelled = True
                utterances[item.utterance.number] = item.utterance
        stopped = [item for item in items if isinstance(item, SentenceJob) and item.cancelled and not item.finished]
        for job in stopped:
            self._stop_job(job)
        # Utterance ends not sent yet are owed no more (the one being sent now may be among them).
        dropped_ends = [
            item for item in items if isinstance(item, UtteranceEnd) and item.utterance.cancelled and not item.sent
        ]
        self.ends_queued -= sum(
            1 for item in self._queue if isinstance(item, UtteranceEnd) and item.utterance.cancelled
        )
        self._queue = deque(
            item for item in self._queue
            if not (isinstance(item, (SentenceJob, UtteranceEnd)) and item.utterance.cancelled)
        )
        current = self._current
        interrupted = current if isinstance(current, SentenceJob) and current in stopped and current.started_sending else None
        return Cut(utterances, stopped, dropped_ends, interrupted, self._finished.get(context_id))

    def _stop_job(self, job: SentenceJob) -> None:
        job.finished = True
        self.pending_chars -= job.chars_pending
        job.chars_pending = 0
        self._drop_queued(job)
        if job.task is not None and not job.task.done():
            job.task.cancel()
        job.chunks.put_nowait(CANCELLED)
        self.metrics.sentences_total.labels("cancelled").inc()

    def _fill_pipeline(self) -> None:
        """Start synthesis for the sentences waiting to be sent, in order: at most `synthesis_concurrency`
        at a time (sentence N+1 starts as soon as N is made, while N is still being sent), and never more
        than 1 + `lookahead_sentences` sentences made or in the making ahead of the one being sent."""
        if self._stopping:
            return
        window = 1 + self.settings.lookahead_sentences
        running = sum(1 for task in self._synthesis if not task.done())
        for item in [self._current, *self._queue]:
            if window == 0 or running >= self.settings.synthesis_concurrency:
                break
            if isinstance(item, SentenceJob) and not item.cancelled and not item.finished and item.needs_synthesis:
                window -= 1
                if item.task is None:
                    item.progress_at = time.monotonic()
                    item.task = asyncio.create_task(self._synthesize(item), name=f"synth-{self.info.session_id}-{item.index}")
                    self._synthesis.add(item.task)
                    item.task.add_done_callback(self._synthesis_ended)
                    running += 1

    def _voice_of(self, job: SentenceJob) -> SentenceVoice:
        """The voice that speaks the sentence, and a warning when it cannot read the sentence's language."""
        if job.spoken_by is None:
            job.spoken_by = voice_for_sentence(self.backend, job.config.voice, job.text, auto=job.config.auto_voice,
                                               previous=self._previous_voice)
            self._previous_voice = job.spoken_by.voice
        return job.spoken_by

    def keeps_codes(self, job: SentenceJob) -> bool:
        """Whether `job`'s codes are kept for a resume (module doc): the backend has them, one request makes
        the sentence (no pronunciation parts, no trimmed tail) and its audio goes out as raw PCM at the
        backend's rate as it is made, so that a byte of the sentence's audio is a byte the client got. Another
        format's encoder (a resampler, a codec) has state that a resume cannot rebuild: such a sentence is
        made again from its start, as before."""
        config = job.config
        return ("resume_codes" in self.backend.honours and self.backend.codebooks > 0 and config.pronouncer is None
                and not job.trim_tail and config.stream_audio and config.response_format == "pcm"
                and config.output_rate == config.source_rate)

    def _synthesis_ended(self, task: asyncio.Task) -> None:
        self._synthesis.discard(task)
        self._fill_pipeline()

    async def _synthesize(self, job: SentenceJob) -> None:
        config = job.config
        stream = job.text_stream
        if stream is None and config.text_streaming:
            # A sentence whole from the start, in a session whose sentences start from their first words:
            # the same streaming-text mode, so its audio is what it would be had its words come one by one
            # (a resume makes a sentence again whole and drops the bytes the client has).
            stream = TextStream(job.text)
            stream.finish()
        request = SynthesisRequest(
            text=stream.text if stream is not None else job.text,
            voice=self._voice_of(job).voice,
            language=config.message.language,
            instructions=config.message.instructions,
            seed=config.message.seed,
            max_new_tokens=config.message.max_new_tokens,
            chunk_schedule=config.message.effective_chunk_schedule,
            utterance_key=f"{self.info.session_id}/{job.utterance.number}",
            session_key=self.info.session_id,
            request_id=f"{self.info.session_id}/{job.index}",
            extra=config.message.backend_extra(),
            word_timestamps=config.timestamps is not None,
            voice_prompt=config.voice_prompt,
            text_stream=stream,
            streaming_text=config.streaming_text,
        )
        keeps_codes = self.keeps_codes(job)
        if job.resume_codes and keeps_codes:  # goes on after the recorded codes: the client has what is before
            request = replace(request, resume_codes=job.resume_codes)
            job.skip_bytes -= job.resume_at
            job.made_bytes = job.resume_at
            job.source_samples = job.resume_at // 2
            self.metrics.sentences_resumed_from_codes_total.inc()
        monitor = self.monitor
        bytes_per_second = 2 * self.backend.sample_rate
        trailing = TrailingSilence(self.backend.sample_rate) if job.trim_tail else None

        def queue(pcm: bytes) -> None:
            job.queued_bytes += len(pcm)
            self.queued_audio += len(pcm)
            job.chunks.put_nowait(pcm)
        try:
            pronouncer = config.pronouncer
            words_wait = WordsWait(self.settings.word_timestamps_wait_s)
            audio_chunks = (words_wait.bound(self.backend.synthesize(request)) if pronouncer is None
                            else pronouncer.synthesize(self.backend, request, words_wait))
            async with contextlib.aclosing(audio_chunks) as audio:
                if self.admission_claim is not None:  # from now on the session's streams count, not its claim
                    self.admission_claim.release()
                with monitor.stream() if monitor is not None else contextlib.nullcontext() as meter:
                    while True:
                        # Back-pressure: no more is pulled from the backend while the sender is behind.
                        while not self._has_room(job):
                            self._audio_taken.clear()
                            await self._audio_taken.wait()
                        pulled_at = time.monotonic()
                        # A pull begun while the client's text still grows may wait for that text: not
                        # synthesis speed, so it is not measured.
                        measured = meter is not None and (stream is None or stream.finished)
                        try:
                            chunk = await anext(audio)
                        except StopAsyncIteration:
                            break
                        if chunk.words and not job.finished:
                            append_monotonic(job.words, chunk.words)
                        if chunk.pcm and not job.finished:
                            if measured:
                                meter.produced(len(chunk.pcm) / bytes_per_second, time.monotonic() - pulled_at)
                            pcm = chunk.pcm if trailing is None else trailing.feed(chunk.pcm)
                            if pcm:
                                queue(pcm)
                        if chunk.codes and keeps_codes and not job.finished:
                            job.chunks.put_nowait(Codes(chunk.codes))
            if words_wait.late and not job.finished:
                job.words_late = True
                job.warnings.append(words_wait.late_warning("timestamp_type"))
                self.metrics.word_timestamps_late_total.labels("websocket").inc()
            if trailing is not None and not job.finished:
                tail = trailing.end(at_least=job.words[-1].end if job.words else 0)
                if tail:
                    queue(tail)
            job.chunks.put_nowait(END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported by the sender, in order
            job.synthesis_failed = True
            job.chunks.put_nowait(exc)

    def _has_room(self, job: SentenceJob) -> bool:
        """May `job` pull another chunk? The sentence being sent (the head) may hold up to the bound on its
        own; sentences made ahead only while the whole session holds less, so look-ahead never starves
        the head and a session's unsent audio stays within about twice the bound."""
        bound = self.settings.max_queued_audio_s * 2 * self.backend.sample_rate
        current = self._current
        if isinstance(current, SentenceJob) and not current.finished:
            head = current
        else:  # between items: the first sentence still to be sent
            head = next((i for i in self._queue if isinstance(i, SentenceJob) and not i.finished), None)
        return job.queued_bytes < bound if job is head else self.queued_audio < bound

    def _take_audio(self, job: SentenceJob, size: int) -> None:
        job.queued_bytes -= size
        self.queued_audio -= size
        self._audio_taken.set()

    def _drop_queued(self, job: SentenceJob) -> None:
        """The job's unsent chunks will never be taken (cancelled, failed or finished)."""
        self.queued_audio -= job.queued_bytes
        job.queued_bytes = 0
        self._audio_taken.set()

    async def send_loop(self) -> None:
        while True:
            while not self._queue:
                self._queue_changed.clear()
                await self._queue_changed.wait()
            item = self._queue.popleft()
            if isinstance(item, UtteranceEnd):
                self.ends_queued -= 1
            self._current = item
            self._audio_taken.set()  # a new head may pull again
            try:
                if isinstance(item, SentenceJob):
                    try:
                        await self._send_sentence(item)
                    finally:
                        self._drop_queued(item)
                elif isinstance(item, UtteranceEnd):
                    await self._send_utterance_end(item)
                else:
                    await self._send_session_end()
                    return
            finally:
                self._current = None
                self.last_sent_at = time.monotonic()
            self._fill_pipeline()

    async def _tell_words_locked(self, job: SentenceJob, *, everything: bool = False) -> None:
        """"async" timestamps: tell the words of `job` whose audio has gone out in full since last told."""
        if job.config.timestamps != "async":
            return
        words = job.spoken_words(everything=everything)[job.words_told:]
        if words:
            job.words_told += len(words)
            await self.writer.send_text_locked(AudioWords(sentence_index=job.index, context_id=job.utterance.context_id,
                                                    words=words).encode())

    async def _send_frames(self, job: SentenceJob, data: bytes, frame_bytes: int, *, record: bool = True,
                           decoded: int | None = None) -> bool:
        """Send encoded audio, split into frames, each recorded in the store before it goes on the socket
        (so the store holds every byte a client can have; `record` False for replayed audio). False if the
        sentence was cancelled meanwhile. `decoded`: compressed audio, the encoder's `decoded_samples`
        once all of `data` is out (word timestamps)."""
        for start in range(0, len(data), frame_bytes):
            frame = data[start : start + frame_bytes]
            if record:
                await self.store.append_audio(self.info.session_id, job.index, frame, offset=job.bytes_sent,
                                              owner=self.info.owner)
            async with self.writer.lock:
                if job.cancelled:
                    return False
                await self.writer.send_bytes_locked(frame)
                job.progress_at = self.last_sent_at = time.monotonic()
                if job.bytes_sent == 0 and job.first_of_utterance:
                    self.metrics.ttfa_seconds.labels("websocket").observe(time.monotonic() - job.released_at)
                job.bytes_sent += len(frame)
                if decoded is not None and start + frame_bytes >= len(data):
                    job.coded_samples_sent = decoded
                await self._tell_words_locked(job)
            self.metrics.audio_bytes_total.labels("websocket").inc(len(frame))
        return True

    async def _send_new_audio(self, job: SentenceJob, data: bytes, frame_bytes: int,
                              encoder: encoders.AudioFileEncoder) -> bool:
        """Send freshly encoded audio, minus the bytes a resumed sentence already delivered or replayed."""
        job.time_offset_samples = encoder.priming
        decoded = None if encoder.bytes_per_sample else encoder.decoded_samples
        if job.skip_bytes:
            dropped = min(job.skip_bytes, len(data))
            job.skip_bytes -= dropped
            data = data[dropped:]
            if not data and decoded is not None:  # the client has these bytes already
                job.coded_samples_sent = decoded
        return not data or await self._send_frames(job, data, frame_bytes, decoded=decoded)

    async def _send_sentence(self, job: SentenceJob) -> None:
        config = job.config
        fmt = config.response_format
        # One file per sentence (raw formats: the samples), made as the audio arrives; streamed piece by
        # piece, or sent whole at the end (a whole wav gets its true sizes, so it is built from the PCM).
        whole_wav = fmt == "wav" and not config.stream_audio
        encoder = encoders.AudioFileEncoder("pcm" if whole_wav else fmt, config.source_rate, config.output_rate,
                                            serial=job.index)
        # Frames of at most max_frame_ms of audio, whole samples for the raw formats (compressed audio of that
        # length is smaller than its PCM, so a compressed piece rarely needs splitting).
        bytes_per_sample = encoder.bytes_per_sample or 2
        frame_bytes = max(1, config.output_rate * self.settings.max_frame_ms // 1000) * bytes_per_sample
        spoken_by = self._voice_of(job)
        warnings = [spoken_by.warning] if spoken_by.warning is not None else []
        if job.text_stream is None or job.text_stream.finished:  # else audio.done tells them, of the whole text
            warnings += markup_warnings(job, self.backend)
        async with self.writer.lock:
            if job.cancelled:
                return
            await self.writer.send_text_locked(
                AudioStart(
                    sentence_index=job.index,
                    sentence_text=config.shown_text(job.text),
                    format=fmt,
                    sample_rate=config.output_rate,
                    context_id=job.utterance.context_id,
                    voice=spoken_by.voice if spoken_by.voice != config.voice else None,
                    warnings=warnings or None,
                ).encode()
            )
            job.started_sending = True
        if job.replay:
            for piece in job.replay:
                if not await self._send_frames(job, piece, frame_bytes, record=False):
                    return
            if not job.needs_synthesis:  # the duration of compressed audio is not known from its size
                job.source_samples = (job.bytes_sent // bytes_per_sample * config.source_rate // config.output_rate
                                      if encoder.bytes_per_sample else None)
        if job.needs_synthesis:
            await self.store.set_sentence_state(self.info.session_id, job.index, "speaking", owner=self.info.owner)
        whole: list[bytes] = []
        failure: BaseException | None = None
        while job.needs_synthesis:
            item = await job.chunks.get()
            if item is CANCELLED or job.cancelled:
                return
            if item is END:
                break
            if isinstance(item, BaseException):
                failure = item
                break
            if isinstance(item, Codes):  # the audio before them is recorded: they resume after it
                await self._record_codes(job, item.codes)
                continue
            self._take_audio(job, len(item))
            job.source_samples += len(item) // 2
            encoded = await encoder.encode(item)
            job.made_bytes += len(encoded)
            if config.stream_audio:
                if encoded and not await self._send_new_audio(job, encoded, frame_bytes, encoder):
                    return
            else:
                whole.append(encoded)
        if job.needs_synthesis and (config.stream_audio or failure is None):
            tail = await encoder.finish()
            if config.stream_audio:
                if tail and not await self._send_new_audio(job, tail, frame_bytes, encoder):
                    return
            else:
                data = b"".join(whole) + tail
                if whole_wav:
                    data = audio.wav_bytes(data, config.output_rate)
                else:  # a flac sent whole states its length, as soundfile needs to read it
                    data = encoder.with_length(data)
                # In as few frames as it takes: clients cap a message (websockets, under vLLM-Omni's
                # client, at 1 MiB), and they join a sentence's frames between audio.start and audio.done.
                frames = max(1, min(len(data), MAX_WHOLE_FRAME_BYTES))
                if data and not await self._send_new_audio(job, data, frames, encoder):
                    return
        async with self.writer.lock:
            if job.cancelled:
                return
            job.finished = True
            self.pending_chars -= job.chars_pending
            job.chars_pending = 0
            if config.timestamps is not None:
                job.utterance.keep_sentence(job.index, job.spoken_words(everything=failure is None),
                                            job.heard_duration_s())
                if failure is None:
                    await self._tell_words_locked(job, everything=True)
            if failure is not None:
                error = _synthesis_error(failure, job)
                self.metrics.errors_total.labels(error.code.value).inc()
                await self.writer.send_text_locked(error.to_message().encode())
            warnings = [*job.warnings, *markup_warnings(job, self.backend)]
            await self.writer.send_text_locked(audio_done(job, error=failure is not None, warnings=warnings).encode())
        outcome = "failed" if failure is not None else "done"
        self.metrics.sentences_total.labels(outcome).inc()
        await self.store.set_sentence_state(self.info.session_id, job.index, outcome, owner=self.info.owner)

    async def _record_codes(self, job: SentenceJob, codes: bytes) -> None:
        """Record a chunk's codes with the byte of the sentence they resume at (its audio made so far, all of
        it recorded by now: sent, or dropped as the client has it). Bounded by the sentence's text: past that
        (a backend that tells more than it could make) none is recorded any more, and a resume goes on from
        the codes recorded before, which still hold."""
        limit = self.backend.max_code_bytes(len(job.text))
        if job.codes_recorded < 0:  # past the bound before
            return
        if job.codes_recorded + len(codes) > limit:
            log.warning("sentence %d: the backend told more codes than its text can make; no more are kept", job.index)
            job.codes_recorded = -1
            return
        await self.store.append_codes(self.info.session_id, job.index, codes, offset=job.codes_recorded,
                                      at=job.made_bytes, limit=limit, owner=self.info.owner)
        job.codes_recorded += len(codes)

    async def _send_utterance_end(self, marker: UtteranceEnd) -> None:
        async with self.writer.lock:
            if marker.utterance.cancelled:
                return
            if self.info.uses_contexts or marker.utterance.context_id is not None:
                message = UtteranceDone(context_id=marker.utterance.context_id, total_sentences=marker.utterance.sentences)
            elif marker.by_close:
                return  # session.close answers with one session.done for everything
            else:
                message = SessionDone(total_sentences=self.info.sentences_released)
            await self.writer.send_text_locked(message.encode())
            marker.sent = True
            self._finished.pop(marker.utterance.context_id, None)
            self._finished[marker.utterance.context_id] = marker.utterance
            while len(self._finished) > FINISHED_KEPT:
                self._finished.popitem(last=False)
        await self.store.add_marker(self.info.session_id, sent_marker(marker), owner=self.info.owner)

    async def _send_session_end(self) -> None:
        async with self.writer.lock:
            await self.writer.send_text_locked(SessionDone(total_sentences=self.info.sentences_released).encode())
            await self.writer.close_locked(CloseCode.normal)
        if self.info.session_id is not None:
            await self.store.delete(self.info.session_id, owner=self.info.owner)


def markup_warnings(job: SentenceJob, backend: Synthesizer) -> list[ConfigWarning]:
    """What of the sentence's markup is not honoured, once per sentence."""
    if job.config.pronouncer is None or job.markup_told:
        return []
    job.markup_told = True
    return job.config.pronouncer.warnings(job.text, backend)


def audio_done(job: SentenceJob, *, error: bool, cancelled: bool = False,
               warnings: list[ConfigWarning] | None = None) -> AudioDone:
    """A sentence's audio.done: the bytes sent of it, its duration, and ("sync" timestamps) its words, unless
    they came too late (a warning in `warnings` then)."""
    timestamp_info = None
    if job.config.timestamps == "sync" and not error and not job.words_late:
        words = job.spoken_words(everything=not cancelled)
        timestamp_info = TimestampInfo(word_alignment=WordAlignment(
            words=[w.word for w in words], word_start_times_seconds=[w.start for w in words],
            word_end_times_seconds=[w.end for w in words]))
    return AudioDone(
        sentence_index=job.index,
        total_bytes=job.bytes_sent,
        error=error,
        context_id=job.utterance.context_id,
        duration_ms=None if job.source_samples is None else round(job.source_samples * 1000 / job.config.source_rate, 1),
        cancelled=True if cancelled else None,
        timestamp_info=timestamp_info,
        # audio.start had its first words
        sentence_text=job.config.shown_text(job.text) if job.config.text_streaming else None,
        warnings=warnings or None,
    )


def _synthesis_error(failure: BaseException, job: SentenceJob) -> ProtocolError:
    code, message = backend_error_code(failure), str(failure)
    if code is None:
        log.error("synthesis of sentence %d failed", job.index, exc_info=failure)
        code, message = ErrorCode.synthesis_failed, f"synthesis failed: {type(failure).__name__}"
    return ProtocolError(
        code,
        f"sentence {job.index} ({job.text!r}) could not be synthesized: {message}",
        context_id=job.utterance.context_id,
        sentence_index=job.index,
    )
