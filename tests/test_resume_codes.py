"""Resume from codes (issue 33), the backend interface (tts_backend/base.py): the synthetic backend tells a
chunk's codes and, given the codes of the chunks delivered so far, goes on with exactly the rest of the
uninterrupted run's audio, at every cut, for whole texts and text streams; it refuses codes that are not this
request's; a request carries its codes across the worker wire's JSON; a backend without codes refuses them."""

from __future__ import annotations

import asyncio

import pytest

from tts_backend.base import (
    SynthesisError,
    SynthesisRequest,
    TextStream,
    check_codes,
    max_code_bytes,
)
from tts_backend.remote import framing
from tts_backend.synthetic import CODEBOOKS, SyntheticSynthesizer

TEXT = "Hello there, this is a sentence long enough for many frames of audio."


async def chunks_of(backend, request):
    return [chunk async for chunk in backend.synthesize(request)]


def joined(chunks) -> bytes:
    return b"".join(chunk.pcm for chunk in chunks)


async def test_every_cut_resumes_byte_exact_with_the_words_in_the_sentences_time_base():
    backend = SyntheticSynthesizer()
    request = SynthesisRequest(TEXT, "tone-mid", seed=3, word_timestamps=True)
    whole = await chunks_of(backend, request)
    assert all(len(c.codes) == 2 * CODEBOOKS for c in whole)  # one frame a chunk
    assert backend.codebooks == CODEBOOKS and "resume_codes" in backend.honours
    words = [w for c in whole for w in c.words]
    for cut in range(len(whole) + 1):
        codes = b"".join(c.codes for c in whole[:cut])
        rest = await chunks_of(backend, SynthesisRequest(TEXT, "tone-mid", seed=3, word_timestamps=True,
                                                         resume_codes=codes))
        assert joined(whole[:cut]) + joined(rest) == joined(whole), cut
        assert [c.codes for c in rest if c.pcm] == [c.codes for c in whole[cut:]]
        assert [w for c in rest for w in c.words] == words  # told again, in the sentence's samples


@pytest.mark.parametrize("change", [{"seed": 4}, {"voice": "tone-low"}, {"text": TEXT + " More."}])
async def test_codes_of_another_request_are_refused(change):
    backend = SyntheticSynthesizer()
    first = await chunks_of(backend, SynthesisRequest(TEXT, "tone-mid", seed=3))
    codes = b"".join(c.codes for c in first[:3])
    other = {"text": TEXT, "voice": "tone-mid", "seed": 3, **change}
    if "text" in change:  # a longer text has the same first frames: its codes continue it
        assert joined(first[:3]) + joined(await chunks_of(backend, SynthesisRequest(**other, resume_codes=codes))) \
            == joined(await chunks_of(backend, SynthesisRequest(**other)))
        return
    with pytest.raises(SynthesisError, match="do not continue"):
        await chunks_of(backend, SynthesisRequest(**other, resume_codes=codes))


@pytest.mark.parametrize("codes", [b"\0" * 3, b"\0" * (2 * CODEBOOKS), b"\xff" * (2 * CODEBOOKS)])
async def test_malformed_codes_are_refused(codes):
    with pytest.raises(SynthesisError):
        await chunks_of(SyntheticSynthesizer(), SynthesisRequest(TEXT, "tone-mid", seed=3, resume_codes=codes))


async def test_a_text_stream_resumes_byte_exact_once_its_text_reaches_the_codes():
    backend = SyntheticSynthesizer()
    words = TEXT.split(" ")

    async def spoken(resume_codes: bytes = b"") -> list:
        stream = TextStream(words[0] + " ")

        async def push() -> None:
            for word in words[1:]:
                await asyncio.sleep(0.001)
                stream.push(word + " ")
            stream.finish()

        pushing = asyncio.create_task(push())
        chunks = await chunks_of(backend, SynthesisRequest(stream.text, "tone-mid", seed=3, text_stream=stream,
                                                           resume_codes=resume_codes))
        await pushing
        return chunks

    whole = await spoken()
    assert joined(whole) == joined(await chunks_of(backend, SynthesisRequest(" ".join(words) + " ", "tone-mid", seed=3)))
    for cut in range(0, len(whole) + 1, 3):
        rest = await spoken(b"".join(c.codes for c in whole[:cut]))
        assert joined(whole[:cut]) + joined(rest) == joined(whole), cut


def test_codes_travel_in_the_request_and_are_left_out_when_there_are_none():
    request = SynthesisRequest(TEXT, "tone-mid", seed=3, resume_codes=bytes(range(64)))
    data = framing.request_to_json(request)
    assert framing.request_from_json(data) == request
    assert "resume_codes" not in framing.request_to_json(SynthesisRequest(TEXT, "tone-mid"))
    with pytest.raises(framing.ProtocolError):
        framing.request_from_json({**data, "resume_codes": "not base64!"})


def test_the_bound_on_codes():
    bound = max_code_bytes(16, 12.5, len(TEXT))
    assert bound == (int((10 + 0.5 * len(TEXT)) * 12.5) + 1 + len(TEXT)) * 32
    assert max_code_bytes(0, 12.5, len(TEXT)) == 0
    check_codes(b"\0" * 64, 16, bound)
    with pytest.raises(SynthesisError, match="whole frames"):
        check_codes(b"\0" * 63, 16, bound)
    with pytest.raises(SynthesisError, match="more than"):
        check_codes(b"\0" * (bound + 32), 16, bound)
    with pytest.raises(SynthesisError, match="no codes"):
        check_codes(b"\0" * 32, 0, 0)


async def test_a_backend_without_codes_refuses_them():
    from tts_backend.base import Synthesizer, Voice

    class NoCodes(Synthesizer):  # the default of every backend: Piper declares the same (codebooks 0)
        def voices(self):
            return [Voice("v", "v")]

        async def synthesize(self, request):
            self.refuse_resume_codes(request)
            yield  # pragma: no cover

    with pytest.raises(SynthesisError, match="cannot continue"):
        await chunks_of(NoCodes(), SynthesisRequest(TEXT, "v", resume_codes=b"\0" * 32))
