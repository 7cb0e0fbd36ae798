"""The text decoder (`thinker.model`) and the timestamp head (`thinker.lm_head`).

A Qwen3 decoder run once over the whole prompt (no KV cache: nothing is generated). Its causal attention sees, at
each `<timestamp>` slot, the audio and the words up to that slot; the head maps the slot's hidden state to
`classify_num` timestamp classes. Rows of a batch are left-padded; a padded row's positions count from its first
real token, as the reference's do.

Shapes: B = rows, S = prompt length (padded to the longest), D = hidden size, H = query heads, Hkv = key/value
heads, Dh = head dim, K = classify_num.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tts_backend.qwen3.talker import MLP, RMSNorm, rotary_cos_sin, rotate_half

from .config import TextDecoderConfig


class DecoderAttention(nn.Module):
    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # per head, before RoPE
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask) -> torch.Tensor:
        """x [B, S, D], cos/sin [B, 1, S, Dh], mask [B, 1, S, S] bool -> [B, S, D]."""
        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, S, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # [B, H, S, Dh]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextDecoder(nn.Module):
    """`thinker.model`: token embedding, layers, final norm."""

    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """embeds [B, S, D], attention_mask [B, S] bool (False = left padding) -> final-norm hidden [B, S, D]."""
        S = embeds.shape[1]
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, S]
        cos, sin = rotary_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, embeds.dtype)
        causal = torch.ones(S, S, dtype=torch.bool, device=embeds.device).tril()
        mask = causal[None] & attention_mask[:, None, :]  # [B, S(query), S(key)]
        # A padding query sees no key; let it see itself so its (discarded) output stays finite.
        mask = mask | torch.eye(S, dtype=torch.bool, device=embeds.device)
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, mask[:, None])
        return self.norm(x)
