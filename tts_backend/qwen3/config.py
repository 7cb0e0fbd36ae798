"""Configuration of a Qwen3-TTS 12 Hz checkpoint, read from its own files.

Every dimension comes from `config.json`; the Python defaults of the reference configuration classes are not the
released values (spec §2.1, §10.1), so nothing here has a default that could silently stand in for a missing key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A checkpoint's configuration file is missing a key or holds an inconsistent value."""


def _require(d: dict, key: str, where: str) -> Any:
    if d.get(key) is None:  # the reference's config classes write an unset attribute as null
        raise ConfigError(f"{where}: missing key {key!r}")
    return d[key]


def _from_file(cls, path: str | Path):
    """cls.from_dict of a JSON file, with the file's path in any error about its fields, so that a start-up
    failure names the file and the field (not "float() argument must be ... not 'NoneType'")."""
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    try:
        return cls.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{path}: a field has a value of the wrong type ({exc})") from None


def _int_or(d: dict, key: str, default: int) -> int:
    """d[key] as an int, the default where it is absent or null; a ConfigError naming the key otherwise."""
    value = d.get(key)
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config.json: {key} = {value!r} is not an integer") from None


def checked_stack_head_dim(d: dict, where: str) -> int:
    """A Qwen3 decoder stack's head_dim, once its config passes the checks every released stack passes (GQA
    grouping, no attention bias, SiLU)."""
    heads = _require(d, "num_attention_heads", where)
    if heads % _require(d, "num_key_value_heads", where):
        raise ConfigError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
    if d.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true is not a released configuration")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported (silu only)")
    # head_dim is explicit in the released configs (128 for every size, not hidden/heads for 0.6B).
    return int(d["head_dim"]) if d.get("head_dim") else _require(d, "hidden_size", where) // heads


