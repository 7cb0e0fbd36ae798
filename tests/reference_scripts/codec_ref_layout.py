"""Tensor layout of the reference speech tokenizer (run by the reference virtualenv, see tests/reference_env.py).

usage: codec_ref_layout.py CONFIG.json OUT.json

Builds qwen-tts 0.1.1's Qwen3TTSTokenizerV2Model from a speech_tokenizer config.json on the meta device and
writes {tensor name: shape} of its state dict, i.e. what `from_pretrained` expects in model.safetensors.
"""

import json
import sys

import torch
from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model


def main(config_path: str, out_path: str) -> None:
    with open(config_path, encoding="utf-8") as f:
        config = Qwen3TTSTokenizerV2Config(**json.load(f))
    with torch.device("meta"):
        model = Qwen3TTSTokenizerV2Model(config)
    layout = {name: list(t.shape) for name, t in model.state_dict().items()}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(layout, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
