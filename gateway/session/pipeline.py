"""The speech pipeline of a streaming session: synthesis of queued sentences with back-pressure, and the
sender that puts them on the socket in order.

`SpeechPipeline` is a part of `StreamingSession` (gateway/session/connection.py), split out to be read on its own;
it works on the session's send queue (`_queue`, `_current`), its synthesis tasks (`_synthesis`), the
send lock, and the store, and writes to the socket only through the session's `_send_*_locked`.

- One synthesis task per sentence (`_synthesize`) fills that sentence's chunk queue. The first
  1 + `lookahead_sentences` sentences of the send queue are synthesizing at any time: sentence N+1 is
  being made while N is sent, so there is no gap, and memory stays bounded (`max_queued_audio_s`).
- The sender (`_send_loop`) walks the send queue in order: for each sentence `audio.start`, the binary
  frames (each recorded in the store before it goes out), `audio.done`; for an utterance end
  `utterance.done`/`session.done`. Only one sentence is ever being sent, so two sentences' frames never
  interleave. Resumed sentences replay logged bytes first and drop re-synthesized bytes already delivered.
- Word timestamps (session.config `timestamp_type`): the backend's timings are kept on the sentence as
  they arrive; a word is told (`audio.words`, "async") once the bytes sent of its sentence decode past its
  end, and all of a sentence's words go in its `audio.done` ("sync"). Each utterance keeps the words sent
  in full, which `context.cancelled` reports as `spoken_text`/`spoken_words`.
- The watchdog (`_watch_consumer`) ends a session whose client stopped reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from starlette.websockets import WebSocket

from tts_backend.base import SynthesisRequest, TextStream

from ..audio import encoders
from ..audio import pcm as audio
from ..language import SentenceVoice, voice_for_sentence
from ..protocol import (
    AudioDone,
    AudioStart,
    AudioWords,
    CloseCode,
    ErrorCode,
    ProtocolError,
    SessionDone,
    TimestampInfo,
    UtteranceDone,
    WordAlignment,
    backend_error_code,
)
from .data import SentenceJob, SlowConsumer, UtteranceEnd, sent_marker
from .word_times import append_monotonic

log = logging.getLogger("voxgate.session")

END = object()  # a sentence's synthesis finished
CANCELLED = object()  # a sentence was cancelled; wakes a sender waiting on its chunks


class SpeechPipeline:
    """Synthesis and sending for `StreamingSession` (see the module docstring)."""

    def _stop_job(self, job: SentenceJob) -> None:
        job.finished = True
        self._pending_chars -= job.chars_pending
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
                    item.task = asyncio.create_task(self._synthesize(item), name=f"synth-{self.session_id}-{item.index}")
                    self._synthesis.add(item.task)
                    item.task.add_done_callback(self._synthesis_ended)
                    running += 1

    def _voice_of(self, job: SentenceJob) -> SentenceVoice:
        """The voice that speaks the sentence, and a warning when it cannot read the sentence's language."""
        if job.spoken_by is None:
            job.spoken_by = voice_for_sentence(self.backend, job.config.voice, job.text, auto=job.config.auto_voice)
        return job.spoken_by

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
            utterance_key=f"{self.session_id}/{job.utterance.number}",
            session_key=self.session_id,
            request_id=f"{self.session_id}/{job.index}",
            extra=config.message.backend_extra(),
            word_timestamps=config.timestamps is not None,
            voice_prompt=config.voice_prompt,
            text_stream=stream,
            streaming_text=config.streaming_text,
        )
        monitor = self.admission.monitor if self.admission is not None else None
        bytes_per_second = 2 * self.backend.sample_rate
        try:
            async with contextlib.aclosing(self.backend.synthesize(request)) as stream:
                if self.admission_claim is not None:  # from now on the session's streams count, not its claim
                    self.admission_claim.release()
                if monitor is not None:
                    monitor.stream_started()
                try:
                    while True:
                        # Back-pressure: no more is pulled from the backend while the sender is behind.
                        while not self._has_room(job):
                            self._audio_taken.clear()
                            await self._audio_taken.wait()
                        pulled_at = time.monotonic()
                        try:
                            chunk = await anext(stream)
                        except StopAsyncIteration:
                            break
                        if chunk.words and not job.finished:
                            append_monotonic(job.words, chunk.words)
                        if chunk.pcm and not job.finished:
                            if monitor is not None:
                                monitor.produced(len(chunk.pcm) / bytes_per_second, time.monotonic() - pulled_at)
                            job.queued_bytes += len(chunk.pcm)
                            self._queued_audio += len(chunk.pcm)
                            job.chunks.put_nowait(chunk.pcm)
                finally:
                    if monitor is not None:
                        monitor.stream_ended()
            job.chunks.put_nowait(END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported by the sender, in order
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
        return job.queued_bytes < bound if job is head else self._queued_audio < bound

    def _take_audio(self, job: SentenceJob, size: int) -> None:
        job.queued_bytes -= size
        self._queued_audio -= size
        self._audio_taken.set()

    def _drop_queued(self, job: SentenceJob) -> None:
        """The job's unsent chunks will never be taken (cancelled, failed or finished)."""
        self._queued_audio -= job.queued_bytes
        job.queued_bytes = 0
        self._audio_taken.set()

    async def _watch_consumer(self) -> None:
        """Ends the session (by raising SlowConsumer) once a write has waited slow_consumer_timeout_s
        for the socket to accept it: the client stopped reading, and only its buffers are held."""
        limit = self.settings.slow_consumer_timeout_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            since = self._blocked_since
            if since is not None and time.monotonic() - since >= limit:
                raise SlowConsumer()

    async def _close_slow_consumer(self) -> None:
        """Stop the blocked sender (releasing the send lock), tell the client why if its socket takes
        it within a second, else drop the connection. The session stays in the store: resumable."""
        limit = self.settings.slow_consumer_timeout_s
        log.warning("session %s: the client read nothing for %g s; closing it (resumable)", self.session_id, limit)
        self._stopping = True
        for task in (self._sender, self._reader):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        error = ProtocolError(
            ErrorCode.slow_consumer,
            f"the client read no audio for {limit:g} s; session {self.session_id} is closed and can be resumed"
            " with session.resume",
            close=CloseCode.try_again_later,
        )
        try:
            await asyncio.wait_for(self._fail(error), 1.0)
        except asyncio.TimeoutError:  # counted by _fail already
            abort_transport(self.ws)

    async def _send_loop(self) -> None:
        while True:
            while not self._queue:
                self._queue_changed.clear()
                await self._queue_changed.wait()
            item = self._queue.popleft()
            if isinstance(item, UtteranceEnd):
                self._ends_queued -= 1
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
                self._last_activity = time.monotonic()
            self._fill_pipeline()

    def _audio_done(self, job: SentenceJob, *, error: bool, cancelled: bool = False) -> AudioDone:
        timestamp_info = None
        if job.config.timestamps == "sync" and not error:
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
            sentence_text=job.text if job.config.text_streaming else None,  # audio.start had its first words
        )

    async def _tell_words_locked(self, job: SentenceJob, *, everything: bool = False) -> None:
        """"async" timestamps: tell the words of `job` whose audio has gone out in full since last told."""
        if job.config.timestamps != "async":
            return
        words = job.spoken_words(everything=everything)[job.words_told:]
        if words:
            job.words_told += len(words)
            await self._send_text_locked(AudioWords(sentence_index=job.index, context_id=job.utterance.context_id,
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
                await self.store.append_audio(self.session_id, job.index, frame, offset=job.bytes_sent, owner=self.owner)
            async with self._send_lock:
                if job.cancelled:
                    return False
                await self._send_bytes_locked(frame)
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
        async with self._send_lock:
            if job.cancelled:
                return
            await self._send_text_locked(
                AudioStart(
                    sentence_index=job.index,
                    sentence_text=job.text,
                    format=fmt,
                    sample_rate=config.output_rate,
                    context_id=job.utterance.context_id,
                    voice=spoken_by.voice if spoken_by.voice != config.voice else None,
                    warnings=[spoken_by.warning] if spoken_by.warning is not None else None,
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
            await self.store.set_sentence_state(self.session_id, job.index, "speaking", owner=self.owner)
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
            self._take_audio(job, len(item))
            job.source_samples += len(item) // 2
            encoded = await encoder.encode(item)
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
                if data and not await self._send_new_audio(job, data, max(len(data), 1), encoder):
                    return
        async with self._send_lock:
            if job.cancelled:
                return
            job.finished = True
            self._pending_chars -= job.chars_pending
            job.chars_pending = 0
            if config.timestamps is not None:
                job.utterance.keep_sentence(job.index, job.spoken_words(everything=failure is None),
                                            job.heard_duration_s())
                if failure is None:
                    await self._tell_words_locked(job, everything=True)
            if failure is not None:
                error = _synthesis_error(failure, job)
                self.metrics.errors_total.labels(error.code.value).inc()
                await self._send_text_locked(error.to_message().encode())
            await self._send_text_locked(self._audio_done(job, error=failure is not None).encode())
        outcome = "failed" if failure is not None else "done"
        self.metrics.sentences_total.labels(outcome).inc()
        await self.store.set_sentence_state(self.session_id, job.index, outcome, owner=self.owner)

    async def _send_utterance_end(self, marker: UtteranceEnd) -> None:
        async with self._send_lock:
            if marker.utterance.cancelled:
                return
            if self.uses_contexts or marker.utterance.context_id is not None:
                message = UtteranceDone(context_id=marker.utterance.context_id, total_sentences=marker.utterance.sentences)
            elif marker.by_close:
                return  # session.close answers with one session.done for everything
            else:
                message = SessionDone(total_sentences=self.next_sentence_index)
            await self._send_text_locked(message.encode())
            marker.sent = True
        await self.store.add_marker(self.session_id, sent_marker(marker), owner=self.owner)

    async def _send_session_end(self) -> None:
        async with self._send_lock:
            await self._send_text_locked(SessionDone(total_sentences=self.next_sentence_index).encode())
            with contextlib.suppress(Exception):
                await self.ws.close(CloseCode.normal)
        if self.session_id is not None:
            await self.store.delete(self.session_id, owner=self.owner)


def abort_transport(websocket: WebSocket) -> None:
    """Drop the TCP connection under a WebSocket whose peer reads nothing (a close frame could never be
    written); the server's WebSocket protocol puts the means in the scope (gateway.limits)."""
    abort = websocket.scope.get("voxgate.abort")
    if abort is not None:
        abort()
    else:
        log.warning("cannot abort the connection of a slow consumer: the server offers no way")


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
