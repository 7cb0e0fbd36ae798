"""Qwen3-ForcedAligner: audio + transcript -> start and end time of every word, in one forward pass.

The audio encoder turns the clip into embeddings that replace the `<|audio_pad|>` placeholders of the prompt; the
decoder reads the prompt once; at every `<timestamp>` slot the head's argmax is a time class (x 80 ms). Nothing is
generated, so a sentence costs one prefill. Several sentences run as one batch, padded to fixed shapes (Buckets)
that CUDA graphs capture on a GPU (graphs.py); on the CPU the same padded passes run eagerly. A sentence's
classes do not depend on that padding: every pass keeps each row, and each row's real positions, to themselves.

`ForcedAligner.align` is the API; it runs on whatever device and dtype the weights were loaded to.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tts_backend.qwen3.tokenizer import TextTokenizer

from .config import AlignerConfig
from .decoder import TextDecoder
from .encoder import AudioEncoder, conv_limits
from .features import HOP, MIN_SAMPLES, batch_log_mel, conv_len, encoder_tokens, to_16k
from .words import split_words, word_times

log = logging.getLogger(__name__)

WordTime = tuple[str, float, float]  # (word, start_s, end_s)


@dataclass
class AlignRequest:
    """One sentence: its audio (mono, int16 or float in [-1, 1]) at `sample_rate`, its text and language."""

    audio: np.ndarray
    sample_rate: int
    text: str
    language: str | None = None


class Thinker(nn.Module):
    """`thinker.*` of the checkpoint: audio_tower, model, lm_head (the timestamp head, no bias)."""

    def __init__(self, cfg: AlignerConfig):
        super().__init__()
        self.audio_tower = AudioEncoder(cfg.audio)
        self.model = TextDecoder(cfg.text)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.classify_num, bias=False)


@dataclass(frozen=True)
class Buckets:
    """The fixed shapes a batch is padded to: rows, chunks of audio per row (1 s each in the release) and
    prompt positions per row. Each (rows, chunks) pair is one captured encoder pass, each (rows, length) one
    decoder pass (graphs.py). A batch beyond the largest runs at its own size, rounded up, uncaptured."""

    rows: tuple[int, ...] = (1, 2, 4, 8, 16)
    chunks: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
    lengths: tuple[int, ...] = (32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)

    def up_to(self, rows: int) -> "Buckets":
        """These buckets for batches of at most `rows`."""
        kept = tuple(r for r in self.rows if r < rows)
        return Buckets(kept + (rows,), self.chunks, self.lengths)


def _bucket(n: int, sizes: tuple[int, ...], step: int) -> int:
    return next((s for s in sizes if s >= n), -(-n // step) * step)


@dataclass
class Batch:
    """The inputs of one aligner pass, padded to its buckets (host tensors but for the features). B rows (the first `rows` real), C chunks,
    S prompt positions. Padding rows have no audio and no prompt; padding positions hold id 0."""

    rows: int
    mel: torch.Tensor  # [B, M, C * chunk_frames] float32 on the model's device, zeros past each clip
    conv_limits: torch.Tensor  # [B, C, 2] long (encoder.conv_limits)
    tokens: torch.Tensor  # [B] long: encoder outputs of each clip
    ids: torch.Tensor  # [B, S] long: each row's prompt from position 0
    slots: list[np.ndarray]  # each real row's `<timestamp>` positions


class ForcedAligner(nn.Module):
    def __init__(self, cfg: AlignerConfig, tokenizer: TextTokenizer | None = None, buckets: Buckets = Buckets()):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.thinker = Thinker(cfg)
        self.buckets = buckets
        self.graphs = None  # graphs.AlignerGraphs once captured (capture())
        self._word_ids: dict[str, list[int]] = {}

    @property
    def device(self) -> torch.device:
        return self.thinker.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.thinker.lm_head.weight.dtype

    def capture(self, max_rows: int) -> None:
        """Capture CUDA graphs of every bucket up to `max_rows` rows (a CUDA device only; elsewhere nothing)."""
        if self.device.type != "cuda":
            return
        from .graphs import AlignerGraphs

        self.buckets = self.buckets.up_to(max_rows)
        try:
            self.graphs = AlignerGraphs(self, self.buckets)
        except Exception:  # slower, never wrong: the same passes, eagerly
            log.exception("capturing the aligner's CUDA graphs failed; it runs eagerly")
            self.graphs = None

    # ---- host: one batch's inputs ----------------------------------------------------------------------
    def _ids_of(self, word: str) -> list[int]:
        """A word's token ids. The tokenizer splits a prompt at its special tokens first, so the prompt's ids are
        its parts' ids end to end (tests check it against encoding prompt_text whole)."""
        ids = self._word_ids.get(word)
        if ids is None:
            if len(self._word_ids) >= 65536:
                self._word_ids.clear()
            ids = self._word_ids[word] = self.tokenizer.encode(word)
        return ids

    def prompt_ids(self, words: list[str], audio_tokens: int) -> list[int]:
        """The ids of words.prompt_text(words, audio_tokens)."""
        cfg = self.cfg
        ids = [cfg.audio_start_token_id] + [cfg.audio_token_id] * audio_tokens + [cfg.audio_end_token_id]
        slot = [cfg.timestamp_token_id, cfg.timestamp_token_id]
        for word in words:
            ids += self._ids_of(word) + slot
        return ids

    def prepare(self, clips: list[np.ndarray], word_lists: list[list[str]]) -> Batch:
        """16 kHz float clips and their words -> the padded inputs of one pass."""
        cfg, buckets = self.cfg, self.buckets
        chunk = cfg.audio.chunk_frames
        rows = len(clips)
        frame_counts = [len(c) // HOP for c in clips]
        B = _bucket(rows, buckets.rows, 1)
        C = _bucket(max(-(-f // chunk) for f in frame_counts), buckets.chunks, 1)
        tokens = [encoder_tokens(f, chunk) for f in frame_counts]
        prompts = [self.prompt_ids(words, n) for words, n in zip(word_lists, tokens)]
        # The decoder takes the encoder's C * conv_len(chunk) outputs at positions 1.. of its rows.
        S = _bucket(max(max(len(p) for p in prompts), C * conv_len(chunk) + 2), buckets.lengths, 32)
        # The features on the model's device: on a GPU its STFT and filter bank are the cheap part.
        mel = torch.zeros(B, cfg.audio.num_mel_bins, C * chunk, device=self.device)
        mel[:rows], _ = batch_log_mel(clips, cfg.audio.num_mel_bins, C * chunk, self.device)
        ids = np.zeros((B, S), np.int64)
        for row, prompt in zip(ids, prompts):
            row[: len(prompt)] = prompt
        slots = [np.flatnonzero(row == cfg.timestamp_token_id) for row in ids[:rows]]
        return Batch(rows, mel, torch.from_numpy(conv_limits(frame_counts + [0] * (B - rows), C, chunk)),
                     torch.tensor(tokens + [0] * (B - rows)), torch.from_numpy(ids), slots)

    # ---- device: one pass -------------------------------------------------------------------------------
    def encode(self, mel: torch.Tensor, limits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """encoder.AudioEncoder.forward on device tensors (mel already in the model's dtype)."""
        return self.thinker.audio_tower(mel, limits, tokens)

    def decode(self, ids: torch.Tensor, placed: torch.Tensor) -> torch.Tensor:
        """ids [B, S], placed [B, S, D] (an audio embedding wherever ids holds <|audio_pad|>; anything elsewhere)
        -> the head's class at every position [B, S]."""
        embeds = self.thinker.model.embed_tokens(ids)
        embeds = torch.where((ids == self.cfg.audio_token_id)[..., None], placed.to(embeds.dtype), embeds)
        return self.thinker.lm_head(self.thinker.model(embeds)).argmax(-1)

    @torch.inference_mode()
    def run(self, batch: Batch) -> np.ndarray:
        """The head's class at every position of every row [B, S]: captured graphs where the batch's buckets
        have them, else the same passes eagerly. One copy back to the host, at the end."""
        if self.graphs is not None:
            classes = self.graphs.run(batch)
            if classes is not None:
                return classes
        device = self.device
        audio = self.encode(batch.mel.to(device, self.dtype), batch.conv_limits.to(device), batch.tokens.to(device))
        S = batch.ids.shape[1]
        placed = F.pad(audio, (0, 0, 1, S - 1 - audio.shape[1]))  # audio output i at prompt position 1 + i
        return self.decode(batch.ids.to(device), placed).cpu().numpy()

    def timestamp_classes(self, clips: list[np.ndarray], word_lists: list[list[str]]) -> list[list[int]]:
        """16 kHz float clips and their words -> the head's class at each `<timestamp>` slot, per clip."""
        batch = self.prepare(clips, word_lists)
        classes = self.run(batch)
        return [classes[b, slots].tolist() for b, slots in enumerate(batch.slots)]

    def align(self, requests: list[AlignRequest]) -> list[list[WordTime]]:
        """Word times of each sentence, seconds from the start of its audio, non-decreasing. A sentence without a
        word to time (punctuation only) gives []. A sentence's times do not depend on the others in its batch.
        Audio too short for one analysis window (12.5 ms) puts every word at 0."""
        word_lists = [split_words(r.text, r.language) for r in requests]
        clips = [to_16k(r.audio, r.sample_rate) for r in requests]
        results: list[list[WordTime]] = [[(w, 0.0, 0.0) for w in words] for words in word_lists]
        todo = [i for i, words in enumerate(word_lists) if words and len(clips[i]) >= MIN_SAMPLES]
        if todo:
            clips = [clips[i] for i in todo]
            classes = self.timestamp_classes(clips, [word_lists[i] for i in todo])
            for i, row in zip(todo, classes):
                results[i] = word_times(word_lists[i], row, self.cfg.timestamp_segment_time)
        return results
