"""The tokens of a text still being written (issue 21): TextTokenizer.settled_text_ids gives only tokens
that no continuation can change, so tokens fed to the model early are the whole text's tokens.

Checked on the real Qwen2 byte-level BPE (the tiny checkpoint ships it), with texts built to hit where BPE
or its pre-tokenizer could merge across a cut: punctuation then a newline ("Hello.\\n"), contractions
("it'" + "s"), runs of spaces, digits, accents written as a combining mark (NFC), and special tokens
written half in one piece ("<|im_" + "end|>").
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.qwen3_fixtures import tiny_custom_voice  # noqa: F401 - session fixture
from tts_backend.qwen3.tokenizer import TextTokenizer

PARTS = ["Hello", " world", ",", ".", "\n", "\n\n", " ", "   ", "it", "'", "s", "'ll", " $3.50", "42", " -",
         "...", " e", "\u0301", "é", " naïve", "<|im_", "end|>", "<|im_end|>", " <", "日本語", "！", "\t", " don't"]


@pytest.fixture(scope="module")
def tokenizer(tiny_custom_voice):
    return TextTokenizer.from_folder(tiny_custom_voice)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(PARTS), min_size=1, max_size=14), data=st.data())
def test_settled_tokens_of_any_prefix_begin_the_whole_texts_tokens(tokenizer, parts, data):
    text = "".join(parts)
    whole = tokenizer.text_ids(text)
    cut = data.draw(st.integers(0, len(text)))
    settled = tokenizer.settled_text_ids(text[:cut])
    assert settled == whole[: len(settled)]


def test_everything_but_the_last_word_is_settled(tokenizer):
    text = "Hello there, general Kenobi"
    settled = tokenizer.settled_text_ids(text)
    assert settled == tokenizer.text_ids("Hello there, general")
    assert tokenizer.settled_text_ids("Hello") == []  # one word: it may still grow
    # A word's tail held back by the caller or not, the settled tokens are the same.
    assert tokenizer.settled_text_ids("Hello there, general Ken") == settled


def test_a_special_token_written_in_two_pieces_is_held_back(tokenizer):
    assert tokenizer.settled_text_ids("Say <|im_") == tokenizer.text_ids("Say")
    whole = tokenizer.text_ids("Say <|im_end|> now")
    settled = tokenizer.settled_text_ids("Say <|im_end|> now")
    assert len(settled) > 1 and settled == whole[: len(settled)]


def test_spaces_before_a_half_written_special_token_wait_for_it(tokenizer):
    # Found by the property above: "   <" tokenises as "  " + " <", but once "<|im_end|>" is complete the
    # special token is split out first and the three spaces are one token of their own.
    text = "   <|im_end|>"
    for cut in range(len(text) + 1):
        settled = tokenizer.settled_text_ids(text[:cut])
        assert settled == tokenizer.text_ids(text)[: len(settled)], cut
    assert tokenizer.settled_text_ids("Hi   <") == tokenizer.text_ids("Hi")
