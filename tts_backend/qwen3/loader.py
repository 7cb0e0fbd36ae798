"""Checkpoint folder -> modules, tensor by tensor, refusing anything that does not match exactly.

A Qwen3-TTS folder holds `model.safetensors` (talker + code predictor, released in bf16) and
`speech_tokenizer/model.safetensors` (codec, released in fp32). Every tensor is mapped by name onto a module
parameter; a missing, unexpected or mis-shaped tensor, or one that is not floating point in bf16, fp16 or fp32,
is an error that names the tensor and the file, so a wrong or truncated download fails loudly at start-up
instead of producing noise. The floating-point width is the storer's choice (a fine-tune saved in fp32, an
fp16 export): values are cast to the module's dtype as they are copied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


# What a checkpoint's weights may be stored in; each is cast to the module's dtype on load.
CHECKPOINT_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class CheckpointError(ValueError):
    """The checkpoint folder does not hold exactly the tensors and files this model needs."""


class SafetensorsFile:
    """Lazy access to one `.safetensors` file: names, shapes and dtypes without reading the data."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"missing file {self.path}")
        self._handle = safe_open(str(self.path), framework="pt", device="cpu")

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return SAFETENSORS_DTYPES[self._handle.get_slice(name).get_dtype()]

    def tensor(self, name: str) -> torch.Tensor:
        return self._handle.get_tensor(name)


class _InMemoryTensors:
    """Adapter so `load_tensors_strict` accepts a plain name -> tensor mapping as well."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._t = tensors

    def keys(self) -> list[str]:
        return list(self._t.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._t[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._t[name].dtype

    def tensor(self, name: str) -> torch.Tensor:
        return self._t[name]


def load_tensors_strict(
    module: nn.Module,
    tensors: SafetensorsFile | Mapping[str, torch.Tensor],
    file: str | Path,
    name_map: Mapping[str, str],
    *,
    stored_dtypes: tuple[torch.dtype, ...] | None = CHECKPOINT_FLOAT_DTYPES,
    ignore: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy every tensor of `tensors` into `module`, by name, or raise CheckpointError naming what is wrong.

    name_map: checkpoint tensor name -> name in `module.state_dict()`. It must cover the module's whole state
      (parameters and persistent buffers); the checkpoint must hold every key of the map.
    stored_dtypes: the dtypes a mapped tensor may have in the file; None skips the dtype check. Values are
      converted to the module's own dtype on copy.
    ignore: checkpoint names that may be present and are deliberately not loaded (e.g. the codec's encoder).
    """
    source = tensors if isinstance(tensors, SafetensorsFile) else _InMemoryTensors(tensors)
    state = module.state_dict(keep_vars=True)
    targets = set(name_map.values())
    unmapped_state = sorted(set(state) - targets)
    if unmapped_state:
        # A programming error in the map, not a bad checkpoint; still fail before touching anything.
        raise CheckpointError(f"{file}: loader has no checkpoint name for module tensors {unmapped_state[:5]}")
    for target in targets:
        if target not in state:
            raise CheckpointError(f"{file}: loader maps onto unknown module tensor {target!r}")

    problems: list[str] = []
    present = set(source.keys())
    for name in sorted(set(name_map) - present):
        problems.append(f"missing tensor {name!r} (expected shape {list(state[name_map[name]].shape)})")
    for name in sorted(present - set(name_map)):
        if not ignore(name):
            problems.append(f"unexpected tensor {name!r} (shape {list(source.shape(name))})")
    for name in sorted(present & set(name_map)):
        want = tuple(state[name_map[name]].shape)
        got = source.shape(name)
        if got != want:
            problems.append(f"tensor {name!r} has shape {list(got)}, expected {list(want)}")
        if stored_dtypes is not None and source.dtype(name) not in stored_dtypes:
            expected = ", ".join(str(d) for d in stored_dtypes)
            problems.append(f"tensor {name!r} has dtype {source.dtype(name)}, expected one of {expected}")
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(f"checkpoint file {file} does not match the model:\n  {shown}{more}")

    with torch.no_grad():
        for name, target in name_map.items():
            # copy_ converts dtype and device in one pass, without a temporary on the destination's device.
            state[target].copy_(source.tensor(name))


MODEL_FILE = "model.safetensors"
SPEECH_TOKENIZER_DIR = "speech_tokenizer"


class ModelWeights(nn.Module):
    """Talker + code predictor (+ the speaker encoder of a Base checkpoint) under one root, so one strict pass
    checks all of model.safetensors."""

    def __init__(self, cfg):
        super().__init__()
        from .code_predictor import CodePredictor
        from .speaker_encoder import SpeakerEncoder
        from .talker import Talker

        self.talker = Talker(cfg.talker)
        self.code_predictor = CodePredictor(cfg.talker)
        self.speaker_encoder = SpeakerEncoder(cfg.speaker_encoder) if cfg.speaker_encoder is not None else None


