"""Run the reference forced aligner (qwen-asr 0.0.6) over a spec of cases and save what it computed.

Runs in the qwen-asr venv (tests/reference_env.py), never in Voxgate's environment.
argv: spec.json out.pt. spec = {"checkpoint", "windowed", "cases": [{"name", "audio": [file.npy...], "texts",
"languages"}]}; each case is one call of Qwen3ForcedAligner.align over its clips (16 kHz float32).
out = {name: {"items": [[(text, start, end)...] per clip], "classes": [[int...] per clip],
"logits": [tensor [slots, K] per clip], "input_ids": [[int...] per clip], "features": tensor, "feature_mask": tensor},
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
    clips = [(np.load(path).astype(np.float32), 16000) for path in case["audio"]]
    results = aligner.align(audio=clips, text=case["texts"], language=case["languages"])
    ids = seen["kwargs"]["input_ids"]
    logits = seen["logits"]
    rows = {"items": [[(it.text, it.start_time, it.end_time) for it in r] for r in results],
            "classes": [], "logits": [], "input_ids": [],
            "features": seen["kwargs"]["input_features"].clone(),
            "feature_mask": seen["kwargs"]["feature_attention_mask"].clone()}
    for b in range(ids.shape[0]):
        slots = ids[b] == ts
        rows["classes"].append(logits[b][slots].argmax(-1).tolist())
        rows["logits"].append(logits[b][slots].clone())
        mask = seen["kwargs"]["attention_mask"][b].bool()
        rows["input_ids"].append(ids[b][mask].tolist())
    out[case["name"]] = rows
text_processor = aligner.aligner_processor
out["words"] = {text: text_processor.encode_timestamp(text, lang)[0] for text, lang in spec.get("words", [])}
out["repair"] = [text_processor.fix_timestamp(np.array(seq, dtype=np.float32)) for seq in spec.get("repair", [])]
torch.save(out, sys.argv[2])
