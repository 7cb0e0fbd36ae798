"""Pronunciation's parts (issue 34, gateway/pronunciation/): the dictionary's bounds and matcher, the markup
subset, the rewrite of a text that arrives in pieces (random boundaries, with hypothesis), and a sentence's
synthesis through the rewrite on the real synthetic backend: what the backend is given, the pauses in its
audio, the word timings mapped back to the written words."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocol import ErrorCode, PronunciationEntry, ProtocolError
from gateway.pronunciation import markup
from gateway.pronunciation.matcher import Matcher
from gateway.pronunciation.pronouncer import Pronouncer
from gateway.pronunciation.rewrite import Pause, Piece, Rewriter, rewrite_whole, written_of
from gateway.pronunciation.rules import MAX_DICTIONARY_BYTES, MAX_ENTRIES, MAX_TEXT_CHARS, Rule, rules_of
from tests.gateway_server import RecordingBackend
from tts_backend.base import SynthesisRequest, TextStream
from tts_backend.synthetic import SyntheticSynthesizer

RULES = (Rule("Voxgate", "vox gate"), Rule("New York", "new york city"), Rule("NY", "new york", case_sensitive=True),
         Rule("Dr.", "doctor"), Rule("gate", "GATE", whole_word=False))


def spoken(text: str, rules=RULES, markup_on: bool = False) -> str:
    pieces, _ = rewrite_whole(Matcher(rules), markup_on, text)
    return "".join(p.spoken if isinstance(p, Piece) else f"[{p.ms}ms]" if isinstance(p, Pause) else "" for p in pieces)


def entry(text: str, say: str = "x", **options) -> PronunciationEntry:
    return PronunciationEntry(text=text, say=say, **options)


def test_whole_word_any_case_by_default_and_the_options_change_it():
    assert spoken("voxgate's VOXGATE, Voxgates") == "vox gate's vox gate, VoxGATEs"
    assert spoken("NY ny Ny") == "new york ny Ny"  # case_sensitive
    assert spoken("tailgate gateway") == "tailGATE GATEway"  # whole_word false: inside words too


def test_the_longest_entry_wins_and_matches_never_overlap():
    assert spoken("New York and New Yorkers") == "new york city and New Yorkers"
    rules = (Rule("a b", "one"), Rule("b c", "two"))
    assert spoken("a b c", rules) == "one c"


def test_bounds_have_their_codes():
    with pytest.raises(ProtocolError) as too_many:
        rules_of([entry(f"w{i}") for i in range(MAX_ENTRIES + 1)], "d")
    assert too_many.value.code is ErrorCode.pronunciation_limit_reached
    with pytest.raises(ProtocolError) as too_big:
        rules_of([entry(f"w{i}", "y" * 500) for i in range(MAX_DICTIONARY_BYTES // 500 + 1)], "d")
    assert too_big.value.code is ErrorCode.pronunciation_limit_reached
    for bad in (entry(" "), entry("x" * (MAX_TEXT_CHARS + 1)), entry("a", " "), entry("a\nb")):
        with pytest.raises(ProtocolError) as invalid:
            rules_of([bad], "d")
        assert invalid.value.code is ErrorCode.pronunciation_invalid


def test_matching_is_linear_in_the_text():
    """The worst a client can write: the longest entries, all alike but for their last character, and a
    text that walks each one almost to its end at every position. Time per character stays flat as the
    text grows 8-fold (a quadratic matcher would take 8 times longer per character)."""
    rules = tuple(Rule("a" * (MAX_TEXT_CHARS - 1) + chr(ord("b") + i), "x", whole_word=False) for i in range(20))
    matcher = Matcher(rules)

    def per_char(n: int) -> float:
        text = "a" * n
        started = time.process_time()
        Rewriter(matcher, False).feed(text, final=True)
        return (time.process_time() - started) / n

    small, large = per_char(2_000), per_char(16_000)
    assert large < 3 * small + 1e-5


def test_markup_subset():
    assert spoken("Code <spell>AB-12</spell>.", (), True) == "Code A B, 1 2."
    assert spoken('<say-as interpret-as="telephone">+1 555-0100</say-as>', (), True) == "plus 1, 5 5 5, 0 1 0 0"
    assert spoken('<say-as interpret-as="digits">2024</say-as>', (), True) == "2 0 2 4"
    assert spoken('<sub alias="doctor">Dr.</sub> Who', (), True) == "doctor Who"
    assert spoken('a <break time="300ms"/> b <break time="1.5s"/> c <break strength="weak"/>', (), True) == \
        "a [300ms] b [1500ms] c [250ms]"
    assert spoken("<speak>hi</speak>", (), True) == "hi"
    # Without text_markup, "<" is just text.
    assert spoken("<spell>AB</spell>", (), False) == "<spell>AB</spell>"


def test_malformed_or_unknown_markup_warns_and_reads_as_text():
    pieces, warnings = rewrite_whole(Matcher(()), True, "a < b and <spell>AB and <emphasis>now</emphasis>")
    assert written_of(pieces) == "a < b and <spell>AB and now"
    assert len(warnings) == 3 and any("emphasis" in w for w in warnings)
    assert markup.read_tag('<break time="forever"/>', 0, final=True) is None


def test_a_break_is_bounded():
    assert spoken('<break time="99999s"/>', (), True) == f"[{markup.MAX_BREAK_MS}ms]"


PIECES_TEXT = ("Voxgate's NY office, in New York, spells <spell>AB-12</spell> for "
               "<sub alias='doctor'>Dr.</sub> Who <break time='200ms'/> then tailgates a Dr. and New Yorkers.")


def pieces_of(text: str, cuts: list[int]) -> list:
    rewriter = Rewriter(Matcher(RULES), True)
    out = []
    for cut in cuts:
        out += rewriter.feed(text[:cut], final=False)
    return out + rewriter.feed(text, final=True)


def said(pieces: list) -> str:
    return "".join(p.spoken if isinstance(p, Piece) else f"[{p.ms}]" if isinstance(p, Pause) else "" for p in pieces)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(PIECES_TEXT) - 1), max_size=40).map(sorted))
def test_what_is_said_does_not_depend_on_where_the_text_breaks(cuts):
    whole = pieces_of(PIECES_TEXT, [])
    assert said(pieces_of(PIECES_TEXT, cuts)) == said(whole)
    assert written_of(pieces_of(PIECES_TEXT, cuts)) == written_of(whole)


def test_only_what_the_longest_rule_needs_is_held_back():
    rewriter = Rewriter(Matcher(RULES), True)
    # "New" may start "New York": held back; everything before it is given.
    assert said(rewriter.feed("Call me in New", final=False)) == "Call me in "
    assert said(rewriter.feed("Call me in New Jersey", final=False)) == "New Jersey"
    assert said(rewriter.feed("Call me in New Jersey <spell>AB", final=False)) == " "  # the tag is not closed
    assert said(rewriter.feed("Call me in New Jersey <spell>AB</spell>", final=True)) == "A B"


# ------------------------------------------------------------------------- synthesis through the rewrite


async def speak(pronouncer: Pronouncer, text: str | None = None, pieces: list[str] | None = None):
    backend = RecordingBackend(SyntheticSynthesizer(speed=0))
    stream = None
    if pieces is not None:
        stream = TextStream(pieces[0])
    request = SynthesisRequest(text=text or "", voice="tone-mid", word_timestamps=True, text_stream=stream)

    async def feed() -> None:
        for piece in pieces[1:]:
            await asyncio.sleep(0.002)
            stream.push(piece)
        stream.finish()

    feeder = asyncio.create_task(feed()) if stream is not None else None
    pcm, words = b"", []
    async for chunk in pronouncer.synthesize(backend, request):
        pcm += chunk.pcm
        words += chunk.words
    if feeder is not None:
        await feeder
    return backend, pcm, words


async def test_the_backend_gets_the_rewrite_and_the_words_come_back_written():
    pronouncer = Pronouncer(RULES, True)
    text = "Voxgate's code is <spell>AB-12</spell>. <break time='500ms'/> Bye now."
    backend, pcm, words = await speak(pronouncer, text)
    assert [r.text for r in backend.records] == ["vox gate's code is A B, 1 2. ", " Bye now."]
    assert [w.word for w in words] == ["Voxgate's", "code", "is", "AB-12.", "Bye", "now."]
    assert " ".join(w.word for w in words) == " ".join(pronouncer.written(text).split())
    # The pause is silence of its length, between the two parts' audio.
    first = SyntheticSynthesizer().render(SynthesisRequest(text="vox gate's code is A B, 1 2.", voice="tone-mid"))
    pause = 24000 * 500 // 1000
    assert pcm[2 * len(first): 2 * (len(first) + pause)] == bytes(2 * pause)
    assert words[3].end <= len(first) < len(first) + pause <= words[4].start
    assert all(a.end <= b.start for a, b in zip(words, words[1:]))


STREAMED = "Voxgate's code is <spell>AB-12</spell>. <break time='500ms'/> Bye now in New York."


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(STREAMED) - 1), max_size=12).map(sorted))
def test_audio_and_words_do_not_depend_on_where_the_stream_breaks(cuts):
    """Through the real synthetic backend: the sentence's audio and its written words' timings are the same
    for every way of cutting its text into pushes."""
    pronouncer = Pronouncer(RULES, True)
    bounds = [0, *cuts, len(STREAMED)]
    _, whole_pcm, whole_words = asyncio.run(speak(pronouncer, pieces=[STREAMED]))
    _, pcm, words = asyncio.run(speak(pronouncer, pieces=[STREAMED[a:b] for a, b in zip(bounds, bounds[1:])]))
    assert pcm == whole_pcm and words == whole_words


async def test_a_text_streamed_in_pieces_is_said_and_timed_as_the_whole_text():
    pronouncer = Pronouncer(RULES, True)
    text = "Voxgate's code is <spell>AB-12</spell>. <break time='500ms'/> Bye now in New York."
    _, whole_pcm, whole_words = await speak(pronouncer, pieces=[text])
    cuts = [0, 5, 9, 20, 23, 31, 40, 52, 60, 70, len(text)]
    backend, pcm, words = await speak(pronouncer, pieces=[text[a:b] for a, b in zip(cuts, cuts[1:])])
    assert pcm == whole_pcm and words == whole_words
    assert [r.text for r in backend.records] == ["vox gate's code is A B, 1 2. ", " Bye now in new york city."]
    # The alias's three words map back to the two it replaced: one word, timed over all three.
    assert [w.word for w in words[-2:]] == ["in", "New York."]


class TakesInstructions(SyntheticSynthesizer):
    """The synthetic backend, declaring instructions honoured (as Qwen3 CustomVoice does)."""

    honours = SyntheticSynthesizer.honours | {"instructions"}


async def test_an_expression_becomes_the_instructions_of_the_words_after_it_where_the_backend_takes_them():
    pronouncer = Pronouncer((), True)
    text = 'Good news! <expression value="warm"/> You won. <expr value="calm"/> Really.'
    backend = RecordingBackend(TakesInstructions(speed=0))
    request = SynthesisRequest(text=text, voice="tone-mid", instructions="friendly")
    async for _ in pronouncer.synthesize(backend, request):
        pass
    assert [(r.text, r.request.instructions) for r in backend.records] == [
        ("Good news! ", "friendly"), (" You won. ", "warm"), (" Really.", "calm")]
    assert pronouncer.warnings(text, backend) == []
    # Elsewhere the expression is dropped, with a warning, and the sentence is one request.
    plain = RecordingBackend(SyntheticSynthesizer(speed=0))
    async for _ in pronouncer.synthesize(plain, SynthesisRequest(text=text, voice="tone-mid")):
        pass
    assert [r.text for r in plain.records] == ["Good news!  You won.  Really."]
    assert [w.code for w in pronouncer.warnings(text, plain)] == ["expression_ignored"]


def test_where_a_sentence_may_not_end():
    for inside in ('Call <sub alias="Doctor Who.', "Spell <spell>A.", "<say-as interpret-as='digits'>1.",
                   "Hi <emphasis>now."):
        assert markup.ends_inside_markup(inside), inside
    for outside in ("Spell <spell>A. B</spell> now.", "a < b.", "Hi <break time='1s'/> there.", "<speak>Hi.",
                    "plain text.", "<spell>" + "x" * markup.MAX_CONTENT_CHARS):
        assert not markup.ends_inside_markup(outside), outside
