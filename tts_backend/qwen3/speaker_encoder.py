"""The Base checkpoints' speaker encoder: ECAPA-TDNN, 24 kHz log-mel -> one x-vector per clip.

The x-vector takes the place of a named speaker's embedding row in the prompt (spec §5.10). Pipeline:

    audio [T] float32 at 24 kHz
    log-mel: reflect-pad (n_fft - hop) / 2 each side, STFT (Hann 1024, hop 256, no centring),
             magnitude sqrt(re^2 + im^2 + 1e-9), 128 Slaney mel filters 0..12 kHz, log(max(., 1e-5))  [F, 128]
    blocks.0: TDNN (conv k5 + ReLU)                                                             [C0, F]
    blocks.1..3: SE-Res2Net (TDNN k1, Res2Net of k3 TDNNs with growing dilation, TDNN k1,
                 squeeze-excitation), each with a residual                                       [C, F]
    mfa: TDNN over the concatenated outputs of blocks 1..3                                      [C_mfa, F]
    asp: attentive statistics pooling -> weighted mean and std                                  [2 C_mfa, 1]
    fc: 1x1 conv                                                                                [enc_dim]

Every conv uses 'same' padding with reflection, as the reference does. Module names mirror the checkpoint's
`speaker_encoder.*` tensors (76 of them for the released 5-layer configuration, spec §7.2).
"""

from __future__ import annotations

import functools
import math
import torch
import torch.nn.functional as F
from torch import nn

from .config import SpeakerEncoderConfig

# The reference computes the speaker encoder's log-mel with these fixed settings (`extract_speaker_embedding`).
SAMPLE_RATE = SpeakerEncoderConfig.sample_rate
N_FFT = 1024
HOP = 256
WINDOW = 1024
N_MELS = SpeakerEncoderConfig.mel_dim
F_MIN = 0.0
F_MAX = 12000.0


# ----------------------------------------------------------------------------------------------- log-mel


def _hz_to_mel(hz: float) -> float:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    f_sp = 200.0 / 3
    if hz < 1000.0:
        return hz / f_sp
    return 1000.0 / f_sp + math.log(hz / 1000.0) / (math.log(6.4) / 27.0)


def _mel_to_hz(mel: float) -> float:
    f_sp = 200.0 / 3
    min_log_mel = 1000.0 / f_sp
    if mel < min_log_mel:
        return f_sp * mel
    return 1000.0 * math.exp(math.log(6.4) / 27.0 * (mel - min_log_mel))


def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int, f_min: float, f_max: float) -> torch.Tensor:
    """Triangular mel filters with Slaney area normalisation -> float32 [n_mels, n_fft // 2 + 1].

    Same values as the filter bank the reference takes from librosa (computed in float64, each triangle rounded to
    float32 before its normalisation factor is applied, as librosa's in-place float32 array does)."""
    bins = n_fft // 2 + 1
    fft_freqs = torch.linspace(0, sample_rate / 2, bins, dtype=torch.float64)
    lo, hi = _hz_to_mel(f_min), _hz_to_mel(f_max)
    mel_points = torch.linspace(lo, hi, n_mels + 2, dtype=torch.float64)
    hz_points = torch.tensor([_mel_to_hz(float(m)) for m in mel_points], dtype=torch.float64)
    widths = hz_points[1:] - hz_points[:-1]  # [n_mels + 1]
    ramps = hz_points[:, None] - fft_freqs[None, :]  # [n_mels + 2, bins]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    triangles = torch.clamp(torch.minimum(rising, falling), min=0).to(torch.float32)
    area = 2.0 / (hz_points[2:] - hz_points[:-2])
    return (triangles.to(torch.float64) * area[:, None]).to(torch.float32)


@functools.lru_cache(maxsize=1)
def _speaker_mel_filters() -> torch.Tensor:
    return slaney_mel_filters(SAMPLE_RATE, N_FFT, N_MELS, F_MIN, F_MAX)


