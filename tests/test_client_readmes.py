"""The client READMEs' examples work as pasted against the default gateway (`voxgate serve`: Piper).

Each example that needs no account is a complete program and runs, unchanged except for the gateway's
port (and the bridge's), against a real default gateway: the Python client's, the telephony bridge's (a
fake Twilio, speaking Twilio's documented messages, places the call), the Pipecat and LiveKit adapters'
(in the cached venvs of tests/adapter_env.py, which hold just what their install lines install) and the
JavaScript client's Node example (tests/test_client_js.py). The agents that need accounts (Deepgram,
OpenAI, LiveKit) are not run: their READMEs must install every extra they import. Every Python example
of every client README compiles and names a voice of the default gateway.
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
    # Heard up to "that" (played_ms), not everything Piper had sent by then.
    assert heard == ["heard: Sure, let me check that"], printed


@pytest.mark.parametrize("readme", CLIENT_READMES, ids=[r.parent.name for r in CLIENT_READMES])
def test_every_python_example_compiles_and_names_a_voice_of_the_default_gateway(readme, default_gateway):
    backend = default_gateway.gateway.backend
    for source in python_examples(readme):
        tree = compile(source, str(readme), "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        voices = [node.value.value for node in ast.walk(tree)
                  if isinstance(node, ast.keyword) and node.arg == "voice" and isinstance(node.value, ast.Constant)]
        for voice in voices:
            assert backend.has_voice(voice), f"{readme}: voice={voice!r} is not a voice of the default gateway"


def example_env(*client_dirs: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*(str(REPO / "clients" / d) for d in client_dirs), *filter(None, [os.environ.get("PYTHONPATH")])]))


def test_telephony_in_process_example_runs_as_pasted(default_gateway, tmp_path):
    """The README's program, as pasted but for the two ports, answers a call from a fake Twilio (which
    speaks Twilio's documented messages and echoes marks as its player would): it greets, streams, barges
    in, and exits when the call ends."""
    import asyncio

    from tests.gateway_server import free_port
    from tests.test_telephony_twilio import FakeTwilio

    (source,) = python_examples(REPO / "clients" / "telephony" / "README.md")
    assert README_URL in source and "8080" in source
    port = free_port()
    script = tmp_path / "bridge_example.py"
    script.write_text(source.replace(README_URL, default_gateway.url.replace("http://", "ws://"))
                      .replace("8080", str(port)))

    async def call() -> tuple[FakeTwilio, list[str], int]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(script), cwd=tmp_path, env=example_env("python", "telephony"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        lines: list[str] = []
        try:
            for _ in range(100):  # the bridge listening
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.close()
                    break
                except OSError:
                    await asyncio.sleep(0.1)
            async with FakeTwilio(f"ws://127.0.0.1:{port}/twilio") as twilio:
                while not any(line.startswith("reply interrupted") for line in lines):
                    line = await asyncio.wait_for(process.stdout.readline(), 60)
                    assert line, (await process.stderr.read()).decode()
                    lines.append(line.decode().strip())
            lines += (await asyncio.wait_for(process.stdout.read(), 30)).decode().splitlines()
            return twilio, lines, await asyncio.wait_for(process.wait(), 30)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()

    twilio, lines, returncode = asyncio.run(call())
    assert returncode == 0, lines
    assert lines[:2] == ["greeting played: True", "reply interrupted: True"], lines
    assert lines[-1].startswith("call ended: CA") and int(lines[-1].split()[-3]) > 50, lines
    assert twilio.problems == []
    assert any(r.message["event"] == "clear" for r in twilio.received)


@pytest.mark.parametrize("framework", ["pipecat", "livekit"])
@pytest.mark.third_party
def test_framework_examples_run_as_pasted(framework, default_gateway, tmp_path):
    """The adapter README's first example, in a venv holding just what its install line installs (the
    pinned framework, voxgate-client and the adapter: tests/adapter_env.py), writes a spoken reply."""
    from tests.adapter_env import adapter_python
    from tests.venv_cache import run_script

    (source,) = [example for example in python_examples(REPO / "clients" / framework / "README.md")
                 if "reply.wav" in example]
    assert README_URL in source
    script = tmp_path / "example.py"
    script.write_text(source.replace(README_URL, default_gateway.url.replace("http://", "ws://")))
    result = run_script(adapter_python(framework), script, timeout=180, cwd=tmp_path)
    assert "reply.wav written" in result.stdout
    with wave.open(str(tmp_path / "reply.wav")) as wav:
        assert wav.getframerate() == 24000 and wav.getnframes() > 24000  # over a second of speech


def extras_installed(readme: Path) -> set[str]:
    """The extras of every `pip install 'package[a,b]...'` line in the README's shell blocks."""
    shell = "\n".join(re.findall(r"^```bash\n(.*?)^```", readme.read_text(), flags=re.MULTILINE | re.DOTALL))
    return {extra.strip() for group in re.findall(r"pip install '[\w.-]+\[([\w,-]+)\]", shell) for extra in group.split(",")}


