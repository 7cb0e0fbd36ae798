"""Generation: the reference-style batched loop, and a streaming utterance whose text can arrive in pieces.

Per-step building blocks (reused by the GPU engine's batched runner):
  `Qwen3TTS.prefill(cache, slots, prompt_embeds)`     prompt embeddings -> last hidden per row
  `Qwen3TTS.decode_step(cache, slots, input_pos, embeds)`  one new position per row -> hidden
  `Qwen3TTS.residual_codes(hidden, c0, choose)`        the 15-step code predictor loop for a batch
  `Qwen3TTS.frame_embeds(c0, residual)`                sum of the 16 code embeddings (next talker input, minus text)
and the sampling functions of `sampling.py`.

One frame, for a row that has sampled c0 from hidden h (spec §5.6): residual = predictor(h, c0); frame =
(c0, residual); next input = frame_embeds + T(next text id or tts_pad); talker step -> h' -> sample next c0;
stop when c0 is EOS or after max_new_tokens sampled c0 tokens (N sampled c0 give N-1 frames).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .code_predictor import CodePredictor
from .config import GenerationConfig, Qwen3TTSConfig
from .prompt import Prompt, PromptError, VoicePrompt, build_clone_prompt, build_prompt, embed_prompt, embed_prompts
from .sampling import Generators, SamplingParams, sample_residual, sample_talker, suppression_mask
from .talker import KVCache, Talker
from .tokenizer import TextTokenizer


def right_padded(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Prompt embeddings [S_i, D] -> one batch [B, max S_i, D], zeros after each row's end."""
    x = rows[0].new_zeros(len(rows), max(e.shape[0] for e in rows), rows[0].shape[-1])
    for i, e in enumerate(rows):
        x[i, : e.shape[0]] = e
    return x


def checkpoint_identity(folder: Path) -> str:
    """A short fingerprint of a checkpoint: its configs, both safetensors headers (names, shapes, dtypes,
    offsets) and the first and last 64 KiB of each file's tensor data (so two checkpoints of one layout, a
    fine-tune say, differ), without reading the rest of the weights. Voice prompts carry it, so one made by
    another model or version is refused rather than spoken with."""
    import hashlib
    import struct

    sample = 1 << 16
    digest = hashlib.sha256()
    for name in ("config.json", "speech_tokenizer/config.json", "model.safetensors",
                 "speech_tokenizer/model.safetensors"):
        path = folder / name
        with open(path, "rb") as f:
            if not name.endswith(".safetensors"):
                digest.update(f.read())
                continue
            (length,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(length))
            digest.update(f.read(sample))
            f.seek(max(8 + length, path.stat().st_size - sample))
            digest.update(f.read(sample))
    return "qwen3-tts:" + digest.hexdigest()[:24]


class TextFeed:
    """Text tokens waiting to be added to decode steps, one per step (streaming-text mode).

    `next_id()` gives the next text id, tts_pad once the text is closed and drained, or None when more text is
    expected but none has arrived yet (the generation must wait: adding pads there would let the model end
    the utterance early).
    """

    def __init__(self, ids: Sequence[int], closed: bool, pad_id: int, eos_id: int):
        self._pending: deque[int] = deque(ids)
        self._closed = closed
        self._pad_id = pad_id
        self._eos_id = eos_id

    def push(self, ids: Sequence[int]) -> None:
        if self._closed:
            raise RuntimeError("text already finished for this utterance")
        self._pending.extend(ids)

    def close(self) -> None:
        """No more text: tts_eos follows what is pending, then pads."""
        if not self._closed:
            self._pending.append(self._eos_id)
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending(self) -> int:
        return len(self._pending)

    def next_id(self) -> int | None:
        if self._pending:
            return self._pending.popleft()
        return self._pad_id if self._closed else None


