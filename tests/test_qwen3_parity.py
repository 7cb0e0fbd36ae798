"""Parity of our Qwen3-TTS generation with the reference qwen-tts 0.1.1 on tiny random checkpoints (fp32, CPU).

The reference runs in its own cached virtualenv (tests/reference_env.py) over the same checkpoint folder; it
dumps codes and the logits of every talker and code-predictor step (tests/reference_scripts/qwen3_ref_generate.py).
Greedy and seeded-sampling codes must be identical; logits must agree to fp32 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.reference_env import run_reference
from tests.qwen3_fixtures import single_torch_thread, tiny_custom_voice, tiny_voice_design  # noqa: F401
from tts_backend.qwen3.generate import Qwen3TTS, Utterance
from tts_backend.qwen3.prompt import build_prompt

pytestmark = pytest.mark.third_party  # a cached venv of third-party packages (tests/conftest.py)


REF_SCRIPT = Path(__file__).parent / "reference_scripts" / "qwen3_ref_generate.py"
GREEDY = {"do_sample": False, "subtalker_dosample": False}
MAX_NEW = 24

CUSTOM_VOICE_CASES = [
    dict(name="greedy_vivian_en", texts=["Hello world, this is a parity test."], speakers=["vivian"],
         languages=["english"], non_streaming_mode=True, gen=GREEDY),
    dict(name="greedy_eric_zh_dialect", texts=["今天天气很好，我们去公园散步吧。"], speakers=["eric"],
         languages=["chinese"], non_streaming_mode=True, gen=GREEDY),
    dict(name="greedy_dylan_auto_streaming", texts=["北京的秋天最美。"], speakers=["dylan"],
         languages=["auto"], non_streaming_mode=False, gen=GREEDY),
    dict(name="greedy_ryan_instruct_streaming", texts=["Please speak slowly and clearly."], speakers=["ryan"],
         languages=["english"], instructs=["Speak in a calm, warm voice."], non_streaming_mode=False, gen=GREEDY),
    dict(name="sampled_vivian_en", texts=["Sampling should follow the same random stream."], speakers=["vivian"],
         languages=["english"], non_streaming_mode=True, seed=7, gen={}),
    dict(name="sampled_serena_instruct_streaming", texts=["我很高兴见到你。"], speakers=["serena"],
         languages=["chinese"], instructs=["用开心的语气说"], non_streaming_mode=False, seed=11,
         gen={"repetition_penalty": 1.5, "top_p": 0.8, "top_k": 20, "subtalker_top_p": 0.9}),
    dict(name="sampled_sohee_ko_auto", texts=["안녕하세요, 반갑습니다."], speakers=["sohee"], languages=["auto"],
         non_streaming_mode=True, seed=3, gen={"temperature": 1.3}),
    dict(name="greedy_batch2", texts=["A short one.", "这是一个更长一点的句子，用来测试左填充。"],
         speakers=["aiden", "eric"], languages=["english", "auto"], non_streaming_mode=True, gen=GREEDY),
    dict(name="sampled_batch2_streaming", texts=["First row of the batch.", "Zweite Zeile."],
         speakers=["ono_anna", "uncle_fu"], languages=["japanese", "german"],
         instructs=["Whisper.", None], non_streaming_mode=False, seed=5, gen={}),
]
VOICE_DESIGN_CASES = [
    dict(name="vd_greedy", texts=["A voice designed from a description."], languages=["english"],
         instructs=["A deep, slow male voice with a British accent."], non_streaming_mode=True, gen=GREEDY),
    dict(name="vd_sampled_streaming", texts=["Bonjour à tous."], languages=["french"],
         instructs=["Une voix féminine joyeuse."], non_streaming_mode=False, seed=21, gen={}),
]
TOKENIZE = [
    "Hello world, this is a parity test.",
    "It's 3:45pm -- we'll meet at 221B Baker St.   OK?\n\nNew paragraph\twith tab.",
    "今天天气很好，我们去公园散步吧。北京的秋天最美！",
    "こんにちは、世界。カタカナとひらがな。",
    "안녕하세요, 반갑습니다. Ünïcödé café naïve résumé — “quotes” … 😀👍🏽",
    "Numbers 1234567 and 3.14159, emails a.b@c.de, URLs https://example.com/x?y=z",
    "<|im_start|> inline special <tts_pad> tokens <|im_end|>",
]


def _with_defaults(cases):
    out = []
    for c in cases:
        c = {"seed": None, "speakers": None, "instructs": None, **c}
        c["gen"] = {"max_new_tokens": MAX_NEW, **c["gen"]}
        out.append(c)
    return out


@pytest.fixture(scope="module")
def reference(tiny_custom_voice, tiny_voice_design, tmp_path_factory) -> dict:
    """Both checkpoints through the reference in one subprocess -> {"cv": run, "vd": run}."""
    tmp = tmp_path_factory.mktemp("qwen3-reference")
    templated = [f"<|im_start|>assistant\n{t}<|im_end|>\n<|im_start|>assistant\n" for t in TOKENIZE]
    runs = [
        {"checkpoint": str(tiny_custom_voice), "cases": _with_defaults(CUSTOM_VOICE_CASES), "tokenize": templated},
        {"checkpoint": str(tiny_voice_design), "cases": _with_defaults(VOICE_DESIGN_CASES)},
    ]
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"dtype": "float32", "threads": 1, "runs": runs}), encoding="utf-8")
    out = tmp / "reference.pt"
    run_reference(REF_SCRIPT, str(spec), str(out))
    cv, vd = torch.load(out)["runs"]
    return {"cv": cv, "vd": vd}


@pytest.fixture(scope="module")
def cv_reference(reference):
    return reference["cv"]


@pytest.fixture(scope="module")
def vd_reference(reference):
    return reference["vd"]


@pytest.fixture(scope="module")
def cv_model(tiny_custom_voice):
    return Qwen3TTS.from_pretrained(tiny_custom_voice, "cpu", torch.float32)


@pytest.fixture(scope="module")
def vd_model(tiny_voice_design):
    return Qwen3TTS.from_pretrained(tiny_voice_design, "cpu", torch.float32, load_codec=False)


def _ours(model: Qwen3TTS, case: dict, trace: dict | None = None) -> list[torch.Tensor]:
    n = len(case["texts"])
    speakers = case["speakers"] or [None] * n
    instructs = case["instructs"] or [None] * n
    prompts = [
        model.make_prompt(t, speaker=s, language=lang, instruct=i, non_streaming_mode=case["non_streaming_mode"])
        for t, s, lang, i in zip(case["texts"], speakers, case["languages"], instructs)
    ]
    gen = case["gen"]
    params = model.sampling_params(
        do_sample=gen.get("do_sample"), subtalker_do_sample=gen.get("subtalker_dosample"),
        temperature=gen.get("temperature"), top_k=gen.get("top_k"), top_p=gen.get("top_p"),
        repetition_penalty=gen.get("repetition_penalty"), subtalker_top_p=gen.get("subtalker_top_p"),
        max_new_tokens=gen["max_new_tokens"],
    )
    generator = torch.Generator().manual_seed(case["seed"]) if case["seed"] is not None else None
    return model.generate_codes(prompts, params, generator, trace=trace)


def _assert_same_codes(ours, ref, name):
    assert len(ours) == len(ref)
    for row, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape, f"{name} row {row}: {tuple(a.shape)} frames vs reference {tuple(b.shape)}"
        assert torch.equal(a.cpu(), b), f"{name} row {row}: codes differ at frames {(a != b).any(1).nonzero()[:5]}"


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_tokenizer_matches_reference(cv_model, cv_reference):
    for text, ids in cv_reference["tokenize"].items():
        assert cv_model.tokenizer.encode(text) == ids, text


@pytest.mark.parametrize("case", _with_defaults(CUSTOM_VOICE_CASES), ids=lambda c: c["name"])
def test_custom_voice_codes_match_reference(cv_model, cv_reference, case):
    ref = cv_reference["cases"][case["name"]]
    trace: dict = {}
    ours = _ours(cv_model, case, trace)
    assert sum(len(c) for c in ours) > 0
    _assert_same_codes(ours, ref["codes"], case["name"])
    if len(ours) > 1:
        # Coverage: one row stops (EOS) while the other goes on, so the finished-row rules are exercised.
        assert len({len(c) for c in ours}) > 1
    # Same steps, same logits (fp32): the talker's c0 logits and every code-predictor draw.
    talker = torch.stack(trace["talker_logits"])
    predictor = torch.stack(trace["predictor_logits"])
    assert talker.shape == ref["talker_logits"].shape
    assert predictor.shape == ref["predictor_logits"].shape
    assert _rel_err(talker, ref["talker_logits"]) < 1e-5
    assert _rel_err(predictor, ref["predictor_logits"]) < 1e-5


@pytest.mark.parametrize("case", _with_defaults(VOICE_DESIGN_CASES), ids=lambda c: c["name"])
def test_voice_design_codes_match_reference(vd_model, vd_reference, case):
    ref = vd_reference["cases"][case["name"]]
    _assert_same_codes(_ours(vd_model, case), ref["codes"], case["name"])


def test_prompt_text_ids_match_reference_slicing(cv_model, cv_reference):
    case = next(c for c in _with_defaults(CUSTOM_VOICE_CASES) if c["name"] == "greedy_batch2")
    for text, ref_ids in zip(case["texts"], cv_reference["cases"]["greedy_batch2"]["input_ids"]):
        assert cv_model.tokenizer.text_ids(text) == ref_ids[3:-5]


def test_streamed_text_pushed_in_pieces_matches_reference(cv_model, cv_reference):
    """Text pushed into a running utterance, a few tokens at a time between frames, gives the reference's
    streaming-text codes: the gateway can keep one generation context across the sentences of an utterance."""
    case = next(c for c in _with_defaults(CUSTOM_VOICE_CASES) if c["name"] == "greedy_ryan_instruct_streaming")
    ids = cv_model.tokenizer.text_ids(case["texts"][0])
    prompt = build_prompt(cv_model.config, ids[:2], speaker="ryan", language="english",
                          instruct_ids=cv_model.tokenizer.instruct_ids(case["instructs"][0]),
                          non_streaming_mode=False, text_complete=False)
    params = cv_model.sampling_params(do_sample=False, subtalker_do_sample=False, max_new_tokens=MAX_NEW)
    utterance = Utterance(cv_model, prompt, params, None, max_len=128)
    frames = list(utterance.frames())  # runs until it needs text beyond the first two tokens
    assert utterance.waiting_for_text and not utterance.finished
    for start in range(2, len(ids), 2):
        utterance.push_ids(ids[start : start + 2])
        frames += list(utterance.frames())
    utterance.finish_text()
    frames += list(utterance.frames())
    assert utterance.finished
    codes = torch.stack(frames)
    eos = cv_model.config.talker.codec_eos_token_id
    assert not bool((codes[:, 0] == eos).any())
    _assert_same_codes([codes], cv_reference["cases"][case["name"]]["codes"], "pushed pieces")


def test_seeded_streaming_utterance_matches_reference(cv_model, cv_reference):
    case = next(c for c in _with_defaults(CUSTOM_VOICE_CASES) if c["name"] == "sampled_serena_instruct_streaming")
    params = cv_model.sampling_params(repetition_penalty=1.5, top_p=0.8, top_k=20, subtalker_top_p=0.9,
                                      max_new_tokens=MAX_NEW)
    utterance = cv_model.start_utterance(case["texts"][0], speaker="serena", language="chinese",
                                         instruct=case["instructs"][0], params=params, seed=case["seed"])
    codes = torch.stack(list(utterance.frames()))
    _assert_same_codes([codes], cv_reference["cases"][case["name"]]["codes"], "utterance")