@pytest.mark.parametrize("framework,pattern", [
    ("pipecat", r"from pipecat\.services\.(\w+)"),
    ("livekit", r"from livekit\.plugins import ([\w, ]+)"),
])
def test_the_agent_examples_say_what_else_they_need(framework, pattern):
    """The agents that need accounts (Deepgram, OpenAI, LiveKit Cloud) are not run here; their README installs
    every framework extra they import (before: `No module named 'deepgram'` / 'livekit.plugins' after the
    README's own install line)."""
    readme = REPO / "clients" / framework / "README.md"
    agent = python_examples(readme)[-1]
    imported = {name.strip() for group in re.findall(pattern, agent) for name in group.split(",")} - {""}
    if framework == "pipecat":  # the development runner and its WebRTC transport are extras too
        imported |= {"runner"} if "pipecat.runner" in agent else set()
        imported |= {"webrtc"} if '"webrtc"' in agent else set()
    assert imported, agent
    assert imported <= extras_installed(readme), f"imported {sorted(imported)}, installed {sorted(extras_installed(readme))}"
    assert "API_KEY" in readme.read_text()


def test_js_client_node_example_runs_as_pasted(default_gateway, tmp_path):
    """The JavaScript README's Node example, saved as it says (beside voxgate.js, after `npm ci`) and run
    with node against the default gateway: before, the README's only example imported a browser path and
    started an AudioContext ('AudioContext is not defined' in Node)."""
    import shutil

    from tests.js_fixtures import JS_CLIENT_DIR, require_node, require_npm_packages

    node = require_node()
    require_npm_packages()
    (source,) = re.findall(r"^## In Node\n.*?^```js\n(.*?)^```", (JS_CLIENT_DIR / "README.md").read_text(),
                           flags=re.MULTILINE | re.DOTALL)
    assert README_URL in source and "./voxgate.js" in source
    # The folder the README means: the client's files and its node_modules, here a copy of them.
    for name in ("voxgate.js", "emitter.js", "player.js", "player-worklet.js", "package.json"):
        shutil.copy(JS_CLIENT_DIR / name, tmp_path / name)
    (tmp_path / "node_modules").symlink_to(JS_CLIENT_DIR / "node_modules")
    (tmp_path / "hello.mjs").write_text(source.replace(README_URL, default_gateway.url.replace("http://", "ws://")))
    result = subprocess.run([node, "hello.mjs"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"hello\.wav: 2 sentences, [1-9]\d* bytes\n", result.stdout), result.stdout
    with wave.open(str(tmp_path / "hello.wav")) as wav:
        assert wav.getframerate() == 24000 and wav.getsampwidth() == 2 and wav.getnframes() > 24000


def test_js_client_browser_example_runs_as_pasted(default_gateway, tmp_path):
    """The browser example in Chromium, saved as a page the user hosts: served from another loopback origin
    than the gateway's, it imports the client from the gateway (CORS), plays, barges in with
    StreamPlayer.bargeIn, whose input.cancel says how much of the reply played, and the gateway answers with
    the words heard: a prefix of the reply, shorter than the reply Piper had long since sent whole. Its POST
    to /v1/audio/speech (a CORS preflight first) gets the WAV."""
    from tests.js_fixtures import (
        JS_CLIENT_DIR, require_chromium, require_node, require_npm_packages, run_node_json, static_site,
    )

    require_node()
    require_npm_packages()
    require_chromium()
    (html,) = re.findall(r"^```html\n(.*?)^```", (JS_CLIENT_DIR / "README.md").read_text(), flags=re.MULTILINE | re.DOTALL)
    readme_http_url = README_URL.replace("ws://", "http://")
    assert readme_http_url + "/clients/js/voxgate.js" in html
    (tmp_path / "hello.html").write_text(html.replace(readme_http_url, default_gateway.url))
    with static_site(tmp_path) as site:
        assert site != default_gateway.url
        result = run_node_json(JS_CLIENT_DIR / "test" / "readme_browser_example.mjs", site + "/hello.html", timeout=90)
    assert result.get("failure") is None and result["pageErrors"] == [], result
    assert result["failedRequests"] == [], result
    (wav,) = [line for line in result["console"] if line.startswith("wav:")]
    assert re.fullmatch(r"wav: 200, [1-9]\d{4,} bytes", wav), wav
    (cancel,) = result["cancels"]
    assert cancel["context_id"] == "turn-2" and cancel["played_ms"] > 0, cancel
    played = [line for line in result["console"] if line.startswith("played ")]
    assert played == [f"played {round(cancel['played_ms'])} ms of turn-2"], result["console"]
    (heard,) = [line.removeprefix("heard: ") for line in result["console"] if line.startswith("heard:")]
    reply = "Sure, let me check that for you. It takes a moment, so please bear with me.".split()
    assert heard and reply[: len(heard.split())] == heard.split() and len(heard.split()) < len(reply), heard
