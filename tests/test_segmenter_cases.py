"""The incremental sentence segmenter on a table of hard cases, fed every way a stream can arrive.

Each case is fed one character at a time, in random-sized pieces (several seeds) and whole; all must give
exactly the expected units. Each unit must also be released no later than the first non-whitespace
character of the next unit arrives (at once for CJK terminators).
"""

from __future__ import annotations

import random

import pytest

from gateway.session.connection import FIRST_UNIT_WORDS
from gateway.session.segmenter import CJK_TERMINATORS, SentenceSegmenter

# (name, granularity, text, expected units)
CASES = [
    # (name, granularity, text, expected)
    ("abbrev_dr", "sentence", "Dr. Smith paid $3.50 at 5 p.m. today. Then he left.", ["Dr. Smith paid $3.50 at 5 p.m. today.", "Then he left."]),
    ("abbrev_mr_mrs", "sentence", "Mr. and Mrs. Jones arrived. They sat down.", ["Mr. and Mrs. Jones arrived.", "They sat down."]),
    ("abbrev_eg", "sentence", "Bring fruit, e.g. apples or pears. Do not be late.", ["Bring fruit, e.g. apples or pears.", "Do not be late."]),
    ("abbrev_ie", "sentence", "Use the default, i.e. the first option. It works.", ["Use the default, i.e. the first option.", "It works."]),
    ("abbrev_etc_end", "sentence", "We sell pens, paper, etc. The shop opens at nine.", ["We sell pens, paper, etc.", "The shop opens at nine."]),
    ("abbrev_us_mid", "sentence", "It costs five U.S. dollars. Pay at the desk.", ["It costs five U.S. dollars.", "Pay at the desk."]),
    ("abbrev_prof_st", "sentence", "Prof. Brown lives on St. James Street. Visit him.", ["Prof. Brown lives on St. James Street.", "Visit him."]),
    ("abbrev_vs", "sentence", "It was Lakers vs. Celtics tonight. The Lakers won.", ["It was Lakers vs. Celtics tonight.", "The Lakers won."]),
    ("abbrev_inc", "sentence", "She works at Apple Inc. in California. She likes it.", ["She works at Apple Inc. in California.", "She likes it."]),
    ("abbrev_no", "sentence", "He was the No. 1 seed. Nobody beat him.", ["He was the No. 1 seed.", "Nobody beat him."]),
    ("abbrev_phd", "sentence", "Ph.D. students work hard. They rarely sleep.", ["Ph.D. students work hard.", "They rarely sleep."]),
    ("abbrev_jan", "sentence", "The launch is on Jan. 5 next year. Be ready.", ["The launch is on Jan. 5 next year.", "Be ready."]),
    ("abbrev_fig", "sentence", "See Fig. 3 for details. It shows the trend.", ["See Fig. 3 for details.", "It shows the trend."]),
    ("decimal", "sentence", "Pi is about 3.14159 and e is 2.718. Both are irrational.", ["Pi is about 3.14159 and e is 2.718.", "Both are irrational."]),
    ("decimal_end", "sentence", "The version is 2.0. Update now.", ["The version is 2.0.", "Update now."]),
    ("currency", "sentence", "Coffee costs $3.50 and tea is $2. Cash only.", ["Coffee costs $3.50 and tea is $2.", "Cash only."]),
    ("currency_euro_big", "sentence", "Revenue hit €1,234.56 million. Profit grew 3.5%. Shares rose.", ["Revenue hit €1,234.56 million.", "Profit grew 3.5%.", "Shares rose."]),
    ("time_pm_continue", "sentence", "The meeting is at 3 p.m. tomorrow. Please come.", ["The meeting is at 3 p.m. tomorrow.", "Please come."]),
    ("time_pm_then", "sentence", "He left at 5 p.m. Then she arrived.", ["He left at 5 p.m.", "Then she arrived."]),
    ("time_am_I", "sentence", "It was 5 a.m. I woke up.", ["It was 5 a.m.", "I woke up."]),
    ("time_clock", "sentence", "Call me at 10:30. I will answer.", ["Call me at 10:30.", "I will answer."]),
    ("initials_tolkien", "sentence", "I met J. R. R. Tolkien. He was tall.", ["I met J. R. R. Tolkien.", "He was tall."]),
    ("initials_kennedy", "sentence", "John F. Kennedy was president. He was young.", ["John F. Kennedy was president.", "He was young."]),
    ("url_plain", "sentence", "Visit https://example.com/docs/v1.2/index.html for help. It is free.", ["Visit https://example.com/docs/v1.2/index.html for help.", "It is free."]),
    ("url_www_end", "sentence", "Go to www.example.com. Sign up there.", ["Go to www.example.com.", "Sign up there."]),
    ("email", "sentence", "Write to jane.doe@example.co.uk today. She replies fast.", ["Write to jane.doe@example.co.uk today.", "She replies fast."]),
    ("email_end", "sentence", "Mail me at a.b@c.com. Thanks.", ["Mail me at a.b@c.com.", "Thanks."]),
    ("filename", "sentence", "Open config.yaml in the editor. Save it.", ["Open config.yaml in the editor.", "Save it."]),
    ("ellipsis_lower", "sentence", "Wait... what happened here? Tell me.", ["Wait... what happened here?", "Tell me."]),
    ("ellipsis_upper", "sentence", "I thought so... Then I left.", ["I thought so...", "Then I left."]),
    ("ellipsis_unicode", "sentence", "Well… maybe later. Not now.", ["Well… maybe later.", "Not now."]),
    ("quote_said", "sentence", "\"Hi.\" she said. \"How are you?\" he asked.", ["\"Hi.\" she said.", "\"How are you?\" he asked."]),
    ("quote_closing", "sentence", "He shouted \"Stop!\" Everyone froze.", ["He shouted \"Stop!\"", "Everyone froze."]),
    ("quote_curly", "sentence", "She said “yes.” Then she left.", ["She said “yes.”", "Then she left."]),
    ("quote_two_spaces", "sentence", "Yes.\"  She went home.", ["Yes.\"", "She went home."]),
    ("paren", "sentence", "The result (see p. 5) is clear. We agree.", ["The result (see p. 5) is clear.", "We agree."]),
    ("list_numbering", "sentence", "1. First, boil water.\n2. Add the pasta.\n3. Wait.", ["1. First, boil water.", "2. Add the pasta.", "3. Wait."]),
    ("list_inline", "sentence", "Steps: 1. mix, 2. bake. Enjoy.", ["Steps: 1. mix, 2. bake.", "Enjoy."]),
    ("list_inline_upper", "sentence", "Steps: 1. Mix it. 2. Bake it. Enjoy.", ["Steps: 1. Mix it.", "2. Bake it.", "Enjoy."]),
    ("number_sentence_end", "sentence", "He scored 5. Then he left.", ["He scored 5.", "Then he left."]),
    ("list_newline_no_period", "sentence", "Shopping list\n- milk\n- eggs", ["Shopping list", "- milk", "- eggs"]),
    ("paragraphs", "sentence", "First paragraph ends here.\n\nSecond one starts.", ["First paragraph ends here.", "Second one starts."]),
    ("question_exclaim", "sentence", "Really?! No way! Yes way.", ["Really?!", "No way!", "Yes way."]),
    ("multi_bang", "sentence", "Hello!! Welcome back.", ["Hello!!", "Welcome back."]),
    ("number_start", "sentence", "I was born in 1990. 2020 was hard.", ["I was born in 1990.", "2020 was hard."]),
    ("lowercase_after_period_word", "sentence", "wait a sec. ok then", ["wait a sec. ok then"]),
    ("no_terminator", "sentence", "this text never ends", ["this text never ends"]),
    ("single_sentence", "sentence", "Hello there.", ["Hello there."]),
    ("leading_trailing_ws", "sentence", "   Hello there.   How are you?   ", ["Hello there.", "How are you?"]),
    ("whitespace_only", "sentence", "   \n\t  ", []),
    ("empty", "sentence", "", []),
    ("tabs_newlines", "sentence", "One.\tTwo.\nThree.", ["One.", "Two.", "Three."]),
    ("acronym_ai", "sentence", "A.I. is changing work. Adapt.", ["A.I. is changing work.", "Adapt."]),
    ("version_v", "sentence", "Install Python 3.11.4 first. Then run it.", ["Install Python 3.11.4 first.", "Then run it."]),
    ("cjk_zh", "sentence", "你好。今天天气很好！你去哪儿？", ["你好。", "今天天气很好！", "你去哪儿？"]),
    ("cjk_ja", "sentence", "こんにちは。元気ですか？はい！", ["こんにちは。", "元気ですか？", "はい！"]),
    ("cjk_fullwidth_then_en", "sentence", "好的！OK then. Bye.", ["好的！", "OK then.", "Bye."]),
    ("cjk_no_terminator_tail", "sentence", "我们走吧。等一下", ["我们走吧。", "等一下"]),
    ("cjk_halfwidth_stop", "sentence", "ｺﾝﾆﾁﾊ｡ｹﾞﾝｷ｡", ["ｺﾝﾆﾁﾊ｡", "ｹﾞﾝｷ｡"]),
    ("mixed_en_cjk", "sentence", "He said 你好。Then he left.", ["He said 你好。", "Then he left."]),
    ("clause_commas", "clause", "When the sun rises over the hills, the birds begin to sing; and then the town wakes up.", ["When the sun rises over the hills,", "the birds begin to sing;", "and then the town wakes up."]),
    ("clause_short_kept", "clause", "Yes, sir, I will do it right away, no problem at all.", ["Yes, sir, I will do it right away,", "no problem at all."]),
    ("clause_number_comma", "clause", "The population of the city grew to 1,250,000 people, which surprised everyone.", ["The population of the city grew to 1,250,000 people,", "which surprised everyone."]),
    ("clause_colon", "clause", "Here is the plan for tomorrow morning: we leave at six.", ["Here is the plan for tomorrow morning:", "we leave at six."]),
    ("clause_dash_spaced", "clause", "I thought about it for a long time - and then I agreed.", ["I thought about it for a long time -", "and then I agreed."]),
    ("clause_emdash", "clause", "She packed everything she owned—then she left town.", ["She packed everything she owned—", "then she left town."]),
    ("clause_and_sentences", "clause", "Dr. Smith, who lives in the U.S., works long hours at the clinic, mostly nights. He is tired.", ["Dr. Smith, who lives in the U.S.,", "works long hours at the clinic,", "mostly nights.", "He is tired."]),
    ("clause_quote_comma", "clause", "\"I really do not think so,\" she said after a while.", ["\"I really do not think so,\"", "she said after a while."]),
    ("clause_cjk", "clause", "我们今天早上一起去公园散步，然后去吃了早饭。", ["我们今天早上一起去公园散步，", "然后去吃了早饭。"]),
    ("clause_time_colon", "clause", "The train leaves the station at 10:30 sharp, so hurry.", ["The train leaves the station at 10:30 sharp,", "so hurry."]),
    ("clause_url", "clause", "Download it from https://example.com/a,b,c/file.zip, then unpack it.", ["Download it from https://example.com/a,b,c/file.zip,", "then unpack it."]),
    ("none_multi", "none", "Hello there. How are you? Fine, thanks.", ["Hello there. How are you? Fine, thanks."]),
    ("none_cjk", "none", "你好。再见。", ["你好。再见。"]),
]

