"""Run the reference forced aligner (qwen-asr 0.0.6) over a spec of cases and save what it computed.

Runs in the qwen-asr venv (tests/reference_env.py), never in Voxgate's environment.
argv: spec.json out.pt. spec = {"checkpoint", "windowed", "cases": [{"name", "audio": [file.npy...], "texts",
"languages"}]}; each clip (16 kHz float32) is aligned by its own call of Qwen3ForcedAligner.align (a batch of
one: the reference's batched call pads the features of its clips to the longest, which Voxgate does not do).
out = {name: {"items": [[(text, start, end)...] per clip], "classes": [[int...] per clip],
"logits": [tensor [slots, K] per clip], "input_ids": [[int...] per clip], "features": [tensor [M, F] per clip]},
"words": {text: [word...]} for spec["words"] ([text, language] pairs), "repair": [[int...]] for spec["repair"] (the
reference's monotonic repair of each sequence)}

windowed: the reference's audio encoder attends within windows (cu_seqlens) only through flash-attention 2; on
CPU its sdpa path gets no mask and attends over the whole clip. With windowed=true the encoder layers get the
reference's own `_prepare_attention_mask` (its block-diagonal equivalent of the FA2 windows), which is what the
model computes on a GPU with flash-attention.
"""

import json
import sys

import numpy as np
import torch

torch.set_num_threads(1)

from qwen_asr import Qwen3ForcedAligner  # noqa: E402
from qwen_asr.core.transformers_backend import modeling_qwen3_asr as modeling  # noqa: E402

spec = json.load(open(sys.argv[1]))
aligner = Qwen3ForcedAligner.from_pretrained(spec["checkpoint"], dtype=torch.float32, device_map="cpu")
thinker = aligner.model.thinker
tower = thinker.audio_tower

if spec.get("windowed"):
    plain_forward = modeling.Qwen3ASRAudioEncoderLayer.forward

    def windowed_forward(self, hidden_states, cu_seqlens, attention_mask=None, **kwargs):
        if attention_mask is None:
            attention_mask = tower._prepare_attention_mask(hidden_states, cu_seqlens)
        return plain_forward(self, hidden_states, cu_seqlens, attention_mask=attention_mask, **kwargs)

    modeling.Qwen3ASRAudioEncoderLayer.forward = windowed_forward

seen = {}


def capture(module, args, kwargs, output):
    seen["kwargs"] = kwargs
    seen["logits"] = output.logits


thinker.register_forward_hook(capture, with_kwargs=True)
ts = aligner.timestamp_token_id
out = {}
for case in spec["cases"]:
    rows = {"items": [], "classes": [], "logits": [], "input_ids": [], "features": []}
    for path, text, language in zip(case["audio"], case["texts"], case["languages"]):
        (result,) = aligner.align(audio=[(np.load(path).astype(np.float32), 16000)], text=[text], language=[language])
        ids, logits = seen["kwargs"]["input_ids"][0], seen["logits"][0]
        slots = ids == ts
        rows["items"].append([(it.text, it.start_time, it.end_time) for it in result])
        rows["classes"].append(logits[slots].argmax(-1).tolist())
        rows["logits"].append(logits[slots].clone())
        rows["input_ids"].append(ids.tolist())
        rows["features"].append(seen["kwargs"]["input_features"][0].clone())
    out[case["name"]] = rows
text_processor = aligner.aligner_processor
out["words"] = {text: text_processor.encode_timestamp(text, lang)[0] for text, lang in spec.get("words", [])}
out["repair"] = [text_processor.fix_timestamp(np.array(seq, dtype=np.float32)) for seq in spec.get("repair", [])]
torch.save(out, sys.argv[2])