@dataclass
class Qwen3TTS:
    """A loaded checkpoint: configs, talker, code predictor, codec decoder and text tokenizer (a Base checkpoint
    adds its speaker encoder and the codec's encoder, which turn reference audio into a VoicePrompt)."""

    config: Qwen3TTSConfig
    generation_config: GenerationConfig
    talker: Talker
    code_predictor: CodePredictor
    codec: torch.nn.Module | None
    tokenizer: TextTokenizer
    codec_config: object | None = None
    speaker_encoder: torch.nn.Module | None = None
    codec_encoder: torch.nn.Module | None = None
    identity: str = ""  # what this checkpoint's voice prompts carry as their maker (see checkpoint_identity)
    _suppress: torch.Tensor | None = field(default=None, repr=False)
    # from_pretrained's phases, seconds each (config, model_weights, codec_decoder, codec_encoder, tokenizer,
    # identity): start-up is a target of its own (issue 29), bench/startup_load.py reports them.
    load_seconds: dict[str, float] = field(default_factory=dict, repr=False)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        *,
        codec_dtype: torch.dtype = torch.float32,
        load_codec: bool = True,
    ) -> "Qwen3TTS":
        """Load a checkpoint folder. Model weights are stored bf16 and cast to `dtype`; the codec stays fp32
        (as stored) unless `codec_dtype` says otherwise; a Base checkpoint's codec encoder is always fp32 (the
        reference runs it in the model dtype; fp32 is what its codes are compared against). Raises
        CheckpointError/ConfigError on a bad folder."""
        import time

        from .loader import check_model_folder, load_codec_decoder, load_codec_encoder, load_model_weights

        seconds: dict[str, float] = {}
        mark = time.perf_counter()

        def phase(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            seconds[name] = now - mark
            mark = now

        folder = check_model_folder(path)
        config = Qwen3TTSConfig.from_json(folder / "config.json")
        gen_path = folder / "generation_config.json"
        generation = GenerationConfig.from_json(gen_path) if gen_path.is_file() else GenerationConfig()
        phase("config")
        weights = load_model_weights(folder, config, device, dtype)
        phase("model_weights")
        codec = codec_config = None
        if load_codec:
            from .codec import CodecDecoderConfig

            codec_config = CodecDecoderConfig.from_json(folder / "speech_tokenizer" / "config.json")
            codec = load_codec_decoder(folder, device).to(codec_dtype)
            if codec_config.num_quantizers != config.talker.num_code_groups or \
                    codec_config.codebook_size != config.talker.codebook_size:
                from .loader import CheckpointError

                raise CheckpointError(f"{folder / 'speech_tokenizer' / 'config.json'}: codec codebooks "
                                      f"({codec_config.num_quantizers} x {codec_config.codebook_size}) do not match "
                                      f"the talker ({config.talker.num_code_groups} x {config.talker.codebook_size})")
            phase("codec_decoder")
        codec_encoder = None
        if config.tts_model_type == "base":
            codec_encoder = load_codec_encoder(folder, device)
            phase("codec_encoder")
        tokenizer = TextTokenizer.from_folder(folder)
        phase("tokenizer")
        identity = checkpoint_identity(folder)
        phase("identity")
        return cls(config, generation, weights.talker, weights.code_predictor, codec, tokenizer, codec_config,
                   weights.speaker_encoder, codec_encoder, identity, load_seconds=seconds)

    # ------------------------------------------------------------------ properties

    @property
    def device(self) -> torch.device:
        return self.talker.codec_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.talker.codec_head.weight.dtype

    @property
    def num_code_groups(self) -> int:
        return self.config.talker.num_code_groups

    @property
    def suppress_mask(self) -> torch.Tensor:
        if self._suppress is None or self._suppress.device != self.device:
            self._suppress = suppression_mask(self.config.talker, self.device)
        return self._suppress

    def sampling_params(self, **overrides) -> SamplingParams:
        """The checkpoint's generation_config.json defaults with explicit overrides (None = keep default)."""
        return SamplingParams.from_generation_config(self.generation_config, **overrides)

    # ------------------------------------------------------------------ prompts

    def make_prompt(
        self,
        text: str,
        *,
        speaker: str | None = None,
        language: str | None = "auto",
        instruct: str | None = None,
        non_streaming_mode: bool = True,
        text_complete: bool = True,
        voice: VoicePrompt | None = None,
        text_ids: Sequence[int] | None = None,
    ) -> Prompt:
        """Tokenise and lay out one request (CustomVoice needs `speaker`; VoiceDesign takes `instruct`; Base
        needs `voice`, from `clone_prompt`). text_ids: the text's ids when the caller has them already (the
        settled part of a text still being written, TextTokenizer.settled_text_ids); `text` is then unused."""
        ids = list(text_ids) if text_ids is not None else self.tokenizer.text_ids(text)
        if voice is not None or self.config.tts_model_type == "base":
            if voice is None:
                raise PromptError("a Base checkpoint speaks in a cloned voice: give a voice prompt")
            if speaker or instruct:
                raise PromptError("a cloned voice takes neither a named speaker nor instructions")
            return build_clone_prompt(self.config, ids, voice, language=language,
                                      non_streaming_mode=non_streaming_mode, text_complete=text_complete)
        instruct_ids = self.tokenizer.instruct_ids(instruct) if instruct else None
        return build_prompt(
            self.config, ids, speaker=speaker, language=language,
            instruct_ids=instruct_ids, non_streaming_mode=non_streaming_mode, text_complete=text_complete,
        )

    @torch.inference_mode()
    def clone_prompt(self, audio: torch.Tensor, ref_text: str | None, x_vector_only: bool) -> VoicePrompt:
        """Reference audio -> the voice's prompt, computed once and reusable for any number of requests.

        audio: [T] float32 mono at 24 kHz (decoding and resampling are the caller's job).
        ref_text: the transcript of the audio; required unless x_vector_only.
        x_vector_only: True uses the x-vector alone (no transcript, weaker likeness); False is in-context
          cloning from the reference codes and transcript, as `create_voice_clone_prompt` does.
        """
        if self.speaker_encoder is None or self.codec_encoder is None:
            raise PromptError(f"voice cloning needs a Base checkpoint, not {self.config.tts_model_type!r}")
        audio = torch.as_tensor(audio, dtype=torch.float32)
        if audio.dim() != 1 or audio.numel() == 0:
            raise PromptError(f"reference audio must be mono samples [T], got shape {list(audio.shape)}")
        if not bool(torch.isfinite(audio).all()):
            raise PromptError("reference audio holds NaN or infinite samples")
        x_vector = self.speaker_encoder.embed(audio).float().cpu()
        if x_vector_only:
            return VoicePrompt(x_vector)
        if not ref_text:
            raise PromptError("in-context cloning needs the reference audio's transcript (ref_text); "
                              "or ask for x_vector_only")
        codes = self.codec_encoder.encode(audio).cpu()
        return VoicePrompt(x_vector, codes, self.tokenizer.ref_text_ids(ref_text))

    def text_feed(self, prompt: Prompt) -> TextFeed:
        return TextFeed(prompt.trailing, prompt.text_complete, self.config.tts_pad_token_id,
                        self.config.tts_eos_token_id)

    # ------------------------------------------------------------------ per-step building blocks

    def new_talker_cache(self, num_slots: int, max_len: int) -> KVCache:
        return self.talker.new_cache(num_slots, max_len)

    def new_predictor_cache(self, num_slots: int) -> KVCache:
        return self.code_predictor.new_cache(num_slots)

    def prompt_embeds(self, prompt: Prompt) -> torch.Tensor:
        """-> [S, D]"""
        return embed_prompt(self.talker, prompt, self.code_predictor)

    def prompts_embeds(self, prompts: Sequence[Prompt], upload=None) -> list[torch.Tensor]:
        """-> [S_i, D] each, made together; `upload` moves host tensors to the device (embed_prompts)"""
        return embed_prompts(self.talker, prompts, self.code_predictor, upload)

    @torch.inference_mode()
    def prefill(self, cache: KVCache, slots: torch.Tensor, embeds: Sequence[torch.Tensor]) -> torch.Tensor:
        """Write each row's prompt into its slot at positions 0..S_i-1 -> last hidden states [B, D].

        Rows are right-padded to the longest; the pad positions' cache entries are overwritten by the row's own
        decode steps before any query can see them (keys are visible only at positions <= the query's).
        """
        lengths = [e.shape[0] for e in embeds]
        S = max(lengths)
        if S > cache.max_len:
            raise ValueError(f"prompt of {S} positions does not fit the KV cache ({cache.max_len})")
        B = len(embeds)
        x = right_padded(embeds)
        pos = torch.arange(S, device=x.device)[None].expand(B, S)
        hidden = self.talker(x, cache, slots, pos, attend_len=S)  # [B, S, D]
        last = torch.tensor([n - 1 for n in lengths], device=x.device)
        return hidden[torch.arange(B, device=x.device), last]

    @torch.inference_mode()
    def decode_step(
        self, cache: KVCache, slots: torch.Tensor, input_pos: torch.Tensor, embeds: torch.Tensor,
        attend_len: int | None = None,
    ) -> torch.Tensor:
        """embeds [B, D] at positions input_pos [B] -> hidden [B, D]."""
        if attend_len is None:
            attend_len = int(input_pos.max()) + 1
        return self.talker(embeds[:, None], cache, slots, input_pos[:, None], attend_len)[:, 0]

    @torch.inference_mode()
    def residual_codes(
        self, cache: KVCache, slots: torch.Tensor, hidden: torch.Tensor, c0: torch.Tensor,
        choose: Callable[[torch.Tensor], torch.Tensor], logits_out: list | None = None,
    ) -> torch.Tensor:
        """hidden [B, D], c0 [B] -> codebooks 1..G-1 [B, G-1]."""
        return self.code_predictor.predict(hidden, self.talker.embed_codec(c0), cache, slots, choose, logits_out)

    @torch.inference_mode()
    def frame_embeds(self, c0: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Sum of the 16 code embeddings of a frame [B, D] (talker table for c0, predictor tables after)."""
        stacked = torch.cat((self.talker.embed_codec(c0)[:, None], self.code_predictor.embed_residual(residual)), 1)
        return stacked.sum(1)

    @torch.inference_mode()
    def text_embeds(self, ids: Sequence[int]) -> torch.Tensor:
        """T(id) for one id per row -> [B, D]."""
        return self.talker.embed_text(torch.tensor(list(ids), device=self.device))

    # ------------------------------------------------------------------ whole generations

    @torch.inference_mode()
    def generate_codes(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        generators: Generators = None,
        *,
        trace: dict | None = None,
    ) -> list[torch.Tensor]:
        """The reference's batched loop -> one LongTensor [frames_i, G] per prompt.

        All rows step together until every row has stopped; a stopped row keeps being fed EOS like the reference
        (so a shared generator is consumed identically), and its frames are cut at its first EOS.
        trace: if given, receives "talker_logits" (list of fp32 [B, V] per c0 draw) and "predictor_logits".
        """
        B = len(prompts)
        device = self.device
        eos = self.config.talker.codec_eos_token_id
        feeds = [self.text_feed(p) for p in prompts]
        embeds = [self.prompt_embeds(p) for p in prompts]
        max_len = max(e.shape[0] for e in embeds) + params.max_new_tokens + 1
        cache = self.new_talker_cache(B, max_len)
        pcache = self.new_predictor_cache(B)
        slots = torch.arange(B, device=device)
        positions = torch.tensor([e.shape[0] for e in embeds], device=device)
        talker_logits: list[torch.Tensor] = []
        predictor_logits: list[torch.Tensor] = []

        def choose_residual(logits: torch.Tensor) -> torch.Tensor:
            return sample_residual(logits, params, generators)

        hidden = self.prefill(cache, slots, embeds)
        logits = self.talker.logits(hidden).float()
        talker_logits.append(logits)
        c0 = sample_talker(logits, None, 0, params, eos, self.suppress_mask, generators)
        history = c0[:, None]
        finished = c0 == eos
        frames: list[torch.Tensor] = []
        while not bool(finished.all()) and history.shape[1] < params.max_new_tokens:
            residual = self.residual_codes(pcache, slots, hidden, c0, choose_residual, predictor_logits)
            frames.append(torch.cat((c0[:, None], residual), dim=1))
            text_ids = [f.next_id() for f in feeds]
            if any(i is None for i in text_ids):
                raise RuntimeError("generate_codes needs complete text; use Utterance for text pushed over time")
            x = self.frame_embeds(c0, residual) + self.text_embeds(text_ids)
            hidden = self.decode_step(cache, slots, positions, x)
            positions = positions + 1
            logits = self.talker.logits(hidden).float()
            talker_logits.append(logits)
            c0 = sample_talker(logits, history, history.shape[1], params, eos, self.suppress_mask, generators)
            c0 = torch.where(finished, torch.full_like(c0, eos), c0)
            history = torch.cat((history, c0[:, None]), dim=1)
            finished = finished | (c0 == eos)
        if trace is not None:
            trace["talker_logits"] = talker_logits
            trace["predictor_logits"] = predictor_logits
        if not frames:
            return [torch.zeros(0, self.num_code_groups, dtype=torch.long, device=device) for _ in range(B)]
        codes = torch.stack(frames, dim=1)  # [B, F, G]
        out = []
        for row in range(B):
            is_eos = codes[row, :, 0] == eos
            n = int(is_eos.int().argmax()) if bool(is_eos.any()) else codes.shape[1]
            out.append(codes[row, :n])
        return out

    def synthesize_codes(
        self, text: str, *, speaker: str | None = None, language: str = "auto", instruct: str | None = None,
        non_streaming_mode: bool = True, seed: int | None = None, voice: VoicePrompt | None = None,
        **sampling_overrides,
    ) -> torch.Tensor:
        """One utterance -> codes [frames, G] (convenience for tests and tools)."""
        prompt = self.make_prompt(text, speaker=speaker, language=language, instruct=instruct,
                                  non_streaming_mode=non_streaming_mode, voice=voice)
        generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        return self.generate_codes([prompt], self.sampling_params(**sampling_overrides), generator)[0]

    def codec_stream(self, voice: VoicePrompt | None = None) -> "CodecStream":
        """Incremental waveform decoding for one stream (state carried between calls).

        voice: an in-context clone's stream starts after its reference codes, as the reference decodes
        `ref_codes ++ generated` and cuts the reference's share of the samples: the codec's state is primed with
        the reference frames and their audio dropped."""
        if self.codec is None:
            raise RuntimeError("model loaded without its codec (load_codec=False)")
        stream = CodecStream(self.codec)
        if voice is not None and voice.ref_codes is not None:
            stream.decode(voice.ref_codes)
        return stream

    @torch.inference_mode()
    def decode_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [F, G] -> float32 waveform [F * 1920] at 24 kHz (whole-sequence decode)."""
        return self.codec_stream().decode(codes)

    def start_utterance(
        self, text: str, *, speaker: str | None = None, language: str = "auto", instruct: str | None = None,
        params: SamplingParams | None = None, seed: int | None = None, more_text: bool = False,
        max_len: int | None = None, voice: VoicePrompt | None = None,
    ) -> "Utterance":
        """A streaming-text generation context: frames come out while text can still be pushed.

        more_text=True leaves the text open (push more with `Utterance.push_text`, end with `finish_text`);
        False is the reference's streaming-text mode for a complete text.
        """
        prompt = self.make_prompt(text, speaker=speaker, language=language, instruct=instruct,
                                  non_streaming_mode=False, text_complete=not more_text, voice=voice)
        generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        return Utterance(self, prompt, params or self.sampling_params(), generator, max_len=max_len)


class Utterance:
    """One generation context (batch 1) that yields frames as they are made and accepts more text meanwhile.

    `frames()` runs until the utterance ends (EOS / max_new_tokens) or until it needs text that has not been
    pushed yet; call it again after `push_text`/`finish_text`. With the whole text pushed and finished before
    the first call, the frames equal `generate_codes` in streaming-text mode for the same seed.
    """

    def __init__(self, model: Qwen3TTS, prompt: Prompt, params: SamplingParams,
                 generator: torch.Generator | None, max_len: int | None = None):
        self.model = model
        self.params = params
        self.generator = generator
        self.feed = model.text_feed(prompt)
        embeds = model.prompt_embeds(prompt)
        self.max_len = max_len or embeds.shape[0] + params.max_new_tokens + 1
        self.cache = model.new_talker_cache(1, self.max_len)
        self.pcache = model.new_predictor_cache(1)
        self.slots = torch.zeros(1, dtype=torch.long, device=model.device)
        self.position = embeds.shape[0]
        self.hidden = model.prefill(self.cache, self.slots, [embeds])
        self._eos = model.config.talker.codec_eos_token_id
        self.history: list[int] = []
        self.c0 = self._sample_c0()
        self._frame_pending_text = False  # a frame was emitted; its talker step waits for text
        self.finished = self.c0 == self._eos

    def push_text(self, text: str) -> None:
        self.feed.push(self.model.tokenizer.continuation_ids(text))

    def push_ids(self, ids: Sequence[int]) -> None:
        self.feed.push(ids)

    def finish_text(self) -> None:
        self.feed.close()

    @property
    def waiting_for_text(self) -> bool:
        return not self.finished and self._frame_pending_text and self.feed.pending == 0 and not self.feed.closed

    @torch.inference_mode()
    def _sample_c0(self) -> int:
        logits = self.model.talker.logits(self.hidden).float()
        history = torch.tensor([self.history], device=self.model.device, dtype=torch.long)
        c0 = sample_talker(logits, history, len(self.history), self.params, self._eos, self.model.suppress_mask,
                           self.generator)
        self.history.append(int(c0))
        return int(c0)

    @torch.inference_mode()
    def frames(self) -> Iterator[torch.Tensor]:
        """Yield frames [G] (long) until the utterance ends or needs more text."""
        m = self.model
        device = m.device
        while not self.finished:
            if not self._frame_pending_text:
                if len(self.history) >= self.params.max_new_tokens:
                    self.finished = True  # the cap's last c0 is never expanded, like the reference
                    return
                c0 = torch.tensor([self.c0], device=device)
                residual = m.residual_codes(self.pcache, self.slots, self.hidden, c0,
                                            lambda l: sample_residual(l, self.params, self.generator))
                self._residual = residual
                self._frame_pending_text = True
                yield torch.cat((c0, residual[0]))
            text_id = self.feed.next_id()
            if text_id is None:
                return  # wait for push_text / finish_text
            if self.position >= self.max_len:
                self.finished = True
                return
            c0 = torch.tensor([self.c0], device=device)
            x = m.frame_embeds(c0, self._residual) + m.text_embeds([text_id])
            self.hidden = m.decode_step(self.cache, self.slots, torch.tensor([self.position], device=device), x)
            self.position += 1
            self._frame_pending_text = False
            self.c0 = self._sample_c0()
            self.finished = self.c0 == self._eos


class CodecStream:
    """Frames in, waveform out, for one stream: each call decodes only the new frames, carrying the codec's
    convolution and attention state, so the concatenated output equals one whole-sequence decode."""

    def __init__(self, codec: torch.nn.Module):
        self.codec = codec
        self.state = codec.init_state(1)

    @torch.inference_mode()
    def decode(self, frames: torch.Tensor) -> torch.Tensor:
        """frames [F, G] (long) -> float32 waveform [F * samples_per_frame]."""
        if frames.shape[0] == 0:
            return torch.zeros(0)
        weight_device = self.state.positions.device
        codes = frames.to(weight_device).T[None]  # [1, G, F]
        return self.codec.decode_chunk(codes, self.state)[0].float()
