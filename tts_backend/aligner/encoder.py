"""The audio encoder (`thinker.audio_tower`): log-mel frames -> one embedding per ~77 ms for the text decoder.

Per clip: the frames are cut into chunks of 2 * n_window (1 s); the tail chunk is zero-padded to the longest
chunk of its clip (a one-chunk clip is not padded). Three 3x3 stride-2 convolutions with GELU shrink each chunk
in time and frequency, a bias-free linear maps (channels x remaining bins) to d_model, and a sinusoidal position
embedding that restarts at every chunk is added. The valid outputs of all chunks are concatenated and run through
pre-norm transformer layers (bidirectional, biased projections) that attend within windows of n_window_infer
mel frames (8 s), then a final LayerNorm and a two-layer GELU projection to the decoder width.

Clips are batched with fixed shapes (model.py's buckets), so the pass can be captured as one CUDA graph: row b
holds clip b's frames from frame 0, cut into C chunks of 2 * n_window frames, zeros after. All chunks of all
clips go through the convolutions at once (conv_limits keeps a short clip's outputs those of the reference's
unpadded run), then each row through the transformer, a mask keeping every window to itself and off the padding.

Shapes: B = clips, N = encoder outputs of a clip (padded to the longest), C = downsample channels,
D = d_model, H = heads, Dh = head dim.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import AudioEncoderConfig
from .features import conv_len


def sinusoid_positions(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels]: sin of position x geometric frequencies in the first half, cos in the second."""
    step = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-step * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class EncoderAttention(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.num_heads = cfg.encoder_attention_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, N, D], mask [B, 1, N, N] bool (True = may attend) -> [B, N, D]."""
        B, N, D = x.shape
        q = self.q_proj(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, N, Dh]
        k = self.k_proj(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(B, N, D))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.self_attn = EncoderAttention(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        x = x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # keep fp16 activations finite, as the reference does
            limit = torch.finfo(torch.float16).max - 1000
            x = x.clamp(-limit, limit)
        return x


class AudioEncoder(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.cfg = cfg
        C = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, C, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(C, C, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(C, C, 3, 2, padding=1)
        self.conv_out = nn.Linear(C * conv_len(cfg.num_mel_bins), cfg.d_model, bias=False)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)
        self.register_buffer(
            "positional_embedding", sinusoid_positions(cfg.max_source_positions, cfg.d_model), persistent=False)

    def forward(self, mel: torch.Tensor, conv_limits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """mel [B, M, C * chunk_frames] (each row's clip from frame 0, zeros after), conv_limits [B, C, 2] long
        (the valid outputs of conv2d1 and conv2d2 in each chunk, `conv_limits`), tokens [B] long (each clip's
        encoder outputs, features.encoder_tokens) -> [B, C * conv_len(chunk_frames), output_dim]; row b's
        first tokens[b] outputs are its clip's, the rest padding. Fixed shapes, no host sync: capturable."""
        B, M, T = mel.shape
        chunk = self.cfg.chunk_frames
        C = T // chunk
        chunks = mel.view(B, M, C, chunk).transpose(1, 2).reshape(B * C, 1, M, chunk)
        limits = conv_limits.view(B * C, 2, 1, 1, 1)
        h = F.gelu(self.conv2d1(chunks))
        h = h * (torch.arange(h.shape[-1], device=h.device) < limits[:, 0]).to(h.dtype)
        h = F.gelu(self.conv2d2(h))
        h = h * (torch.arange(h.shape[-1], device=h.device) < limits[:, 1]).to(h.dtype)
        h = F.gelu(self.conv2d3(h))  # [B * C, channels, bins', t']
        n, c, f, t = h.shape
        h = self.conv_out(h.permute(0, 3, 1, 2).reshape(n, t, c * f))  # [B * C, t', D]
        h = h + self.positional_embedding[:t].to(h.dtype)
        # A clip's valid outputs are contiguous: every chunk but its last is full, so they are its first tokens.
        x = h.reshape(B, C * t, -1)
        N = C * t
        position = torch.arange(N, device=x.device)
        window = position // self.window_tokens
        valid = position[None, :] < tokens[:, None]  # [B, N]
        same = window[:, None] == window[None, :]
        # Padding rows attend to themselves only, so no row is fully masked (their outputs are dropped).
        mask = (same[None] & valid[:, None, :]) | torch.eye(N, dtype=torch.bool, device=x.device)
        mask = mask[:, None]  # [B, 1, N, N]
        for layer in self.layers:
            x = layer(x, mask)
        return self.proj2(F.gelu(self.proj1(self.ln_post(x))))

    @property
    def window_tokens(self) -> int:
        """Encoder outputs per attention window: n_window_infer frames' worth of full chunks (104 in the
        release). A clip of one chunk has fewer outputs than that, so it is one window, as the reference's."""
        return conv_len(self.cfg.chunk_frames) * (self.cfg.n_window_infer // self.cfg.chunk_frames)


def conv_limits(frames: list[int], chunks: int, chunk_frames: int) -> np.ndarray:
    """[B, chunks, 2]: the valid outputs of the first two convolutions in each chunk of each clip.

    The reference pads a clip's tail chunk with zeros to the clip's longest chunk, which is a full one when the
    clip has several, and runs a one-chunk clip unpadded. Here every chunk is padded to chunk_frames, so a
    one-chunk clip's convolution outputs past its own length are zeroed after each layer: the next
    convolution's window then sees the zeros the reference's own padding gives it. (The third's outputs past
    the length are dropped.) A full limit masks nothing."""
    full = conv_len(chunk_frames, 1), conv_len(chunk_frames, 2)
    limits = np.empty((len(frames), chunks, 2), np.int64)
    limits[:] = full
    for b, n in enumerate(frames):
        if 0 < n < chunk_frames:
            limits[b, 0] = conv_len(n, 1), conv_len(n, 2)
    return limits
