"""Prompt construction for CustomVoice and VoiceDesign: which id sits on each track of each prefill position.

Every prefill position is T(text id) (+ C(codec id) where the codec track has one); T = text_projection of the
text embedding, C = the talker's codec embedding (spec §5.4). Layout, in order:
  [instruct ids]                    text only (`<|im_start|>user\\n{instruct}<|im_end|>\\n`, all ids)
  im_start, assistant, \\n           text only
  K[0..L_K-2] under tts_pad..., tts_bos   K = tag prefix + [speaker] + [codec_pad, codec_bos]; K without its last id
  non-streaming: t_1..t_n, tts_eos over codec_pad, then tts_pad over codec_bos; later steps add T(tts_pad)
  streaming:     t_1 over codec_bos; later steps add T(t_2), ..., T(t_n), T(tts_eos), then T(tts_pad)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import Qwen3TTSConfig

NO_CODEC = -1  # codec-track value of a position that carries text only


class PromptError(ValueError):
    """The request cannot be expressed for this model (unknown speaker or language, missing text...)."""


@dataclass
class Prompt:
    text_track: list[int]  # [S] text id of every prefill position
    codec_track: list[int]  # [S] codec id of every prefill position, NO_CODEC where there is none
    trailing: list[int] = field(default_factory=list)  # text ids fed one per decode step (streaming text)
    text_complete: bool = True  # trailing already ends with tts_eos (no more text will be pushed)

    def __len__(self) -> int:
        return len(self.text_track)


def resolve_language(cfg: Qwen3TTSConfig, language: str | None, speaker: str | None) -> int | None:
    """Language name -> codec language id (None for auto), with the dialect-speaker override (spec §5.3)."""
    t = cfg.talker
    lang = (language or "auto").lower()
    if lang == "auto":
        lang_id = None
    elif lang in t.codec_language_id:
        lang_id = t.codec_language_id[lang]
    else:
        raise PromptError(f"unsupported language {language!r}; supported: {', '.join(cfg.supported_languages)}")
    if lang in ("chinese", "auto") and speaker:
        dialect = t.spk_is_dialect.get(speaker.lower(), False)
        if dialect is not False and dialect:
            lang_id = t.codec_language_id[dialect]
    return lang_id


def codec_prefix(cfg: Qwen3TTSConfig, language: str | None, speaker: str | None) -> list[int]:
    """K: tag prefix + [speaker id] + [codec_pad, codec_bos]."""
    t = cfg.talker
    lang_id = resolve_language(cfg, language, speaker)
    if lang_id is None:
        tags = [t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id]
    else:
        tags = [t.codec_think_id, t.codec_think_bos_id, lang_id, t.codec_think_eos_id]
    speaker_ids: list[int] = []
    if speaker:
        key = speaker.lower()
        if key not in t.spk_id:
            raise PromptError(f"unknown speaker {speaker!r}; supported: {', '.join(cfg.supported_speakers)}")
        speaker_ids = [t.spk_id[key]]
    return tags + speaker_ids + [t.codec_pad_id, t.codec_bos_id]


def build_prompt(
    cfg: Qwen3TTSConfig,
    text_ids: list[int],
    *,
    speaker: str | None,
    language: str | None = "auto",
    instruct_ids: list[int] | None = None,
    non_streaming_mode: bool = True,
    text_complete: bool = True,
) -> Prompt:
    """Prefill layout for one request.

    text_ids: the target text's tokens t_1..t_n (what the reference slices as ids[3:-5] of the templated text).
    instruct_ids: all ids of `<|im_start|>user\\n{instruct}<|im_end|>\\n`, or None.
    non_streaming_mode: True puts the whole text in the prefill; False feeds it one token per frame.
    text_complete: streaming only; False leaves tts_eos off the trailing text, so more text can be pushed
      (see generate.TextFeed) before the end is marked.
    """
    if not text_ids:
        raise PromptError("text is empty")
    if cfg.tts_model_type == "custom_voice":
        if not speaker:
            raise PromptError("a CustomVoice model needs a speaker")
        if not cfg.supports_instruct:
            instruct_ids = None  # the reference wrapper drops instructions for 0.6B models
    elif cfg.tts_model_type == "voice_design":
        if speaker:
            raise PromptError("a VoiceDesign model has no named speakers; describe the voice in the instructions")
    else:
        raise PromptError(f"tts_model_type {cfg.tts_model_type!r} is not supported (needs reference audio)")

    t = cfg.talker
    K = codec_prefix(cfg, language, speaker)
    text_track: list[int] = []
    codec_track: list[int] = []
    if instruct_ids:
        text_track += list(instruct_ids)
        codec_track += [NO_CODEC] * len(instruct_ids)
    text_track += [cfg.im_start_token_id, cfg.assistant_token_id, 198]  # "<|im_start|>assistant\n"
    codec_track += [NO_CODEC] * 3
    text_track += [cfg.tts_pad_token_id] * (len(K) - 2) + [cfg.tts_bos_token_id]
    codec_track += K[:-1]
    if non_streaming_mode:
        text_track += list(text_ids) + [cfg.tts_eos_token_id, cfg.tts_pad_token_id]
        codec_track += [t.codec_pad_id] * (len(text_ids) + 1) + [t.codec_bos_id]
        return Prompt(text_track, codec_track, [], True)
    text_track.append(text_ids[0])
    codec_track.append(t.codec_bos_id)
    trailing = list(text_ids[1:]) + ([cfg.tts_eos_token_id] if text_complete else [])
    return Prompt(text_track, codec_track, trailing, text_complete)


def embed_prompt(talker, prompt: Prompt) -> torch.Tensor:
    """-> prefill embeddings [S, D] on the talker's device and dtype."""
    device = talker.codec_head.weight.device
    text = torch.tensor(prompt.text_track, device=device)
    codec = torch.tensor(prompt.codec_track, device=device)
    has_codec = codec != NO_CODEC
    embeds = talker.embed_text(text)  # [S, D]
    codec_embeds = talker.embed_codec(codec.clamp(min=0))  # [S, D]
    return torch.where(has_codec[:, None], embeds + codec_embeds, embeds)
