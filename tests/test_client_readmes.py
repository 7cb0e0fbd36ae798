"""The client READMEs' examples work as pasted against the default gateway (`voxgate serve`: Piper).

The Python client's examples are complete programs: each runs, unchanged except for the gateway's port,
against a real default gateway. The other clients' examples need accounts or frameworks (Twilio, LiveKit,
Pipecat with Deepgram and OpenAI) and are checked for what can go wrong without them: each one compiles,
and every voice it names is a voice of the default gateway (not one that only resolves by falling back).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import wave
from pathlib import Path

import pytest

from tests.gateway_server import running_gateway

REPO = Path(__file__).resolve().parent.parent
README_URL = "ws://127.0.0.1:8000"
CLIENT_READMES = sorted(REPO.glob("clients/*/README.md"))


def python_examples(readme: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", readme.read_text(), flags=re.MULTILINE | re.DOTALL)


@pytest.fixture(scope="module")
def default_gateway():
    with running_gateway("piper") as server:
        yield server


def run_example(source: str, server, folder: Path) -> subprocess.CompletedProcess:
    assert README_URL in source, "the example must name the default gateway's URL"
    script = folder / "example.py"
    script.write_text(source.replace(README_URL, server.url.replace("http://", "ws://")))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "clients" / "python"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    result = subprocess.run([sys.executable, str(script)], cwd=folder, env=env, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr
    return result


def test_python_client_examples_run_as_pasted(default_gateway, tmp_path):
    one_utterance, streaming, contexts, words = python_examples(REPO / "clients" / "python" / "README.md")

    run_example(one_utterance, default_gateway, tmp_path)
    with wave.open(str(tmp_path / "hello.wav")) as wav:
        assert wav.getframerate() == 24000 and wav.getnframes() > 24000  # over a second of speech

    printed = run_example(streaming, default_gateway, tmp_path).stdout
    # The client asks for token splitting; Piper speaks whole units only, so the gateway ends the first one
    # after four words (docs/protocol.md, "Text streaming").
    assert "sentence 0: 'Sure, I can help'" in printed and "sentence 1: 'with that.'" in printed
    assert re.search(r"sentence 1: [1-9]\d* bytes", printed), printed
    assert "error" not in printed

    printed = run_example(contexts, default_gateway, tmp_path).stdout
    assert re.search(r"turn-1: [1-9]\d* bytes", printed) and re.search(r"another: [1-9]\d* bytes", printed), printed

    # Piper's word timestamps: each word with its time in the turn, then the barge-in after "that".
    printed = run_example(words, default_gateway, tmp_path).stdout.splitlines()
    timed = [line.split() for line in printed if not line.startswith("heard:")]
    assert [word for _, word in timed][:5] == ["Sure,", "let", "me", "check", "that"], printed
    times = [float(time) for time, _ in timed]
    assert times == sorted(times) and times[-1] > 0, printed
    heard = [line for line in printed if line.startswith("heard: ")]
    assert len(heard) == 1 and heard[0].startswith("heard: Sure, let me check that"), printed


@pytest.mark.parametrize("readme", CLIENT_READMES, ids=[r.parent.name for r in CLIENT_READMES])
def test_every_python_example_compiles_and_names_a_voice_of_the_default_gateway(readme, default_gateway):
    backend = default_gateway.gateway.backend
    for source in python_examples(readme):
        tree = compile(source, str(readme), "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        voices = [node.value.value for node in ast.walk(tree)
                  if isinstance(node, ast.keyword) and node.arg == "voice" and isinstance(node.value, ast.Constant)]
        for voice in voices:
            assert backend.has_voice(voice), f"{readme}: voice={voice!r} is not a voice of the default gateway"
