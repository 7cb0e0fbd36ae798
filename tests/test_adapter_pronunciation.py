"""Pronunciation through the voice-agent adapters (issue 34): voxgate-pipecat and voxgate-livekit pass
`pronunciations` and `text_markup` to the gateway (session.config, and LiveKit's synthesize() over HTTP).

pipecat-ai 1.14.0 and livekit-agents 1.8.9 run in their cached venvs (tests/adapter_env.py) against a real
gateway with the synthetic backend. Checked: what reaches the backend (recorded per request), and that the
words the framework gets are the ones written, not the ones the backend was given.
"""

from __future__ import annotations

import pytest

from tests.adapter_fixtures import scenario, scenario_results

pytestmark = pytest.mark.third_party  # a cached venv of third-party packages (tests/conftest.py)

TURN = "Welcome to Voxgate. Your code is <spell>AB-12</spell>, see you soon."
CHUNKED = "Voxgate over HTTP <break time='200ms'/> works."
OPTIONS = {"pronunciations": [{"text": "Voxgate", "say": "vox gate"}], "text_markup": "ssml"}
SAID = ["Welcome to vox gate.", "Your code is A B, 1 2, see you soon."]
WRITTEN = ["Welcome", "to", "Voxgate.", "Your", "code", "is", "AB-12,", "see", "you", "soon."]


def backend_heard(backend) -> list[str]:
    return [r.text.strip() for r in backend.records if r.text.strip()]


def test_pipecat_passes_pronunciations_and_its_words_are_the_written_ones():
    with scenario_results("pipecat", lambda _: {"pronunciation": {"turn": TURN, **OPTIONS}}) as results:
        observed = scenario(results, "pronunciation")
        heard = backend_heard(results[1])
    assert heard == SAID
    assert [w.strip() for w in observed["words"]] == WRITTEN
    # The assistant's context keeps what the LLM wrote (Pipecat adds the turn's own text, markup and all),
    # never what the backend was given.
    [message] = observed["assistant_messages"]
    assert message.startswith("Welcome to Voxgate. Your code is") and "vox gate" not in message
    assert observed["errors"] == []


def test_livekit_passes_pronunciations_on_streams_and_over_http():
    plan = {"pronunciation": {"reply": TURN, "chunked": CHUNKED, **OPTIONS}}
    with scenario_results("livekit", lambda _: plan) as results:
        observed = scenario(results, "pronunciation")
        heard = backend_heard(results[1])
    assert heard == [*SAID, "vox gate over HTTP", "works."]
    assert [w.strip() for w in observed["words"]] == WRITTEN
    assert observed["chunked_bytes"] > 0