SEEDS = (0, 1, 2, 3, 4, 5, 6, 7)


def feed(pieces: list[str], granularity: str) -> list[str]:
    segmenter = SentenceSegmenter(granularity=granularity)
    units: list[str] = []
    for piece in pieces:
        units += segmenter.push(piece)
    return units + segmenter.flush()


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 9)
        pieces.append(text[i : i + n])
        i += n
    return pieces


def test_table_is_large_and_names_unique() -> None:
    assert len(CASES) >= 60
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,granularity,text,expected", CASES, ids=[c[0] for c in CASES])
def test_case_one_char_at_a_time(name: str, granularity: str, text: str, expected: list[str]) -> None:
    assert feed(list(text), granularity) == expected


@pytest.mark.parametrize("name,granularity,text,expected", CASES, ids=[c[0] for c in CASES])
def test_case_random_pieces(name: str, granularity: str, text: str, expected: list[str]) -> None:
    for seed in SEEDS:
        assert feed(random_pieces(text, seed), granularity) == expected, f"seed {seed}"


@pytest.mark.parametrize("name,granularity,text,expected", CASES, ids=[c[0] for c in CASES])
def test_case_whole(name: str, granularity: str, text: str, expected: list[str]) -> None:
    assert feed([text], granularity) == expected


def unit_spans(text: str, units: list[str]) -> list[tuple[int, int]]:
    """Where each unit sits in the input; asserts that only whitespace lies between and around them."""
    spans, cursor = [], 0
    for unit in units:
        start = text.find(unit, cursor)
        assert start >= 0 and text[cursor:start].strip() == "", (unit, text[cursor:start])
        spans.append((start, start + len(unit)))
        cursor = start + len(unit)
    assert text[cursor:].strip() == ""
    return spans


