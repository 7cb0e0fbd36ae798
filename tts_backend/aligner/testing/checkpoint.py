"""Random-weight Qwen3-ForcedAligner checkpoints in the released folder layout, for tests.

`write_aligner_checkpoint(folder, size)` writes config.json (the `qwen3_asr` / `qwen3_forced_aligner` layout),
model.safetensors (bf16, the released tensor names, shapes derived here from the config rather than from our
modules, so a wrong name or shape in the model is caught by the strict loader), preprocessor_config.json (the
Whisper feature extractor the reference reads) and the tokenizer files.

The tokenizer is the real Qwen2 byte-level BPE (tts_backend.qwen3.testing.checkpoint). Its added tokens sit at
the ids the release uses for the four the aligner reads (<|audio_start|> 151669, <|audio_end|> 151670,
<|audio_pad|> 151676, <timestamp> 151705); the ids in between are filled with placeholders, since added tokens
must be contiguous and these tests never write them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tts_backend.qwen3.testing.checkpoint import (
    ADDED_TOKENS, NUM_REGULAR_TOKENS, _random_tensor, decoder_stack_shapes, qwen_tokenizer_files)

AUDIO_START, AUDIO_END, AUDIO_PAD, TIMESTAMP = 151669, 151670, 151676, 151705

_SIZES = {
    # One attention window covers any test clip (the release's 8 s); 5000 classes as released.
    "tiny": dict(d_model=32, encoder_layers=2, heads=4, ffn=64, channels=8, n_window_infer=800,
                 hidden=32, inter=64, layers=2, q_heads=4, kv_heads=2, head_dim=16, classify_num=5000),
    # 2 s windows, so clips of a few seconds span several; 60 classes (4.8 s), so times land inside the clip.
    "tiny-windowed": dict(d_model=48, encoder_layers=2, heads=4, ffn=96, channels=8, n_window_infer=200,
                          hidden=32, inter=64, layers=3, q_heads=4, kv_heads=1, head_dim=8, classify_num=60),
    "0.6b": dict(d_model=1024, encoder_layers=24, heads=16, ffn=4096, channels=480, n_window_infer=800,
                 hidden=1024, inter=3072, layers=28, q_heads=16, kv_heads=8, head_dim=128, classify_num=5000),
}


def aligner_config(size: str = "tiny") -> dict:
    s = _SIZES[size]
    half = s["head_dim"] // 2
    mrope = [half - 2 * (half // 4), half // 4, half // 4]
    return {
        "architectures": ["Qwen3ASRForConditionalGeneration"],
        "model_type": "qwen3_asr",
        "timestamp_token_id": TIMESTAMP,
        "timestamp_segment_time": 80,
        "support_languages": ["Chinese", "English", "French", "German", "Italian", "Japanese", "Korean",
                              "Portuguese", "Russian", "Spanish", "Cantonese"],
        "torch_dtype": "bfloat16",
        "thinker_config": {
            "model_type": "qwen3_forced_aligner",
            "classify_num": s["classify_num"],
            "audio_token_id": AUDIO_PAD,
            "audio_start_token_id": AUDIO_START,
            "audio_end_token_id": AUDIO_END,
            "audio_config": {
                "num_mel_bins": 128, "d_model": s["d_model"], "encoder_layers": s["encoder_layers"],
                "encoder_attention_heads": s["heads"], "encoder_ffn_dim": s["ffn"],
                "downsample_hidden_size": s["channels"], "output_dim": s["hidden"], "n_window": 50,
                "n_window_infer": s["n_window_infer"], "max_source_positions": 1500, "activation_function": "gelu",
                "scale_embedding": False, "conv_chunksize": 500,
            },
            "text_config": {
                "vocab_size": 152064, "hidden_size": s["hidden"], "intermediate_size": s["inter"],
                "num_hidden_layers": s["layers"], "num_attention_heads": s["q_heads"],
                "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "hidden_act": "silu",
                "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 65536,
                "attention_bias": False, "tie_word_embeddings": False,
                "rope_scaling": {"rope_type": "default", "type": "default", "interleaved": True,
                                 "mrope_interleaved": True, "mrope_section": mrope},
            },
        },
    }


def aligner_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    t = config["thinker_config"]
    a, x = t["audio_config"], t["text_config"]
    D, C, F = a["d_model"], a["downsample_hidden_size"], a["encoder_ffn_dim"]
    bins = a["num_mel_bins"]
    for _ in range(3):
        bins = (bins + 1) // 2
    shapes: dict[str, tuple[int, ...]] = {}
    at = "thinker.audio_tower."
    shapes[at + "conv2d1.weight"], shapes[at + "conv2d1.bias"] = (C, 1, 3, 3), (C,)
    for name in ("conv2d2", "conv2d3"):
        shapes[f"{at}{name}.weight"], shapes[f"{at}{name}.bias"] = (C, C, 3, 3), (C,)
    shapes[at + "conv_out.weight"] = (D, C * bins)
    for i in range(a["encoder_layers"]):
        lp = f"{at}layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{lp}self_attn.{proj}.weight"], shapes[f"{lp}self_attn.{proj}.bias"] = (D, D), (D,)
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            shapes[f"{lp}{norm}.weight"], shapes[f"{lp}{norm}.bias"] = (D,), (D,)
        shapes[lp + "fc1.weight"], shapes[lp + "fc1.bias"] = (F, D), (F,)
        shapes[lp + "fc2.weight"], shapes[lp + "fc2.bias"] = (D, F), (D,)
    shapes[at + "ln_post.weight"], shapes[at + "ln_post.bias"] = (D,), (D,)
    shapes[at + "proj1.weight"], shapes[at + "proj1.bias"] = (D, D), (D,)
    shapes[at + "proj2.weight"], shapes[at + "proj2.bias"] = (a["output_dim"], D), (a["output_dim"],)

    shapes["thinker.model.embed_tokens.weight"] = (x["vocab_size"], x["hidden_size"])
    shapes.update(decoder_stack_shapes("thinker.model", x, x["hidden_size"]))
    shapes["thinker.lm_head.weight"] = (t["classify_num"], x["hidden_size"])
    return shapes


def _random_weight(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if "layer_norm" in name or "ln_post" in name:  # LayerNorm: weight near 1, bias near 0
        return (1.0 if name.endswith(".weight") else 0.0) + 0.1 * torch.randn(shape, generator=generator)
    if len(shape) == 4:  # conv kernels: fan-in is in_channels * 3 * 3
        return torch.randn(shape, generator=generator) / (shape[1] * 9) ** 0.5
    return _random_tensor(name, shape, generator, "cpu")


def tokenizer_config() -> dict:
    names = {AUDIO_START: "<|audio_start|>", AUDIO_END: "<|audio_end|>", AUDIO_PAD: "<|audio_pad|>",
             TIMESTAMP: "<timestamp>"}
    base = dict(ADDED_TOKENS[:26])  # <|endoftext|> .. </think>: ids 151643..151668, as in every Qwen3 vocabulary
    added = {}
    for offset, (content, special) in enumerate(base.items()):
        added[NUM_REGULAR_TOKENS + offset] = (content, special)
    for token_id in range(AUDIO_START, TIMESTAMP + 1):
        added[token_id] = (names.get(token_id, f"<|voxgate_test_placeholder_{token_id}|>"), True)
    return {
        "add_bos_token": False, "add_prefix_space": False, "bos_token": None, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
        "processor_class": "Qwen3ASRProcessor",
        "added_tokens_decoder": {
            str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": s} for i, (c, s) in sorted(added.items())},
        "extra_special_tokens": {"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
                                 "audio_eos_token": "<|audio_end|>"},
    }


PREPROCESSOR_CONFIG = {
    "chunk_length": 30, "dither": 0.0, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128,
    "hop_length": 160, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right",
    "padding_value": 0.0, "processor_class": "Qwen3ASRProcessor", "return_attention_mask": True,
    "sampling_rate": 16000,
}


def write_aligner_checkpoint(folder: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    import shutil

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = aligner_config(size)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    source = qwen_tokenizer_files()
    shutil.copyfile(source / "vocab.json", folder / "vocab.json")
    shutil.copyfile(source / "merges.txt", folder / "merges.txt")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: _random_weight(name, shape, generator).to(torch.bfloat16).contiguous()
               for name, shape in aligner_tensor_shapes(config).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
