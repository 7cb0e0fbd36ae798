"""Properties of the incremental segmenter on generated text: chunking never changes the result, no text
is lost, pysbd only sees a bounded tail, and the API behaves as the gateway expects."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from gateway.session import segmenter as segmenter_module
from gateway.session.segmenter import MAX_UNIT_CHARS, PYSBD_WINDOW, SentenceSegmenter, pysbd_language

FRAGMENTS = [
    "Dr.", "Mr.", "e.g.", "i.e.", "etc.", "U.S.", "p.m.", "a.m.", "J.", "R.", "$3.50", "3.14", "1,000", "No.",
    "https://example.com/a.b?c=d", "jane@example.org", "...", "…", "\"Hi.\"", "(see p. 5)", "1.", "2)",
    "Hello", "world", "then", "Then", "The", "it", "I", "she", "went", "home", "today", "quickly",
    ",", ";", ":", "—", "-", "--", ".", "!", "?", "?!", "你好", "。", "！", "？", "再见", "，", "\n", "\n\n",
]


def generated_text(rng: random.Random, words: int) -> str:
    parts = []
    for _ in range(words):
        parts.append(rng.choice(FRAGMENTS))
        parts.append(rng.choice(["", " ", " ", " ", "  ", "\n", "\t"]))
    return "".join(parts)


def feed(pieces: list[str], granularity: str) -> tuple[list[str], list[tuple[int, int]]]:
    """Units, and after each push (total characters pushed, characters still buffered)."""
    segmenter = SentenceSegmenter(granularity=granularity)
    units: list[str] = []
    pushed = 0
    trace = []
    for piece in pieces:
        units += segmenter.push(piece)
        pushed += len(piece)
        trace.append((pushed, segmenter.buffered_chars))
    return units + segmenter.flush(), trace


def cut(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 13, 40])
        pieces.append(text[i : i + n])
        i += n
    return pieces


def assert_lossless(text: str, units: list[str]) -> None:
    """Units appear in the input in order, with only whitespace between and around them."""
    cursor = 0
    for unit in units:
        assert unit and unit == unit.strip()
        start = text.find(unit, cursor)
        assert start >= 0 and text[cursor:start].strip() == "", (unit, text[cursor : cursor + 80])
        cursor = start + len(unit)
    assert text[cursor:].strip() == ""


@pytest.mark.parametrize("granularity", ["sentence", "clause", "none"])
def test_chunking_never_changes_units_and_nothing_is_lost(granularity: str) -> None:
    rng = random.Random(1234)
    for _ in range(60):
        text = generated_text(rng, rng.randint(1, 60))
        whole, _ = feed([text], granularity)
        by_char, _ = feed(list(text), granularity)
        assert by_char == whole, text
        for _ in range(3):
            pieces, _ = feed(cut(text, rng), granularity)
            assert pieces == whole, text
        assert_lossless(text, whole)
        if granularity == "none":
            assert len(whole) <= 1


@pytest.mark.parametrize("granularity", ["sentence", "clause"])
def test_slicing_the_work_never_changes_units(granularity: str) -> None:
    """append + advance with a deadline already passed (one character examined per call) gives push's units."""
    rng = random.Random(4321)
    for _ in range(40):
        text = generated_text(rng, rng.randint(1, 60))
        whole, _ = feed([text], granularity)
        segmenter = SentenceSegmenter(granularity=granularity)
        units: list[str] = []
        for piece in cut(text, rng):
            segmenter.append(piece)
            while not segmenter.examined_all:
                units += segmenter.advance(deadline=0.0)
        assert units + segmenter.flush() == whole, text


async def test_push_in_slices_lets_the_loop_run_and_gives_push_units() -> None:
    text = "Dr. " * 3000
    expected = SentenceSegmenter().push(text)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    units = await segmenter_module.push_in_slices(SentenceSegmenter(), text)
    ticker.cancel()
    assert units == expected
    assert ticks > 10  # the loop ran other tasks between slices


def test_released_plus_buffered_is_the_input() -> None:
    """At every moment, what was released plus what is buffered accounts for all text (whitespace aside)."""
    rng = random.Random(99)
    for _ in range(30):
        text = generated_text(rng, 40)
        segmenter = SentenceSegmenter("clause")
        released: list[str] = []
        pushed = ""
        for piece in cut(text, rng):
            released += segmenter.push(piece)
            pushed += piece
            # The buffer is always a suffix of the input; released units account for the rest.
            released_part = pushed[: len(pushed) - segmenter.buffered_chars]
            assert_lossless(released_part, released)
            assert segmenter.buffered_chars == 0 or not pushed[len(pushed) - segmenter.buffered_chars].isspace()