@pytest.mark.parametrize("name,granularity,text,expected", CASES, ids=[c[0] for c in CASES])
def test_released_the_moment_it_is_certain(name: str, granularity: str, text: str, expected: list[str]) -> None:
    segmenter = SentenceSegmenter(granularity=granularity)
    released_at: list[int] = []  # index of the input character whose push released each unit
    units: list[str] = []
    for index, char in enumerate(text):
        out = segmenter.push(char)
        units += out
        released_at += [index] * len(out)
    tail = segmenter.flush()
    units += tail
    released_at += [len(text)] * len(tail)
    assert units == expected
    spans = unit_spans(text, units)
    for k, (start, end) in enumerate(spans):
        if granularity != "none" and text[end - 1] in CJK_TERMINATORS:
            assert released_at[k] == end - 1, f"{units[k]!r} should leave with its CJK terminator"
        if k + 1 < len(spans):
            next_start = spans[k + 1][0]
            assert released_at[k] <= next_start, f"{units[k]!r} held back past the start of {units[k + 1]!r}"


# The first unit on a backend that synthesizes whole units (Piper, split_granularity "token"): at most four
# words, ending at a clause mark or before a word that starts a phrase when one comes first (issue 31): (text,
# first unit, whether the cut is inside the sentence, where the unit's trailing silence is dropped).
FIRST_UNIT_CASES = [
    ("Hello there, this is a test of the first unit.", "Hello there,", False),
    ("He turned sharply, and faced Gregson across the table.", "He turned sharply,", False),
    ("Please call Stella and ask her to bring these things.", "Please call Stella", True),
    ("I was so glad because you came.", "I was so glad", True),
    ("We went home because it rained.", "We went home", True),
    ("Gregson shoved back his chair and rose to his feet.", "Gregson shoved back his", True),
    ("Will we ever forget it.", "Will we ever forget", True),
    # A clause mark after one word, or a phrase word after one, is too soon.
    ("Sure, I can help with that.", "Sure, I can help", True),
    ("Cats and dogs play together in the yard.", "Cats and dogs play", True),
    ("Stop.", "Stop.", False),
]


@pytest.mark.parametrize("text,first,in_sentence", FIRST_UNIT_CASES)
def test_the_first_unit_ends_where_a_speaker_may_pause(text: str, first: str, in_sentence: bool) -> None:
    for pieces in (list(text), random_pieces(text, 3), [text]):
        segmenter = SentenceSegmenter("sentence", first_unit_words=FIRST_UNIT_WORDS)
        units: list[str] = []
        for piece in pieces:
            units += segmenter.push(piece)
        units += segmenter.flush()
        assert units[0] == first and " ".join(units) == text
        assert segmenter.first_unit_in_sentence is in_sentence
