"""A slow worker is not a hostile one (found on the H200: with word timestamps on, the aligner's queue held
a sentence's words more than chunk_timeout_s after its last audio; the pool set its only worker aside for
30 s and every session failed meanwhile). Against real `voxgate worker` processes (the synthetic backend
with `words_delay_s`, which sends the words in a chunk of their own after the audio, as qwen3 with an
aligner does):

- the worker sends keep-alives while its backend works, and the pool takes them as proof of life: the
  sentence completes with its words and the worker stays in the pool;
- a worker that is truly silent (SIGSTOPped mid-sentence: no keep-alives either) is still caught by the
  deadline, with a retryable error;
- with one worker, that deadline miss does not set it aside: the next session is served at once.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.worker_fixtures import synthetic_worker_args, wait_for_async, workers
from tts_backend.base import SynthesisError, SynthesisRequest
from tts_backend.remote import RemoteSynthesizer

CHUNK_TIMEOUT_S = 2.5  # the pool's inter-frame deadline in these tests (10 s in production, the same rule)
WORDS_DELAY_S = 2 * CHUNK_TIMEOUT_S  # the backend's wait between the last audio and the words: past it
TEXT = "Hello there, how are you today?"


def pool(address: str) -> RemoteSynthesizer:
    return RemoteSynthesizer(workers=address, connect_timeout_s=20, info_refresh_s=0.1,
                             first_audio_timeout_s=CHUNK_TIMEOUT_S, chunk_timeout_s=CHUNK_TIMEOUT_S)


def request(session: str) -> SynthesisRequest:
    return SynthesisRequest(text=TEXT, voice="tone-mid", seed=7, session_key=session, utterance_key=f"{session}/0",
                            request_id=f"{session}/0", word_timestamps=True)


async def speak(remote: RemoteSynthesizer, session: str) -> tuple[int, list]:
    audio, words = 0, []
    async for chunk in remote.synthesize(request(session)):
        audio += len(chunk.pcm)
        words.extend(chunk.words)
    return audio, words


async def test_words_long_after_the_audio_complete_the_sentence_and_the_worker_stays():
    """Before: `worker ... set aside for 30 s: worker ... sent nothing for 2.5 s`, and the sentence failed."""
    with workers(synthetic_worker_args("--option", f"words_delay_s={WORDS_DELAY_S}", speed=0)) as (worker,):
        remote = pool(worker.address)
        await remote.start()
        try:
            started = time.monotonic()
            audio, words = await speak(remote, "slow-words")
            took = time.monotonic() - started
            assert took >= WORDS_DELAY_S  # the words really came that long after the audio
            assert audio > 0 and [w.word for w in words] == TEXT.split(), words
            (member,) = remote.members.values()
            assert member.ready and remote.quarantined == 0
            assert "set aside" not in "\n".join(worker.output)
        finally:
            await remote.stop()


async def test_a_silent_worker_is_still_caught_and_the_only_worker_is_not_set_aside():
    """A SIGSTOPped worker sends nothing, keep-alives neither: the deadline fails its sentence with a
    retryable error. Before, that worker (the only one) was then set aside for 30 s and every new session
    failed; now the next session is served as soon as the worker runs again."""
    with workers(synthetic_worker_args("--option", f"words_delay_s={WORDS_DELAY_S}", speed=0)) as (worker,):
        remote = pool(worker.address)
        await remote.start()
        try:
            stream = remote.synthesize(request("silenced"))
            first = await anext(stream)
            assert first.pcm
            os.kill(worker.proc.pid, signal.SIGSTOP)
            started = time.monotonic()
            try:
                with pytest.raises(SynthesisError, match="no other worker") as caught:
                    async for _ in stream:
                        pass
            finally:
                os.kill(worker.proc.pid, signal.SIGCONT)
            waited = time.monotonic() - started
            assert CHUNK_TIMEOUT_S - 0.5 <= waited < CHUNK_TIMEOUT_S + 5, waited
            assert getattr(caught.value, "retryable", True)
            (member,) = remote.members.values()
            assert remote.quarantined == 0 and member.quarantined_until == 0.0
            # Stopped, it missed its info queries too, so the pool counts it down until it answers one again:
            # seconds, not the 30 s of a quarantine.
            await wait_for_async(lambda: remote.ready, 10, "the pool seeing the worker answer again")
            audio, words = await speak(remote, "next")
            assert audio > 0 and [w.word for w in words] == TEXT.split()
        finally:
            await remote.stop()
