"""Random-weight Qwen3-TTS checkpoints in the official folder layout, at any size.

`write_checkpoint(folder, size="tiny")` writes config.json, generation_config.json, model.safetensors (bf16,
official tensor names), tokenizer files (vocab.json, merges.txt, tokenizer_config.json), preprocessor_config.json
and `speech_tokenizer/` (via `codec_checkpoint.write_speech_tokenizer`, whose file always holds the Mimi encoder).
model_type "base" adds `speaker_encoder_config` and the speaker encoder's tensors (spec §7.2). Sizes: "tiny" (spec §9.3, CPU tests),
"small" (CPU tests of the Triton kernels), "0.6b" and "1.7b" (the released shapes, for GPU benchmarks).

The text tokenizer is the real Qwen2 byte-level BPE: its ranks ship in the PyPI package `dashscope`
(`dashscope/resources/qwen.tiktoken`). Only that one file is needed, so the wheel is fetched with pip (no
dependencies, nothing installed) and the derived vocab.json/merges.txt are cached under ~/.cache/voxgate.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

DASHSCOPE_VERSION = "2.0.2"
NUM_REGULAR_TOKENS = 151643

# Added tokens of the Qwen3 vocabulary (ids 151643..151675); the TTS tokens are 151669..151675 (spec §5.1).
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False), ("<|audio_start|>", True), ("<|audio_end|>", True),
    ("<tts_pad>", True), ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]

# --------------------------------------------------------------------------------------------- configs

LANGUAGE_IDS = {
    "chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071, "spanish": 2054,
    "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069, "beijing_dialect": 2074,
    "sichuan_dialect": 2062,
}
SPEAKER_IDS = {
    "serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861, "ono_anna": 2873,
    "sohee": 2864, "eric": 2875, "dylan": 2878,
}
SPEAKER_DIALECTS = {name: False for name in SPEAKER_IDS} | {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}
CODEC_SPECIAL_IDS = {
    "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_think_id": 2154,
    "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
}

_STACK_SIZES = {
    # talker: hidden, intermediate, layers, heads, kv heads, head_dim, text_hidden, mrope sections, max pos
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, text_hidden_size=16, mrope_section=[2, 1, 1],
                 max_position_embeddings=4096),
    # "small": tiny, but every width a multiple of 16 and head_dim 32, the smallest shapes the Triton decode
    # kernels (tts_backend/engine/kernels.py) take; CPU tests run them in Triton's interpreter.
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, text_hidden_size=32, mrope_section=[8, 4, 4],
                  max_position_embeddings=4096),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, text_hidden_size=2048, mrope_section=[24, 20, 20],
                 max_position_embeddings=32768),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, text_hidden_size=2048, mrope_section=[24, 20, 20],
                 max_position_embeddings=32768),
}
_PREDICTOR_SIZES = {
    "tiny": dict(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_code_groups=4),
    "small": dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=64, num_code_groups=4),
    "full": dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=65536,
                 num_code_groups=16),
}

# speaker_encoder_config of Base checkpoints. The released files name only the x-vector width (the talker's) and
# the sample rate; the CPU sizes also shrink the ECAPA-TDNN channels (128 mel bands stay: the log-mel is fixed).
_SPEAKER_ENCODER_SIZES = {
    "tiny": dict(enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8, enc_se_channels=8),
    "small": dict(enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8, enc_se_channels=8),
}

GENERATION_CONFIG = {
    "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
    "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0, "subtalker_top_k": 50,
    "max_new_tokens": 8192,
}


def model_config(size: str = "tiny", model_type: str = "custom_voice", tts_model_size: str | None = None) -> dict:
    """config.json contents. Tiny ids keep the released layout shifted down so the specials sit in the top 1024
    of a 64 + 1024 vocabulary (every released special id minus 2048 - 64)."""
    if size not in _STACK_SIZES:
        raise ValueError(f"size must be one of {sorted(_STACK_SIZES)}, got {size!r}")
    stack = dict(_STACK_SIZES[size])
    predictor = dict(_PREDICTOR_SIZES[size if size in _PREDICTOR_SIZES else "full"])
    codebook = predictor["vocab_size"]
    shift = 2048 - codebook
    mrope = stack.pop("mrope_section")
    text_hidden = stack.pop("text_hidden_size")
    talker = {
        **stack,
        "attention_bias": False, "attention_dropout": 0, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": {"interleaved": True, "mrope_section": mrope, "rope_type": "default", "type": "default"},
        "vocab_size": codebook + 1024, "num_code_groups": predictor["num_code_groups"],
        "text_hidden_size": text_hidden, "text_vocab_size": 151936, "position_id_per_seconds": 13,
        "sliding_window": None, "use_sliding_window": False, "use_cache": True, "model_type": "qwen3_tts_talker",
        **{k: v - shift for k, v in CODEC_SPECIAL_IDS.items()},
        "codec_language_id": {k: v - shift for k, v in LANGUAGE_IDS.items()},
        "code_predictor_config": {
            **predictor, "attention_bias": False, "attention_dropout": 0, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None, "sliding_window": None,
            "use_sliding_window": False, "layer_types": ["full_attention"] * predictor["num_hidden_layers"],
            "model_type": "qwen3_tts_talker_code_predictor", "max_window_layers": 28, "use_cache": True,
        },
    }
    extra = {}
    if model_type == "base":
        extra["speaker_encoder_config"] = {"enc_dim": stack["hidden_size"], "sample_rate": 24000,
                                           **_SPEAKER_ENCODER_SIZES.get(size, {})}
    if model_type == "custom_voice":
        talker["spk_id"] = {k: v - shift for k, v in SPEAKER_IDS.items()}
        talker["spk_is_dialect"] = dict(SPEAKER_DIALECTS)
    else:
        talker["spk_id"] = {}
        talker["spk_is_dialect"] = {}
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "assistant_token_id": 77091, "im_end_token_id": 151645, "im_start_token_id": 151644,
        "tts_bos_token_id": 151672, "tts_eos_token_id": 151673, "tts_pad_token_id": 151671,
        "model_type": "qwen3_tts", "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": tts_model_size or ("0b6" if size == "0.6b" else "1b7"),
        "tts_model_type": model_type,
        "talker_config": talker,
        **extra,
        "transformers_version": "4.57.3",
    }


def decoder_stack_shapes(prefix: str, c: dict, width: int) -> dict[str, tuple[int, ...]]:
    """The tensors of a Qwen3 decoder stack (layers and final norm) under `prefix`, from its config `c`."""
    hd, H, Hkv, inter = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(c["num_hidden_layers"]):
        lp = f"{prefix}.layers.{i}."
        shapes[lp + "self_attn.q_proj.weight"] = (H * hd, width)
        shapes[lp + "self_attn.k_proj.weight"] = (Hkv * hd, width)
        shapes[lp + "self_attn.v_proj.weight"] = (Hkv * hd, width)
        shapes[lp + "self_attn.o_proj.weight"] = (width, H * hd)
        shapes[lp + "self_attn.q_norm.weight"] = (hd,)
        shapes[lp + "self_attn.k_norm.weight"] = (hd,)
        shapes[lp + "mlp.gate_proj.weight"] = (inter, width)
        shapes[lp + "mlp.up_proj.weight"] = (inter, width)
        shapes[lp + "mlp.down_proj.weight"] = (width, inter)
        shapes[lp + "input_layernorm.weight"] = (width,)
        shapes[lp + "post_attention_layernorm.weight"] = (width,)
    shapes[f"{prefix}.norm.weight"] = (width,)
    return shapes


def model_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of model.safetensors with its shape (spec §7.2), derived from config.json."""
    t = config["talker_config"]
    p = t["code_predictor_config"]
    D, Dt, Dp = t["hidden_size"], t["text_hidden_size"], p["hidden_size"]
    shapes = decoder_stack_shapes("talker.model", t, D)
    shapes["talker.model.codec_embedding.weight"] = (t["vocab_size"], D)
    shapes["talker.model.text_embedding.weight"] = (t["text_vocab_size"], Dt)
    shapes["talker.text_projection.linear_fc1.weight"] = (Dt, Dt)
    shapes["talker.text_projection.linear_fc1.bias"] = (Dt,)
    shapes["talker.text_projection.linear_fc2.weight"] = (D, Dt)
    shapes["talker.text_projection.linear_fc2.bias"] = (D,)
    shapes["talker.codec_head.weight"] = (t["vocab_size"], D)
    shapes.update(decoder_stack_shapes("talker.code_predictor.model", p, Dp))
    for g in range(p["num_code_groups"] - 1):
        shapes[f"talker.code_predictor.model.codec_embedding.{g}.weight"] = (p["vocab_size"], D)
        shapes[f"talker.code_predictor.lm_head.{g}.weight"] = (p["vocab_size"], Dp)
    if Dp != D:
        shapes["talker.code_predictor.small_to_mtp_projection.weight"] = (Dp, D)
        shapes["talker.code_predictor.small_to_mtp_projection.bias"] = (Dp,)
    if "speaker_encoder_config" in config:
        from tts_backend.qwen3.config import SpeakerEncoderConfig
        from tts_backend.qwen3.speaker_encoder import SpeakerEncoder

        with torch.device("meta"):
            encoder = SpeakerEncoder(SpeakerEncoderConfig.from_dict(config["speaker_encoder_config"]))
        shapes.update({f"speaker_encoder.{k}": tuple(v.shape) for k, v in encoder.state_dict().items()})
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator, device) -> torch.Tensor:
    """Scales that keep activations O(1) through the stack, so logits are well separated (greedy parity is then
    insensitive to rounding) and nothing overflows in bf16."""
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=generator, device=device)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=generator, device=device)
    if "embedding" in name:
        return torch.randn(shape, generator=generator, device=device)
    return torch.randn(shape, generator=generator, device=device) / math.sqrt(math.prod(shape[1:]))