def log_mel_spectrogram(audio: torch.Tensor, filters: torch.Tensor | None = None) -> torch.Tensor:
    """audio [B, T] float32 in [-1, 1] at 24 kHz -> log-mel [B, frames, 128] float32 (the speaker encoder's input).

    frames = (T + 2 * 384 - 1024) // 256 + 1 after the reflect padding; T must exceed 384 samples (16 ms)."""
    if filters is None:
        filters = _speaker_mel_filters()
    pad = (N_FFT - HOP) // 2
    if audio.shape[-1] <= pad:
        raise ValueError(f"reference audio of {audio.shape[-1]} samples is too short for the speaker encoder")
    x = F.pad(audio[:, None], (pad, pad), mode="reflect")[:, 0]
    window = torch.hann_window(WINDOW, device=audio.device)
    spec = torch.stft(x, N_FFT, hop_length=HOP, win_length=WINDOW, window=window, center=False,
                      normalized=False, onesided=True, return_complex=True)  # [B, bins, frames]
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = torch.matmul(filters.to(audio.device), magnitude)  # [B, 128, frames]
    return torch.log(torch.clamp(mel, min=1e-5)).transpose(1, 2)


# ----------------------------------------------------------------------------------------------- ECAPA-TDNN


def _same_conv(c_in: int, c_out: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(c_in, c_out, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    """Conv ('same', reflect) + ReLU. `conv` is the checkpoint's `...conv.weight/bias`."""

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int):
        super().__init__()
        self.conv = _same_conv(c_in, c_out, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C_in, F] -> [B, C_out, F]
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    """Channels split into `scale` groups; group 0 passes through, group i > 0 goes through its own TDNN after
    adding the previous group's output (a growing receptive field inside one block)."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int):
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TDNN(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.chunk(x, self.scale, dim=1)
        outputs = [parts[0]]
        previous = None
        for i, part in enumerate(parts[1:]):
            previous = self.blocks[i](part if previous is None else part + previous)
            outputs.append(previous)
        return torch.cat(outputs, dim=1)


class SqueezeExcitation(nn.Module):
    """Channel gates from the time-average: conv1 + ReLU, conv2 + sigmoid, multiplied onto the input."""

    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.conv1 = _same_conv(channels, squeeze, 1)
        self.conv2 = _same_conv(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))  # [B, C, 1]
        return x * gates


class SERes2NetBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, scale: int, squeeze: int, kernel: int, dilation: int):
        super().__init__()
        self.tdnn1 = TDNN(c_in, c_out, 1, 1)
        self.res2net_block = Res2Net(c_out, scale, kernel, dilation)
        self.tdnn2 = TDNN(c_out, c_out, 1, 1)
        self.se_block = SqueezeExcitation(c_out, squeeze)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


class AttentiveStatisticsPooling(nn.Module):
    """Per-channel attention over time (conditioned on the global mean and std), then the attention-weighted
    mean and std: [B, C, F] -> [B, 2C, 1]."""

    EPS = 1e-12

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TDNN(channels * 3, attention_channels, 1, 1)
        self.conv = _same_conv(attention_channels, channels, 1)

    @classmethod
    def _statistics(cls, x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (weights * x).sum(2)
        std = torch.sqrt((weights * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(cls.EPS))
        return mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[-1]
        # Uniform weights 1/F (the reference builds them from an all-ones mask divided by its sum).
        uniform = torch.ones(x.shape[0], 1, frames, dtype=x.dtype, device=x.device)
        uniform = uniform / uniform.sum(dim=2, keepdim=True)
        mean, std = self._statistics(x, uniform)
        context = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, frames), std.unsqueeze(2).expand(-1, -1, frames)], 1)
        attention = F.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = self._statistics(x, attention)
        return torch.cat((mean, std), dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    def __init__(self, cfg: SpeakerEncoderConfig):
        super().__init__()
        self.cfg = cfg
        ch, ks, dil = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        blocks: list[nn.Module] = [TDNN(cfg.mel_dim, ch[0], ks[0], dil[0])]
        for i in range(1, len(ch) - 1):
            blocks.append(SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, ks[i], dil[i]))
        self.blocks = nn.ModuleList(blocks)
        self.mfa = TDNN(sum(ch[1:-1]), ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatisticsPooling(ch[-1], cfg.enc_attention_channels)
        self.fc = _same_conv(ch[-1] * 2, cfg.enc_dim, 1)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """mels [B, frames, 128] -> x-vectors [B, enc_dim]."""
        x = mels.transpose(1, 2)
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1))
        return self.fc(self.asp(x))[..., 0]

    @torch.inference_mode()
    def embed(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [T] float32 mono 24 kHz -> x-vector [enc_dim] in the module's dtype. The log-mel is computed in
        float32 on the module's device, then cast to the module's dtype (what the reference does)."""
        weight = self.fc.weight
        mels = log_mel_spectrogram(audio.to(device=weight.device, dtype=torch.float32)[None])
        return self(mels.to(weight.dtype))[0]
