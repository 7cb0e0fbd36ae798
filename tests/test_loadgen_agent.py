"""bench/loadgen.py's agent workload (--agent-sentences N --words-per-s R) against a real gateway on loopback
with the synthetic backend: replies of N prompts streamed one word per input.text, audible TTFA timed from
the first word and from the first sentence's last word, underruns over the whole reply."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.engine_load import agent_table, parse_args as engine_load_args
from bench.loadgen import build_parser, last_piece_of, parse_args, run_seeds, word_pieces
from tests.gateway_server import running_gateway
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

PROMPTS = [
    "The river ran high after the storm.",
    "Nobody expected the train to be on time.",
    "She opened the window and listened.",
    "Three boats waited at the harbour.",
]


def prompt_file(tmp_path: Path, prompts: list[str]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(prompts)))
    return path


def run(args: list[str]) -> dict:
    return asyncio.run(run_seeds(parse_args(args)))


def test_word_pieces_are_one_word_each_and_join_back():
    text = "The river ran high.  Nobody expected it, did they?"
    pieces = word_pieces(text)
    assert "".join(pieces) == text
    assert pieces[:2] == ["The ", "river "] and pieces[3] == "high.  "
    assert all(len(p.split()) == 1 for p in pieces)
    assert last_piece_of(pieces, len("The river ran high.")) == 3
    assert word_pieces("") == []


def test_agent_sessions_time_ttfa_from_the_first_word_and_the_first_sentences_end(tmp_path: Path):
    prompts = prompt_file(tmp_path, PROMPTS)
    backend = SyntheticSynthesizer(first_chunk_delay_s=0.05)
    rate = 20.0
    with running_gateway(backend) as server:
        report = run(["--url", server.ws_url, "--rps", "3", "--warmup", "0.3", "--duration", "1.5", "--seed", "4",
                      "--prompts", str(prompts), "--agent-sentences", "2", "--words-per-s", str(rate),
                      "--granularity", "sentence", "--per-request"])
    assert report["load"]["agent_sentences"] == 2 and report["load"]["words_per_s"] == rate
    assert report["session_config"]["split_granularity"] == "sentence"
    summary = report["runs"][0]["summary"]
    assert summary["failed"] == 0 and summary["errors"] == [] and summary["warnings"] == []
    measured = [r for r in report["runs"][0]["requests"] if r["measured"]]
    assert len(measured) == summary["requests"] >= 2
    for r in measured:
        assert len(r["prompt_ids"]) == 2 and r["sentences"] == 2
        texts = [PROMPTS[int(p[1:])] for p in r["prompt_ids"]]
        assert r["bytes"] == sum(backend.render(SynthesisRequest(text=t, voice="tone-low")).nbytes for t in texts)
        # The first sentence's last word is word n-1, sent (n-1)/rate after the first.
        planned = (len(texts[0].split()) - 1) / rate
        assert planned <= r["first_sentence_sent_s"] < planned + 0.2
        assert r["audible_ttfa_after_sentence_s"] == pytest.approx(r["audible_ttfa_s"] - r["first_sentence_sent_s"])
        # Split at sentences, nothing can be heard before the sentence's last word and the backend's 50 ms.
        assert r["audible_ttfa_after_sentence_s"] >= 0.05
        assert r["e2e_s"] > r["audible_ttfa_s"]
    assert summary["audible_ttfa_after_sentence_s"]["n"] == len(measured)
    assert summary["audible_ttfa_s"]["p95"] > summary["audible_ttfa_after_sentence_s"]["p95"]


def test_a_gap_between_sentences_is_an_underrun_of_the_reply(tmp_path: Path):
    # At 4 words/s the second sentence's text ends (3.75 s) long after the first sentence's 1.33 s of audio,
    # which started when the segmenter saw the next word (1.0 s), has played out (2.33 s): the listener hears
    # a gap of about 1.4 s that no single sentence's stream shows.
    prompts = prompt_file(tmp_path, ["Good morning to you.", "We will all see you again at the end of next week."])
    with running_gateway(SyntheticSynthesizer()) as server:
        report = run(["--url", server.ws_url, "--concurrency", "1", "--warmup", "0", "--requests", "1",
                      "--prompts", str(prompts), "--agent-sentences", "2", "--words-per-s", "4", "--seed", "2",
                      "--per-request"])
    summary = report["runs"][0]["summary"]
    (r,) = report["runs"][0]["requests"]
    assert r["ok"] and r["sentences"] == 2 and r["prompt_ids"] == ["t0", "t1"]  # seed 2 draws this order
    assert r["underruns"] == 1 and 0.9 < r["longest_stall_s"] < 2.0
    assert not summary["passed"] and any("underruns" in reason for reason in summary["fail_reasons"])


def test_agent_options_are_checked_and_reach_engine_load():
    with pytest.raises(SystemExit):
        parse_args(["--rps", "1", "--agent-sentences", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--rps", "1", "--agent-sentences", "2", "--stream-tokens"])
    args = build_parser().parse_args(["--rps", "1", "--granularity", "token"])
    assert args.split_granularity == "token"
    args = engine_load_args(["--model", "m", "--agent-sentences", "3", "--words-per-s", "100", "--granularity",
                             "token", "--keep-going", "--worker"])
    assert (args.agent_sentences, args.words_per_s, args.granularity, args.keep_going) == (3, 100.0, "token", True)
    entry = {"rps": 5.0, "passed": True, "summary": {
        "audible_ttfa_s": {"p50": 0.02, "p95": 0.04, "p99": 0.05},
        "audible_ttfa_after_sentence_s": {"p50": -0.2, "p95": -0.1, "p99": -0.05},
        "e2e_s": {"p95": 9.0}, "underrun_events": 0, "underrun_requests": 0, "failed": 0, "requests": 40,
        "max_in_flight": 30, "warnings": []}}
    table = agent_table({"load": {"agent_sentences": 3, "words_per_s": 100.0,
                                  "session_config": {"split_granularity": "token"}}, "rates": [entry]},
                        lambda d, k: f"{d[k] * 1000:.1f}")
    assert "3 sentences per session, 100 words/s, split_granularity token" in table
    assert "| 5 | 20.0 / 40.0 / 50.0 | -200.0 / -100.0 / -50.0 | 9000.0 | 0 (0) | 0 | 40 | 30 | - | PASS |" in table
