"""Qwen3-TTS-Tokenizer-12Hz encoder: 24 kHz reference audio -> codes [frames, 16] (the Base models' ICL prompt).

The encoder is Mimi's (spec §4.5): the reference keeps transformers' MimiModel and deletes its decoder half.
Shapes for one clip of T samples (released config: num_filters 64, ratios [8, 6, 5, 4], hidden 512):

    SEANet: causal conv k7 -> [B, 64, T]; for r in 4, 5, 6, 8: residual block (ELU, conv k3 to C/2, ELU, conv k1
            back to C, plus the input), ELU, causal conv k=2r stride r doubling C; ELU, conv k3 -> [B, 512, T/960]
    transformer: 8 pre-LayerNorm layers (RoPE attention, causal over the whole clip, GELU MLP, LayerScale on both
                 branches)                                                                    [B, T/960, 512]
    downsample: causal conv k4 stride 2, replicate padding                                    [B, 512, T/1920]
    split RVQ: the semantic quantizer (1 codebook) and the acoustic one (the rest) each project the same
               embedding to 256 dims and quantize it residually (nearest codebook entry, Euclidean)
                                                                                             [B, 16, T/1920]

Only the first `encoder_valid_num_quantizers` (16) of the 32 trained codebooks are used; residual quantization
makes code k depend only on codebooks <= k, so the later ones are not computed. The config's sliding_window (250)
is not applied: the reference builds a plain causal mask for the encoder transformer, and parity with it is the
contract. Every conv is causal and zero-padded on the left (the downsample repeats its edge instead), with the
extra right padding Mimi adds so that each strided conv sees whole windows.

Module names mirror `speech_tokenizer/model.safetensors` minus its `encoder.` prefix.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .talker import rotary_cos_sin, rotate_half

CODEC_ENCODER_PREFIX = "encoder."


class CodecEncoderConfigError(ValueError):
    pass


@dataclass(frozen=True)
class CodecEncoderConfig:
    """`encoder_config` of `speech_tokenizer/config.json` (transformers' MimiConfig keys) plus the top-level
    `encoder_valid_num_quantizers` and `input_sample_rate`."""

    audio_channels: int
    num_filters: int
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    num_residual_layers: int
    dilation_growth_rate: int
    compress: int
    upsampling_ratios: tuple[int, ...]
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    frame_rate: float
    sampling_rate: int
    codebook_size: int
    codebook_dim: int
    vector_quantization_hidden_dimension: int
    num_quantizers: int
    num_semantic_quantizers: int
    valid_num_quantizers: int

    @classmethod
    def from_dict(cls, d: Mapping) -> "CodecEncoderConfig":
        """The whole speech_tokenizer config (with `encoder_config`)."""
        if "encoder_config" not in d:
            raise CodecEncoderConfigError("speech tokenizer config.json has no encoder_config")
        # The reference's config classes write every attribute, unset ones as null ("_frame_rate": null in a
        # Base checkpoint saved by qwen-tts itself): a null is an absent key here, filled as the reference fills it.
        e = {k: v for k, v in dict(d["encoder_config"]).items() if v is not None}

        absent = object()

        def typed(kind, key: str, default=absent):
            """e[key] as `kind`; an error that names the field when it is missing or of another type."""
            value = e.get(key, default)
            if value is absent:
                raise CodecEncoderConfigError(f"speech tokenizer encoder_config: missing key {key!r}")
            try:
                return kind(value)
            except (TypeError, ValueError):
                raise CodecEncoderConfigError(
                    f"speech tokenizer encoder_config: {key} = {value!r} is not a valid {kind.__name__}") from None

        if not e.get("use_causal_conv", True):
            raise CodecEncoderConfigError("speech tokenizer encoder_config: only causal convolutions are supported")
        if e.get("use_conv_shortcut", False):
            raise CodecEncoderConfigError("speech tokenizer encoder_config: conv shortcuts are not supported")
        if e.get("attention_bias", False):
            raise CodecEncoderConfigError("speech tokenizer encoder_config: attention_bias is not supported")
        if e.get("hidden_act", "gelu") != "gelu":
            raise CodecEncoderConfigError(f"speech tokenizer encoder_config: hidden_act {e['hidden_act']!r}")
        if e.get("pad_mode", "constant") != "constant":
            raise CodecEncoderConfigError(f"speech tokenizer encoder_config: pad_mode {e['pad_mode']!r}")
        def int_tuple(value) -> tuple[int, ...]:
            return tuple(int(v) for v in value)

        heads = typed(int, "num_attention_heads")
        hidden = typed(int, "hidden_size")
        cfg = cls(
            audio_channels=typed(int, "audio_channels", 1),
            num_filters=typed(int, "num_filters"),
            kernel_size=typed(int, "kernel_size"),
            last_kernel_size=typed(int, "last_kernel_size"),
            residual_kernel_size=typed(int, "residual_kernel_size"),
            num_residual_layers=typed(int, "num_residual_layers"),
            dilation_growth_rate=typed(int, "dilation_growth_rate"),
            compress=typed(int, "compress"),
            upsampling_ratios=typed(int_tuple, "upsampling_ratios"),
            hidden_size=hidden,
            intermediate_size=typed(int, "intermediate_size"),
            num_hidden_layers=typed(int, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=typed(int, "num_key_value_heads", heads),
            head_dim=typed(int, "head_dim", hidden // heads),
            norm_eps=typed(float, "norm_eps"),
            rope_theta=typed(float, "rope_theta"),
            frame_rate=typed(float, "_frame_rate", e.get("frame_rate", 0.0)),
            sampling_rate=typed(int, "sampling_rate"),
            codebook_size=typed(int, "codebook_size"),
            codebook_dim=typed(int, "codebook_dim"),
            vector_quantization_hidden_dimension=typed(int, "vector_quantization_hidden_dimension"),
            num_quantizers=typed(int, "num_quantizers"),
            num_semantic_quantizers=typed(int, "num_semantic_quantizers"),
            valid_num_quantizers=(typed(int, "num_quantizers") if d.get("encoder_valid_num_quantizers") is None
                                  else int(d["encoder_valid_num_quantizers"])),
        )
        if cfg.frame_rate <= 0:
            # As MimiConfig.frame_rate: the sampling rate over the encoder's hop (every conv stride: the
            # upsampling ratios, then the stride-2 downsampling layer).
            cfg = dataclasses.replace(cfg, frame_rate=cfg.sampling_rate / cfg.samples_per_frame)
        if not cfg.num_semantic_quantizers <= cfg.valid_num_quantizers <= cfg.num_quantizers:
            raise CodecEncoderConfigError("encoder_valid_num_quantizers must lie between the semantic and the total "
                                          "number of quantizers")
        if cfg.audio_channels != 1:
            raise CodecEncoderConfigError("speech tokenizer encoder: only mono (audio_channels 1) is supported")
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "CodecEncoderConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        try:
            return cls.from_dict(data)
        except CodecEncoderConfigError as exc:
            raise CodecEncoderConfigError(f"{path}: {exc}") from None
        except (TypeError, ValueError) as exc:  # a field of the wrong type: "abc" where a number belongs
            raise CodecEncoderConfigError(f"{path}: speech tokenizer encoder_config: {exc}") from None

    @property
    def samples_per_frame(self) -> int:
        """Input samples per output code frame (1920 for the released config)."""
        return math.prod(self.upsampling_ratios) * self.downsample_stride

    @property
    def downsample_stride(self) -> int:
        return 2

    @property
    def downsample_kernel(self) -> int:
        encodec_frame_rate = math.ceil(self.sampling_rate / math.prod(self.upsampling_ratios))  # as MimiConfig
        return 2 * int(encodec_frame_rate / self.frame_rate)


class CausalConv(nn.Module):
    """Mimi's causal Conv1d: left padding (k_eff - stride), plus right padding so the last window is whole."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, dilation: int = 1, bias: bool = True,
                 pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.effective_kernel = (kernel - 1) * dilation + 1
        self.padding_total = self.effective_kernel - stride
        self.pad_mode = pad_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C_in, L] -> [B, C_out, ceil(L / stride)]
        length = x.shape[-1]
        windows = -(-(length - self.effective_kernel + self.padding_total) // self.stride)  # ceil division
        extra = windows * self.stride + self.effective_kernel - self.padding_total - length
        return self.conv(F.pad(x, (self.padding_total, extra), mode=self.pad_mode))


class ResnetBlock(nn.Module):
    """ELU, conv (k_res, dilation) to C/compress, ELU, conv k1 back to C, plus the input. Indices 1 and 3 of
    `block` are the checkpoint's convs (0 and 2 are the activations)."""

    def __init__(self, cfg: CodecEncoderConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList([nn.ELU(), CausalConv(dim, hidden, cfg.residual_kernel_size, dilation=dilation),
                                    nn.ELU(), CausalConv(hidden, dim, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return x + h


class SEANetEncoder(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        layers: list[nn.Module] = [CausalConv(cfg.audio_channels, cfg.num_filters, cfg.kernel_size)]
        scale = 1
        for ratio in reversed(cfg.upsampling_ratios):
            dim = scale * cfg.num_filters
            for j in range(cfg.num_residual_layers):
                layers.append(ResnetBlock(cfg, dim, cfg.dilation_growth_rate ** j))
            layers += [nn.ELU(), CausalConv(dim, dim * 2, 2 * ratio, stride=ratio)]
            scale *= 2
        layers += [nn.ELU(), CausalConv(scale * cfg.num_filters, cfg.hidden_size, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 1, T] -> [B, hidden, ceil(T / prod(ratios))]
        for layer in self.layers:
            x = layer(x)
        return x


class EncoderAttention(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.cfg = cfg
        H, Hkv, Dh, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(D, H * Dh, bias=False)
        self.k_proj = nn.Linear(D, Hkv * Dh, bias=False)
        self.v_proj = nn.Linear(D, Hkv * Dh, bias=False)
        self.o_proj = nn.Linear(H * Dh, D, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, S, c.num_attention_heads, c.head_dim).transpose(1, 2)  # [B, H, S, Dh]
        k = self.k_proj(x).view(B, S, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = c.num_attention_heads // c.num_key_value_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1)  # [B, H, S, Dh]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class EncoderMLP(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderLayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class EncoderTransformerLayer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = EncoderAttention(cfg)
        self.self_attn_layer_scale = EncoderLayerScale(cfg.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = EncoderMLP(cfg)
        self.mlp_layer_scale = EncoderLayerScale(cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class EncoderTransformer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(EncoderTransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, D] -> [B, S, D]
        positions = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = rotary_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class Codebook(nn.Module):
    """`...layers.{j}.codebook`: centroids are embed_sum / cluster_usage (EMA statistics as trained)."""

    EPS = 1e-5

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("embed_sum", torch.zeros(size, dim))
        self.register_buffer("cluster_usage", torch.ones(size))

    def centroids(self) -> torch.Tensor:  # [size, dim]
        return self.embed_sum / self.cluster_usage.clamp(min=self.EPS)[:, None]

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, dim] -> index of the nearest centroid [N] (Euclidean; torch.cdist as the reference)."""
        return torch.cdist(x[None].float(), self.centroids()[None].float(), p=2)[0].argmin(dim=-1)


class VQLayer(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.codebook = Codebook(size, dim)


class ResidualQuantizer(nn.Module):
    """One half of the split RVQ: a 1x1 input projection, then residual nearest-centroid quantization."""

    def __init__(self, cfg: CodecEncoderConfig, count: int):
        super().__init__()
        self.input_proj = nn.Conv1d(cfg.hidden_size, cfg.vector_quantization_hidden_dimension, 1, bias=False)
        self.layers = nn.ModuleList(VQLayer(cfg.codebook_size, cfg.codebook_dim) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, hidden, F] -> codes [B, count, F]."""
        residual = self.input_proj(x).transpose(1, 2)  # [B, F, dim]
        B, frames, dim = residual.shape
        codes = []
        for layer in self.layers:
            centroids = layer.codebook.centroids()
            index = layer.codebook.nearest(residual.reshape(-1, dim)).view(B, frames)
            residual = residual - F.embedding(index, centroids)
            codes.append(index)
        return torch.stack(codes, dim=1)


class SplitQuantizer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualQuantizer(cfg, semantic)
        self.acoustic_residual_vector_quantizer = ResidualQuantizer(cfg, cfg.valid_num_quantizers - semantic)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, hidden, F] -> [B, valid, F]
        semantic = self.semantic_residual_vector_quantizer(x)
        if not len(self.acoustic_residual_vector_quantizer.layers):
            return semantic
        return torch.cat([semantic, self.acoustic_residual_vector_quantizer(x)], dim=1)


class CodecEncoder(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = SEANetEncoder(cfg)
        self.encoder_transformer = EncoderTransformer(cfg)
        self.downsample = CausalConv(cfg.hidden_size, cfg.hidden_size, cfg.downsample_kernel,
                                     stride=cfg.downsample_stride, bias=False, pad_mode="replicate")
        self.quantizer = SplitQuantizer(cfg)

    @torch.inference_mode()
    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [T] float32 mono at 24 kHz -> codes [ceil(T / 1920), valid_num_quantizers] (long)."""
        weight = self.downsample.conv.weight
        x = audio.to(device=weight.device, dtype=weight.dtype)[None, None]  # [1, 1, T]
        x = self.encoder(x)  # [1, hidden, T/960]
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        x = self.downsample(x)  # [1, hidden, F]
        codes = self.quantizer(x)[0]  # [valid, F]
        frames = -(-audio.shape[-1] // self.cfg.samples_per_frame)
        return codes[:, :frames].T.contiguous()


def is_unused_encoder_tensor(name: str, cfg: CodecEncoderConfig) -> bool:
    """`encoder.*` tensors that are in the official file and not needed to encode: the RVQ output projections
    (decoding direction), the `initialized` flags, and the codebooks past `encoder_valid_num_quantizers`."""
    if name.endswith(".output_proj.weight") or name.endswith(".codebook.initialized"):
        return True
    for half, first_unused in (("semantic_residual_vector_quantizer", cfg.num_semantic_quantizers),
                               ("acoustic_residual_vector_quantizer",
                                cfg.valid_num_quantizers - cfg.num_semantic_quantizers)):
        prefix = f"{CODEC_ENCODER_PREFIX}quantizer.{half}.layers."
        if name.startswith(prefix):
            return int(name[len(prefix):].split(".")[0]) >= first_unused
    return False


def codec_encoder_name_map(encoder: CodecEncoder) -> dict[str, str]:
    """Checkpoint tensor name -> CodecEncoder state-dict name."""
    return {CODEC_ENCODER_PREFIX + name: name for name in encoder.state_dict()}