@dataclass(frozen=True)
class DecoderStackConfig:
    """A Qwen3-style pre-norm decoder stack (QK-norm, GQA, SwiGLU, RoPE): the talker and the code predictor."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    num_code_groups: int

    @classmethod
    def _stack_kwargs(cls, d: dict, where: str) -> dict:
        kw = {f.name: _require(d, f.name, where) for f in fields(DecoderStackConfig) if f.name != "head_dim"}
        kw["head_dim"] = checked_stack_head_dim(d, where)
        return kw


@dataclass(frozen=True)
class CodePredictorConfig(DecoderStackConfig):
    @classmethod
    def from_dict(cls, d: dict) -> "CodePredictorConfig":
        return cls(**cls._stack_kwargs(d, "talker_config.code_predictor_config"))


@dataclass(frozen=True)
class TalkerConfig(DecoderStackConfig):
    text_vocab_size: int = 0
    text_hidden_size: int = 0
    codec_pad_id: int = 0
    codec_bos_id: int = 0
    codec_eos_token_id: int = 0
    codec_think_id: int = 0
    codec_nothink_id: int = 0
    codec_think_bos_id: int = 0
    codec_think_eos_id: int = 0
    codec_language_id: dict[str, int] = field(default_factory=dict)
    spk_id: dict[str, int] = field(default_factory=dict)
    spk_is_dialect: dict[str, str | bool] = field(default_factory=dict)
    code_predictor: CodePredictorConfig | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "TalkerConfig":
        where = "talker_config"
        kw = cls._stack_kwargs(d, where)
        for name in (
            "text_vocab_size", "text_hidden_size", "codec_pad_id", "codec_bos_id", "codec_eos_token_id",
            "codec_think_id", "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id",
        ):
            kw[name] = int(_require(d, name, where))
        kw["codec_language_id"] = {k.lower(): int(v) for k, v in _require(d, "codec_language_id", where).items()}
        kw["spk_id"] = {k.lower(): int(v) for k, v in (d.get("spk_id") or {}).items()}
        kw["spk_is_dialect"] = {k.lower(): v for k, v in (d.get("spk_is_dialect") or {}).items()}
        kw["code_predictor"] = CodePredictorConfig.from_dict(_require(d, "code_predictor_config", where))
        rope_scaling = d.get("rope_scaling")
        if rope_scaling and "mrope_section" in rope_scaling:
            # The three M-RoPE position streams are identical in TTS, so M-RoPE is plain 1-D RoPE (spec §2.3);
            # still refuse a config whose sections could not have been valid for the reference.
            if sum(rope_scaling["mrope_section"]) != kw["head_dim"] // 2:
                raise ConfigError(f"{where}: rope_scaling.mrope_section must sum to head_dim/2")
        cfg = cls(**kw)
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        cp = self.code_predictor
        assert cp is not None
        if cp.num_code_groups != self.num_code_groups:
            raise ConfigError("talker and code predictor disagree on num_code_groups")
        # Generation suppresses ids [vocab-1024, vocab) except EOS, so the talker vocabulary must be exactly the
        # codebook plus 1024 special slots, and every special id must sit in that top range (spec §9.3).
        if self.vocab_size != cp.vocab_size + 1024:
            raise ConfigError(
                f"talker vocab_size {self.vocab_size} must equal code predictor vocab_size {cp.vocab_size} + 1024"
            )
        special = {
            "codec_pad_id": self.codec_pad_id, "codec_bos_id": self.codec_bos_id,
            "codec_eos_token_id": self.codec_eos_token_id, "codec_think_id": self.codec_think_id,
            "codec_nothink_id": self.codec_nothink_id, "codec_think_bos_id": self.codec_think_bos_id,
            "codec_think_eos_id": self.codec_think_eos_id,
            **{f"codec_language_id[{k}]": v for k, v in self.codec_language_id.items()},
            **{f"spk_id[{k}]": v for k, v in self.spk_id.items()},
        }
        for name, value in special.items():
            if not cp.vocab_size <= value < self.vocab_size:
                raise ConfigError(f"talker_config.{name}={value} is outside the special range "
                                  f"[{cp.vocab_size}, {self.vocab_size})")
        for speaker, dialect in self.spk_is_dialect.items():
            if dialect is not False and dialect not in self.codec_language_id:
                raise ConfigError(f"speaker {speaker!r} names unknown dialect {dialect!r}")

    @property
    def codebook_size(self) -> int:
        return self.code_predictor.vocab_size  # type: ignore[union-attr]


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """`speaker_encoder_config` of a Base `config.json`. The released files give only `enc_dim` (the talker width)
    and `sample_rate`; the other fields are the architecture's fixed values, which the reference's configuration
    class supplies as defaults, so a config.json may override them but need not."""

    enc_dim: int
    mel_dim: int = 128
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    @classmethod
    def from_dict(cls, d: dict) -> "SpeakerEncoderConfig":
        where = "speaker_encoder_config"
        kw = {"enc_dim": int(_require(d, "enc_dim", where))}
        # null, as the reference's config classes write an unset field, takes the class default as absence does
        for name in ("mel_dim", "enc_attention_channels", "enc_res2net_scale", "enc_se_channels", "sample_rate"):
            if d.get(name) is not None:
                kw[name] = int(d[name])
        for name in ("enc_channels", "enc_kernel_sizes", "enc_dilations"):
            if d.get(name) is not None:
                kw[name] = tuple(int(v) for v in d[name])
        cfg = cls(**kw)
        if not len(cfg.enc_channels) == len(cfg.enc_kernel_sizes) == len(cfg.enc_dilations) >= 3:
            raise ConfigError(f"{where}: enc_channels, enc_kernel_sizes and enc_dilations need one entry per layer")
        if cfg.mel_dim != 128 or cfg.sample_rate != 24000:
            raise ConfigError(f"{where}: the x-vector is computed on a 128-band log-mel at 24000 Hz; "
                              f"got mel_dim {cfg.mel_dim}, sample_rate {cfg.sample_rate}")
        if any(c % cfg.enc_res2net_scale for c in cfg.enc_channels[1:-1]):
            raise ConfigError(f"{where}: SE-Res2Net channels must be multiples of enc_res2net_scale")
        return cfg


@dataclass(frozen=True)
class Qwen3TTSConfig:
    """`config.json` of a Qwen3-TTS model folder."""

    talker: TalkerConfig
    tokenizer_type: str
    tts_model_size: str
    tts_model_type: str
    im_start_token_id: int
    im_end_token_id: int
    tts_pad_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int
    assistant_token_id: int
    speaker_encoder: SpeakerEncoderConfig | None = None  # Base checkpoints only

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen3TTSConfig":
        cfg = cls(
            talker=TalkerConfig.from_dict(_require(d, "talker_config", "config.json")),
            tokenizer_type=str(d.get("tokenizer_type") or ""),
            tts_model_size=str(d.get("tts_model_size") or ""),
            tts_model_type=str(d.get("tts_model_type") or ""),
            im_start_token_id=_int_or(d, "im_start_token_id", 151644),
            im_end_token_id=_int_or(d, "im_end_token_id", 151645),
            tts_pad_token_id=_int_or(d, "tts_pad_token_id", 151671),
            tts_bos_token_id=_int_or(d, "tts_bos_token_id", 151672),
            tts_eos_token_id=_int_or(d, "tts_eos_token_id", 151673),
            assistant_token_id=_int_or(d, "assistant_token_id", 77091),
            speaker_encoder=(SpeakerEncoderConfig.from_dict(_require(d, "speaker_encoder_config", "config.json"))
                             if d.get("tts_model_type") == "base" else None),
        )
        if cfg.tokenizer_type != "qwen3_tts_tokenizer_12hz":
            raise ConfigError(f"config.json: tokenizer_type {cfg.tokenizer_type!r} is not the 12 Hz family")
        if cfg.tts_model_type not in ("custom_voice", "voice_design", "base"):
            raise ConfigError(f"config.json: unknown tts_model_type {cfg.tts_model_type!r}")
        if cfg.speaker_encoder is not None and cfg.speaker_encoder.enc_dim != cfg.talker.hidden_size:
            raise ConfigError(f"config.json: speaker_encoder_config.enc_dim {cfg.speaker_encoder.enc_dim} must equal "
                              f"the talker hidden_size {cfg.talker.hidden_size} (the x-vector is a codec-track row)")
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "Qwen3TTSConfig":
        return _from_file(cls, path)

    @property
    def supports_instruct(self) -> bool:
        # The reference wrapper drops instruct for "0b6" models (a substring test, spec §5.3).
        return self.tts_model_size not in "0b6"

    @property
    def supported_languages(self) -> list[str]:
        return ["auto"] + [k for k in self.talker.codec_language_id if "dialect" not in k]

    @property
    def supported_speakers(self) -> list[str]:
        return list(self.talker.spk_id)


@dataclass(frozen=True)
class GenerationConfig:
    """`generation_config.json`; missing keys take the reference wrapper's fallbacks (spec §5.8)."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    max_new_tokens: int = 2048

    @classmethod
    def from_dict(cls, d: dict) -> "GenerationConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, path: str | Path) -> "GenerationConfig":
        return _from_file(cls, path)
