"""The Qwen3-TTS talker: a Qwen3-style decoder that predicts codebook 0 of each 80 ms frame.

Also home of the pieces the code predictor shares with it (RMSNorm, rotary embedding, the attention block with a
static KV cache, SwiGLU MLP, decoder layer); the codec decoder's transformer reuses RMSNorm, RoPE and the MLP. Module and parameter names mirror the checkpoint
(`talker.model.layers.{i}.self_attn.q_proj.weight` is `Talker.model.layers[i].self_attn.q_proj.weight`), so the
loader maps names by stripping a prefix.

Shapes: B = rows in the batch, S = new positions in this forward, D = hidden size, H = query heads,
Hkv = key/value heads, Dh = head dim, L = KV-cache capacity per slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DecoderStackConfig, TalkerConfig


# Keys a CPU attention reads in whole vectors (below). PyTorch's CPU attention kernel (SDPA's flash kernel)
# reduces each row of scores (max, exp, sum) in vectors of 8 floats (AVX2) or 16 (AVX-512) and a scalar
# tail, so which keys fall in the tail, and with them a row's last bits, follow the attended length: a row
# attending past its own keys (masked) because a longer row shares its batch would not compute what it
# computes alone, and in bf16 that flips a sampled code now and then (tests/test_engine_resume_codes.py, on
# an AVX2 machine). Attending a multiple of ATTEND_MULTIPLE keys puts every row's own keys in whole vectors,
# and the masked keys after them add exact zeros: a row computes the same bits at any attended length.
ATTEND_MULTIPLE = 64


def attend_length(n: int, max_len: int, device: torch.device) -> int:
    """The attended length for `n` keys: on the CPU rounded up to whole vectors (at most `max_len`), so that a
    row's attention does not depend on its batch company; elsewhere `n`."""
    if device.type != "cpu":
        return n
    return min(-(-n // ATTEND_MULTIPLE) * ATTEND_MULTIPLE, max_len)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same numerics as the reference: normalise in fp32, cast back, then scale (spec §2.2).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, S] (int) -> cos, sin [B, 1, S, Dh] in `dtype`; computed in fp32 like the reference."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [Dh/2]
    freqs = positions.float()[..., None] * inv_freq  # [B, S, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # rotate-half pairing: dim i with dim i + Dh/2
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVCache:
    """Static, preallocated key/value cache: one slot per request, positions 0..max_len-1 in each slot.

    k, v: [num_layers, slots, Hkv, max_len, Dh]. A request owns a slot for its lifetime; position p of the slot
    holds the key/value of its p-th token. Nothing is ever moved or compacted, which is what lets a batched
    engine index slots freely and capture CUDA graphs over fixed shapes.
    """

    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
        device: torch.device | str, dtype: torch.dtype,
    ):
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len

    @classmethod
    def for_stack(cls, cfg: DecoderStackConfig, num_slots: int, max_len: int, device, dtype) -> "KVCache":
        return cls(cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, max_len, cfg.head_dim, device, dtype)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderStackConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # over each head's Dh, before RoPE
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, D], cos/sin [B, 1, S, Dh] -> q [B, H, S, Dh], k and v [B, Hkv, S, Dh]: normed, rotated."""
        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, S, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, H, S, Dh] over keys/values [B, Hkv, Lk, Dh], mask [B, 1, S, Lk] bool -> [B, S, D]."""
        B, _, S, _ = q.shape
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # [B,H,S,Dh]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))

    def forward(
        self,
        x: torch.Tensor,  # [B, S, D]
        cos: torch.Tensor,  # [B, 1, S, Dh]
        sin: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,  # [B] slot index of each row
        input_pos: torch.Tensor,  # [B, S] position of each new token within its slot
        mask: torch.Tensor,  # [B, 1, S, Lk] bool, True = may attend
        attend_len: int,  # Lk: only cache positions < attend_len are read
    ) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        k_layer = cache.k[self.layer_idx]  # [slots, Hkv, L, Dh]
        v_layer = cache.v[self.layer_idx]
        # Scatter the new keys/values: row b, token s goes to (slots[b], :, input_pos[b, s]).
        rows = slots[:, None].expand(B, S)
        k_layer[rows, :, input_pos] = k.transpose(1, 2)  # [B, S, Hkv, Dh]
        v_layer[rows, :, input_pos] = v.transpose(1, 2)
        return self.attend(q, k_layer[slots, :, :attend_len], v_layer[slots, :, :attend_len], mask)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderStackConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, cache, slots, input_pos, mask, attend_len) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, slots, input_pos, mask, attend_len)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Layers + final norm; `forward` runs S new positions of B rows against a static KV cache."""

    def __init__(self, cfg: DecoderStackConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def run_layers(
        self,
        x: torch.Tensor,  # [B, S, D]
        cache: KVCache,
        slots: torch.Tensor,  # [B] long
        input_pos: torch.Tensor,  # [B, S] long
        attend_len: int | None = None,
    ) -> torch.Tensor:
        """-> final-norm hidden states [B, S, D]. Causal: a token sees its slot's positions <= its own."""
        attend_len = cache.max_len if attend_len is None else attend_length(attend_len, cache.max_len, x.device)
        cos, sin = rotary_cos_sin(input_pos, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        key_pos = torch.arange(attend_len, device=x.device)
        mask = (key_pos[None, None, :] <= input_pos[:, :, None])[:, None]  # [B, 1, S, Lk]
        for layer in self.layers:
            x = layer(x, cos, sin, cache, slots, input_pos, mask, attend_len)
        return self.norm(x)


class TalkerBackbone(DecoderStack):
    """`talker.model`: the decoder plus the two input embedding tables."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # codes, specials, speakers
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class TextProjection(nn.Module):
    """`talker.text_projection`: text_hidden -> text_hidden -> D, SiLU in between, with biases."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.text_hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.cfg = cfg
        self.model = TalkerBackbone(cfg)
        self.text_projection = TextProjection(cfg)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """T(id): text ids [...] -> [..., D]."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """C(id): codebook-0 codes / special / language / speaker ids [...] -> [..., D]."""
        return self.model.codec_embedding(ids)

    def forward(
        self,
        embeds: torch.Tensor,  # [B, S, D] input embeddings (prompt positions or one frame per row)
        cache: KVCache,
        slots: torch.Tensor,  # [B]
        input_pos: torch.Tensor,  # [B, S]
        attend_len: int | None = None,
    ) -> torch.Tensor:
        """-> final-norm hidden states [B, S, D] (the code predictor consumes these)."""
        return self.model.run_layers(embeds, cache, slots, input_pos, attend_len)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> codec logits [..., vocab] (codebook 0 + specials)."""
        return self.codec_head(hidden)

    def new_cache(self, num_slots: int, max_len: int, device=None, dtype=None) -> KVCache:
        w = self.codec_head.weight
        return KVCache.for_stack(self.cfg, num_slots, max_len, device or w.device, dtype or w.dtype)
