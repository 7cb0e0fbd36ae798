"""Reference side of the voice-clone parity tests: qwen-tts 0.1.1 on a Base checkpoint folder.

Usage: python qwen3_ref_clone.py SPEC_JSON OUT_PT
SPEC_JSON: {"checkpoint": folder, "threads": 1, "clips": {name: path of a float32 .npy at 24 kHz},
  "ref_texts": [text, ...],
  "cases": [{"name", "text", "language", "clip", "ref_text", "x_vector_only_mode", "non_streaming_mode", "seed",
             "gen": {generate kwargs}}]}
OUT_PT (torch.save): {"clips": {name: {"mel": [frames, 128], "x_vector": [D], "ref_code": LongTensor[F, G]}},
  "ref_text_ids": {text: [int]},
  "cases": {name: {"codes": LongTensor[frames, G], "wav": float32 [samples], "input_ids": [int],
                   "ref_ids": [int] or None}}}
Runs in the reference virtualenv (tests/reference_env.py), never in Voxgate's own environment.
"""

import json
import sys

import numpy as np
import torch
from qwen_tts import Qwen3TTSModel
from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path, encoding="utf-8").read())
    torch.set_num_threads(int(spec.get("threads", 1)))
    wrapper = Qwen3TTSModel.from_pretrained(spec["checkpoint"], dtype=torch.float32, device_map="cpu")
    model = wrapper.model
    out = {"clips": {}, "cases": {}, "ref_text_ids": {},
           "encoder_attention": model.speech_tokenizer.model.encoder.config._attn_implementation}
    clips = {name: np.load(path).astype(np.float32) for name, path in spec["clips"].items()}
    for name, wav in clips.items():
        item = wrapper.create_voice_clone_prompt((wav, 24000), ref_text="unused", x_vector_only_mode=False)[0]
        mel = mel_spectrogram(torch.from_numpy(wav).unsqueeze(0), n_fft=1024, num_mels=128, sampling_rate=24000,
                              hop_size=256, win_size=1024, fmin=0, fmax=12000).transpose(1, 2)[0]
        out["clips"][name] = {"mel": mel, "x_vector": item.ref_spk_embedding.detach().float().cpu(),
                              "ref_code": item.ref_code.detach().cpu()}
    for text in spec.get("ref_texts", []):
        out["ref_text_ids"][text] = wrapper._tokenize_texts([wrapper._build_ref_text(text)])[0][0].tolist()

    captured = {}
    generate = model.generate

    def recording_generate(**kwargs):
        codes, hidden = generate(**kwargs)
        captured["codes"] = [c.detach().cpu() for c in codes]
        captured["input_ids"] = kwargs["input_ids"][0][0].tolist()
        ref_ids = kwargs.get("ref_ids")
        captured["ref_ids"] = None if not ref_ids or ref_ids[0] is None else ref_ids[0][0].tolist()
        return codes, hidden

    model.generate = recording_generate
    for case in spec["cases"]:
        captured.clear()
        if case.get("seed") is not None:
            torch.manual_seed(case["seed"])
        wavs, sr = wrapper.generate_voice_clone(
            text=case["text"], language=case["language"], ref_audio=(clips[case["clip"]], 24000),
            ref_text=case.get("ref_text"), x_vector_only_mode=case["x_vector_only_mode"],
            non_streaming_mode=case["non_streaming_mode"], **case.get("gen", {}),
        )
        assert sr == 24000
        out["cases"][case["name"]] = {"codes": captured["codes"][0], "wav": torch.from_numpy(wavs[0]),
                                      "input_ids": captured["input_ids"], "ref_ids": captured["ref_ids"]}
    torch.save(out, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
