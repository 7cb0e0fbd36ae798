"""Which language a text is in, cheaply and deterministically, and the voice that speaks it.

A Piper voice speaks one language: given text of another it reads it with its own rules (the English voice
spells Chinese out as "Chinese letter", "Chinese letter", ...). Clients of vLLM-Omni send `language: "Auto"`
by default, so the gateway looks at the text itself:

- `detect` names a sentence's language only when it is confident: by script (Han, kana, Hangul, Cyrillic,
  Greek, Arabic, Hebrew, Devanagari, Thai: a script is as good as a language for "this voice cannot read
  it"), and for Latin-script text by its function words and letters (German's ä ö ü ß, Spanish's ñ ¿ ¡, ...)
  among English, German, French, Spanish, Italian, Portuguese and Dutch. Short or mixed Latin text gives
  None: no claim, no warning. A table lookup per character, no model, no dependency.
- `voice_for_sentence` picks, for a backend whose voices each speak one language (it does not honour
  "language"), the voice of a sentence: when the client named no voice and asked for Auto, a voice of the
  text's language if the backend has one (several Piper voices loaded from a folder), and for a sentence
  whose language is not clear ("Yes.", "OK, thanks!") the voice of the sentence before it; otherwise the
  session's voice, with the warning `language_unsupported` when the text is not in that voice's language.

The choice depends only on the text, the sentence before it, the request and the backend's voices. A
sentence made again after a resume gets the same voice, except an unclear one whose previous sentence had
already been sent: it gets the session's voice.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass

from tts_backend.base import Synthesizer

from .protocol import ConfigWarning

# Scripts that name a language (or a family whose voices read them alike): the first code point range a
# letter falls in decides. Kana before Han: Japanese mixes both, Chinese has no kana.
_SCRIPT_RANGES: tuple[tuple[int, int, str], ...] = (
    (0x3040, 0x30FF, "ja"), (0x31F0, 0x31FF, "ja"), (0xFF66, 0xFF9F, "ja"),  # hiragana, katakana
    (0xAC00, 0xD7AF, "ko"), (0x1100, 0x11FF, "ko"), (0x3130, 0x318F, "ko"),  # Hangul
    (0x4E00, 0x9FFF, "zh"), (0x3400, 0x4DBF, "zh"), (0xF900, 0xFAFF, "zh"), (0x20000, 0x2FA1F, "zh"),  # Han
    (0x0400, 0x052F, "ru"),  # Cyrillic (Ukrainian is told apart below)
    (0x0370, 0x03FF, "el"), (0x1F00, 0x1FFF, "el"),  # Greek
    (0x0600, 0x06FF, "ar"), (0x0750, 0x077F, "ar"), (0xFB50, 0xFDFF, "ar"), (0xFE70, 0xFEFF, "ar"),  # Arabic
    (0x0590, 0x05FF, "he"),  # Hebrew
    (0x0900, 0x097F, "hi"),  # Devanagari
    (0x0E00, 0x0E7F, "th"),  # Thai
)
_UKRAINIAN_LETTERS = frozenset("іїєґІЇЄҐ")
LANGUAGE_NAMES = {
    "en": "English", "de": "German", "fr": "French", "es": "Spanish", "it": "Italian", "pt": "Portuguese",
    "nl": "Dutch", "zh": "Chinese", "ja": "Japanese", "ko": "Korean", "ru": "Russian", "uk": "Ukrainian",
    "el": "Greek", "ar": "Arabic", "he": "Hebrew", "hi": "Hindi", "th": "Thai",
}
# Function words: frequent in any sentence of their language, rare as words of the others.
_FUNCTION_WORDS: dict[str, frozenset[str]] = {
    "en": frozenset("the and is are was were of to in that it with for you this not have be on at by from "
                    "what which there their they we he she his her would could should will can do does".split()),
    "de": frozenset("der die das und ist nicht ein eine einen dem den des ich du sie wir ihr mit auf für "
                    "von zu sich auch es war sind wird werden noch nur aber wie kann hat haben heute".split()),
    "fr": frozenset("le la les et est un une des du de pas que qui dans pour sur avec ce cette il elle nous "
                    "vous ils sont était je ne au aux mais ou où très".split()),
    "es": frozenset("el la los las y es un una unos de del que en por para con no se su sus está son "
                    "pero como muy yo tú él ella nosotros hoy también hola gracias gustaría quiero usted "
                    "tengo hay aquí".split()),
    "it": frozenset("il lo la gli le e è un una di del della che in per con non si sono ma come molto io "
                    "tu lui lei noi oggi anche questo questa".split()),
    "pt": frozenset("o a os as e é um uma de do da dos das que em por para com não se são mas como muito "
                    "eu tu ele ela nós hoje também isso está".split()),
    "nl": frozenset("de het een en is niet van dat die in op te met voor zijn was ik je jij hij zij we "
                    "wij ze maar ook nog al naar heeft hebben vandaag".split()),
}
# Words that are also everyday English ("a", "as", "no", "come", "in", ...) point nowhere: they are dropped
# from the other languages' lists, so English text does not score for them.
_ALSO_ENGLISH = frozenset("a as no come in is was we die do me an son men pan con on at be to are hat den "
                          "also so her his war will per via ma".split())
_FUNCTION_WORDS = {language: words if language == "en" else words - _ALSO_ENGLISH - _FUNCTION_WORDS["en"]
                   for language, words in _FUNCTION_WORDS.items()}
# Letters that only some of those languages write: each one met counts as a function word for them.
_LETTERS: dict[str, str] = {
    "ß": "de", "ä": "de", "ö": "de", "ü": "de",
    "ñ": "es", "¿": "es", "¡": "es",
    "ã": "pt", "õ": "pt",
    "œ": "fr", "ç": "fr pt", "è": "fr it", "ê": "fr pt", "ë": "fr nl", "î": "fr", "ï": "fr nl", "û": "fr",
    "à": "fr it pt", "ù": "fr it", "ò": "it", "ì": "it",
}
_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)*")
# How sure a Latin-script guess must be: this many points, and twice the runner-up's.
_MIN_POINTS = 2


def _script(char: str) -> str | None:
    code = ord(char)
    for low, high, language in _SCRIPT_RANGES:
        if low <= code <= high:
            return language
    return None


def detect(text: str) -> str | None:
    """The language (ISO 639-1) `text` is written in, or None when that is not clear."""
    scripts: dict[str, int] = {}
    latin = 0
    for char in text:
        if not char.isalpha():
            continue
        script = _script(char)
        if script is not None:
            scripts[script] = scripts.get(script, 0) + 1
        elif unicodedata.name(char, "").startswith("LATIN"):
            latin += 1
    if scripts:
        script, count = max(scripts.items(), key=lambda item: (item[1], item[0]))
        if "ja" in scripts and script == "zh":  # kanji with kana is Japanese
            script, count = "ja", count + scripts["ja"]
        if count >= latin:
            if script == "ru" and any(char in _UKRAINIAN_LETTERS for char in text):
                return "uk"
            return script
    return _latin_language(text) if latin else None


def _latin_language(text: str) -> str | None:
    """The language the text's cues (function words, letters) point to: at least _MIN_POINTS of them, and
    against each other language twice as many cues that point to it and not the other as the reverse. Cues
    two languages share ("para", "por": Spanish and Portuguese) say nothing between those two."""
    lowered = text.lower()
    cues = [frozenset(language for language, words in _FUNCTION_WORDS.items() if word in words)
            for word in _WORD.findall(lowered)]
    cues += [frozenset(_LETTERS[char].split()) for char in lowered if char in _LETTERS]
    cues = [cue for cue in cues if cue]
    points = {language: sum(language in cue for cue in cues) for language in _FUNCTION_WORDS}
    best = min(points, key=lambda language: (-points[language], language))
    if points[best] < _MIN_POINTS:
        return None
    for other in points:
        if other == best:
            continue
        only_best = sum(best in cue and other not in cue for cue in cues)
        only_other = sum(other in cue and best not in cue for cue in cues)
        if only_best == 0 or only_best < 2 * only_other:
            return None
    return best


def voice_language(language: str) -> str:
    """A voice's language tag ("en_US", "en-us", "de", espeak's "cmn") as the ISO 639-1 code detect uses."""
    primary = re.split(r"[-_]", language.strip().lower(), maxsplit=1)[0]
    return {"cmn": "zh", "yue": "zh", "zho": "zh", "jpn": "ja", "kor": "ko", "eng": "en", "deu": "de"}.get(
        primary, primary)


def language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code, code)


@dataclass(frozen=True)
class SentenceVoice:
    voice: str  # the backend's voice id that speaks the sentence
    warning: ConfigWarning | None = None


def unsupported(text_language: str, voice: str, voice_lang: str, *, could_pick: bool) -> ConfigWarning:
    advice = ("load a Piper voice of that language beside it (--model DIR) and ask for no voice, or name one"
              if could_pick else "name a voice of that language")
    return ConfigWarning(
        code="language_unsupported", field="language",
        message=f"the text looks {language_name(text_language)} ({text_language}); voice {voice!r} speaks"
        f" {language_name(voice_lang)} ({voice_lang}) and reads it by its own rules: {advice}",
    )


def voice_for_sentence(backend: Synthesizer, voice: str, text: str, *, auto: bool,
                       previous: str | None = None) -> SentenceVoice:
    """The voice of a sentence (see the module doc): `voice` is the request's resolved voice, `auto` whether
    the client left both the voice and the language to the server (no voice named, language Auto, no clone),
    `previous` the voice of the sentence before it, if known."""
    if "language" in backend.honours:  # the backend speaks the request's language with any voice
        return SentenceVoice(voice)
    text_language = detect(text)
    if text_language is None:  # too short or mixed to tell: a conversation goes on in its language
        return SentenceVoice(previous if auto and previous is not None else voice)
    voices = backend.voices()
    own = next((voice_language(v.language) for v in voices if v.id == voice), None)
    if own is None or own == text_language:
        return SentenceVoice(voice)
    if auto:
        for candidate in voices:
            if voice_language(candidate.language) == text_language:
                return SentenceVoice(candidate.id)
    return SentenceVoice(voice, unsupported(text_language, voice, own, could_pick=auto))


def voices_for_sentences(backend: Synthesizer, voice: str, texts: list[str], *, auto: bool) -> Iterator[SentenceVoice]:
    """`voice_for_sentence` of each of a request's sentences, in order, one at a time: a caller on an event
    loop takes them in slices (telling a language looks at every character)."""
    previous = None
    for text in texts:
        chosen = voice_for_sentence(backend, voice, text, auto=auto, previous=previous)
        previous = chosen.voice
        yield chosen