def test_arctic_turns_split_into_their_sentences() -> None:
    """Consecutive ARCTIC prompts joined into a turn come back as the same prompts (pysbd agrees here)."""
    data = Path(__file__).resolve().parents[1] / "bench" / "data" / "arctic_en.jsonl"
    if not data.exists():
        data = Path("/work/shared/bench/arctic_en.jsonl")
    if not data.exists():
        pytest.skip("ARCTIC prompt list not present")
    rows = [json.loads(line)["text"] for line in data.read_text().splitlines() if line.strip()]
    checked = 0
    for start in range(0, 600, 6):
        turn = rows[start : start + 4]
        if any(". " in t or "? " in t or "! " in t for t in turn):
            continue  # a prompt that is itself two sentences
        units, _ = feed(list(" ".join(turn)), "sentence")
        assert units == turn
        checked += 1
    assert checked > 50


def test_pysbd_only_sees_a_bounded_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    segmenter = SentenceSegmenter()
    real = segmenter._pysbd.processor

    def spy(text: str):
        seen.append(len(text))
        return real(text)

    monkeypatch.setattr(segmenter._pysbd, "processor", spy)
    run_on = "We met Mr. A. B. Smith and Dr. C. D. Jones, e.g. at 5 p.m. on Jan. 5, " * 200
    units = []
    for i in range(0, len(run_on), 7):
        units += segmenter.push(run_on[i : i + 7])
    units += segmenter.flush()
    assert seen and max(seen) <= PYSBD_WINDOW + 60
    assert max(len(u) for u in units) <= MAX_UNIT_CHARS
    assert_lossless(run_on, units)


def test_run_on_text_is_cut_at_a_clause_mark() -> None:
    text = ("word " * 30 + "and more, ") * 5
    units, _ = feed([text], "sentence")
    assert all(len(u) <= MAX_UNIT_CHARS for u in units)
    assert units[0].endswith(",")
    assert_lossless(text, units)


def test_a_long_flush_is_cut_after_a_sentence_end_else_a_clause_else_a_word() -> None:
    segmenter = SentenceSegmenter("none", max_unit_chars=20)
    segmenter.push("One two. Three four, five six seven eight nine ten Supercalifragilistic")
    assert segmenter.flush() == ["One two.", "Three four,", "five six seven eight", "nine ten", "Supercalifragilistic"]
    segmenter.push("x" * 45)
    assert segmenter.flush() == ["x" * 20, "x" * 20, "x" * 5]  # a word longer than the limit: cut inside
    assert segmenter_module.split_to_fit("你好。再见！好的，是的", 5) == ["你好。", "再见！", "好的，是的"]


def test_flush_releases_the_tail_and_the_utterance_continues() -> None:
    segmenter = SentenceSegmenter()
    assert segmenter.push("Hello there.") == []
    assert segmenter.push(" ") == []
    assert segmenter.push("How are") == ["Hello there."]
    assert segmenter.buffered_chars == len("How are")
    assert segmenter.push(" you") == []
    assert segmenter.push("? I") == ["How are you?"]
    assert segmenter.flush() == ["I"]
    assert segmenter.buffered_chars == 0
    assert segmenter.flush() == []
    assert segmenter.push("  am fine. ") == []
    assert segmenter.push("Bye.") == ["am fine."]
    assert segmenter.flush() == ["Bye."]


def test_none_granularity_waits_for_flush() -> None:
    segmenter = SentenceSegmenter("none")
    assert segmenter.push("One. Two. 三。") == []
    assert segmenter.flush() == ["One. Two. 三。"]


def test_whitespace_is_never_a_unit() -> None:
    segmenter = SentenceSegmenter()
    assert segmenter.push("   ") == []
    assert segmenter.push("\n\t") == []
    assert segmenter.buffered_chars == 0
    assert segmenter.flush() == []


def test_bad_granularity_is_refused() -> None:
    with pytest.raises(ValueError, match="granularity"):
        SentenceSegmenter("word")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "language,code",
    [("en", "en"), ("English", "en"), ("Auto", "en"), (None, "en"), ("Chinese", "zh"), ("ja", "ja"), ("de-DE", "de"),
     ("Korean", "en"), ("fr_FR", "fr")],
)
def test_language_names_map_to_pysbd_codes(language: str | None, code: str) -> None:
    assert pysbd_language(language) == code


def test_other_languages_split_with_their_rules() -> None:
    segmenter = SentenceSegmenter(language="German")
    units = segmenter.push("Das kostet z. B. 5 Euro. Dann gehen wir.") + segmenter.flush()
    assert units == ["Das kostet z. B. 5 Euro.", "Dann gehen wir."]
    assert segmenter_module.pysbd_language("German") == "de"
