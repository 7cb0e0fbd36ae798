"""`session.config`: every field of protocol.md, as a dataclass whose unset fields are not sent."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SAMPLE_RATES = (8000, 16000, 22050, 24000, 44100, 48000)


@dataclass
class SessionConfig:
    """Fields left as None are omitted, so the gateway applies its own defaults.

    `stream_audio` defaults to True here (the gateway's default is False, for vLLM-Omni compatibility):
    a client library exists to stream. With `stream_audio=False` each sentence arrives as one whole
    encoded file (`response_format` `wav` by default).
    """

    voice: str | None = None
    response_format: str | None = None  # pcm (s16le mono), mulaw, alaw; wav/... when stream_audio is False
    sample_rate: int | None = None  # 8000, 16000, 22050, 24000, 44100 or 48000; the gateway resamples
    stream_audio: bool = True
    model: str | None = None
    language: str | None = None
    instructions: str | None = None
    task_type: str | None = None
    speed: float | None = None
    max_new_tokens: int | None = None
    initial_codec_chunk_frames: int | None = None
    seed: int | None = None
    # token (the default here): each sentence's synthesis starts at its first words, where the gateway's
    # backend can take text while it speaks; elsewhere the gateway splits at sentences and says so in
    # session.started's warnings (`Session.text_streaming`). Or sentence, clause, none.
    split_granularity: str | None = "token"
    chunk_schedule: list[int] | None = None  # codec frames per chunk, e.g. [2, 4, 8, 12]
    # Voice cloning inputs (vLLM-Omni compatible), passed through to backends that support them.
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    # Word timestamps: "word" asks for them. They arrive as `AudioWords` events, as soon as each word's
    # audio has been sent ("async") or with the sentence's audio.done ("sync"; left out: the gateway's default).
    timestamp_type: str | None = None
    timestamp_transport_strategy: str | None = None
    # Pronunciation (docs/pronunciation.md): dictionary entries ({"text": ..., "say": ...}, optionally
    # "case_sensitive", "whole_word") and names of dictionaries registered with the key, in one list; and
    # "ssml" to have the text read as the markup subset (<spell>, <say-as>, <sub>, <break>).
    pronunciations: list[dict[str, Any] | str] | None = None
    text_markup: str | None = None
    # Fields a newer gateway knows and this client does not: sent as they are.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sample_rate is not None and self.sample_rate not in SAMPLE_RATES:
            raise ValueError(f"sample_rate must be one of {SAMPLE_RATES}, not {self.sample_rate}")
        if self.timestamp_type not in (None, "word", "char"):
            raise ValueError(f"timestamp_type must be 'word' or 'char', not {self.timestamp_type!r}")
        if self.timestamp_transport_strategy not in (None, "sync", "async"):
            raise ValueError(
                f"timestamp_transport_strategy must be 'sync' or 'async', not {self.timestamp_transport_strategy!r}"
            )
        if self.text_markup not in (None, "ssml"):
            raise ValueError(f"text_markup must be 'ssml', not {self.text_markup!r}")
        if self.chunk_schedule is not None:
            if not self.chunk_schedule or any(int(n) < 1 for n in self.chunk_schedule):
                raise ValueError("chunk_schedule must be a non-empty list of positive frame counts")

    def to_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"type": "session.config"}
        for name, value in asdict(self).items():
            if name != "extra" and value is not None:
                message[name] = value
        message.update(self.extra)
        return message
