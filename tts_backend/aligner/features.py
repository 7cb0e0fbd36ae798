"""Audio in, log-mel frames out: the front end the aligner was trained with (Whisper's, at 128 mel bins).

16 kHz mono, 25 ms Hann window (n_fft 400), 10 ms hop, centred STFT with reflection at the edges, power spectrum,
Slaney-scale triangular filters normalised to equal area over 0-8 kHz, log10 floored at 1e-10, each clip's
values floored at its own maximum minus 8, then (x + 4) / 4.

Each clip gets its features on its own, as the reference computes a batch of one. (The reference's batched
call pads every clip with zeros to the longest before the STFT, so a shorter clip's last frame sees those zeros
and it keeps one more frame; its word times then depend on which other sentences share its batch. Voxgate
batches sentences of unrelated sessions, so a sentence's times must not depend on them.)
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
MEL_FMAX = 8000.0
MIN_SAMPLES = N_FFT // 2 + 1  # the centred STFT reflects n_fft / 2 samples at each edge

# Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above.
_LINEAR_HZ_PER_MEL = 200.0 / 3
_LOG_START_HZ = 1000.0
_LOG_START_MEL = _LOG_START_HZ / _LINEAR_HZ_PER_MEL
_MELS_PER_LOG_HZ = 27.0 / math.log(6.4)


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / _LINEAR_HZ_PER_MEL
    high = hz >= _LOG_START_HZ
    return np.where(high, _LOG_START_MEL + np.log(np.maximum(hz, 1e-300) / _LOG_START_HZ) * _MELS_PER_LOG_HZ, mel)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    hz = mel * _LINEAR_HZ_PER_MEL
    high = mel >= _LOG_START_MEL
    return np.where(high, _LOG_START_HZ * np.exp((mel - _LOG_START_MEL) / _MELS_PER_LOG_HZ), hz)


@lru_cache(maxsize=4)
def mel_filters(num_mel_bins: int) -> torch.Tensor:
    """[n_fft/2 + 1, num_mel_bins] float32: triangles between consecutive mel-spaced edges, each scaled by
    2 / (its width in Hz) so every filter has the same area."""
    fft_hz = np.linspace(0, SAMPLE_RATE // 2, N_FFT // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(MEL_FMAX), num_mel_bins + 2))
    widths = np.diff(edges)
    offsets = edges[None, :] - fft_hz[:, None]  # [freq, edge]
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    bank = np.maximum(0.0, np.minimum(rising, falling))
    bank *= 2.0 / (edges[2 : num_mel_bins + 2] - edges[:num_mel_bins])
    return torch.from_numpy(bank).float()


def log_mel(clip: np.ndarray, num_mel_bins: int) -> torch.Tensor:
    """A 16 kHz float clip -> features [num_mel_bins, n // HOP] float32."""
    features, frames = batch_log_mel([clip], num_mel_bins)
    return features[0, :, : frames[0]]


def batch_log_mel(clips: list[np.ndarray], num_mel_bins: int, width: int | None = None,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, list[int]]:
    """16 kHz float clips -> features [B, num_mel_bins, width] float32 on `device` (zeros past each clip's
    n // HOP frames) and those frame counts; width defaults to the longest clip's.

    One STFT for the batch: each clip gets its own reflected edges first, then zeros to the common length, so
    every frame it keeps lies within its own samples and edges (a centred frame i spans padded samples
    [i * HOP, i * HOP + N_FFT)), and its floor is its own maximum: a clip's features are the ones it has
    alone."""
    frames = []
    for clip in clips:
        if len(clip) < MIN_SAMPLES:
            raise ValueError(f"audio too short to align: {len(clip)} samples at {SAMPLE_RATE} Hz")
        frames.append(len(clip) // HOP)
    width = max(frames) if width is None else width
    if width < max(frames):
        raise ValueError(f"width {width} is less than the longest clip's {max(frames)} frames")
    edge = N_FFT // 2
    waves = np.zeros((len(clips), (width - 1) * HOP + N_FFT), np.float32)
    for row, clip in zip(waves, clips):
        padded = np.pad(np.asarray(clip, dtype=np.float32), edge, mode="reflect")
        row[: min(len(padded), len(row))] = padded[: len(row)]
    spec = torch.stft(torch.from_numpy(waves).to(device), N_FFT, HOP, window=torch.hann_window(N_FFT, device=device),
                      center=False, return_complex=True)  # [B, freq, width]
    filters = mel_filters(num_mel_bins).to(device)
    log = torch.clamp(filters.T @ spec.abs().square(), min=1e-10).log10()  # [B, mels, width]
    valid = torch.arange(width, device=device)[None, :] < torch.tensor(frames, device=device)[:, None]
    peak = torch.where(valid[:, None, :], log, -torch.inf).amax(dim=(1, 2), keepdim=True)
    features = (torch.maximum(log, peak - 8.0) + 4.0) / 4.0
    return features.masked_fill(~valid[:, None, :], 0.0), frames


def to_16k(pcm: np.ndarray, sample_rate: int) -> np.ndarray:
    """Mono float32 in [-1, 1] at 16 kHz; int16 input is scaled, other rates resampled (soxr HQ, as the reference
    does through librosa). Like the reference, a clip that peaks above 1 is scaled down to peak at 1."""
    audio = np.asarray(pcm)
    if audio.ndim != 1:
        raise ValueError(f"expected mono audio, got shape {audio.shape}")
    if audio.dtype == np.int16:
        audio = audio.astype(np.float32) / 32768.0
    audio = audio.astype(np.float32, copy=False)
    if sample_rate != SAMPLE_RATE and audio.size:
        import soxr

        audio = soxr.resample(audio, sample_rate, SAMPLE_RATE, quality="HQ").astype(np.float32, copy=False)
    peak = float(np.max(np.abs(audio))) if audio.size else 0.0
    if peak > 1.0:
        audio = audio / peak
    return np.clip(audio, -1.0, 1.0)


def encoder_tokens(frames: int, chunk_frames: int) -> int:
    """Audio-encoder outputs for `frames` mel frames: each full chunk gives conv_len(chunk_frames), the tail
    chunk conv_len(its frames); three stride-2 convolutions (kernel 3, padding 1) each map n to (n - 1) // 2 + 1."""
    full, tail = divmod(frames, chunk_frames)
    return full * conv_len(chunk_frames) + (conv_len(tail) if tail else 0)


def conv_len(n: int, layers: int = 3) -> int:
    """Outputs of `layers` of the stride-2 convolutions over n inputs."""
    for _ in range(layers):
        n = (n - 1) // 2 + 1
    return n
