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

from .safetensors_file import CheckpointError, SafetensorsFile

# What a checkpoint's weights may be stored in; each is cast to the module's dtype on load.
CHECKPOINT_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
        if isinstance(source, SafetensorsFile):
            source.copy_into([(name, state[target].data) for name, target in name_map.items()])
            return
        for name, target in name_map.items():
            # copy_ converts dtype and device in one pass, without a temporary on the destination's device.
            state[target].copy_(source.tensor(name))


# The initialisers a module's constructor may call; build_empty turns them into no-ops while it builds.
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                 "sparse_")


def build_empty(make: Callable[[], nn.Module], device: torch.device | str,
                dtype: torch.dtype | None = None) -> nn.Module:
    """`make()`'s module with uninitialised memory on `device` (in `dtype`, else as built), for a module whose
    whole state load_tensors_strict then overwrites from a file.

    Built on the meta device, so a real build's random initialisation (2 s of a CPU for the released codec)
    is not paid, with torch.nn.init's initialisers made no-ops meanwhile: even on meta, `normal_` (every
    nn.Embedding's) goes through a Python reference that imports torch._dynamo, 6 s of start-up on a 2-core
    CPU. Cast while still meta, so the memory is allocated in `dtype` at once rather than float32 first (6.8 GB
    at 1.7B). Not thread-safe against another thread initialising modules meanwhile (the worker builds none).
    """
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS if hasattr(nn.init, name)}
    try:
        for name in saved:
            setattr(nn.init, name, _skip_init)
        with torch.device("meta"):
            module = make()
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
    if dtype is not None:
        module = module.to(dtype)
    # Not to_empty: its empty_like of a meta tensor goes through a Python reference that imports sympy (1.7 s of
    # a 2-core CPU). One allocation per tensor, each at storage offset 0: a view into a shared block would have
    # an offset, which TorchDynamo specialises 0/1, so compiled functions taking the weights would trace more
    # variants (tests/test_engine_compile_variants.py).
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def _skip_init(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


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
    weights = build_empty(lambda: ModelWeights(cfg), device, dtype)
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
    decoder = build_empty(lambda: CodecDecoder(CodecDecoderConfig.from_json(config_path)), device)
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
    encoder = build_empty(lambda: CodecEncoder(cfg), device)
    weights = tokenizer_dir / MODEL_FILE
    load_tensors_strict(encoder, SafetensorsFile(weights), weights, codec_encoder_name_map(encoder),
                        ignore=lambda name: name.startswith(CODEC_DECODER_PREFIX) or is_unused_encoder_tensor(name, cfg))
    return encoder.eval()
