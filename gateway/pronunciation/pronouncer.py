"""`Pronouncer`: the pronunciation a session or an HTTP request speaks with (its dictionary rules and
whether its text is markup), the one object the session's pipeline and the speech route use.

Its interface is narrow: `synthesize` stands in for the backend's (the text given is the client's; the
backend gets the rewrite), `written` is the text as the client's words show it (markup removed), and
`warnings` what of the markup was not honoured.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tts_backend.base import AudioChunk, SynthesisRequest, Synthesizer

from ..protocol import ConfigWarning
from ..session.word_times import WordsWait
from .matcher import Matcher
from .rewrite import Expression, Rewriter, rewrite_whole, written_of
from .rules import Rule
from .speech import speak


class Pronouncer:
    def __init__(self, rules: tuple[Rule, ...], markup_on: bool) -> None:
        self.rules = rules
        self.markup_on = markup_on
        self.matcher = Matcher(rules)

    def synthesize(self, backend: Synthesizer, request: SynthesisRequest,
                   words_wait: WordsWait | None = None) -> AsyncIterator[AudioChunk]:
        """`backend.synthesize(request)` with the request's text (or text stream) rewritten; word timings
        refer to the written words. `words_wait` bounds each backend request's wait for word timings that
        come after its audio."""
        return speak(backend, request, Rewriter(self.matcher, self.markup_on), words_wait)

    def written(self, text: str) -> str:
        """The client's words of `text`: as written, markup removed."""
        if not self.markup_on:
            return text
        return written_of(rewrite_whole(self.matcher, True, text)[0])

    def warnings(self, text: str, backend: Synthesizer) -> list[ConfigWarning]:
        """What of `text`'s markup is not honoured (read as text, or dropped)."""
        if not self.markup_on:
            return []
        pieces, messages = rewrite_whole(self.matcher, True, text)
        warnings = [ConfigWarning(code="markup_ignored", message=m, field="text_markup") for m in messages]
        if "instructions" not in backend.honours and any(isinstance(p, Expression) for p in pieces):
            warnings.append(ConfigWarning(
                code="expression_ignored", field="text_markup",
                message=f"the {backend.name} backend does not take instructions; expressions are dropped"))
        return warnings

    def entries(self) -> list[dict[str, Any]]:
        """The rules as a config records them (a resume applies the same ones)."""
        return [rule.to_json() for rule in self.rules]
