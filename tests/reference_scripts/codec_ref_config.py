"""The speech tokenizer config as the reference's own config classes write it (run by the reference virtualenv,
see tests/reference_env.py).

usage: codec_ref_config.py CONFIG.json OUT_DIR OUT.json

Builds qwen-tts 0.1.1's Qwen3TTSTokenizerV2Config from CONFIG.json's decoder block and the encoder block without
its frame rate (as a config made in code, with the encoder's defaults, carries none), saves it with
`save_pretrained` into OUT_DIR (config.json, as a Base checkpoint saved by qwen-tts holds it), and writes the
frame rate and downsampling kernel the reference's encoder config derives into OUT.json.
"""

import json
import sys

from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config


def main(config_path: str, out_dir: str, out_path: str) -> None:
    with open(config_path, encoding="utf-8") as f:
        data = json.load(f)
    data["encoder_config"] = {k: v for k, v in data["encoder_config"].items() if k not in ("_frame_rate", "frame_rate")}
    config = Qwen3TTSTokenizerV2Config(**data)
    config.save_pretrained(out_dir)
    encoder = config.encoder_config
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"frame_rate": float(encoder.frame_rate),
                   "downsample_kernel": 2 * int(encoder.encodec_frame_rate / encoder.frame_rate)}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
