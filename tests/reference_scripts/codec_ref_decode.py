"""Reference decode with qwen-tts 0.1.1 (run by the reference virtualenv, see tests/reference_env.py).

usage: codec_ref_decode.py SPEECH_TOKENIZER_DIR CODES.npz OUT.npz [DIR CODES OUT ...]

CODES.npz holds arrays c0, c1, ... each [T_i, Q] (int64); they are decoded as one batch through the public
wrapper `qwen_tts.Qwen3TTSTokenizer.decode` (right-padded with -1, 300-frame chunks with 25 frames of context).
OUT.npz gets w0, w1, ... (float32 waveforms). Before decoding, the script checks that the loaded model holds
exactly the file's tensors (same names, equal values), so a misnamed tensor cannot hide behind random init.
"""

import sys

import numpy as np
import torch
from safetensors.torch import load_file

import qwen_tts


def main(tokenizer_dir: str, codes_path: str, out_path: str) -> None:
    tokenizer = qwen_tts.Qwen3TTSTokenizer.from_pretrained(tokenizer_dir, dtype=torch.float32)
    model = tokenizer.model
    file_tensors = load_file(f"{tokenizer_dir}/model.safetensors")
    state = model.state_dict()
    missing = sorted(set(state) - set(file_tensors))
    unexpected = sorted(set(file_tensors) - set(state))
    if missing or unexpected:
        raise SystemExit(f"state/file key mismatch: missing {missing[:5]} unexpected {unexpected[:5]}")
    differing = [k for k in state if not torch.equal(state[k].float(), file_tensors[k].float())]
    if differing:
        raise SystemExit(f"tensors not loaded from the file: {differing[:5]}")
    if next(model.parameters()).dtype != torch.float32:
        raise SystemExit("reference model is not float32")

    archive = np.load(codes_path)
    codes = [torch.from_numpy(archive[f"c{i}"]).long() for i in range(len(archive.files))]
    with torch.no_grad():
        wavs, sample_rate = tokenizer.decode([{"audio_codes": c} for c in codes])
    assert sample_rate == 24000, sample_rate
    np.savez(out_path, **{f"w{i}": w.astype(np.float32) for i, w in enumerate(wavs)})


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or len(args) % 3:
        raise SystemExit(__doc__)
    for i in range(0, len(args), 3):  # several jobs in one process: importing qwen_tts is the slow part
        main(*args[i:i + 3])
