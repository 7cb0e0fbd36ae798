"""Qwen3-TTS-Tokenizer-12Hz decoder ("Code2Wav") in plain PyTorch, with exact state-carrying streaming.

Codes [B, Q, T] (16 codebooks at 12.5 Hz) become 24 kHz audio [B, T * 1920]:

    RVQ dequant (first book + sum of the rest, each half with its own 1x1 projection)   [B, 512, T]
    pre_conv: causal conv k=3                                                          [B, 1024, T]
    pre_transformer: input_proj, 8 sliding-window (72) layers, norm, output_proj        [B, T, 1024]
    upsample x2: ConvTranspose(k=s=2) + ConvNeXt, twice                                [B, 1024, 4T]
    decoder: causal conv k=7, 4 blocks (SnakeBeta, ConvTranspose k=2r s=r, 3 residual
             units with dilations 1/3/9) for r = 8, 5, 4, 3, SnakeBeta, conv k=7, clamp [B, 1, 1920T]

Module and parameter names mirror `speech_tokenizer/model.safetensors` minus its `decoder.` prefix, so the
checkpoint maps one-to-one (see `codec_state_dict_from_checkpoint`).

Streaming. Every stage is causal (design doc qwen3-tts.md §6), so decoding frames [P, P+t) needs only a bounded
summary of frames < P:
  * each causal conv: its last (k-1)*dilation inputs,
  * each transposed conv with kernel k and stride s: its last ceil(k/s)-1 inputs (the overlap of the kernel
    into the next output block),
  * each attention layer: the rotated keys and the values of the last `sliding_window - 1` positions,
  * the number of frames already decoded (the RoPE position of the next frame).
`CodecState` holds exactly these tensors, batch dimension first, preallocated at a fixed size. A fresh
(all-zero) state is the start of a stream: zero conv history equals the reference's zero left padding and
positions < 0 are masked out of attention. `decode(codes)` is `decode_chunk` on a fresh `init_state(B)` (in
pieces of at most 256 frames), so a whole decode and a chunked decode run the same code, and the concatenated
chunks equal the whole decode (to fp32 rounding of different reduction orders; the tests bound it by 1e-5, and
the whole decode matches the reference decoder within 1e-5).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .talker import MLP, RMSNorm, rotary_cos_sin, rotate_half

logger = logging.getLogger(__name__)

__all__ = [
    "CodecDecoderConfig",
    "CodecDecoder",
    "CodecState",
    "codec_state_dict_from_checkpoint",
    "codec_checkpoint_name_map",
    "is_ignored_codec_tensor",
    "CODEC_DECODER_PREFIX",
    "CODEC_ENCODER_PREFIX",
]

CODEC_DECODER_PREFIX = "decoder."
CODEC_ENCODER_PREFIX = "encoder."


# --------------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CodecDecoderConfig:
    """The `decoder_config` block of `speech_tokenizer/config.json` (+ two top-level rates).

    Defaults are the released Qwen3-TTS-Tokenizer-12Hz values (design doc §4.1); `from_dict` reads every field
    from the checkpoint's own file.
    """

    codebook_size: int = 2048
    codebook_dim: int = 512  # RVQ output width; each codebook vector is codebook_dim // 2 wide
    num_quantizers: int = 16
    num_semantic_quantizers: int = 1
    semantic_codebook_size: int = 4096  # stated in the config, not used by the decoder (first book is codebook_size)
    vector_quantization_hidden_dimension: int = 512  # stated in the config, not used by the decoder
    latent_dim: int = 1024
    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    intermediate_size: int = 1024
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int = 72
    layer_scale_initial_scale: float = 0.01
    max_position_embeddings: int = 8000  # not a limit here: RoPE angles are computed for any position
    decoder_dim: int = 1536
    upsampling_ratios: tuple[int, ...] = (2, 2)
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    attention_bias: bool = False
    attention_dropout: float = 0.0
    # top level of speech_tokenizer/config.json
    output_sample_rate: int = 24000
    decode_upsample_rate: int = 1920

    # Keys the HF config serialiser writes into every sub-config; they carry no architecture.
    _GENERIC_KEYS = frozenset(
        {"transformers_version", "model_type", "dtype", "torch_dtype", "architectures", "_name_or_path",
         "return_dict", "output_hidden_states", "output_attentions", "use_cache", "initializer_range"}
    )

    def __post_init__(self) -> None:
        if self.num_semantic_quantizers != 1:
            raise ValueError(
                f"num_semantic_quantizers={self.num_semantic_quantizers}: the 12 Hz decoder splits its RVQ into "
                "exactly 1 first codebook and the rest")
        if self.num_quantizers < 2:
            raise ValueError(f"num_quantizers={self.num_quantizers} must be at least 2")
        if self.codebook_dim % 2:
            raise ValueError(f"codebook_dim={self.codebook_dim} must be even")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r}: only 'silu' is implemented")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1")
        if self.decoder_dim % (2 ** len(self.upsample_rates)):
            raise ValueError("decoder_dim must be divisible by 2**len(upsample_rates)")
        if self.decode_upsample_rate != self.samples_per_frame:
            raise ValueError(
                f"decode_upsample_rate={self.decode_upsample_rate} disagrees with the product of upsampling_ratios "
                f"{list(self.upsampling_ratios)} and upsample_rates {list(self.upsample_rates)} "
                f"({self.samples_per_frame})")

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @property
    def codebook_vector_dim(self) -> int:
        return self.codebook_dim // 2

    @classmethod
    def from_dict(cls, d: Mapping) -> "CodecDecoderConfig":
        """Accepts the whole speech_tokenizer config (with `decoder_config`) or the decoder block alone."""
        if "decoder_config" in d:
            top = {k: d[k] for k in ("output_sample_rate", "decode_upsample_rate") if k in d}
            block = dict(d["decoder_config"])
        else:
            top, block = {}, dict(d)
        names = {f.name for f in fields(cls)}
        values = {}
        for key, value in block.items():
            if value is None and key in names:
                continue  # an unset field as the reference's config classes write it: the released default
            if key in names:
                values[key] = value
            elif key == "rope_scaling":
                if value not in (None, {}) and (value.get("rope_type", value.get("type")) != "default"):
                    raise ValueError(f"codec decoder rope_scaling={value!r}: only plain RoPE is implemented")
            elif key not in cls._GENERIC_KEYS:
                logger.warning("speech tokenizer decoder_config: ignoring unknown key %r=%r", key, value)
        values.update(top)
        if "head_dim" not in values and "hidden_size" in values:
            # the reference falls back to hidden_size // num_attention_heads when head_dim is absent
            values["head_dim"] = values["hidden_size"] // values.get("num_attention_heads", cls.num_attention_heads)
        for key in ("upsampling_ratios", "upsample_rates"):
            if key in values:
                values[key] = tuple(int(v) for v in values[key])
        if "rope_theta" in values:
            values["rope_theta"] = float(values["rope_theta"])
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | Path) -> "CodecDecoderConfig":
        """Reads `speech_tokenizer/config.json` (or a folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


# --------------------------------------------------------------------------------------------------------------
# Streaming state
# --------------------------------------------------------------------------------------------------------------


@dataclass
class CodecState:
    """Per-stream decoder state; every tensor is batch-first, one row per stream.

    `tensors` maps a module path (e.g. "decoder.1.block.2.conv1") to its history buffer and "positions" to a
    LongTensor [B] with the number of frames each stream has decoded. All-zero rows are fresh streams.

    How an engine batches streams (each with its own state):
        pool = decoder.init_state(max_streams)       # one preallocated row ("slot") per stream
        pool.reset_(rows)                            # slot(s) handed to new stream(s)
        batch = pool.index_select(rows)              # gather the rows decoded together (or
                                                     #   static.copy_rows_from_(pool, rows) into a static state)
        wav = decoder.decode_chunk(codes, batch)     # codes [len(rows), Q, t]; updates `batch` in place
        pool.index_copy_(rows, batch)                # scatter the advanced state back
    Rows in one call may be at different positions; they must decode the same number of frames t.
    """

    tensors: dict[str, Tensor] = field(default_factory=dict)

    @property
    def positions(self) -> Tensor:
        return self.tensors["positions"]

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    def nbytes_per_stream(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    def index_select(self, rows: Tensor | Sequence[int]) -> "CodecState":
        """A new state holding copies of `rows` (in that order)."""
        rows = self._rows(rows)
        return CodecState({k: t.index_select(0, rows) for k, t in self.tensors.items()})

    def copy_rows_from_(self, source: "CodecState", rows: Tensor | Sequence[int]) -> "CodecState":
        """self[i] = source[rows[i]] in place (keeps self's storage, e.g. CUDA-graph static inputs)."""
        rows = self._rows(rows)
        for k, t in self.tensors.items():
            torch.index_select(source.tensors[k], 0, rows, out=t)
        return self

    def index_copy_(self, rows: Tensor | Sequence[int], source: "CodecState") -> "CodecState":
        """self[rows[i]] = source[i] in place."""
        rows = self._rows(rows)
        for k, t in self.tensors.items():
            t.index_copy_(0, rows, source.tensors[k])
        return self

    def reset_(self, rows: Tensor | Sequence[int] | None = None) -> "CodecState":
        """Zero the given rows (all rows if None): those streams start over at frame 0."""
        for t in self.tensors.values():
            if rows is None:
                t.zero_()
            else:
                t.index_fill_(0, self._rows(rows), 0)
        return self

    def clone(self) -> "CodecState":
        return CodecState({k: t.clone() for k, t in self.tensors.items()})

    @staticmethod
    def cat(states: Iterable["CodecState"]) -> "CodecState":
        states = list(states)
        return CodecState({k: torch.cat([s.tensors[k] for s in states]) for k in states[0].tensors})

    def split(self) -> list["CodecState"]:
        """One single-row state per stream (views)."""
        return [CodecState({k: t[i:i + 1] for k, t in self.tensors.items()}) for i in range(self.batch_size)]

    def _rows(self, rows: Tensor | Sequence[int]) -> Tensor:
        if not isinstance(rows, Tensor):
            rows = torch.tensor(list(rows), dtype=torch.long)
        return rows.to(device=self.positions.device, dtype=torch.long)


# --------------------------------------------------------------------------------------------------------------
# Building blocks (each stateful module knows its key in CodecState.tensors)
# --------------------------------------------------------------------------------------------------------------


class _Stateful(nn.Module):
    state_key: str = ""  # set by CodecDecoder after construction to the module's path

    def state_shape(self) -> tuple[int, ...] | None:  # per-stream shape, None = no state
        return None


class CausalConv1d(_Stateful):
    """Conv1d left-padded by (k-1)*dilation; streaming keeps that many past inputs."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.history = (kernel_size - 1) * dilation

    def state_shape(self):
        return (self.conv.in_channels, self.history) if self.history else None

    def forward(self, x: Tensor, state: CodecState) -> Tensor:
        # x [B, C_in, t] -> [B, C_out, t]
        if not self.history:
            return self.conv(x)
        past = state.tensors[self.state_key]  # [B, C_in, history]
        window = torch.cat([past, x], dim=2)  # [B, C_in, history + t]
        past.copy_(window[:, :, -self.history:])
        return self.conv(window)


class CausalConvTranspose1d(_Stateful):
    """ConvTranspose1d whose k - s trailing samples are dropped (the reference trims on the right only).

    Output block n (samples n*s .. n*s+s-1) is the sum of the kernel contributions of inputs n, n-1, ...,
    n - (ceil(k/s)-1), so streaming keeps the last ceil(k/s)-1 inputs and re-runs them in front of new input.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.history = -(-kernel_size // stride) - 1

    def state_shape(self):
        return (self.conv.in_channels, self.history) if self.history else None

    def forward(self, x: Tensor, state: CodecState) -> Tensor:
        # x [B, C_in, t] -> [B, C_out, t * stride]
        t = x.shape[2]
        if self.history:
            past = state.tensors[self.state_key]  # [B, C_in, history]
            x = torch.cat([past, x], dim=2)  # [B, C_in, history + t]
            past.copy_(x[:, :, -self.history:])
        y = self.conv(x)  # [B, C_out, (history + t - 1) * s + k]
        start = self.history * self.stride  # blocks of the history inputs were emitted by earlier calls
        return y[:, :, start:start + t * self.stride]


class SnakeBeta(nn.Module):
    """y = x + sin^2(x * e^alpha) / (e^beta + 1e-9), per channel; alpha/beta stored in log space."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor) -> Tensor:
        # x [B, C, t]
        alpha = torch.exp(self.alpha)[None, :, None]
        beta = torch.exp(self.beta)[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, state: CodecState) -> Tensor:
        # x [B, C, t]
        h = self.dwconv(x, state).transpose(1, 2)  # [B, t, C]
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, kernel_size=1)

    def forward(self, x: Tensor, state: CodecState) -> Tensor:
        h = self.conv1(self.act1(x), state)
        return x + self.conv2(self.act2(h), state)


class DecoderBlock(nn.Module):
    """SnakeBeta -> ConvTranspose (k=2r, s=r) -> residual units with dilations 1, 3, 9."""

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
            + [ResidualUnit(out_dim, d) for d in (1, 3, 9)]
        )

    def forward(self, x: Tensor, state: CodecState) -> Tensor:
        # x [B, in_dim, n] -> [B, out_dim, n * rate]
        x = self.block[0](x)
        for module in self.block[1:]:
            x = module(x, state)
        return x


class LayerScale(nn.Module):
    def __init__(self, dim: int, initial: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), initial))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class SlidingWindowAttention(_Stateful):
    """Causal attention over the last `sliding_window` positions (current one included); no QK-norm.

    State: rotated keys and values of the `sliding_window - 1` positions before the chunk,
    [B, 2, H_kv, W-1, head_dim] (index 0 keys, 1 values), oldest first.
    """

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.window = c.sliding_window
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)

    def state_shape(self):
        return (2, self.num_kv_heads, self.window - 1, self.head_dim) if self.window > 1 else None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, state: CodecState) -> Tensor:
        # x [B, t, hidden]; rope: cos, sin [B, 1, t, hd]; mask [B, 1, t, W-1+t] (True = may attend)
        bsz, t, _ = x.shape
        hd, past_len = self.head_dim, self.window - 1
        q = self.q_proj(x).view(bsz, t, self.num_heads, hd).transpose(1, 2)  # [B, H, t, hd]
        k = self.k_proj(x).view(bsz, t, self.num_kv_heads, hd).transpose(1, 2)  # [B, Hkv, t, hd]
        v = self.v_proj(x).view(bsz, t, self.num_kv_heads, hd).transpose(1, 2)
        cos, sin = rope
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past_len:
            past = state.tensors[self.state_key]  # [B, 2, Hkv, W-1, hd]
            keys = torch.cat([past[:, 0], k], dim=2)  # [B, Hkv, W-1+t, hd]
            values = torch.cat([past[:, 1], v], dim=2)
            past.copy_(torch.stack([keys[:, :, -past_len:], values[:, :, -past_len:]], dim=1))
        else:
            keys, values = k, v
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=hd ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, t, self.num_heads * hd))  # [B, t, hidden]


class TransformerLayer(nn.Module):
    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        self.self_attn = SlidingWindowAttention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)

    def forward(self, h: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, state: CodecState) -> Tensor:
        h = h + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(h), rope, mask, state))
        return h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h)))


class PreTransformer(nn.Module):
    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        self.input_proj = nn.Linear(config.latent_dim, config.hidden_size)
        self.layers = nn.ModuleList([TransformerLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output_proj = nn.Linear(config.hidden_size, config.latent_dim)
        self.head_dim, self.rope_theta, self.window = config.head_dim, config.rope_theta, config.sliding_window

    def rope_and_mask(self, positions: Tensor, t: int, dtype: torch.dtype) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """RoPE tables and the sliding-window mask for t new frames of streams at `positions` [B]; shared by
        all layers. Key j of the attention sits at position positions - (W-1) + j (history first, then the new
        frames); query i (position positions + i) sees the keys in (q - W, q] that exist (position >= 0)."""
        device, hd, past_len = positions.device, self.head_dim, self.window - 1
        query_pos = positions[:, None] + torch.arange(t, device=device)[None, :]  # [B, t]
        rope = rotary_cos_sin(query_pos, hd, self.rope_theta, dtype)  # cos, sin [B, 1, t, hd]
        key_pos = positions[:, None] - past_len + torch.arange(past_len + t, device=device)[None, :]  # [B, W-1+t]
        distance = query_pos[:, :, None] - key_pos[:, None, :]  # [B, t, W-1+t]
        mask = (distance >= 0) & (distance < self.window) & (key_pos[:, None, :] >= 0)
        return rope, mask[:, None]

    def forward(self, x: Tensor, state: CodecState) -> Tensor:
        # x [B, t, latent] -> [B, t, latent]
        h = self.input_proj(x)
        rope, mask = self.rope_and_mask(state.positions, x.shape[1], h.dtype)
        for layer in self.layers:
            h = layer(h, rope, mask, state)
        return self.output_proj(self.norm(h))


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))
        self.cluster_usage = nn.Parameter(torch.ones(size))

    def lookup(self, codes: Tensor) -> Tensor:
        # codes [B, t] -> [B, t, dim]. Row-wise embedding_sum / max(usage, 1e-5), computed for the looked-up rows
        # only: the same per-element division as normalising the whole table first.
        usage = self.cluster_usage.clamp(min=1e-5)
        return F.embedding(codes, self.embedding_sum) / F.embedding(codes, usage[:, None])


class _CodebookList(nn.Module):
    def __init__(self, count: int, size: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleList([_VQLayer(size, dim) for _ in range(count)])


class _VQLayer(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _RVQHalf(nn.Module):
    """Codebooks whose vectors are summed (in codebook_dim/2) and then projected by one 1x1 conv."""

    def __init__(self, count: int, size: int, dim: int, out_dim: int):
        super().__init__()
        self.vq = _CodebookList(count, size, dim)
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)

    def forward(self, codes: Tensor) -> Tensor:
        # codes [B, n, t] -> [B, out_dim, t]
        total = 0
        for i, layer in enumerate(self.vq.layers):
            total = total + layer._codebook.lookup(codes[:, i])
        return self.output_proj(total.transpose(1, 2))


class SplitRVQDecoder(nn.Module):
    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        dim = config.codebook_vector_dim
        self.rvq_first = _RVQHalf(1, config.codebook_size, dim, config.codebook_dim)
        self.rvq_rest = _RVQHalf(config.num_quantizers - 1, config.codebook_size, dim, config.codebook_dim)

    def forward(self, codes: Tensor) -> Tensor:
        # codes [B, Q, t] -> [B, codebook_dim, t]
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


# --------------------------------------------------------------------------------------------------------------
# The decoder
# --------------------------------------------------------------------------------------------------------------


class CodecDecoder(nn.Module):
    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        c = self.config = config
        self.quantizer = SplitRVQDecoder(c)
        self.pre_conv = CausalConv1d(c.codebook_dim, c.latent_dim, kernel_size=3)
        self.pre_transformer = PreTransformer(c)
        self.upsample = nn.ModuleList(
            [nn.ModuleList([CausalConvTranspose1d(c.latent_dim, c.latent_dim, r, r), ConvNeXtBlock(c.latent_dim)])
             for r in c.upsampling_ratios]
        )
        blocks: list[nn.Module] = [CausalConv1d(c.latent_dim, c.decoder_dim, kernel_size=7)]
        for i, rate in enumerate(c.upsample_rates):
            blocks.append(DecoderBlock(c.decoder_dim // 2 ** i, c.decoder_dim // 2 ** (i + 1), rate))
        out_dim = c.decoder_dim // 2 ** len(c.upsample_rates)
        blocks += [SnakeBeta(out_dim), CausalConv1d(out_dim, 1, kernel_size=7)]
        self.decoder = nn.ModuleList(blocks)
        self._stateful = [(name, m) for name, m in self.named_modules() if isinstance(m, _Stateful)]
        for name, module in self._stateful:
            module.state_key = name

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-stream shape of every state tensor (without the batch dimension)."""
        shapes = {name: m.state_shape() for name, m in self._stateful}
        return {name: s for name, s in shapes.items() if s is not None}

    def init_state(self, batch_size: int, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> CodecState:
        """A zeroed state for `batch_size` fresh streams (dtype/device of the weights by default)."""
        weight = self.pre_conv.conv.weight
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        tensors = {name: torch.zeros((batch_size, *shape), device=device, dtype=dtype)
                   for name, shape in self.state_shapes().items()}
        tensors["positions"] = torch.zeros(batch_size, device=device, dtype=torch.long)
        return CodecState(tensors)

    @torch.no_grad()
    def decode_chunk(self, codes: Tensor, state: CodecState) -> Tensor:
        """Decode the next t frames of each stream: codes [B, Q, t] -> wav [B, t * samples_per_frame].

        Updates `state` in place (its tensors keep their storage). No range checks here (hot path): codes must
        lie in [0, codebook_size).
        """
        if codes.dim() != 3 or codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"codes must be [B, {self.config.num_quantizers}, t], got {list(codes.shape)}")
        if codes.shape[0] != state.batch_size:
            raise ValueError(f"codes batch {codes.shape[0]} != state batch {state.batch_size}")
        if codes.shape[2] == 0:
            return codes.new_zeros((codes.shape[0], 0), dtype=state.tensors["pre_conv"].dtype)
        x = self.quantizer(codes)  # [B, codebook_dim, t]
        x = self.pre_conv(x, state).transpose(1, 2)  # [B, t, latent]
        x = self.pre_transformer(x, state).transpose(1, 2)  # [B, latent, t]
        for transposed, convnext in self.upsample:
            x = convnext(transposed(x, state), state)  # [B, latent, t * prod(ratios so far)]
        x = self.decoder[0](x, state)  # [B, decoder_dim, 4t]
        for block in self.decoder[1:-2]:
            x = block(x, state)
        wav = self.decoder[-1](self.decoder[-2](x), state)  # [B, 1, t * samples_per_frame]
        state.positions.add_(codes.shape[2])
        return wav.clamp(-1.0, 1.0).squeeze(1)

    @torch.inference_mode()
    def decode(self, codes: Tensor, max_frames_per_call: int = 256) -> Tensor:
        """Whole-sequence decode: codes [B, Q, T] (values in [0, codebook_size)) -> wav [B, T * 1920].

        Exact for any T. The reference wrapper (qwen-tts `chunked_decode`) instead decodes more than 300 frames in
        300-frame windows, each re-decoding 25 frames of context from a fresh start, so its samples from frame
        300 on differ from this (design doc §4.4); padding codes (-1) must be removed by the caller, not clamped.
        Long inputs go through decode_chunk in pieces of `max_frames_per_call` frames (same result, attention
        memory bounded by pieces x (window + pieces) instead of T x T).
        """
        if codes.dim() != 3 or codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"codes must be [B, {self.config.num_quantizers}, T], got {list(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.config.codebook_size):
            raise ValueError(f"codes must lie in [0, {self.config.codebook_size}), got "
                             f"[{int(codes.min())}, {int(codes.max())}]")
        state = self.init_state(codes.shape[0], device=codes.device)
        pieces = [self.decode_chunk(codes[:, :, start:start + max_frames_per_call], state)
                  for start in range(0, codes.shape[2], max_frames_per_call)]
        return torch.cat(pieces, dim=1) if pieces else self.decode_chunk(codes, state)


# --------------------------------------------------------------------------------------------------------------
# Checkpoint mapping
# --------------------------------------------------------------------------------------------------------------

# In the official file but not used to decode: the RVQ input projections belong to the encoding direction.
UNUSED_DECODER_KEYS = frozenset(
    {"decoder.quantizer.rvq_first.input_proj.weight", "decoder.quantizer.rvq_rest.input_proj.weight"})


def is_ignored_codec_tensor(name: str) -> bool:
    """Tensors of speech_tokenizer/model.safetensors that are present in the official file and deliberately not
    loaded: the whole Mimi encoder (`encoder.*`, used only to encode reference audio) and the decoder's two RVQ
    input projections."""
    return name.startswith(CODEC_ENCODER_PREFIX) or name in UNUSED_DECODER_KEYS


def codec_checkpoint_name_map(decoder: CodecDecoder) -> dict[str, str]:
    """Checkpoint tensor name -> CodecDecoder state-dict name, for every tensor the decoder needs."""
    return {CODEC_DECODER_PREFIX + name: name for name in decoder.state_dict()}


def codec_state_dict_from_checkpoint(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """CodecDecoder state dict from the tensors of speech_tokenizer/model.safetensors.

    Ignored tensors (see `is_ignored_codec_tensor`) are dropped; any name outside `decoder.*`/`encoder.*` is an
    error. Completeness and shapes are checked by the strict loader (or `load_state_dict(strict=True)`)."""
    out, unknown = {}, []
    for name, tensor in tensors.items():
        if is_ignored_codec_tensor(name):
            continue
        if not name.startswith(CODEC_DECODER_PREFIX):
            unknown.append(name)
            continue
        out[name[len(CODEC_DECODER_PREFIX):]] = tensor
    if unknown:
        raise ValueError(f"speech tokenizer checkpoint has tensors outside encoder.*/decoder.*: {sorted(unknown)[:5]}")
    return out
