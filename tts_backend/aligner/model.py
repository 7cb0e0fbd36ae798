"""Qwen3-ForcedAligner: audio + transcript -> start and end time of every word, in one forward pass.

The audio encoder turns the clip into embeddings that replace the `<|audio_pad|>` placeholders of the prompt; the
decoder reads the prompt once; at every `<timestamp>` slot the head's argmax is a time class (x 80 ms). Nothing is
generated, so a sentence costs one prefill. Several sentences run as one batch (left-padded rows).

`ForcedAligner.align` is the API; it runs on whatever device and dtype the weights were loaded to.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tts_backend.qwen3.tokenizer import TextTokenizer

from .config import AlignerConfig
from .decoder import TextDecoder
from .encoder import AudioEncoder
from .features import MIN_SAMPLES, encoder_tokens, log_mel, to_16k
from .words import prompt_text, split_words, word_times

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


class ForcedAligner(nn.Module):
    def __init__(self, cfg: AlignerConfig, tokenizer: TextTokenizer | None = None):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.thinker = Thinker(cfg)

    @property
    def device(self) -> torch.device:
        return self.thinker.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.thinker.lm_head.weight.dtype

    @torch.inference_mode()
    def timestamp_classes(self, clips: list[np.ndarray], word_lists: list[list[str]]) -> list[list[int]]:
        """16 kHz float clips and their words -> the head's class at each `<timestamp>` slot, per clip."""
        cfg = self.cfg
        mels = [log_mel(clip, cfg.audio.num_mel_bins).to(self.device, self.dtype) for clip in clips]
        audio = self.thinker.audio_tower(mels)
        rows = []
        for words, mel, embeds in zip(word_lists, mels, audio):
            tokens = encoder_tokens(mel.shape[1], cfg.audio.chunk_frames)
            if tokens != embeds.shape[0]:  # the two counts come from the same rule; a mismatch is a bug here
                raise AssertionError(f"{tokens} audio placeholders for {embeds.shape[0]} encoder outputs")
            rows.append(self.tokenizer.encode(prompt_text(words, tokens)))
        S = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), S, dtype=torch.long)
        attention = torch.zeros(len(rows), S, dtype=torch.bool)
        for b, row in enumerate(rows):  # left padding
            ids[b, S - len(row):] = torch.tensor(row)
            attention[b, S - len(row):] = True
        ids, attention = ids.to(self.device), attention.to(self.device)
        embeds = self.thinker.model.embed_tokens(ids)  # [B, S, D]
        placeholders = ids == cfg.audio_token_id
        embeds[placeholders] = torch.cat(audio).to(embeds.dtype)  # row-major: clip b's outputs fill row b's slots
        hidden = self.thinker.model(embeds, attention)
        slots = ids == cfg.timestamp_token_id
        classes = self.thinker.lm_head(hidden[slots]).argmax(-1).tolist()
        out, start = [], 0
        for b in range(len(rows)):
            count = int(slots[b].sum())
            out.append(classes[start:start + count])
            start += count
        return out

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