def model_name_map(weights: ModelWeights) -> dict[str, str]:
    """Checkpoint name -> ModelWeights state name: `talker.X` for the talker, `talker.code_predictor.X` for the
    predictor (the released files nest the predictor inside the talker), `speaker_encoder.X` as it is."""
    names = {}
    for key in weights.state_dict():
        if key.startswith(("talker.", "speaker_encoder.")):
            names[key] = key
        else:
            names["talker." + key] = key  # "code_predictor.X" -> "talker.code_predictor.X"
    return names


def check_model_folder(folder: str | Path) -> Path:
    """Refuse a folder that lacks a file the model needs, naming the file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    required = ["config.json", MODEL_FILE, "vocab.json", "merges.txt", "tokenizer_config.json",
                f"{SPEECH_TOKENIZER_DIR}/config.json", f"{SPEECH_TOKENIZER_DIR}/{MODEL_FILE}"]
    for name in required:
        if not (folder / name).is_file():
            what = " (the speech tokenizer)" if name.startswith(SPEECH_TOKENIZER_DIR) else ""
            raise CheckpointError(f"missing file {folder / name}{what}")
    return folder


def load_model_weights(
    folder: str | Path, cfg, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> ModelWeights:
    """Talker, code predictor and (Base) speaker encoder from `<folder>/model.safetensors` (bf16, fp16 or fp32),
    cast to `dtype` on `device`."""
    path = Path(folder) / MODEL_FILE
    with torch.device("meta"):
        weights = ModelWeights(cfg)
    # Cast while the parameters are still meta: to_empty then allocates them in `dtype` at once, instead of
    # allocating float32 (6.8 GB at 1.7B) and converting its garbage (9.5 s on a CPU) before the copy.
    weights = weights.to(dtype).to_empty(device=device)
    load_tensors_strict(weights, SafetensorsFile(path), path, model_name_map(weights))
    return weights.eval()


def load_codec_decoder(folder: str | Path, device: torch.device | str = "cpu"):
    """The 12 Hz codec decoder of a checkpoint, in float32 (the file's bf16 or fp16 is cast up).

    folder: the model folder (holding `speech_tokenizer/`) or the speech tokenizer folder itself. The Mimi encoder
    and the RVQ input projections in the file are recognised and skipped (`is_ignored_codec_tensor`).
    """
    from tts_backend.qwen3.codec import (
        CodecDecoder, CodecDecoderConfig, codec_checkpoint_name_map, is_ignored_codec_tensor)

    tokenizer_dir, config_path = _speech_tokenizer_config(folder)
    # Built on the meta device and allocated where it will run: every parameter is overwritten from the file
    # (load_tensors_strict covers the module's whole state), so the random initialisation of a real build
    # only cost start-up time (2 s of a CPU for the released codec).
    with torch.device("meta"):
        decoder = CodecDecoder(CodecDecoderConfig.from_json(config_path))
    decoder = decoder.to_empty(device=device)
    weights = tokenizer_dir / "model.safetensors"
    load_tensors_strict(decoder, SafetensorsFile(weights), weights, codec_checkpoint_name_map(decoder),
                        ignore=is_ignored_codec_tensor)
    return decoder.eval()


def _speech_tokenizer_config(folder: str | Path) -> tuple[Path, Path]:
    folder = Path(folder)
    tokenizer_dir = folder / SPEECH_TOKENIZER_DIR if (folder / SPEECH_TOKENIZER_DIR).is_dir() else folder
    config_path = tokenizer_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"missing file {config_path} (the speech tokenizer config)")
    return tokenizer_dir, config_path


def load_codec_encoder(folder: str | Path, device: torch.device | str = "cpu"):
    """The 12 Hz codec's encoder (reference audio -> codes) in float32, for Base checkpoints.

    folder: the model folder or the speech tokenizer folder. The decoder's tensors, the encoder's RVQ output
    projections and `initialized` flags, and its codebooks past `encoder_valid_num_quantizers` are recognised and
    skipped (`codec_encoder.is_unused_encoder_tensor`); anything else must match exactly."""
    from tts_backend.qwen3.codec import CODEC_DECODER_PREFIX
    from tts_backend.qwen3.codec_encoder import (
        CodecEncoder, CodecEncoderConfig, codec_encoder_name_map, is_unused_encoder_tensor)

    tokenizer_dir, config_path = _speech_tokenizer_config(folder)
    cfg = CodecEncoderConfig.from_json(config_path)
    encoder = CodecEncoder(cfg)
    weights = tokenizer_dir / MODEL_FILE
    load_tensors_strict(encoder, SafetensorsFile(weights), weights, codec_encoder_name_map(encoder),
                        ignore=lambda name: name.startswith(CODEC_DECODER_PREFIX) or is_unused_encoder_tensor(name, cfg))
    return encoder.to(device).eval()
