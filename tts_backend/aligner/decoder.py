"""The text decoder (`thinker.model`).

A Qwen3 decoder run once over the whole prompt (no KV cache: nothing is generated). Its causal attention sees, at
each `<timestamp>` slot, the audio and the words up to that slot (the timestamp head, model.Thinker.lm_head,
reads the slot's hidden state). Rows of a batch are right-padded to a fixed length (model.py's buckets).

Shapes: B = rows, S = prompt length (padded to the longest), D = hidden size, H = query heads, Hkv = key/value
heads, Dh = head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from tts_backend.qwen3.talker import DecoderLayer, RMSNorm, rotary_cos_sin

from .config import TextDecoderConfig


class TextDecoder(nn.Module):
    """`thinker.model`: token embedding, layers, final norm."""

    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # The TTS talker's layer (same Qwen3 layer, same tensor names), run here without its KV cache.
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        """embeds [B, S, D], each row's prompt from position 0 (right padding) -> final-norm hidden [B, S, D].

        Attention is causal, so a prompt's tokens never see the padding after them and their positions are
        0, 1, ... as in the reference's batch of one: no mask of padding is needed, and the shapes are fixed."""
        B, S, _ = embeds.shape
        positions = torch.arange(S, device=embeds.device).expand(B, S)
        cos, sin = rotary_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, embeds.dtype)
        causal = torch.ones(S, S, dtype=torch.bool, device=embeds.device).tril()[None, None]  # [1, 1, S, S]
        x = embeds
        for layer in self.layers:
            attention = layer.self_attn
            x = x + attention.attend(*attention.project(layer.input_layernorm(x), cos, sin), causal)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)
