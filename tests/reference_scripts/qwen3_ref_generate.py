"""Reference side of the Qwen3-TTS parity tests: run qwen-tts 0.1.1 on a checkpoint folder and dump what it does.

Usage: python qwen3_ref_generate.py SPEC_JSON OUT_PT
SPEC_JSON: {"dtype": "float32", "threads": 1, "runs": [{"checkpoint": folder, "tokenize": [text, ...],
  "cases": [{"name", "texts", "speakers", "languages", "instructs", "non_streaming_mode", "seed",
  "gen": {generate kwargs}}]}]}
OUT_PT (torch.save): {"runs": [{"tokenize": {text: ids}, "cases": {name: {"codes": [LongTensor[F, G]],
  "talker_logits": fp32 [steps, B, V], "predictor_logits": fp32 [draws, B, V], "input_ids": [[int]]}}}]}
(one process for several checkpoints: importing qwen_tts and converting the tokenizer dominate its run time)
Runs in the reference virtualenv (tests/reference_env.py), never in Voxgate's own environment.
"""

import json
import sys

import torch
from qwen_tts import Qwen3TTSModel


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path, encoding="utf-8").read())
    torch.set_num_threads(int(spec.get("threads", 1)))  # tiny models: threads only add contention
    dtype = getattr(torch, spec.get("dtype", "float32"))
    runs = [run_checkpoint(run, dtype, spec.get("device", "cpu")) for run in spec["runs"]]
    torch.save({"runs": runs}, out_path)


def run_checkpoint(spec: dict, dtype: torch.dtype, device: str) -> dict:
    wrapper = Qwen3TTSModel.from_pretrained(spec["checkpoint"], dtype=dtype, device_map=device)
    model = wrapper.model
    talker = model.talker
    out = {"tokenize": {}, "cases": {}}
    for text in spec.get("tokenize", []):
        out["tokenize"][text] = wrapper._tokenize_texts([text])[0][0].tolist()

    captured = {"talker": [], "predictor": []}
    talker.codec_head.register_forward_hook(
        lambda mod, inp, output: captured["talker"].append(output[:, -1].detach().float().cpu()))
    for head in talker.code_predictor.lm_head:
        head.register_forward_hook(
            lambda mod, inp, output: captured["predictor"].append(output[:, -1].detach().float().cpu()))

    for case in spec["cases"]:
        captured["talker"].clear()
        captured["predictor"].clear()
        texts = case["texts"]
        input_ids = wrapper._tokenize_texts([wrapper._build_assistant_text(t) for t in texts])
        instruct_ids = []
        for ins in case.get("instructs") or [None] * len(texts):
            instruct_ids.append(wrapper._tokenize_texts([wrapper._build_instruct_text(ins)])[0] if ins else None)
        if model.tts_model_size in "0b6" and model.tts_model_type == "custom_voice":
            instruct_ids = [None] * len(texts)  # what generate_custom_voice does
        gen = wrapper._merge_generate_kwargs(**case.get("gen", {}))
        if case.get("seed") is not None:
            torch.manual_seed(case["seed"])
        codes, _ = model.generate(
            input_ids=input_ids, instruct_ids=instruct_ids, languages=case["languages"],
            speakers=case.get("speakers"), non_streaming_mode=case["non_streaming_mode"], **gen,
        )
        out["cases"][case["name"]] = {
            "codes": [c.detach().cpu() for c in codes],
            "talker_logits": torch.stack(captured["talker"]),
            "predictor_logits": torch.stack(captured["predictor"]),
            "input_ids": [i[0].tolist() for i in input_ids],
        }
    return out


if __name__ == "__main__":
    main(*sys.argv[1:3])