def write_model_weights(path: Path, config: dict, seed: int, device: str | torch.device = "cpu") -> None:
    from safetensors.torch import save_file

    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in model_tensor_shapes(config).items():
        tensors[name] = _random_tensor(name, shape, generator, device).to(torch.bfloat16).cpu().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


# --------------------------------------------------------------------------------------------- tokenizer files


def _cache_dir() -> Path:
    return Path(os.environ.get("VOXGATE_CACHE", Path.home() / ".cache" / "voxgate"))


def _qwen_tiktoken_path() -> Path:
    """qwen.tiktoken from an installed dashscope, else from its wheel fetched once with pip (no install)."""
    import importlib.util

    spec = importlib.util.find_spec("dashscope")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "resources" / "qwen.tiktoken"
            if candidate.is_file():
                return candidate
    cached = _cache_dir() / f"dashscope-{DASHSCOPE_VERSION}" / "qwen.tiktoken"
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
             "-d", tmp, f"dashscope=={DASHSCOPE_VERSION}"],
            check=True,
        )
        wheel = next(Path(tmp).glob("dashscope-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read("dashscope/resources/qwen.tiktoken")
    partial = cached.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(cached)
    return cached


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """For each multi-byte token (in rank order) the pair that byte-level BPE, restricted to lower ranks,
    merges last to form it: one merge per token, in rank order, reproduces tiktoken's rank-greedy merging."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best_rank, best_i = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best_rank is None or r < best_rank):
                    best_rank, best_i = r, i
            if best_rank is None:
                break
            parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        if len(parts) != 2:
            raise ValueError(f"token of rank {rank} cannot be formed by one merge")
        merges.append((parts[0], parts[1]))
    return merges


def qwen_tokenizer_files() -> Path:
    """Directory holding vocab.json and merges.txt derived from qwen.tiktoken (built once, then cached)."""
    source = _qwen_tiktoken_path()
    raw = source.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()[:16]
    out = _cache_dir() / f"qwen2-bpe-{digest}"
    if (out / "merges.txt").is_file() and (out / "vocab.json").is_file():
        return out
    ranks: dict[bytes, int] = {}
    for line in raw.splitlines():
        if line.strip():
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
    if len(ranks) != NUM_REGULAR_TOKENS or sorted(ranks.values()) != list(range(NUM_REGULAR_TOKENS)):
        raise ValueError(f"{source}: expected ranks 0..{NUM_REGULAR_TOKENS - 1}")
    byte_map = _bytes_to_unicode()

    def show(b: bytes) -> str:
        return "".join(byte_map[x] for x in b)

    vocab = {show(token): rank for token, rank in ranks.items()}
    merges = _merges_from_ranks(ranks)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (tmp / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{show(a)} {show(b)}\n" for a, b in merges), encoding="utf-8"
    )
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tokenizer_config() -> dict:
    added = {
        str(NUM_REGULAR_TOKENS + i): {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    return {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": [c for c, s in ADDED_TOKENS if s and c not in
                                      ("<|endoftext|>", "<|im_start|>", "<|im_end|>")],
        "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }


def write_tokenizer_files(folder: str | Path) -> None:
    folder = Path(folder)
    source = qwen_tokenizer_files()
    shutil.copyfile(source / "vocab.json", folder / "vocab.json")
    shutil.copyfile(source / "merges.txt", folder / "merges.txt")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------- the folder


def write_checkpoint(
    folder: str | Path,
    size: str = "tiny",
    *,
    model_type: str = "custom_voice",
    seed: int = 0,
    tts_model_size: str | None = None,
    speech_tokenizer: bool = True,
    device: str | torch.device = "cpu",
) -> Path:
    """Write a complete random checkpoint folder; returns it. size: "tiny", "small", "0.6b" or "1.7b"."""
    from .codec_checkpoint import write_speech_tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model_config(size, model_type, tts_model_size)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n", encoding="utf-8")
    (folder / "preprocessor_config.json").write_text(
        json.dumps({"processor_class": "Qwen3TTSProcessor"}, indent=2) + "\n", encoding="utf-8"
    )
    write_tokenizer_files(folder)
    write_model_weights(folder / "model.safetensors", config, seed, device)
    if speech_tokenizer:
        write_speech_tokenizer(folder, "tiny" if size in ("tiny", "small") else "full", seed + 1)
    return folder
