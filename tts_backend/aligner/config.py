"""Configuration of a Qwen3-ForcedAligner checkpoint, read from its config.json.

The released folder keeps the Qwen3-ASR layout: a top-level `qwen3_asr` config holding the timestamp token and
the milliseconds per timestamp class, and `thinker_config` holding the audio encoder, the text decoder, the
audio placeholder ids and `classify_num` (the width of the timestamp head). Every dimension comes from the file;
a missing key is an error, never a default that could stand in for the released value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tts_backend.qwen3.config import ConfigError, _require, checked_stack_head_dim


@dataclass(frozen=True)
class AudioEncoderConfig:
    """The Whisper-style audio encoder: a 3-layer strided conv front end over chunks of 2 * n_window mel frames,
    then a bidirectional transformer attending within windows of n_window_infer mel frames."""

    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    downsample_hidden_size: int
    output_dim: int
    n_window: int
    n_window_infer: int
    max_source_positions: int

    @classmethod
    def from_dict(cls, d: dict) -> "AudioEncoderConfig":
        where = "thinker_config.audio_config"
        kw = {name: int(_require(d, name, where)) for name in cls.__dataclass_fields__}
        if d.get("activation_function", "gelu") != "gelu":
            raise ConfigError(f"{where}: activation_function {d['activation_function']!r} is not supported (gelu)")
        if d.get("scale_embedding"):
            raise ConfigError(f"{where}: scale_embedding=true is not a released configuration")
        if kw["d_model"] % kw["encoder_attention_heads"]:
            raise ConfigError(f"{where}: d_model must be a multiple of encoder_attention_heads")
        if kw["n_window_infer"] % (2 * kw["n_window"]):
            raise ConfigError(f"{where}: n_window_infer must be a multiple of 2 * n_window")
        return cls(**kw)

    @property
    def chunk_frames(self) -> int:
        """Mel frames per conv chunk (100 = 1 s in the release)."""
        return 2 * self.n_window

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads


@dataclass(frozen=True)
class TextDecoderConfig:
    """The Qwen3 decoder (QK-norm, GQA, SwiGLU, RoPE). Its multimodal RoPE gets the same position on all three
    axes for this model (text and audio placeholders alike), which is plain 1-D RoPE."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def from_dict(cls, d: dict) -> "TextDecoderConfig":
        where = "thinker_config.text_config"
        kw = {name: _require(d, name, where) for name in cls.__dataclass_fields__ if name != "head_dim"}
        kw["head_dim"] = checked_stack_head_dim(d, where)
        scaling = d.get("rope_scaling") or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ConfigError(f"{where}: rope_scaling type {scaling!r} is not supported (default RoPE only)")
        if d.get("tie_word_embeddings"):
            raise ConfigError(f"{where}: tie_word_embeddings=true is not a released configuration")
        return cls(**kw)


@dataclass(frozen=True)
class AlignerConfig:
    audio: AudioEncoderConfig
    text: TextDecoderConfig
    audio_token_id: int  # <|audio_pad|>: one per audio-encoder output, replaced by that output's embedding
    audio_start_token_id: int  # <|audio_start|>
    audio_end_token_id: int  # <|audio_end|>
    timestamp_token_id: int  # <timestamp>: two after each word (start, end); the head is read there
    classify_num: int  # timestamp classes: class k means k * timestamp_segment_time ms
    timestamp_segment_time: float  # milliseconds per class (80 in the release)

    @classmethod
    def from_dict(cls, d: dict) -> "AlignerConfig":
        thinker = _require(d, "thinker_config", "config.json")
        where = "config.json thinker_config"
        if "forced_aligner" not in str(thinker.get("model_type", "")):
            raise ConfigError(f"{where}: model_type {thinker.get('model_type')!r} is not a forced aligner "
                              "(a Qwen3-ASR checkpoint has no timestamp head)")
        return cls(
            audio=AudioEncoderConfig.from_dict(_require(thinker, "audio_config", where)),
            text=TextDecoderConfig.from_dict(_require(thinker, "text_config", where)),
            audio_token_id=int(_require(thinker, "audio_token_id", where)),
            audio_start_token_id=int(_require(thinker, "audio_start_token_id", where)),
            audio_end_token_id=int(_require(thinker, "audio_end_token_id", where)),
            timestamp_token_id=int(_require(d, "timestamp_token_id", "config.json")),
            classify_num=int(_require(thinker, "classify_num", where)),
            timestamp_segment_time=float(_require(d, "timestamp_segment_time", "config.json")),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "AlignerConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"missing file {path}")
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
