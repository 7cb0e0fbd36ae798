"""Prompt construction: which id sits on each track of each prefill position (CustomVoice, VoiceDesign, and the
Base models' voice clones).

Every prefill position is T(text id) (+ C(codec id) where the codec track has one); T = text_projection of the
text embedding, C = the talker's codec embedding (spec §5.4). Layout, in order:
  [instruct ids]                    text only (`<|im_start|>user\\n{instruct}<|im_end|>\\n`, all ids)
  im_start, assistant, \\n           text only
  K[0..L_K-2] under tts_pad..., tts_bos   K = tag prefix + [speaker] + [codec_pad, codec_bos]; K without its last id
  non-streaming: t_1..t_n, tts_eos over codec_pad, then tts_pad over codec_bos; later steps add T(tts_pad)
  streaming:     t_1 over codec_bos; later steps add T(t_2), ..., T(t_n), T(tts_eos), then T(tts_pad)

Voice clones (Base checkpoints, spec §5.10) put the reference speaker's x-vector where a named speaker's id row
would be (codec-track SPEAKER_EMBEDDING), in both modes. In-context (ICL) mode then replaces the target-text part:
  text track  R = ref_text ids ++ t_1..t_n ++ tts_eos
  codec track Q = codec_bos, then each reference frame f as the sum of its 16 code embeddings (REF_FRAME)
  non-streaming: R over codec_pad, then Q under tts_pad
  streaming:     R[i] + Q[i] position-wise; R's excess is fed one per step, or tts_pad fills R up to |Q|

The positions before t_1 do not depend on the request's text: in ICL mode the head (up to tts_bos), then the
reference transcript's ids (over codec_pad, or summed with codec_bos and the first reference frames in streaming
mode). That is `Prompt.voice_prefix`, what a runner may prefill once per voice. The reference frames themselves
are not in it: non-streaming mode puts them after the text, streaming mode adds the text to them.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .config import Qwen3TTSConfig

NO_CODEC = -1  # codec-track value of a position that carries text only
SPEAKER_EMBEDDING = -2  # codec-track value of the position that carries the voice's x-vector
REF_FRAME = -3  # codec-track value of a reference-audio frame (the i-th such position carries frame i)


class PromptError(ValueError):
    """The request cannot be expressed for this model (unknown speaker or language, missing text...)."""


@dataclass
class Prompt:
    text_track: list[int]  # [S] text id of every prefill position
    codec_track: list[int]  # [S] codec id of every prefill position, NO_CODEC where there is none
    trailing: list[int] = field(default_factory=list)  # text ids fed one per decode step (streaming text)
    text_complete: bool = True  # trailing already ends with tts_eos (no more text will be pushed)
    speaker_embedding: torch.Tensor | None = None  # [D] x-vector at the SPEAKER_EMBEDDING position
    ref_codes: torch.Tensor | None = None  # [F, G] reference codes at the REF_FRAME positions, in order
    # Leading positions that depend on the voice (and language and text mode) alone, never on the request's
    # text (module docstring); 0 where no runner should keep them apart (named voices, x-vector clones: their
    # 8-9 such positions are not worth a cache lookup). At most len - 1: the last position's hidden state
    # samples the first frame, so some prefill always remains.
    voice_prefix: int = 0

    def __len__(self) -> int:
        return len(self.text_track)

    def voice_prefix_digest(self) -> bytes | None:
        """A digest of everything the voice prefix's positions hold (ids of both tracks, the x-vector, the
        reference frames among them), or None without a prefix: equal digests, equal prefixes, whoever made
        the voice (two tenants' identical clips share it, no two different clips meet)."""
        n = self.voice_prefix
        if n <= 0:
            return None
        codec = self.codec_track[:n]
        frames = codec.count(REF_FRAME)
        digest = hashlib.sha256(struct.pack("<qq", n, frames))
        digest.update(torch.tensor(self.text_track[:n], dtype=torch.int64).numpy().tobytes())
        digest.update(torch.tensor(codec, dtype=torch.int64).numpy().tobytes())
        if SPEAKER_EMBEDDING in codec:
            digest.update(self.speaker_embedding.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        if frames:
            digest.update(self.ref_codes[:frames].to("cpu", torch.int64).contiguous().numpy().tobytes())
        return digest.digest()


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
        raise PromptError(f"tts_model_type {cfg.tts_model_type!r} speaks in cloned voices: use build_clone_prompt")

    return _layout(cfg, codec_prefix(cfg, language, speaker), text_ids, instruct_ids, non_streaming_mode,
                   text_complete)


def _layout(cfg: Qwen3TTSConfig, K: list[int], text_ids: list[int], instruct_ids: list[int] | None,
            non_streaming_mode: bool, text_complete: bool) -> Prompt:
    """The layout of the module docstring for codec prefix K (with its speaker row, if any)."""
    t = cfg.talker
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


@torch.inference_mode()
def embed_prompt(talker, prompt: Prompt, code_predictor=None,
                 upload: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """-> prefill embeddings [S, D] on the talker's device and dtype (a clone prompt's reference frames also need
    the code predictor's embedding tables); embed_prompts for one prompt."""
    return embed_prompts(talker, [prompt], code_predictor, upload)[0]


@torch.inference_mode()
def embed_prompts(talker, prompts: Sequence[Prompt], code_predictor=None,
                  upload: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor]:
    """-> each prompt's prefill embeddings [S_i, D], made together: one upload of every prompt's ids and one
    pass of embedding ops over all of them (each position's embedding is its own row's lookups and sums, so
    the same bits as one prompt at a time), then a few ops per cloned voice's vectors.

    Everything that decides which position gets what is read from the host tracks, and every host tensor goes
    to the device through `upload` (default: a plain copy): a serving engine passes its non-blocking upload from
    pinned memory. Built from device-side masks (`codec == SPEAKER_EMBEDDING`, boolean indexing, `.any()`) and
    pageable copies, each cloned request's prefill and each resumed request made the engine thread wait for
    the device four to six times, behind the frame in flight; and one at a time, a failover's eight resumed
    requests were eight uploads and eight passes of small launches before their Talker pass."""
    device = talker.codec_head.weight.device
    if upload is None:
        def upload(host: torch.Tensor) -> torch.Tensor:
            return host.to(device)

    def moved(t: torch.Tensor) -> torch.Tensor:  # a prompt's tensors are usually the host's
        return upload(t.detach()) if t.device.type == "cpu" else t.to(device)

    codec_track = [c for p in prompts for c in p.codec_track]
    codec_host = torch.tensor(codec_track, dtype=torch.long)
    text_host = torch.tensor([t for p in prompts for t in p.text_track], dtype=torch.long)
    ids = upload(torch.stack((text_host, codec_host.clamp(min=0), (codec_host != NO_CODEC).long())))
    embeds = talker.embed_text(ids[0])  # [sum S, D]
    codec_embeds = talker.embed_codec(ids[1])  # [sum S, D]
    at = 0
    for prompt in prompts:
        speaker_at = [at + i for i, c in enumerate(prompt.codec_track) if c == SPEAKER_EMBEDDING]
        frames_at = [at + i for i, c in enumerate(prompt.codec_track) if c == REF_FRAME]
        at += len(prompt.codec_track)
        if speaker_at:
            vector = moved(prompt.speaker_embedding).reshape(1, -1).to(codec_embeds.dtype)
            codec_embeds[upload(torch.tensor(speaker_at, dtype=torch.long))] = vector
        if frames_at:
            ref = moved(prompt.ref_codes).long()  # [F, G], one per REF_FRAME position
            stacked = torch.cat((talker.embed_codec(ref[:, :1]), code_predictor.embed_residual(ref[:, 1:])), dim=1)
            # the 16 code embeddings of each frame, summed
            codec_embeds[upload(torch.tensor(frames_at, dtype=torch.long))] = stacked.sum(1)
    out = torch.where(ids[2].bool()[:, None], embeds + codec_embeds, embeds)
    return list(out.split([len(p.codec_track) for p in prompts]))


@dataclass
class VoicePrompt:
    """A cloned voice, computed once from reference audio: everything a request needs besides its own text.

    x_vector: [D] float32, the speaker encoder's output for the whole clip.
    ref_codes: [F, G] int64 reference-audio codes, None in x-vector-only mode.
    ref_text_ids: the reference transcript's ids as the prompt uses them, None in x-vector-only mode.
    """

    x_vector: torch.Tensor
    ref_codes: torch.Tensor | None = None
    ref_text_ids: list[int] | None = None

    FORMAT = "voxgate.qwen3.voice_prompt.v1"

    @property
    def x_vector_only(self) -> bool:
        return self.ref_codes is None

    def to_bytes(self, maker: str = "") -> bytes:
        """safetensors bytes (no pickle: a registry may hand them to any replica). maker: what made the prompt
        (Qwen3TTS.identity), checked by from_bytes, since an x-vector means nothing to another model."""
        from safetensors.torch import save

        tensors = {"x_vector": self.x_vector.detach().float().cpu().contiguous()}
        if self.ref_codes is not None:
            tensors["ref_codes"] = self.ref_codes.detach().to(torch.int64).cpu().contiguous()
            tensors["ref_text_ids"] = torch.tensor(self.ref_text_ids or [], dtype=torch.int64)
        # One metadata entry: safetensors writes a metadata map in no fixed order, and equal prompts should be
        # equal bytes.
        return save(tensors, metadata={"voxgate": json.dumps({"format": self.FORMAT, "maker": maker},
                                                              sort_keys=True)})

    @classmethod
    def from_bytes(cls, data: bytes, maker: str | None = None) -> "VoicePrompt":
        """Refuses (PromptError) bytes that are not a voice prompt, or, with `maker`, one another model made."""
        from safetensors.torch import load

        try:
            tensors = load(bytes(data))
            metadata = json.loads(_safetensors_metadata(bytes(data)).get("voxgate", "{}"))
        except Exception as exc:  # safetensors raises its own error types for a bad header
            raise PromptError(f"not a voice prompt: {exc}") from exc
        if not isinstance(metadata, dict) or metadata.get("format") != cls.FORMAT:
            raise PromptError(f"not a voice prompt of format {cls.FORMAT}")
        if maker is not None and metadata.get("maker") != maker:
            raise PromptError("this voice prompt was made by another model; clone the voice again with this one")
        if set(tensors) not in ({"x_vector"}, {"x_vector", "ref_codes", "ref_text_ids"}):
            raise PromptError(f"not a voice prompt: tensors {sorted(tensors)}")
        x_vector = tensors["x_vector"]
        if x_vector.dim() != 1 or x_vector.dtype != torch.float32:
            raise PromptError("voice prompt x_vector must be a float32 vector")
        if "ref_codes" not in tensors:
            return cls(x_vector)
        codes, ids = tensors["ref_codes"], tensors["ref_text_ids"]
        if codes.dim() != 2 or codes.dtype != torch.int64 or ids.dim() != 1 or ids.dtype != torch.int64:
            raise PromptError("voice prompt ref_codes must be int64 [frames, groups], ref_text_ids int64 [n]")
        return cls(x_vector, codes, [int(i) for i in ids])


def _safetensors_metadata(data: bytes) -> dict:
    """The `__metadata__` of safetensors bytes (an 8-byte little-endian header length, then the JSON header)."""
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8: 8 + length]).get("__metadata__") or {}


def build_clone_prompt(
    cfg: Qwen3TTSConfig,
    text_ids: list[int],
    voice: VoicePrompt,
    *,
    language: str | None = "auto",
    non_streaming_mode: bool = False,
    text_complete: bool = True,
) -> Prompt:
    """Prefill layout of a Base checkpoint's request in the voice `voice` (module docstring).

    text_complete=False (streaming only) leaves tts_eos off, so more text can be pushed: in ICL mode the text
    beyond the prefill then follows it one token per step, after any tts_pad filling of the reference frames.
    """
    if cfg.tts_model_type != "base":
        raise PromptError(f"voice cloning needs a Base checkpoint, not {cfg.tts_model_type!r}")
    if not text_ids:
        raise PromptError("text is empty")
    t = cfg.talker
    if voice.x_vector.shape != (t.hidden_size,):
        raise PromptError(f"voice x-vector has shape {list(voice.x_vector.shape)}, this model needs "
                          f"[{t.hidden_size}]")
    if voice.ref_codes is not None and (voice.ref_codes.dim() != 2 or voice.ref_codes.shape[1] != t.num_code_groups
                                        or voice.ref_codes.shape[0] == 0):
        raise PromptError(f"voice reference codes have shape {list(voice.ref_codes.shape)}, this model needs "
                          f"[frames > 0, {t.num_code_groups}]")
    if voice.ref_codes is not None and bool(((voice.ref_codes < 0) | (voice.ref_codes >= t.codebook_size)).any()):
        raise PromptError("voice reference codes lie outside the codebook")
    K = codec_prefix(cfg, language, None)
    K = K[:-2] + [SPEAKER_EMBEDDING] + K[-2:]
    if voice.x_vector_only:
        prompt = _layout(cfg, K, text_ids, None, non_streaming_mode, text_complete)
        prompt.speaker_embedding = voice.x_vector
        return prompt
    text_track = [cfg.im_start_token_id, cfg.assistant_token_id, 198]
    codec_track = [NO_CODEC] * 3
    text_track += [cfg.tts_pad_token_id] * (len(K) - 2) + [cfg.tts_bos_token_id]
    codec_track += K[:-1]
    head = len(text_track)
    complete = text_complete or non_streaming_mode
    R = list(voice.ref_text_ids or []) + list(text_ids) + ([cfg.tts_eos_token_id] if complete else [])
    Q = [t.codec_bos_id] + [REF_FRAME] * voice.ref_codes.shape[0]
    trailing: list[int] = []
    if non_streaming_mode:
        text_track += R + [cfg.tts_pad_token_id] * len(Q)
        codec_track += [t.codec_pad_id] * len(R) + Q
    elif len(R) > len(Q):
        text_track += R[: len(Q)]
        codec_track += Q
        trailing = R[len(Q):]
    else:
        text_track += R + [cfg.tts_pad_token_id] * (len(Q) - len(R))
        codec_track += Q
    # Both modes start R at `head`; its transcript part is the request's text-free part (in streaming mode only
    # up to |Q|: R's excess is trailing text).
    ref_text = len(voice.ref_text_ids or [])
    prefix = head + (ref_text if non_streaming_mode else min(ref_text, len(Q)))
    return Prompt(text_track, codec_track, trailing, complete, voice.x_vector, voice.ref_codes,
                  voice_prefix=min(prefix, len(text_track) - 1))
