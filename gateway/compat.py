"""Requests written for other servers (vLLM-Omni, OpenAI, Baseten) as this gateway serves them: the voice a
requested name gets, and the options the backend cannot honour, reported as warnings instead of refused.

A requested voice name resolves, for the WebSocket and HTTP alike, to:
1. the backend's voice of that name (case-insensitive, or a name the backend accepts, e.g. Piper's "joe");
2. else an alias: `voice_aliases` (--voice-alias NAME=VOICE) first, then the built-in names that clients of
   other servers send by default, OpenAI's voices ("alloy", ...) and Qwen3-TTS's CustomVoice speakers
   ("Vivian", ...), which speak with the default voice unless an alias maps them elsewhere;
3. else the default voice with a `voice_fallback` warning, or, with `voice_fallback` off (strict), the
   error `unknown_voice`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tts_backend.base import Synthesizer

from .protocol import ConfigWarning, ErrorCode, ProtocolError
from .settings import GatewaySettings

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                 "marin", "cedar")
QWEN3_SPEAKERS = ("Vivian", "Serena", "Uncle_Fu", "Dylan", "Eric", "Ryan", "Aiden", "Ono_Anna", "Sohee")
BUILTIN_ALIASES = frozenset(name.lower() for name in (*OPENAI_VOICES, *QWEN3_SPEAKERS))
TASK_TYPES = ("CustomVoice", "VoiceDesign", "Base")


@dataclass(frozen=True)
class VoiceChoice:
    voice: str  # the backend's id
    warnings: list[ConfigWarning] = field(default_factory=list)


def backend_voice(backend: Synthesizer, name: str) -> str | None:
    """The id of the backend's preset voice of that name (case-insensitive, or a name the backend accepts
    for it, as Piper's "joe"), if it has one."""
    return backend.voice_id(name)


def _unknown(backend: Synthesizer, message: str) -> ProtocolError:
    names = ", ".join(v.id for v in backend.voices())
    return ProtocolError(ErrorCode.unknown_voice, f"{message}; available: {names}")


def resolve_voice(backend: Synthesizer, settings: GatewaySettings, requested: str | None) -> VoiceChoice:
    """The voice for a requested name (None: the default voice). Raises ProtocolError(unknown_voice) for an
    unknown name in strict mode, or when the default voice or an alias's target is not the backend's."""
    default = settings.voice or backend.default_voice
    if not requested:
        voice = backend_voice(backend, default)
        if voice is None:
            raise _unknown(backend, f"the default voice {default!r} is not one of the backend's")
        return VoiceChoice(voice)
    voice = backend_voice(backend, requested)
    if voice is not None:
        return VoiceChoice(voice)
    aliases = {name.lower(): target for name, target in settings.voice_aliases.items()}
    target = aliases.get(requested.lower())
    if target is not None:
        voice = backend_voice(backend, target)
        if voice is None:
            raise _unknown(backend, f"voice {requested!r} is an alias of {target!r}, which this backend does not have")
        return VoiceChoice(voice)
    if requested.lower() in BUILTIN_ALIASES:
        return resolve_voice(backend, settings, None)
    if not settings.voice_fallback:
        raise _unknown(backend, f"unknown voice {requested!r}")
    voice = resolve_voice(backend, settings, None).voice
    warning = ConfigWarning(
        code="voice_fallback", field="voice",
        message=f"voice {requested!r} is not available here; speaking with the default voice {voice!r}"
        " (see voices for the ones there are)",
    )
    return VoiceChoice(voice, [warning])


def option_warnings(backend: Synthesizer, options: dict[str, Any]) -> list[ConfigWarning]:
    """What of a request's options (session.config or POST /v1/audio/speech fields; None = not given) the
    backend cannot honour. The request still goes ahead, without them."""
    honours = backend.honours
    warnings: list[ConfigWarning] = []

    def ignored(name: str, why: str, code: str = "option_ignored") -> None:
        warnings.append(ConfigWarning(code=code, field=name, message=f"{name}: {why}"))

    task_type = options.get("task_type")
    cloning = [name for name in ("ref_audio", "ref_text", "x_vector_only_mode") if options.get(name) is not None]
    if (task_type == "Base" or cloning) and "voice_cloning" not in honours:
        fields = (["task_type"] if task_type == "Base" else []) + cloning
        ignored(", ".join(fields), f"the {backend.name} backend cannot clone a voice from reference audio; the"
                " configured voice speaks instead", code="voice_cloning_unsupported")
    elif task_type == "VoiceDesign" and "voice_design" not in honours:
        ignored("task_type", f"the {backend.name} backend speaks preset voices; it cannot design one from the"
                " instructions")
    elif task_type is not None and task_type not in TASK_TYPES:
        ignored("task_type", f"unknown task type {task_type!r} (known: {', '.join(TASK_TYPES)}); it has no effect")
    language = options.get("language")
    if language and language.lower() != "auto" and "language" not in honours:
        ignored("language", f"the {backend.name} backend speaks each voice's own language; {language!r} has no"
                " effect")
    for name, option in (("instructions", "instructions"), ("max_new_tokens", "max_new_tokens"),
                         ("initial_codec_chunk_frames", "chunk_schedule"), ("chunk_schedule", "chunk_schedule")):
        if options.get(name) is not None and option not in honours:
            ignored(name, f"the {backend.name} backend does not use it")
    non_streaming = options.get("non_streaming_mode")
    text_streaming = options.get("split_granularity") == "token" and "text_streaming" in honours
    if options.get("split_granularity") == "token":
        if "text_streaming" not in honours:
            ignored("split_granularity", f"the {backend.name} backend cannot take a sentence's text while it"
                    " speaks; each sentence is synthesized once it has ended (sentence granularity), an"
                    " utterance's first one cut short after its first words or clause")
        elif non_streaming:
            ignored("split_granularity", "non_streaming_mode true puts a sentence's whole text in the prompt, so"
                    " each sentence is synthesized once it has ended (sentence granularity)")
    # A text stream is always in streaming-text mode: non_streaming_mode false asks for what it does anyway.
    if non_streaming is not None and "text_mode" not in honours and not (text_streaming and not non_streaming):
        ignored("non_streaming_mode", f"the {backend.name} backend reads text one way only; non_streaming_mode"
                " has no effect")
    if options.get("speed", 1.0) not in (None, 1.0) and "speed" not in honours:
        ignored("speed", f"the {backend.name} backend speaks at its own pace")
    timestamp_type = options.get("timestamp_type")
    if options.get("word_timestamps") or timestamp_type:
        name = "timestamp_type" if timestamp_type else "word_timestamps"
        if "word_timestamps" not in honours:
            ignored(name, f"the {backend.name} backend gives no timestamps; audio.done carries none",
                    code="timestamps_unsupported")
        elif timestamp_type == "char":
            ignored(name, f"the {backend.name} backend times words, not characters; word timestamps are sent"
                    " instead", code="timestamps_unsupported")
        elif timestamp_type not in (None, "word"):
            ignored(name, f"unknown timestamp type {timestamp_type!r} (known: word, char); word timestamps are"
                    " sent instead")
    return warnings


def timestamp_transport(backend: Synthesizer, options: dict[str, Any]) -> str | None:
    """How a request's word timestamps travel: None (not asked for, or the backend gives none), "sync" (with
    the sentence's audio.done; the default, as Baseten's servers) or "async" (as soon as the audio is out)."""
    if not (options.get("word_timestamps") or options.get("timestamp_type")) or "word_timestamps" not in backend.honours:
        return None
    return options.get("timestamp_transport_strategy") or "sync"
