"""Writes a Qwen3-TTS speech tokenizer (`speech_tokenizer/`) with random weights in the official layout.

The files and tensor names are those of the released Qwen3-TTS-Tokenizer-12Hz (design doc qwen3-tts.md §4.1,
§4.5, §7.1, §7.3): `config.json` with the decoder and the Mimi encoder blocks, `model.safetensors` in float32
holding the decoder, its two unused RVQ input projections and the whole Mimi encoder, `preprocessor_config.json`
and `configuration.json`. Every parameter is random and non-trivial (SnakeBeta alpha/beta, ConvNeXt gamma,
LayerScale, norms, codebook usage), so a decoder that ignores one of them produces different audio.

`size="full"` gives the released shapes (170,557,441 values, 682 MB); `size="tiny"` the CPU configuration of
§9.3 (about 0.13 M decoder parameters), whose codebook_size/num_quantizers match the tiny Talker of the same
section.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file
from torch import nn

from tts_backend.qwen3.codec import (
    CodecDecoder, CodecDecoderConfig, ConvNeXtBlock, LayerScale, ResidualUnit, RMSNorm, SnakeBeta)

__all__ = [
    "FULL_SPEECH_TOKENIZER_CONFIG",
    "TINY_SPEECH_TOKENIZER_CONFIG",
    "speech_tokenizer_config",
    "speech_tokenizer_tensor_shapes",
    "write_speech_tokenizer",
]

FULL_SPEECH_TOKENIZER_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3TTSTokenizerV2Model"],
    "model_type": "qwen3_tts_tokenizer_12hz",
    "encoder_valid_num_quantizers": 16,
    "input_sample_rate": 24000,
    "output_sample_rate": 24000,
    "decode_upsample_rate": 1920,
    "encode_downsample_rate": 1920,
    "decoder_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "latent_dim": 1024,
        "codebook_dim": 512,
        "codebook_size": 2048,
        "decoder_dim": 1536,
        "hidden_act": "silu",
        "hidden_size": 512,
        "intermediate_size": 1024,
        "layer_scale_initial_scale": 0.01,
        "max_position_embeddings": 8000,
        "head_dim": 64,
        "num_attention_heads": 16,
        "num_hidden_layers": 8,
        "num_key_value_heads": 16,
        "num_quantizers": 16,
        "num_semantic_quantizers": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000,
        "semantic_codebook_size": 4096,
        "sliding_window": 72,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "vector_quantization_hidden_dimension": 512,
    },
    "encoder_config": {
        "_frame_rate": 12.5,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "audio_channels": 1,
        "codebook_dim": 256,
        "codebook_size": 2048,
        "compress": 2,
        "dilation_growth_rate": 2,
        "dtype": "float32",
        "head_dim": 64,
        "hidden_act": "gelu",
        "hidden_size": 512,
        "initializer_range": 0.02,
        "intermediate_size": 2048,
        "kernel_size": 7,
        "last_kernel_size": 3,
        "layer_scale_initial_scale": 0.01,
        "max_position_embeddings": 8000,
        "norm_eps": 1e-05,
        "normalize": False,
        "num_attention_heads": 8,
        "num_filters": 64,
        "num_hidden_layers": 8,
        "num_key_value_heads": 8,
        "num_quantizers": 32,
        "num_residual_layers": 1,
        "num_semantic_quantizers": 1,
        "pad_mode": "constant",
        "residual_kernel_size": 3,
        "rope_theta": 10000.0,
        "sampling_rate": 24000,
        "sliding_window": 250,
        "transformers_version": "4.57.0.dev0",
        "trim_right_ratio": 1.0,
        "upsample_groups": 512,
        "upsampling_ratios": [8, 6, 5, 4],
        "use_cache": False,
        "use_causal_conv": True,
        "use_conv_shortcut": False,
        "use_streaming": False,
        "vector_quantization_hidden_dimension": 256,
    },
    "transformers_version": "4.57.3",
}

# Design doc §9.3: the tiny configuration verified to run in qwen-tts 0.1.1 on CPU.
_TINY_DECODER = {
    "codebook_size": 64, "codebook_dim": 16, "hidden_size": 32, "head_dim": 8, "num_attention_heads": 4,
    "num_key_value_heads": 4, "intermediate_size": 64, "num_hidden_layers": 2, "latent_dim": 24, "decoder_dim": 32,
    "num_quantizers": 4, "sliding_window": 72, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
}
_TINY_ENCODER = {
    "hidden_size": 32, "num_filters": 4, "num_hidden_layers": 1, "intermediate_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 4, "head_dim": 8, "codebook_size": 64, "codebook_dim": 16, "num_quantizers": 8,
    "vector_quantization_hidden_dimension": 16, "upsample_groups": 32,
}
TINY_SPEECH_TOKENIZER_CONFIG: dict[str, Any] = copy.deepcopy(FULL_SPEECH_TOKENIZER_CONFIG)
TINY_SPEECH_TOKENIZER_CONFIG["encoder_valid_num_quantizers"] = 4
TINY_SPEECH_TOKENIZER_CONFIG["decoder_config"].update(_TINY_DECODER)
TINY_SPEECH_TOKENIZER_CONFIG["encoder_config"].update(_TINY_ENCODER)

# EncodecFeatureExtractor settings of the released file (234 bytes as written here).
_PREPROCESSOR_CONFIG = {
    "chunk_length_s": None,
    "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1,
    "overlap": None,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 24000,
}
# ModelScope metadata file shipped beside the weights; no loader reads it.
_CONFIGURATION = {"framework": "pytorch", "task": "text-to-speech", "allow_remote": True}


def speech_tokenizer_config(size: str = "tiny", decoder_overrides: Mapping[str, Any] | None = None) -> dict:
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    config = copy.deepcopy(TINY_SPEECH_TOKENIZER_CONFIG if size == "tiny" else FULL_SPEECH_TOKENIZER_CONFIG)
    config["decoder_config"].update(decoder_overrides or {})
    return config


def _mimi_encoder_shapes(enc: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names/shapes of transformers' MimiModel encoder half (what Qwen3TTSTokenizerV2Encoder keeps)."""
    shapes: dict[str, tuple[int, ...]] = {}
    p = "encoder."
    nf, k = enc["num_filters"], enc["kernel_size"]
    index = 0

    def conv(name: str, c_in: int, c_out: int, kernel: int, bias: bool = True) -> None:
        shapes[f"{name}.conv.weight"] = (c_out, c_in, kernel)
        if bias:
            shapes[f"{name}.conv.bias"] = (c_out,)

    conv(f"{p}encoder.layers.{index}", enc["audio_channels"], nf, k)
    index += 1
    scale = 1
    for ratio in reversed(enc["upsampling_ratios"]):
        dim = scale * nf
        for _ in range(enc["num_residual_layers"]):  # resnet block: ELU, conv k_res, ELU, conv 1
            conv(f"{p}encoder.layers.{index}.block.1", dim, dim // enc["compress"], enc["residual_kernel_size"])
            conv(f"{p}encoder.layers.{index}.block.3", dim // enc["compress"], dim, 1)
            index += 1
        index += 1  # ELU
        conv(f"{p}encoder.layers.{index}", dim, dim * 2, 2 * ratio)
        index += 1
        scale *= 2
    index += 1  # ELU
    conv(f"{p}encoder.layers.{index}", scale * nf, enc["hidden_size"], enc["last_kernel_size"])

    hidden, heads, kv_heads, hd = enc["hidden_size"], enc["num_attention_heads"], enc["num_key_value_heads"], enc["head_dim"]
    for i in range(enc["num_hidden_layers"]):
        layer = f"{p}encoder_transformer.layers.{i}."
        shapes[layer + "self_attn.q_proj.weight"] = (heads * hd, hidden)
        shapes[layer + "self_attn.k_proj.weight"] = (kv_heads * hd, hidden)
        shapes[layer + "self_attn.v_proj.weight"] = (kv_heads * hd, hidden)
        shapes[layer + "self_attn.o_proj.weight"] = (hidden, heads * hd)
        shapes[layer + "mlp.fc1.weight"] = (enc["intermediate_size"], hidden)
        shapes[layer + "mlp.fc2.weight"] = (hidden, enc["intermediate_size"])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[layer + norm + ".weight"] = (hidden,)
            shapes[layer + norm + ".bias"] = (hidden,)
        shapes[layer + "self_attn_layer_scale.scale"] = (hidden,)
        shapes[layer + "mlp_layer_scale.scale"] = (hidden,)

    encodec_frame_rate = enc["sampling_rate"] / math.prod(enc["upsampling_ratios"])
    downsample_kernel = 2 * int(encodec_frame_rate / enc["_frame_rate"])
    shapes[f"{p}downsample.conv.weight"] = (hidden, hidden, downsample_kernel)

    vq_dim, cb_dim, cb_size = enc["vector_quantization_hidden_dimension"], enc["codebook_dim"], enc["codebook_size"]
    n_semantic = enc["num_semantic_quantizers"]
    for rvq, count in (("semantic_residual_vector_quantizer", n_semantic),
                       ("acoustic_residual_vector_quantizer", enc["num_quantizers"] - n_semantic)):
        base = f"{p}quantizer.{rvq}."
        for j in range(count):
            shapes[f"{base}layers.{j}.codebook.initialized"] = (1,)
            shapes[f"{base}layers.{j}.codebook.cluster_usage"] = (cb_size,)
            shapes[f"{base}layers.{j}.codebook.embed_sum"] = (cb_size, cb_dim)
        shapes[f"{base}input_proj.weight"] = (vq_dim, hidden, 1)
        shapes[f"{base}output_proj.weight"] = (hidden, vq_dim, 1)
    return shapes


def _decoder_unused_shapes(dec: CodecDecoderConfig) -> dict[str, tuple[int, ...]]:
    half = dec.codebook_vector_dim
    return {f"decoder.quantizer.{rvq}.input_proj.weight": (half, dec.codebook_dim, 1) for rvq in ("rvq_first", "rvq_rest")}


def speech_tokenizer_tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the official speech_tokenizer/model.safetensors for this config, with its shape."""
    dec = CodecDecoderConfig.from_dict(config)
    with torch.device("meta"):
        decoder = CodecDecoder(dec)
    shapes = {f"decoder.{name}": tuple(t.shape) for name, t in decoder.state_dict().items()}
    shapes.update(_decoder_unused_shapes(dec))
    shapes.update(_mimi_encoder_shapes(config["encoder_config"]))
    return shapes


def _randomise_decoder(decoder: CodecDecoder, generator: torch.Generator) -> None:
    """Random values with roughly unit-variance activations, so the waveform is neither silent nor clipped."""

    def normal(t: torch.Tensor, mean: float, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=generator) * std + mean)

    for module in decoder.modules():
        if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d, nn.Linear)):
            w = module.weight
            if isinstance(module, nn.ConvTranspose1d):
                fan_in = w.shape[0] * w.shape[2] / module.stride[0]
            else:
                fan_in = w[0].numel()
            normal(w, 0.0, 1.0 / math.sqrt(fan_in))
            if module.bias is not None:
                normal(module.bias, 0.0, 0.05)
        elif isinstance(module, SnakeBeta):
            normal(module.alpha, 0.0, 0.2)
            normal(module.beta, 0.5, 0.2)
        elif isinstance(module, ConvNeXtBlock):
            normal(module.gamma, 0.2, 0.05)
            normal(module.norm.weight, 1.0, 0.1)
            normal(module.norm.bias, 0.0, 0.1)
        elif isinstance(module, LayerScale):
            normal(module.scale, 0.3, 0.1)
        elif isinstance(module, RMSNorm):
            normal(module.weight, 1.0, 0.1)
    # Keep the waveform stages from growing ~3x per block (three residual additions each) and the output mostly
    # inside [-1, 1]: smaller residual branches and a small final conv.
    for module in decoder.modules():
        if isinstance(module, ResidualUnit):
            module.conv2.conv.weight.mul_(0.3)
    decoder.decoder[-1].conv.weight.mul_(0.12)
    for layer_list in (decoder.quantizer.rvq_first.vq.layers, decoder.quantizer.rvq_rest.vq.layers):
        for layer in layer_list:
            normal(layer._codebook.embedding_sum, 0.0, 1.0)
            layer._codebook.cluster_usage.copy_(0.5 + 1.5 * torch.rand(layer._codebook.cluster_usage.shape,
                                                                       generator=generator))


def _random_like_name(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if name.endswith(".initialized"):
        return torch.ones(shape)
    if name.endswith("cluster_usage"):
        return 0.5 + 1.5 * torch.rand(shape, generator=generator)
    if len(shape) == 1:
        return 1.0 + 0.1 * torch.randn(shape, generator=generator) if "norm.weight" in name else \
            0.05 * torch.randn(shape, generator=generator)
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=generator) / math.sqrt(fan_in)


def write_speech_tokenizer(folder: str | Path, size: str = "tiny", seed: int = 0,
                           decoder_overrides: Mapping[str, Any] | None = None) -> Path:
    """Write `<folder>/speech_tokenizer/` (config.json, configuration.json, model.safetensors,
    preprocessor_config.json) with random float32 weights; returns that directory."""
    config = speech_tokenizer_config(size, decoder_overrides)
    out = Path(folder) / "speech_tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)

    dec = CodecDecoderConfig.from_dict(config)
    decoder = CodecDecoder(dec)
    with torch.no_grad():
        _randomise_decoder(decoder, generator)
    tensors = {f"decoder.{name}": t.detach().contiguous() for name, t in decoder.state_dict().items()}
    extra = {**_decoder_unused_shapes(dec), **_mimi_encoder_shapes(config["encoder_config"])}
    for name, shape in extra.items():
        tensors[name] = _random_like_name(name, shape, generator)
    del decoder

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "preprocessor_config.json").write_text(json.dumps(_PREPROCESSOR_CONFIG, indent=2) + "\n", encoding="utf-8")
    (out / "configuration.json").write_text(json.dumps(_CONFIGURATION) + "\n", encoding="utf-8")
    return out
