"""The audio encoder (`thinker.audio_tower`): log-mel frames -> one embedding per ~77 ms for the text decoder.

Per clip: the frames are cut into chunks of 2 * n_window (1 s); the tail chunk is zero-padded to the longest
chunk of its clip (a one-chunk clip is not padded). Three 3x3 stride-2 convolutions with GELU shrink each chunk
in time and frequency, a bias-free linear maps (channels x remaining bins) to d_model, and a sinusoidal position
embedding that restarts at every chunk is added. The valid outputs of all chunks are concatenated and run through
pre-norm transformer layers (bidirectional, biased projections) that attend within windows of n_window_infer
mel frames (8 s), then a final LayerNorm and a two-layer GELU projection to the decoder width.

Clips are batched through the transformer: each row is one clip, padded to the longest, and a block-diagonal mask
keeps every window to itself. The convolution front end runs per clip, because the padding of a tail chunk
reaches its last outputs and must be exactly the clip's own.

Shapes: B = clips, N = encoder outputs of a clip (padded to the longest), C = downsample channels,
D = d_model, H = heads, Dh = head dim.
"""

from __future__ import annotations

import math

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

    def front_end(self, mel: torch.Tensor) -> torch.Tensor:
        """One clip's mel [M, T] -> conv outputs with positions [N, D]."""
        chunk = self.cfg.chunk_frames
        lengths = [chunk] * (mel.shape[1] // chunk) + ([mel.shape[1] % chunk] if mel.shape[1] % chunk else [])
        width = max(lengths)
        chunks = torch.zeros(len(lengths), 1, mel.shape[0], width, dtype=mel.dtype, device=mel.device)
        for i, piece in enumerate(mel.split(chunk, dim=1)):
            chunks[i, 0, :, : piece.shape[1]] = piece
        h = F.gelu(self.conv2d1(chunks))
        h = F.gelu(self.conv2d2(h))
        h = F.gelu(self.conv2d3(h))  # [chunks, C, bins', t']
        n, c, f, t = h.shape
        h = self.conv_out(h.permute(0, 3, 1, 2).reshape(n, t, c * f))  # [chunks, t', D]
        h = h + self.positional_embedding[:t].to(h.dtype)
        return torch.cat([h[i, : conv_len(length)] for i, length in enumerate(lengths)])

    def window_tokens(self, clip_frames: int) -> int:
        """Encoder outputs per attention window: n_window_infer frames' worth of full chunks (104 in the release).
        A clip of one chunk is one window."""
        if clip_frames <= self.cfg.chunk_frames:
            return conv_len(clip_frames)
        return conv_len(self.cfg.chunk_frames) * (self.cfg.n_window_infer // self.cfg.chunk_frames)

    def forward(self, mels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each clip's log-mel [M, T_b] (features.log_mel) -> its encoder outputs [N_b, output_dim]."""
        fronts = [self.front_end(mel) for mel in mels]
        frames = [mel.shape[1] for mel in mels]
        lengths = [f.shape[0] for f in fronts]
        N = max(lengths)
        x = torch.zeros(len(fronts), N, self.cfg.d_model, dtype=fronts[0].dtype, device=fronts[0].device)
        window_id = torch.full((len(fronts), N), -1, dtype=torch.long, device=x.device)  # -1 = padding
        for b, (front, n) in enumerate(zip(fronts, frames)):
            x[b, : front.shape[0]] = front
            window_id[b, : front.shape[0]] = torch.arange(front.shape[0], device=x.device) // self.window_tokens(n)
        same = window_id[:, :, None] == window_id[:, None, :]
        # Padding rows attend to themselves only, so no row is fully masked (their outputs are dropped).
        mask = (same & (window_id[:, :, None] >= 0)) | torch.eye(N, dtype=torch.bool, device=x.device)
        mask = mask[:, None]  # [B, 1, N, N]
        for layer in self.layers:
            x = layer(x, mask)
        x = self.proj2(F.gelu(self.proj1(self.ln_post(x))))
        return [x[b, :n] for b, n in enumerate(lengths)]
